"""Whether this gateway can serve a generate now, and if not, why.

Ready means: Redis answers, the gateway's reply channel is subscribed (token events can
reach it), at least one scheduler's heartbeat is live (proto/scheduler_registry.py) and at
least one of those schedulers drives a worker whose registration is live (the registry
admission reads the model's workers from: a scheduler that still names a worker whose key
vanished with a Redis restart does not make the gateway ready). `/health/ready` (gateway/routes/health.py)
answers it; admission (gateway/admission.py) refuses requests with it before enqueueing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from redis.exceptions import RedisError

from gateway.backend import RedisBackend
from proto.messages import SchedulerHeartbeat


@dataclass(frozen=True)
class Readiness:
    reason: str | None  # None = ready; else an error code: redis_unavailable, ...
    message: str
    schedulers: list[SchedulerHeartbeat] = field(default_factory=list)
    registered: frozenset[str] = frozenset()  # ids of the workers whose registration is live

    @property
    def ready(self) -> bool:
        return self.reason is None

    @property
    def worker_ids(self) -> list[str]:
        """Every registered worker some live scheduler drives."""
        return sorted({w for s in self.schedulers for w in s.worker_ids if w in self.registered})


async def readiness(backend: RedisBackend) -> Readiness:
    try:
        schedulers = await backend.schedulers()
        registered = frozenset(w.worker_id for w in await backend.live_workers())
    except (RedisError, OSError) as exc:
        return Readiness("redis_unavailable", f"Redis does not answer: {exc}")
    if not backend.subscribed:
        return Readiness("reply_channel_unsubscribed",
                         "The gateway is not subscribed to its reply channel yet; retry later.")
    if not schedulers:
        return Readiness("no_live_scheduler", "No scheduler is running; retry later.")
    ready = Readiness(None, "ready", schedulers, registered)
    if not ready.worker_ids:
        return Readiness("no_live_worker", "No live worker is driven by a scheduler; retry later.",
                         schedulers, registered)
    return ready
