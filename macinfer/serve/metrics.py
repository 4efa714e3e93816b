"""The server's Prometheus metrics: request and token counters, latency histograms, KV gauges.

Counters and histograms are updated as requests finish and steps run; gauges (KV
blocks, running and waiting requests) are read from the engines at scrape time. A server of
several models labels every series but the refusals with `model`; finished requests are labelled
with the protocol they came through (`protocol`: openai, responses, anthropic, ollama) and endpoint.
Each app has its own registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

import functools
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)
disable_created_metrics()  # the *_created series only clutter a local server's page

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class ServerMetrics:
    """The server's counters, histograms and (read at scrape time) engine gauges.

    Args:
        model_label: every series but the refusals (`macinfer_request_errors`, counted before a
            model is known) carries `model="..."`: a server of several models. Without it the
            series are unlabelled, as a one-model server shows them.
    """

    def __init__(self, model_label: bool = False):
        r = self.registry = CollectorRegistry()
        self.model_label = model_label
        m = ["model"] if model_label else []
        self.requests = Counter("macinfer_requests", "Finished requests", ["protocol", "endpoint", "finish_reason"] + m,
                                registry=r)
        self.errors = Counter("macinfer_request_errors", "Requests refused, by HTTP status", ["status"], registry=r)
        self.prompt_tokens = Counter("macinfer_prompt_tokens", "Prompt tokens of finished requests", m, registry=r)
        self.generation_tokens = Counter("macinfer_generation_tokens", "Generated tokens", m, registry=r)
        self.cached_tokens = Counter("macinfer_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                     m, registry=r)
        self.prefix_hits = Counter("macinfer_prefix_cache_hits", "Requests that reused a cached prefix", m, registry=r)
        self.draft_tokens = Counter("macinfer_draft_tokens", "Tokens proposed by the drafter", m, registry=r)
        self.accepted_tokens = Counter("macinfer_draft_accepted_tokens", "Drafted tokens accepted", m, registry=r)
        self.ttft = Histogram("macinfer_time_to_first_token_seconds", "Time to first token", m,
                              buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("macinfer_request_latency_seconds", "Arrival to last token", m, buckets=LATENCY_BUCKETS,
                             registry=r)
        self.tpot = Histogram("macinfer_time_per_output_token_seconds", "Decode time per token after the first", m,
                              buckets=STEP_BUCKETS, registry=r)
        self.step = Histogram("macinfer_engine_step_seconds", "Engine step time", m, buckets=STEP_BUCKETS, registry=r)
        self.engines: Callable[[], dict[str | None, object]] = dict

    def attach(self, async_engine) -> None:
        """Read KV and queue gauges from this engine at scrape time."""
        self.attach_engines(lambda: {None: async_engine})

    def attach_pool(self, pool) -> None:
        """Read the gauges of every model a ModelPool has loaded, each labelled with its name."""
        self.attach_engines(lambda: {m.name if self.model_label else None: m.engine for m in pool.loaded()})

    def attach_engines(self, engines: Callable[[], dict[str | None, object]]) -> None:
        """`engines()`: {model name (None: no label) -> AsyncEngine}, called at each scrape."""
        self.engines = engines
        self.registry.register(_EngineCollector(self))

    def _of(self, metric, *labels: str, model: str | None = None):
        """`metric`'s series for these labels (and the model, when series carry one)."""
        values = list(labels) + ([model or ""] if self.model_label else [])
        return metric.labels(*values) if values else metric

    def observe_step(self, seconds: float, deltas: list, model: str | None = None) -> None:
        self._of(self.step, model=model).observe(seconds)

    def observe_request(self, out, endpoint: str, model: str | None = None, protocol: str = "openai") -> None:
        """A finished request; `protocol`: "openai", "responses", "anthropic" or "ollama" (its routes)."""
        m, of = out.metrics, functools.partial(self._of, model=model)
        of(self.requests, protocol, endpoint, out.finish_reason or "unknown").inc()
        of(self.prompt_tokens).inc(m.prompt_tokens)
        of(self.generation_tokens).inc(len(out.token_ids))
        if m.cached_tokens:
            of(self.cached_tokens).inc(m.cached_tokens)
            of(self.prefix_hits).inc()
        of(self.draft_tokens).inc(m.draft_tokens)
        of(self.accepted_tokens).inc(m.accepted_tokens)
        if m.ttft is not None:
            of(self.ttft).observe(m.ttft)
        if m.finish_time is not None:
            of(self.e2e).observe(m.finish_time - m.arrival_time)
        if m.decode_tps:
            of(self.tpot).observe(1.0 / m.decode_tps)

    def acceptance_ratio(self, model: str | None) -> float:
        drafted = self._count("macinfer_draft_tokens_total", model)
        return self._count("macinfer_draft_accepted_tokens_total", model) / drafted if drafted else 0.0

    def _count(self, sample: str, model: str | None) -> float:
        """A counter's value for one model (all models' without the model label), through the registry."""
        labels = {"model": model or ""} if self.model_label else {}
        return self.registry.get_sample_value(sample, labels) or 0.0

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


