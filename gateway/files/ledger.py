"""Where every uploaded file is, in Redis, kept consistent by scripts that run atomically:
its record, its scope's index, and the storage all files take together, bounded by
--max-file-storage-bytes.

    RedisKeys.file(scope, id)         the record (msgpack FileRecord), PX: until it expires
    RedisKeys.files(scope)            zset: the scope's file ids, scored by expiry (ms)
    RedisKeys.file_storage            zset: "<scope>/<id>/<bytes>" of every file, scored by expiry
    RedisKeys.file_storage_bytes      the bytes of file_storage's members that have not expired

Each script first drops what expired by now (the gateway's clock, in ms) from the zsets and
from the byte count, so the count is what live files take, whenever it is read; `admit`
then adds a file only while the count stays within the bound, and otherwise says when
enough will have expired (the client's Retry-After). Files expire on their own (their
record's TTL); deleting one takes it out of all three at once.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.files.models import FileRecord, record_encoder
from proto.keys import RedisKeys

# KEYS[1] file_storage, KEYS[2] file_storage_bytes; ARGV[1] now (ms). Leaves `total`.
_PRUNE = """
local now = tonumber(ARGV[1])
local total = tonumber(redis.call('GET', KEYS[2]) or '0')
for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do
  total = total - tonumber(string.match(member, '/(%d+)$'))
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if total < 0 then total = 0 end
redis.call('SET', KEYS[2], total)
"""
# + KEYS[3] files(scope), KEYS[4] file(scope, id); ARGV[2] member, ARGV[3] bytes, ARGV[4]
# expiry (ms), ARGV[5] the bound, ARGV[6] id, ARGV[7] the record, ARGV[8] its TTL (ms).
# {1, total} admitted; {0, total, expiry of the file whose end frees enough (ms), or -1}.
_ADMIT = _PRUNE + """
local size = tonumber(ARGV[3])
if total + size > tonumber(ARGV[5]) then
  local need, freed = total + size - tonumber(ARGV[5]), 0
  local stored = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
  for i = 1, #stored, 2 do
    freed = freed + tonumber(string.match(stored[i], '/(%d+)$'))
    if freed >= need then return {0, total, tonumber(stored[i + 1])} end
  end
  return {0, total, -1}
end
redis.call('ZADD', KEYS[1], ARGV[4], ARGV[2])
redis.call('INCRBY', KEYS[2], size)
redis.call('SET', KEYS[4], ARGV[7], 'PX', ARGV[8])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[6])
local last = redis.call('ZRANGE', KEYS[3], -1, -1, 'WITHSCORES')
redis.call('PEXPIREAT', KEYS[3], last[2])
return {1, total + size}
"""
# + KEYS[3] files(scope), KEYS[4] file(scope, id); ARGV[2] member, ARGV[3] id. 1: deleted.
_DROP = _PRUNE + """
if redis.call('ZREM', KEYS[1], ARGV[2]) == 1 then
  total = total - tonumber(string.match(ARGV[2], '/(%d+)$'))
  if total < 0 then total = 0 end
  redis.call('SET', KEYS[2], total)
end
redis.call('ZREM', KEYS[3], ARGV[3])
return redis.call('DEL', KEYS[4])
"""
_USAGE = _PRUNE + "return total"


@dataclass(frozen=True)
class Admission:
    admitted: bool
    stored_bytes: int  # all live files' bytes: with this one when admitted, without it when not
    retry_after_s: int | None = None  # not admitted: when enough will have expired (None: never)


def _member(scope: str, record: FileRecord) -> str:
    return f"{scope}/{record.id}/{record.bytes}"


class FileLedger:
    def __init__(self, client: aioredis.Redis, keys: RedisKeys, max_storage_bytes: int):
        self._client = client
        self._keys = keys
        self.max_storage_bytes = max_storage_bytes

    def _keys_of(self, scope: str, file_id: str) -> list[str]:
        return [self._keys.file_storage, self._keys.file_storage_bytes, self._keys.files(scope),
                self._keys.file(scope, file_id)]

    async def admit(self, scope: str, record: FileRecord, now_ms: int, expires_ms: int) -> Admission:
        """Write `record` (and index it) until `expires_ms` if all files with it stay within
        the bound (times: unix ms)."""
        answer = await self._client.eval(
            _ADMIT, 4, *self._keys_of(scope, record.id), now_ms, _member(scope, record), record.bytes, expires_ms,
            self.max_storage_bytes, record.id, record_encoder.encode(record), max(1, expires_ms - now_ms))
        if answer[0] == 1:
            return Admission(True, int(answer[1]))
        when = int(answer[2])
        retry = None if when < 0 else max(1, math.ceil((when - now_ms) / 1000))
        return Admission(False, int(answer[1]), retry)

    async def drop(self, scope: str, record: FileRecord, now_s: float | None = None) -> bool:
        """Delete the file everywhere; False when it was gone already."""
        now_ms = int((time.time() if now_s is None else now_s) * 1000)
        return bool(await self._client.eval(_DROP, 4, *self._keys_of(scope, record.id), now_ms,
                                            _member(scope, record), record.id))

    async def stored_bytes(self, now_s: float | None = None) -> int:
        """What the files that have not expired take, all scopes together."""
        now_ms = int((time.time() if now_s is None else now_s) * 1000)
        return int(await self._client.eval(_USAGE, 2, self._keys.file_storage, self._keys.file_storage_bytes,
                                           now_ms))

    async def file_ids(self, scope: str, now_s: float | None = None) -> list[str]:
        """The ids of the scope's files that have not expired (some may be deleted meanwhile)."""
        now_ms = int((time.time() if now_s is None else now_s) * 1000)
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.zremrangebyscore(self._keys.files(scope), "-inf", now_ms)
            pipe.zrange(self._keys.files(scope), 0, -1)
            _, ids = await pipe.execute()
        return [i.decode() if isinstance(i, bytes) else i for i in ids]
