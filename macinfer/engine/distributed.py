"""One engine across several ranks (MLX distributed): rank 0 schedules, every rank runs each forward.

    mlx.launch --hosts 10.0.0.1,10.0.0.2 --backend ring -- macinfer run MODEL "PROMPT" --parallel tensor

The model is split by mlx-lm itself (macinfer.modelio.loader: `shard()` for tensor parallelism,
`model.pipeline()` for pipeline parallelism). Its forward then holds collectives (an all_sum after
each sharded projection; send / recv / all_gather between pipeline stages) that every rank must
enter together, in the same order, with the same shapes. So:

- Rank 0 (the leader) owns the scheduler, the block pool, sampling and the API. Its runner
  (`LeaderRunner`) broadcasts each forward's plan before running it: each row's block table,
  first position and new token ids (`Ranks.send_plan`).
- The other ranks (followers) hold the same paged pools (for their KV heads, or their layers),
  receive each plan (`Ranks.recv_plan`) and run the same forward (`follow`). Their logits are
  dropped: tokens are sampled on rank 0 and reach the followers as the next plan's input ids,
  so every rank's K/V agrees.
- NOTE: every rank evaluates each forward's logits with its pools. Evaluating the pools alone
  would skip the collectives after the last K/V write (the last layer's MLP all_sum, a pipeline
  stage's send) on one rank and not on another: a deadlock.

A plan on the wire (int32; the other ranks send zeros where only rank 0's values count):

    header   (ranks, 8)  all_gather of [kind, num_rows, payload_len, seconds until the next plan at the
                         latest (0: no promise), micro-batches, replay this forward's collectives (0/1):
                         rank 0's fields; this rank's active memory in KiB, its last replay in microseconds]
    payload              all_sum; per row: [start, num_tokens, table_len, *tokens, *block_table]

Pipeline micro-batches (macinfer.engine.collectives.run_micro_batches): rank 0 splits a forward's rows
into micro-batches, so that the stages overlap; the plan says how many. By default one per rank when
each gets MICRO_BATCH_TOKENS tokens: a forward of fewer (a decode step of a small batch) is bound by
reading the weights, which each micro-batch would do again.

Communication time: every rank records the collectives of the forward it builds (their ops and shapes).
At most once a second rank 0 asks, in a plan, for that forward's collectives to be replayed alone on
every rank before the next exchange; each rank times its replay and reports it in the next header
(`stats()["rank_comm_seconds"]`, /metrics).

Off across ranks (one line on rank 0 when asked for): speculative decoding, async scheduling
(the next plan needs this step's tokens on the host), the prefix cache's disk tier. Models with
recurrent state layers are refused.

Failure: a rank whose process ends closes its sockets, and the others' collectives fail within
about a second. A rank that hangs, or a host that drops off the network, is caught by a watchdog:
a step, or a follower's wait for a promised plan, taking more than MACINFER_DIST_TIMEOUT seconds
(default 30; a serving leader sends a heartbeat plan every half second while idle). Either way
the rank prints one line and exits non-zero, and mlx.launch stops the others.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager

import mlx.core as mx

from macinfer.core.model_runner import ModelRunner
from macinfer.engine.collectives import Recorder, replay, run_micro_batches
from macinfer.errors import MacinferError

FORWARD, HEARTBEAT, STOP = 1, 2, 3
PARALLEL = ("auto", "tensor", "pipeline")
MICRO_BATCH_TOKENS = 32  # tokens per micro-batch at least, unless --micro-batches says (a threshold, not a fit)
REPLAY_EVERY = 1.0  # seconds between replays of a forward's collectives (each costs about its communication)


class Ranks:
    """This process's place in the group, the plan exchange, and the watchdog over collectives.

    Args:
        group: an mx.distributed group of more than one rank.
        parallel: "tensor" or "pipeline" (how the model is split; "auto" until the loader chose).
        timeout: seconds a step or a promised plan may take (default MACINFER_DIST_TIMEOUT or 30).
        micro_batches: micro-batches per pipelined forward (None: one per rank); rank 0's counts.
    """

    def __init__(self, group, parallel: str, timeout: float | None = None, micro_batches: int | None = None):
        if parallel not in PARALLEL:
            raise MacinferError(f"--parallel must be one of {', '.join(PARALLEL)}, got {parallel!r}")
        if micro_batches is not None and micro_batches < 1:
            raise MacinferError(f"--micro-batches must be at least 1, got {micro_batches}")
        self.group, self.parallel = group, parallel
        self.rank, self.size = group.rank(), group.size()
        self.is_leader = self.rank == 0
        self.timeout = timeout or float(os.environ.get("MACINFER_DIST_TIMEOUT") or 30)
        self.heartbeats = False  # the leader promises a plan (or a heartbeat) within the timeout
        self.comm_seconds = 0.0  # host time spent in plan exchanges
        self.memory: list[int] = []  # each rank's active memory (bytes) at the last plan
        self.num_plans = 0
        self.micro_batches = micro_batches
        self._split = 1  # micro-batches of the plan in hand (rank 0's choice)
        self.collectives: list[tuple] = []  # those of the last forward this rank built (collectives.Recorder)
        self.comm: list[float] = []  # each rank's last replay of a forward's collectives (seconds)
        self._replay_due = False  # the last plan asked for its forward's collectives to be replayed
        self.replay_every = REPLAY_EVERY  # rank 0: seconds between replays (the first forward is always replayed)
        self._last_replay = -float("inf")  # rank 0: when it last asked
        self._replayed = 0.0  # this rank's last replay (seconds)
        self._deadline: float | None = None  # set while a watched collective runs
        self._what = ""
        self._promise = 0  # follower: seconds the leader promised the next plan within (0: none)
        self._stopped = False
        threading.Thread(target=self._watch_loop, name="macinfer-rank-watchdog", daemon=True).start()

    def __repr__(self) -> str:
        return f"rank {self.rank} of {self.size} ({self.parallel} parallel)"

    def stats(self) -> dict:
        """For kv_stats and /metrics: ranks, plans sent, host seconds in plan exchanges (waits included),
        each rank's active memory at the last plan."""
        return {"ranks": self.size, "plans": self.num_plans, "plan_seconds": self.comm_seconds,
                "rank_memory_bytes": list(self.memory), "rank_comm_seconds": list(self.comm)}

    # -- one forward -----------------------------------------------------------------------
    def run_forward(self, run_forward, tables, starts, tokens, *rest) -> mx.array:
        """ModelRunner.run_forward's forward on this rank, its collectives recorded (for the replay);
        pipelined, in the micro-batches the plan says."""
        recorder = Recorder()
        with recorder.recording():
            logits = run_micro_batches(run_forward, self._split, recorder, tables, starts, tokens, *rest)
        self.collectives = recorder.calls
        return logits

    def _replay(self) -> None:
        """The last forward's collectives, alone (the plan asked): every rank times its own."""
        self._replay_due = False
        self._replayed = replay(self.collectives, self.group)

    # -- the plan exchange -------------------------------------------------------------
    def _broadcast(self, values: list[int] | None, n: int) -> list[int]:
        """Rank 0's n int32 values on every rank (the others pass None)."""
        x = mx.array(values, dtype=mx.int32) if self.is_leader else mx.zeros((n,), dtype=mx.int32)
        y = mx.distributed.all_sum(x, group=self.group, stream=mx.cpu)
        mx.eval(y)
        return y.tolist()

    def _exchange(self, kind: int, payload: list[int] | None, n_rows: int = 0,
                  split: int = 1) -> tuple[int, int, list[int]]:
        """One plan: the header (all_gather: rank 0's fields, and every rank's memory and last replay), then the
        payload. A replay the last plan asked for runs first, on every rank, so its collectives pair up."""
        if self._replay_due:
            self._replay()
        t0 = time.perf_counter()
        mine = [0] * 6
        if self.is_leader:
            mine = [kind, n_rows, len(payload or []), int(self.timeout) if self.heartbeats else 0,
                    split, kind == FORWARD and self._ask_replay()]
        mine += [mx.get_active_memory() >> 10, round(self._replayed * 1e6)]
        header = mx.distributed.all_gather(mx.array(mine, dtype=mx.int32), group=self.group, stream=mx.cpu)
        mx.eval(header)
        rows = header.reshape(self.size, 8).tolist()
        kind, n_rows, size, self._promise, self._split, self._replay_due = rows[0][:6]
        self.memory = [r[6] << 10 for r in rows]  # KiB: int32 holds up to 2 TiB
        self.comm = [r[7] / 1e6 for r in rows]
        body = self._broadcast(payload, size) if size else []
        self.comm_seconds += time.perf_counter() - t0
        self.num_plans += 1
        return kind, n_rows, body

    def _plan_split(self, tokens: list[list[int]]) -> int:
        """Rank 0: micro-batches for a pipelined forward of these rows: as asked, else one per rank
        if each gets MICRO_BATCH_TOKENS tokens (fewer: the stages are bound by reading their weights,
        which each micro-batch does again, so splitting would only add passes)."""
        if self.parallel != "pipeline":
            return 1
        if self.micro_batches:
            return min(len(tokens), self.micro_batches)
        return min(len(tokens), self.size, sum(map(len, tokens)) // MICRO_BATCH_TOKENS) or 1

    def _ask_replay(self) -> bool:
        """Rank 0: whether this forward's collectives are replayed (the first, then one per replay_every seconds)."""
        now = time.monotonic()
        if now - self._last_replay < self.replay_every:
            return False
        self._last_replay = now
        return True

    def send_plan(self, tables: list[list[int]], starts: list[int], tokens: list[list[int]]) -> None:
        """Leader: broadcast one forward's rows (run_forward's arguments)."""
        payload = []
        for table, start, ids in zip(tables, starts, tokens):
            payload += [start, len(ids), len(table), *ids, *table]
        with self.watch("another rank stopped answering while a forward was sent"):
            self._exchange(FORWARD, payload, len(tables), self._plan_split(tokens))

    def recv_plan(self) -> tuple[list[list[int]], list[int], list[list[int]]] | None:
        """Follower: the next forward's (tables, starts, tokens), after any heartbeats; None at STOP."""
        while True:
            with self.watch("rank 0 stopped sending plans: it hung or the link is down", self._promise or None):
                kind, n_rows, body = self._exchange(0, None)
            if kind == STOP:
                return None
            if kind == FORWARD:
                return _decode_rows(body, n_rows)

    def heartbeat(self) -> None:
        """Leader, idle: tell the followers it is alive (and promise the next plan within the timeout)."""
        if self.is_leader and not self._stopped:
            self.heartbeats = True
            with self.watch("another rank stopped answering a heartbeat"):
                self._exchange(HEARTBEAT, None)

    def stop(self) -> None:
        """Leader: release the followers (they return from `follow`). Idempotent; also run at exit."""
        if self.is_leader and not self._stopped:
            self._stopped = True
            with self.watch("another rank stopped answering while told to stop"):
                self._exchange(STOP, None)

    def abandon(self) -> None:
        """Leader: no more exchanges (not even STOP at exit): a step broke off mid-forward."""
        self._stopped = True

    def agree_min(self, n: int) -> int:
        """The smallest n over the ranks (KV blocks: each rank's pool must fit its own memory)."""
        with self.watch("another rank did not answer while sizing the KV pools"):
            y = mx.distributed.all_min(mx.array([n], dtype=mx.int32), group=self.group, stream=mx.cpu)
            mx.eval(y)
        return int(y.item())

    # -- failure -------------------------------------------------------------------------
    @contextmanager
    def watch(self, what: str, seconds: float | None = -1.0):
        """Run collectives under the watchdog (`seconds`: None = no limit, -1 = the timeout);
        a lost peer (MLX's backends raise RuntimeError("[ring] ...")) ends the process with one line.
        Nests: the inner watch's limit holds while it runs, then the outer one's again."""
        outer = self._deadline, self._what
        self._what = what
        self._deadline = None if seconds is None else time.monotonic() + (self.timeout if seconds < 0 else seconds)
        try:
            yield
        except RuntimeError as e:
            if not str(e).startswith(("[ring]", "[jaccl]", "[mpi]", "[nccl]")):
                raise
            self.fail(f"lost the connection to another rank ({str(e).splitlines()[0]})")
        finally:
            self._deadline, self._what = outer

    def fail(self, why: str) -> None:
        """Print one line and end this process now (a rank stuck in a collective cannot unwind)."""
        sys.stdout.flush()
        print(f"error: {self}: {why}; stopping", file=sys.stderr, flush=True)
        os._exit(1)

    def _watch_loop(self) -> None:
        while True:
            time.sleep(0.25)
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                self.fail(f"{self._what} (nothing for {self.timeout:g} s; MACINFER_DIST_TIMEOUT sets the limit)")


def _decode_rows(body: list[int], n_rows: int):
    tables, starts, tokens, i = [], [], [], 0
    for _ in range(n_rows):
        start, n, t = body[i: i + 3]
        starts.append(start)
        tokens.append(body[i + 3: i + 3 + n])
        tables.append(body[i + 3 + n: i + 3 + n + t])
        i += 3 + n + t
    return tables, starts, tokens


def join(parallel: str | None, backend: str = "any", micro_batches: int | None = None) -> Ranks | None:
    """This process's Ranks when it was started with more than one rank (mlx.launch), else None.

    parallel: "tensor", "pipeline" or "auto" (the loader chooses: macinfer.modelio.loader.shard_model).
    On the leader, the followers are released at exit; on every rank, mlx.launch's SIGTERM
    (another rank failed) ends the process with one line.
    """
    group = mx.distributed.init(backend=backend)
    if group.size() == 1:
        return None
    ranks = Ranks(group, parallel or "auto", micro_batches=micro_batches)
    if ranks.is_leader:
        atexit.register(ranks.stop)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: ranks.fail("stopped by mlx.launch (another rank ended; see its line)"))
    return ranks


