"""A server's /metrics, read for the chat's server panel (`macinfer chat --url`).

    text = fetch("http://127.0.0.1:8000", api_key=None)   # MacinferError: one line
    figures = parse(text, model="tiny")                    # ServerFigures
    show(figures, previous)                                # {"kv": "12 / 129", ...}

The names are those macinfer.serve.metrics exports: KV blocks, requests running and waiting,
and for a model split over ranks (`mlx.launch`) each rank's active memory and the seconds one
forward's collectives take on it, plus the seconds rank 0 spends sending plans. A server of
several models labels its series with `model`: only the chatted model's are read.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass, field

from macinfer import units
from macinfer.errors import MacinferError

TIMEOUT = 2.0  # seconds a scrape may take: the panel polls about once a second


@dataclass
class RankFigures:
    rank: int
    memory_bytes: float | None = None  # active MLX memory at the last plan
    comm_seconds: float | None = None  # one forward's collectives, replayed alone


@dataclass
class ServerFigures:
    """What one scrape said; None where the server sent no such series."""

    kv_used: float | None = None
    kv_total: float | None = None
    running: float | None = None
    waiting: float | None = None
    ranks: int = 1
    plans: float | None = None  # plans rank 0 sent (a counter)
    plan_seconds: float | None = None  # seconds rank 0 spent sending them, waits included (a counter)
    per_rank: list[RankFigures] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        """No macinfer series at all (another server's /metrics)."""
        return self.kv_total is None and self.running is None


def fetch(root: str, api_key: str | None = None) -> str:
    """The text of `root`/metrics.

    Raises:
        MacinferError: one line: unreachable, no /metrics (mlx_lm.server), the key refused.
    """
    request = urllib.request.Request(root + "/metrics",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT) as r:
            return r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        if e.code == 404:
            raise MacinferError(f"no /metrics at {root}: server figures need `macinfer serve`") from None
        if e.code == 401:
            raise MacinferError(f"{root}/metrics refused the API key: pass it with --api-key") from None
        raise MacinferError(f"{root}/metrics answered {e.code}") from None
    except (urllib.error.URLError, OSError) as e:  # refused, timed out, name not found
        raise MacinferError(f"cannot read {root}/metrics: {getattr(e, 'reason', e)}") from None


_SCALARS = {"macinfer_kv_blocks_used": "kv_used", "macinfer_kv_blocks_total": "kv_total",
            "macinfer_requests_running": "running", "macinfer_requests_waiting": "waiting",
            "macinfer_distributed_plans": "plans", "macinfer_distributed_plan_seconds": "plan_seconds"}
_PER_RANK = {"macinfer_rank_active_memory_bytes": "memory_bytes", "macinfer_rank_comm_seconds": "comm_seconds"}


def parse(text: str, model: str | None = None) -> ServerFigures:
    """The figures in a Prometheus text page (prometheus_client's parser).

    Args:
        text: what /metrics returned.
        model: keep only series labelled with this model (unlabelled ones are always kept).

    Raises:
        MacinferError: the text is not Prometheus' format.
    """
    from prometheus_client.parser import text_string_to_metric_families

    f, ranks = ServerFigures(), {}
    try:
        samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    except ValueError as e:
        raise MacinferError(f"/metrics is not Prometheus text: {e}") from None
    for s in samples:
        if model is not None and s.labels.get("model", model) != model:
            continue
        name = s.name if s.name in _SCALARS else s.name.removesuffix("_total")  # a counter's sample ends so
        if name in _SCALARS:
            setattr(f, _SCALARS[name], s.value)
        elif name == "macinfer_ranks":
            f.ranks = int(s.value)
        elif name in _PER_RANK and s.labels.get("rank", "").isdigit():
            rank = int(s.labels["rank"])
            setattr(ranks.setdefault(rank, RankFigures(rank)), _PER_RANK[name], s.value)
    f.per_rank = [ranks[r] for r in sorted(ranks)]
    return f


def plan_ms(now: ServerFigures, before: ServerFigures | None) -> float | None:
    """Milliseconds rank 0 spent per plan: since the scrape `before` if it sent plans since, else overall."""
    if not now.plans or now.plan_seconds is None:
        return None
    if before is not None and before.plans is not None and before.plan_seconds is not None \
            and now.plans > before.plans:
        return 1000 * (now.plan_seconds - before.plan_seconds) / (now.plans - before.plans)
    return 1000 * now.plan_seconds / now.plans


def _count(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def show(now: ServerFigures, before: ServerFigures | None = None) -> dict[str, str]:
    """The panel's strings: "kv", "requests", "ranks", "plan", and "rank N" (memory, comm per forward)."""
    out = {"kv": f"{_count(now.kv_used)} / {_count(now.kv_total)}",
           "requests": f"{_count(now.running)} run, {_count(now.waiting)} wait",
           "ranks": str(now.ranks)}
    ms = plan_ms(now, before)
    out["plan"] = "-" if ms is None else f"{ms:.2f} ms"
    for r in now.per_rank:
        memory = "-" if r.memory_bytes is None else units.fmt_bytes(r.memory_bytes)
        comm = "-" if r.comm_seconds is None else f"{1000 * r.comm_seconds:.2f} ms"
        out[f"rank {r.rank}"] = f"{memory}  {comm}"
    return out