# (family, name, help, value from (AsyncEngine, its engine's kv_stats())); None: no sample.
_ENGINE_SERIES = [
    (GaugeMetricFamily, "macinfer_kv_blocks_used", "KV blocks in use", lambda a, s: s.get("used_blocks")),
    (GaugeMetricFamily, "macinfer_kv_blocks_total", "KV blocks in the pool", lambda a, s: s.get("num_blocks")),
    (GaugeMetricFamily, "macinfer_kv_usage_ratio", "Fraction of KV blocks in use", lambda a, s: s.get("usage")),
    (GaugeMetricFamily, "macinfer_requests_running", "Requests being computed", lambda a, s: s.get("running")),
    (GaugeMetricFamily, "macinfer_requests_waiting", "Requests queued for KV blocks", lambda a, s: s.get("waiting")),
    (GaugeMetricFamily, "macinfer_requests_in_flight", "Requests the server is streaming", lambda a, s: a.num_active),
    (GaugeMetricFamily, "macinfer_engine_peak_batch", "Most requests advanced in one engine step",
     lambda a, s: a.peak_batch),
    (GaugeMetricFamily, "macinfer_ranks", "Processes the model is split over (mlx.launch)", lambda a, s: s.get("ranks")),
    # across ranks (macinfer.engine.distributed)
    (CounterMetricFamily, "macinfer_distributed_plans", "Forward plans rank 0 sent (and heartbeats)",
     lambda a, s: s.get("plans")),
    (CounterMetricFamily, "macinfer_distributed_plan_seconds",
     "Seconds rank 0 spent sending plans, waiting for the other ranks included", lambda a, s: s.get("plan_seconds")),
    (CounterMetricFamily, "macinfer_requests_aborted", "Requests aborted (client disconnected)",
     lambda a, s: a.num_aborted),
]


_RANK_SERIES = [  # (metric, help, kv_stats key of a list with one value per rank): across ranks only
    ("macinfer_rank_active_memory_bytes", "Each rank's active MLX memory at the last plan", "rank_memory_bytes"),
    ("macinfer_rank_comm_seconds", "Seconds one forward's collectives take on each rank, replayed alone "
     "(the last replay; at most one a second)", "rank_comm_seconds"),
]


def _kv_stats(aengine) -> dict:
    # NOTE: read from the scrape thread without a lock: plain ints, at worst one step stale.
    try:
        return aengine.engine.kv_stats()
    except Exception:  # the engine changed under us mid-read; skip this scrape's gauges
        return {}


class _EngineCollector:
    """The engines' gauges at scrape time: one sample per engine (labelled with its model, if several)."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        m = self.metrics
        engines = [(name, aengine, _kv_stats(aengine)) for name, aengine in m.engines().items()]
        model = ["model"] if m.model_label else []

        def labels(name, *more):
            return list(more) + ([name] if m.model_label else [])

        for family, metric, doc, read in _ENGINE_SERIES:
            fam = family(metric, doc, labels=model)
            for name, aengine, stats in engines:
                if (value := read(aengine, stats)) is not None:
                    fam.add_metric(labels(name), value)
            if fam.samples:
                yield fam
        for metric, doc, key in _RANK_SERIES:
            fam = GaugeMetricFamily(metric, doc, labels=["rank"] + model)
            for name, _, stats in engines:
                for rank, value in enumerate(stats.get(key, ())):
                    fam.add_metric(labels(name, str(rank)), value)
            if fam.samples:
                yield fam
        ratio = GaugeMetricFamily("macinfer_draft_acceptance_ratio", "Accepted / drafted tokens so far", labels=model)
        for name, _, _ in engines:
            ratio.add_metric(labels(name), m.acceptance_ratio(name))
        yield ratio