def engine_options(ranks: Ranks, options: dict) -> dict:
    """The engine options this rank runs with: what cannot work across ranks turned off (one line on rank 0)."""
    off = [what for key, what in (("draft", "speculative decoding"),) if options.get(key)]
    if off and ranks.is_leader:
        print(f"note: {' and '.join(off)} is off across ranks ({ranks})", file=sys.stderr)
    return {**options, "draft": None, "async_scheduling": False, "persist_prefix_cache": False,
            "verbose": bool(options.get("verbose")) and ranks.is_leader}


def check_model(ranks: Ranks, specs, model_type: str) -> None:
    """Refuse what the plan exchange cannot carry: recurrent state layers (their slots are not in the plan)."""
    if getattr(specs, "states", None):
        raise MacinferError(f"{model_type}: models with recurrent state layers cannot run across ranks yet: "
                            "run it in one process")


class LeaderRunner(ModelRunner):
    """Rank 0's ModelRunner: each forward's plan goes to the followers first, each step is watched."""

    def __init__(self, *args, ranks: Ranks, **kwargs):
        super().__init__(*args, **kwargs)
        self.ranks = ranks

    def run_forward(self, tables, starts, tokens, seqs=None, all_logits=False, head=None, prompt_lens=None) -> mx.array:
        # NOTE: the plan does not carry prompt_lens, which only a prompt window (plamo3) reads:
        # such a model across ranks would see other windows on the followers.
        self.ranks.send_plan(tables, starts, tokens)
        logits = self.ranks.run_forward(super().run_forward, tables, starts, tokens, seqs, all_logits, head, prompt_lens)
        self._with_forward.append(logits)  # the NOTE in the module docstring
        return logits

    def execute_model(self, scheduled):
        with self.ranks.watch("another rank stopped answering during a step"):
            try:
                return super().execute_model(scheduled)
            except BaseException:
                # The followers may be inside this forward's collectives, where a STOP would not pair
                # up: send nothing more; this process's exit closes the sockets and ends them.
                self.ranks.abandon()
                raise


def follow(runner: ModelRunner, ranks: Ranks) -> int:
    """A follower's loop: run every plan rank 0 sends until it says stop. Returns the forwards run."""
    n = 0
    while (plan := ranks.recv_plan()) is not None:
        with ranks.watch("another rank stopped answering during a forward"):
            logits = ranks.run_forward(runner.run_forward, *plan)
            mx.eval(logits, [c.state for c in runner.caches])
        n += 1
    return n
