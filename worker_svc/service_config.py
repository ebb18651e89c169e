"""The worker service's settings (`pagedserve worker` flags: compose/flags.py): the model
runner's (worker_svc/config.py) and the service's own -- its gRPC address, Redis, its id,
registration and drain, launching steps ahead."""

import uuid
from dataclasses import dataclass, field

from worker_svc.config import RunnerConfig


@dataclass(frozen=True)
class WorkerServiceConfig:
    runner: RunnerConfig
    host: str = "127.0.0.1"
    port: int = 50051  # 0 picks a free port
    advertise_host: str | None = None  # the address schedulers dial; default: host
    redis_url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "pagedserve"
    worker_id: str = field(default_factory=lambda: f"worker-{uuid.uuid4().hex[:8]}")
    heartbeat_interval_s: float = 1.0
    registration_ttl_s: float = 5.0  # the registration expires this long after a death
    metrics_port: int = 0  # /metrics on host:metrics_port; 0 = none
    # SIGTERM: registered as draining (no new requests) while running ones finish, for at
    # most this long; then deregistered, and schedulers move what is left elsewhere.
    drain_timeout_s: float = 30.0
    # Launch a step planned ahead before finishing the one in flight (ModelWorkerServicer._run).
    # None: on an accelerator. On the CPU a launch is the whole step, so finishing the one
    # before later only delays its result; tests turn it on there to check the bookkeeping.
    launch_ahead: bool | None = None
