"""The scheduler leader lease: which of the schedulers sharing one Redis drives the workers.

Only one scheduler may assign block ids on the workers, so schedulers take a lease:
`<prefix>:scheduler-lease` holds `"<scheduler id>:<token>"` with a TTL, set only when absent
(or held under our own id: a restarted scheduler need not wait for its old lease to run
out). Taking it draws the next fencing token: one more than `<prefix>:scheduler-epoch`,
or Redis's clock in milliseconds if that is larger -- so tokens keep growing across a
Redis restart that lost the counter (workers remember the highest they saw); the
leader renews it every `ttl_s / 3` and stamps its token on every `Step`, and a worker
refuses a token below the highest it has seen (worker_svc/server.py). A standby polls until
the lease is free, so it takes over within about one TTL of the leader's death.

A renewal finds the lease gone when Redis restarted empty or our lease ran out while we
stalled: we take it back under the same token unless a newer token was drawn since (then
another scheduler led meanwhile, and this one has lost).
"""

from __future__ import annotations

import redis.asyncio as aioredis

from proto.keys import RedisKeys

_ACQUIRE = """
local current = redis.call('GET', KEYS[1])
if current and string.sub(current, 1, string.len(ARGV[1]) + 1) ~= ARGV[1] .. ':' then
  return 0
end
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local token = tonumber(redis.call('GET', KEYS[2]) or '0') + 1
if token < now then
  token = now
end
token = string.format('%d', token)
redis.call('SET', KEYS[2], token)
redis.call('SET', KEYS[1], ARGV[1] .. ':' .. token, 'PX', ARGV[2])
return token
"""

_RENEW = """
local current = redis.call('GET', KEYS[1])
if current == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
if current then
  return 0
end
local epoch = tonumber(redis.call('GET', KEYS[2]) or '0')
if epoch > tonumber(ARGV[3]) then
  return 0
end
redis.call('SET', KEYS[2], ARGV[3])
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


class LeaseLost(Exception):
    """Another scheduler holds the lease now: this one must stop driving workers."""


class LeaderLease:
    def __init__(self, redis: aioredis.Redis, keys: RedisKeys, scheduler_id: str, ttl_s: float):
        self._redis, self._keys, self._id = redis, keys, scheduler_id
        self.ttl_s = ttl_s
        self.token = 0  # the fencing token while we hold the lease; 0 before

    @property
    def _value(self) -> str:
        return f"{self._id}:{self.token}"

    @property
    def _key_names(self) -> list[str]:
        return [self._keys.scheduler_lease, self._keys.scheduler_epoch]

    async def acquire(self) -> bool:
        """Take the lease if it is free (or ours from before); True if we hold it now."""
        token = await self._redis.eval(_ACQUIRE, 2, *self._key_names, self._id, int(self.ttl_s * 1000))
        if token:
            self.token = int(token)
        return bool(token)

    async def renew(self) -> None:
        """Extend the lease; LeaseLost if another scheduler has taken it."""
        held = await self._redis.eval(_RENEW, 2, *self._key_names, self._value, int(self.ttl_s * 1000),
                                      self.token)
        if not held:
            raise LeaseLost(f"another scheduler holds the lease (ours had token {self.token})")

    async def release(self) -> None:
        """On a clean stop, so a standby takes over at once."""
        if self.token:
            await self._redis.eval(_RELEASE, 1, self._keys.scheduler_lease, self._value)
