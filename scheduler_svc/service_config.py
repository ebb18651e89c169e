"""The scheduler service's settings (`pagedserve scheduler` flags: compose/flags.py): the
batching core's (scheduler_svc/policy/config.py) and the service's own -- Redis, consumer name,
timeouts, heartbeat and lease, async scheduling."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from proto import worker_pb2
from scheduler_svc.policy.config import SchedulerConfig


@dataclass(frozen=True)
class SchedulerServiceConfig:
    batching: SchedulerConfig = field(default_factory=SchedulerConfig)
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "pagedserve"
    # Fixed per instance so a restarted scheduler re-reads what it had not acknowledged.
    consumer_name: str = field(default_factory=lambda: f"scheduler-{socket.gethostname()}")
    discovery_interval_s: float = 0.5
    step_timeout_s: float = 120.0
    max_reroutes: int = 2  # a request whose worker died this often gets an error instead
    read_batch: int = 256
    max_early_aborts: int = 10_000
    stats_interval_s: float = 1.0  # each worker's WorkerStats written this often, busy or idle
    retired_retry_s: float = 30.0  # a retired worker that still looks registered is redialled after this
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0  # /metrics (scheduler_svc/metrics.py) on this port; 0 = none
    # Plan step k+1 while step k runs (scheduler_svc/step_loop.py): "on", "off", or "auto":
    # Bound on the requests waiting for a step (in workers' waiting queues or parked), which
    # the gateway enforces from the heartbeat with 429 + Retry-After; 0 = no bound.
    max_waiting_requests: int = 1024
    heartbeat_interval_s: float = 0.5
    heartbeat_ttl_s: float = 3.0  # the heartbeat expires this long after a death
    lease_ttl_s: float = 3.0  # the leader lease (scheduler_svc/leader.py): a standby takes over within about this
    # on for a worker that computes on an accelerator, off for one on the CPU, where the
    # host work it overlaps with a step competes with that step for the same cores
    # (docs/performance.md, "Async scheduling").
    async_scheduling: str = "auto"
    # Scheduler shards (scheduler_svc/service.py): each its own requests stream, lease and
    # share of the workers; every scheduler of a stack must be given the same number.
    shards: int = 1

    def __post_init__(self) -> None:
        if self.async_scheduling not in ("auto", "on", "off"):
            raise ValueError(f"async_scheduling must be 'auto', 'on' or 'off', got {self.async_scheduling!r}")
        if self.shards < 1:
            raise ValueError(f"shards must be >= 1, got {self.shards}")
        if self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0, got {self.max_waiting_requests}")

    def schedules_ahead(self, info: worker_pb2.WorkerInfo) -> bool:
        """Whether steps for this worker are planned while the one before runs."""
        if self.async_scheduling == "auto":
            return info.device not in ("", "cpu")
        return self.async_scheduling == "on"
