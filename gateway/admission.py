"""Saying no early, before a request is enqueued (so a refused request was never queued,
and an admitted one is never dropped for load): 503 with the reason when nothing could
serve it (gateway/readiness.py), 429 with `Retry-After` when the waiting queue of every
live scheduler that drives workers (not a standby) is at its `--max-waiting-requests` bound.

The waiting counts come from the schedulers' heartbeats (refreshed every
`heartbeat_interval_s`, cached here for `--worker-cache-ttl-s`), so the bound holds to
within the requests that arrive during one refresh.
"""

from __future__ import annotations

import math

from gateway.backend import RedisBackend
from gateway.errors import OpenAIError
from gateway.readiness import readiness
from proto.messages import SchedulerHeartbeat


def _full(s: SchedulerHeartbeat) -> bool:
    return 0 < s.max_waiting_requests <= s.num_waiting


async def admit(backend: RedisBackend) -> None:
    """Raise the OpenAIError that refuses a new request now, if any."""
    state = await readiness(backend)
    if not state.ready:
        raise OpenAIError(503, state.message, code=state.reason)
    driving = [s for s in state.schedulers if s.worker_ids]  # a standby drives none
    if all(_full(s) for s in driving):
        waiting = sum(s.num_waiting for s in driving)
        retry_after = max(1, math.ceil(max(s.interval_s for s in driving)))
        raise OpenAIError(429, f"The server is at capacity ({waiting} requests waiting); retry "
                               f"after {retry_after} s.", code="too_many_waiting_requests",
                          headers={"Retry-After": str(retry_after)})
