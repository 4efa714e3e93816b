"""What each rank runs in tests/test_distributed.py, started by `mlx.launch -n 2 --backend ring`.

    python3 dist_worker.py MODEL OUT.json PARALLEL OPTIONS.json [DIE_AFTER]

Every rank constructs the same LLM; rank 0 drives the staggered workload of
test_distributed.workload() and writes {request id: token ids, "preemptions": n, "forwards": plans sent}
to OUT.json, with the forwards rank 0 built (pipelined: more than its plans, the micro-batches) and whether
every rank reported its memory and a replay of a forward's collectives.
OPTIONS: engine options on top of test_distributed.ENGINE. DIE_AFTER: rank 1 kills itself (SIGKILL) after that many forwards, mid-generation.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import macinfer  # noqa: F401  (OpenBLAS before mlx; found through PYTHONPATH, set by the test)

import driver
from test_distributed import ENGINE, workload


def main(model: str, out: str, parallel: str, options: dict, die_after: int | None = None) -> None:
    from macinfer.core.model_runner import ModelRunner
    from macinfer.engine import distributed
    from macinfer.llm import LLM

    built = []
    run_forward = ModelRunner.run_forward
    ModelRunner.run_forward = lambda self, *a, **k: built.append(len(a[0])) or run_forward(self, *a, **k)

    if die_after is not None:
        follow = distributed.follow

        def dying_follow(runner, ranks):
            run = runner.run_forward
            count = iter(range(die_after))

            def counted(*args, **kwargs):
                if next(count, None) is None:
                    os.kill(os.getpid(), signal.SIGKILL)
                return run(*args, **kwargs)

            runner.run_forward = counted
            return follow(runner, ranks)

        distributed.follow = dying_follow
    llm = LLM(model, parallel=parallel, engine="paged", **ENGINE, **options)  # the other ranks stay in here
    outputs = driver.run(llm.engine, workload())
    result = {rid: o.token_ids for rid, o in outputs.items()}
    result["preemptions"] = llm.engine.scheduler.num_preemptions
    stats = llm.engine.kv_stats()
    result["forwards"] = stats["plans"]  # one plan per forward (no heartbeats: not serving)
    result["ranks_report_memory"] = len(stats["rank_memory_bytes"]) == 2 and min(stats["rank_memory_bytes"]) > 0
    result["ranks_report_comm"] = len(stats["rank_comm_seconds"]) == 2 and min(stats["rank_comm_seconds"]) > 0
    result["built"] = built  # rows of each forward rank 0 built
    result["collectives"] = [op for op, *_ in llm.ranks.collectives]  # those of rank 0's last forward
    Path(out).write_text(json.dumps(result))
    llm.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5]) if len(sys.argv) > 5 else None)
