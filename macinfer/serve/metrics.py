"""The server's Prometheus metrics: request and token counters, latency histograms, KV gauges.

Counters and histograms are updated as requests finish and steps run; gauges (KV
blocks, running and waiting requests) are read from the engine at scrape time.
Each app has its own registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120)
disable_created_metrics()  # the *_created series only clutter a local server's page

STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class ServerMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("macinfer_requests", "Finished requests", ["endpoint", "finish_reason"], registry=r)
        self.errors = Counter("macinfer_request_errors", "Requests refused, by HTTP status", ["status"], registry=r)
        self.prompt_tokens = Counter("macinfer_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("macinfer_generation_tokens", "Generated tokens", registry=r)
        self.cached_tokens = Counter("macinfer_prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache",
                                     registry=r)
        self.prefix_hits = Counter("macinfer_prefix_cache_hits", "Requests that reused a cached prefix", registry=r)
        self.draft_tokens = Counter("macinfer_draft_tokens", "Tokens proposed by the drafter", registry=r)
        self.accepted_tokens = Counter("macinfer_draft_accepted_tokens", "Drafted tokens accepted", registry=r)
        self.ttft = Histogram("macinfer_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=r)
        self.e2e = Histogram("macinfer_request_latency_seconds", "Arrival to last token", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.tpot = Histogram("macinfer_time_per_output_token_seconds", "Decode time per token after the first",
                              buckets=STEP_BUCKETS, registry=r)
        self.step = Histogram("macinfer_engine_step_seconds", "Engine step time", buckets=STEP_BUCKETS, registry=r)
        self.engine = None

    def attach(self, async_engine) -> None:
        """Read KV and queue gauges from this engine at scrape time."""
        self.engine = async_engine
        self.registry.register(_EngineCollector(self))

    def observe_step(self, seconds: float, deltas: list) -> None:
        self.step.observe(seconds)

    def observe_request(self, out, endpoint: str) -> None:
        m = out.metrics
        self.requests.labels(endpoint, out.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(m.prompt_tokens)
        self.generation_tokens.inc(len(out.token_ids))
        if m.cached_tokens:
            self.cached_tokens.inc(m.cached_tokens)
            self.prefix_hits.inc()
        self.draft_tokens.inc(m.draft_tokens)
        self.accepted_tokens.inc(m.accepted_tokens)
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.finish_time is not None:
            self.e2e.observe(m.finish_time - m.arrival_time)
        if m.decode_tps:
            self.tpot.observe(1.0 / m.decode_tps)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _EngineCollector:
    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics

    def collect(self):
        aengine = self.metrics.engine
        # NOTE: read from the scrape thread without a lock: plain ints, at worst one step stale.
        stats = {}
        kv_stats = getattr(aengine.engine, "kv_stats", None)
        if kv_stats is not None:
            try:
                stats = kv_stats()
            except Exception:  # the engine changed under us mid-read; skip this scrape's gauges
                stats = {}
        gauges = [
            ("macinfer_kv_blocks_used", "KV blocks in use", stats.get("used_blocks")),
            ("macinfer_kv_blocks_total", "KV blocks in the pool", stats.get("num_blocks")),
            ("macinfer_kv_usage_ratio", "Fraction of KV blocks in use", stats.get("usage")),
            ("macinfer_requests_running", "Requests being computed", stats.get("running")),
            ("macinfer_requests_waiting", "Requests queued for KV blocks", stats.get("waiting")),
            ("macinfer_requests_in_flight", "Requests the server is streaming", aengine.num_active),
            ("macinfer_engine_peak_batch", "Most requests advanced in one engine step", aengine.peak_batch),
            ("macinfer_ranks", "Processes the model is split over (mlx.launch)", stats.get("ranks")),
        ]
        for name, doc, value in gauges:
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=value)
        if "plans" in stats:  # across ranks (macinfer.engine.distributed)
            yield CounterMetricFamily("macinfer_distributed_plans", "Forward plans rank 0 sent (and heartbeats)",
                                      value=stats["plans"])
            yield CounterMetricFamily("macinfer_distributed_plan_seconds",
                                      "Seconds rank 0 spent sending plans, waiting for the other ranks included",
                                      value=stats["plan_seconds"])
            memory = GaugeMetricFamily("macinfer_rank_active_memory_bytes", "Each rank's active MLX memory at the "
                                       "last plan", labels=["rank"])
            for rank, value in enumerate(stats["rank_memory_bytes"]):
                memory.add_metric([str(rank)], value)
            yield memory
            comm = GaugeMetricFamily("macinfer_rank_comm_seconds", "Seconds one forward's collectives take on each "
                                     "rank, replayed alone (the last replay; at most one a second)", labels=["rank"])
            for rank, value in enumerate(stats.get("rank_comm_seconds", [])):
                comm.add_metric([str(rank)], value)
            yield comm
        yield CounterMetricFamily("macinfer_requests_aborted", "Requests aborted (client disconnected)",
                                  value=aengine.num_aborted)
        m = self.metrics
        drafted = m.draft_tokens._value.get()
        rate = m.accepted_tokens._value.get() / drafted if drafted else 0.0
        yield GaugeMetricFamily("macinfer_draft_acceptance_ratio", "Accepted / drafted tokens so far", value=rate)
