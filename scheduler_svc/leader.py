"""Leases with fencing tokens: which scheduler leads a shard, which shard drives a worker.

Only one scheduler may read a shard's requests stream and assign block ids on its
workers, so schedulers take a lease per shard: `<prefix>:scheduler-lease` (shard 0;
`scheduler-lease:<k>` for shard k) holds `"<scheduler id>:<token>"` with a TTL, set only
when absent (or held under our own id: a restarted scheduler need not wait for its old
lease to run out). Taking it draws the next fencing token: one more than
`<prefix>:scheduler-epoch`, or Redis's clock in milliseconds if that is larger -- so tokens
keep growing across a Redis restart that lost the counter (workers remember the highest
they saw). The leader renews it every `ttl_s / 3`; a scheduler without it polls until it
is free (scheduler_svc/service.py), so a shard is taken over within about one TTL of its
leader's death. A shard's workers are leased the same way (scheduler_svc/worker_leases.py:
`worker-lease:<id>` holds `"<shard>:<token>"`), their tokens drawn from the same counter:
a worker's token is stamped on every `Step` sent to it, and a worker refuses a token below
the highest it has seen (worker_svc/server.py).

A renewal finds the lease gone when Redis restarted empty or our lease ran out while we
stalled: we take it back under the same token unless a newer token was drawn for this
lease since (`<prefix>:scheduler-epoch:last` holds each lease's last token: then another
owner held it meanwhile, and this one has lost). Tokens drawn for other leases do not
count: a shard's workers draw theirs after the shard's.
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
redis.call('HSET', KEYS[3], KEYS[1], token)
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
local last = tonumber(redis.call('HGET', KEYS[3], KEYS[1]) or '0')
if last > tonumber(ARGV[3]) then
  return 0
end
if tonumber(redis.call('GET', KEYS[2]) or '0') < tonumber(ARGV[3]) then
  redis.call('SET', KEYS[2], ARGV[3])
end
redis.call('HSET', KEYS[3], KEYS[1], ARGV[3])
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


class Lease:
    """One lease: `key` holds `"<owner>:<token>"` with a TTL; taking it draws the next
    token from `epoch_key` (the same counter for every lease of the stack, so a token
    outranks every one drawn before it, whatever it leases)."""

    def __init__(self, redis: aioredis.Redis, key: str, epoch_key: str, owner: str, ttl_s: float):
        """`epoch_key`: the stack's token counter; beside it, `<epoch_key>:last` records the
        last token drawn for each lease key (a hash)."""
        self._redis, self._key_names, self._id = redis, [key, epoch_key, f"{epoch_key}:last"], owner
        self.ttl_s = ttl_s
        self.token = 0  # the fencing token while we hold the lease; 0 before

    @property
    def _value(self) -> str:
        return f"{self._id}:{self.token}"

    async def acquire(self) -> bool:
        """Take the lease if it is free (or ours from before); True if we hold it now."""
        token = await self._redis.eval(_ACQUIRE, 3, *self._key_names, self._id, int(self.ttl_s * 1000))
        if token:
            self.token = int(token)
        return bool(token)

    async def renew(self) -> None:
        """Extend the lease; LeaseLost if another owner has taken it."""
        held = await self._redis.eval(_RENEW, 3, *self._key_names, self._value, int(self.ttl_s * 1000),
                                      self.token)
        if not held:
            raise LeaseLost(f"another owner holds {self._key_names[0]} (ours had token {self.token})")

    async def release(self) -> None:
        """On a clean stop (or a hand-over), so another owner takes it at once."""
        if self.token:
            await self._redis.eval(_RELEASE, 1, self._key_names[0], self._value)


def shard_lease(redis: aioredis.Redis, keys: RedisKeys, scheduler_id: str, ttl_s: float, shard: int = 0) -> Lease:
    """The lease on leading shard `shard` (its requests stream, its workers' leases)."""
    return Lease(redis, keys.shard_lease(shard), keys.scheduler_epoch, scheduler_id, ttl_s)
