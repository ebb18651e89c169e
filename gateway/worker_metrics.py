"""The scheduler's per-worker accounting (`WorkerStats`, which it writes to Redis) rendered
as Prometheus metrics at the gateway's /metrics, named after vLLM's where they mean the same
(`vllm:kv_cache_usage_perc` → `pagedserve:kv_cache_usage_perc`, …), labelled by worker.

The /metrics handler refreshes `snapshot` from the backend before each scrape; `collect`
only renders it (prometheus_client calls collectors synchronously).
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from proto.messages import WorkerStats

# (name, help, value of a WorkerStats) — gauges: a level now.
_GAUGES = (
    ("pagedserve:kv_cache_usage_perc", "fraction of KV blocks held by requests (1 = full)",
     lambda s: s.num_used_blocks / s.num_blocks if s.num_blocks else 0.0),
    ("pagedserve:kv_cache_waste_perc", "1 - tokens held / slots of the blocks they hold",
     lambda s: s.kv_waste),
    ("pagedserve:num_requests_running", "requests scheduled on the worker", lambda s: s.num_running),
    ("pagedserve:num_requests_waiting", "requests queued for the worker", lambda s: s.num_waiting),
    ("pagedserve:num_requests_swapped", "requests swapped out to CPU blocks", lambda s: s.num_swapped),
    ("pagedserve:kv_blocks_total", "KV blocks of the worker", lambda s: s.num_blocks),
    ("pagedserve:kv_blocks_used", "KV blocks held by requests", lambda s: s.num_used_blocks),
    ("pagedserve:kv_blocks_cached", "free KV blocks still holding a reusable prefix", lambda s: s.num_cached_blocks),
    ("pagedserve:kv_blocks_free", "KV blocks held by no request (cached ones included)", lambda s: s.num_free_blocks),
    ("pagedserve:kv_integrity_ok", "1 while the scheduler's check_integrity() holds",
     lambda s: 0.0 if s.integrity_error else 1.0),
)
# Counters: cumulative since the scheduler took the worker on ("_total" is appended).
_COUNTERS = (
    ("pagedserve:prefix_cache_queries", "prompt tokens looked up in the prefix cache",
     lambda s: s.prefix_cache_queries),
    ("pagedserve:prefix_cache_hits", "prompt tokens found in the prefix cache", lambda s: s.prefix_cache_hits),
    ("pagedserve:num_preemptions", "requests preempted (recompute or swap)", lambda s: s.num_preemptions),
    ("pagedserve:num_swap_outs", "preemptions by swap", lambda s: s.num_swapped_out),
    ("pagedserve:kv_blocks_evicted", "cached blocks taken for other contents", lambda s: s.num_evicted_blocks),
    ("pagedserve:num_aborted_requests", "requests aborted while waiting, running or swapped",
     lambda s: s.num_aborted),
    ("pagedserve:cow_copies", "shared, partly filled blocks copied on write", lambda s: s.num_cow_copies),
    ("pagedserve:scheduler_steps", "steps the scheduler ran on the worker", lambda s: s.num_steps),
)


class WorkerStatsCollector:
    def __init__(self) -> None:
        self.snapshot: list[WorkerStats] = []

    def collect(self) -> Iterator[Metric]:
        stats = list(self.snapshot)
        for kind, table in ((GaugeMetricFamily, _GAUGES), (CounterMetricFamily, _COUNTERS)):
            for name, help_text, value in table:
                family = kind(name, help_text, labels=["worker"])
                for s in stats:
                    family.add_metric([s.worker_id], float(value(s)))
                yield family
