"""The encode-job stream as one encoder sees it (`RedisKeys.encode_jobs`, group `encoders`):
reading its share, taking over what a dead encoder left pending, acknowledging.

    jobs = EncodeJobStream(client, keys, consumer)
    jobs.create_group()                  the group, from the stream's start (idempotent)
    jobs.read(count, block_ms)           -> [(entry id, EncodeJob)] new to this group
    jobs.claim_stale(min_idle_ms, count) -> entries another consumer read and did not
                                            acknowledge for min_idle_ms (it died): now ours
    jobs.ack(entry_ids)                  XACK + XDEL: done
    jobs.depth()                         -> jobs no encoder has finished (lag + pending)

A job is acknowledged only after its media are published (or found published, or failed
for good), so an encoder that dies mid-batch loses nothing: its entries stay pending and
the next `claim_stale` of a live encoder takes them.
"""

from __future__ import annotations

import logging

import msgspec
import redis

from proto.encoder_messages import EncodeJob, job_decoder
from proto.keys import ENCODER_GROUP, STREAM_FIELD, RedisKeys

log = logging.getLogger(__name__)


class EncodeJobStream:
    def __init__(self, client: redis.Redis, keys: RedisKeys, consumer: str):
        self._client = client
        self._keys = keys
        self.consumer = consumer

    def create_group(self) -> None:
        try:
            self._client.xgroup_create(self._keys.encode_jobs, ENCODER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read(self, count: int, block_ms: int) -> list[tuple[bytes, EncodeJob]]:
        reply = self._client.xreadgroup(ENCODER_GROUP, self.consumer, {self._keys.encode_jobs: ">"},
                                        count=count, block=block_ms)
        return self._decode(reply[0][1] if reply else [])

    def claim_stale(self, min_idle_ms: int, count: int) -> list[tuple[bytes, EncodeJob]]:
        _, entries, *_ = self._client.xautoclaim(self._keys.encode_jobs, ENCODER_GROUP, self.consumer,
                                                 min_idle_time=min_idle_ms, start_id="0-0", count=count)
        return self._decode(entries)

    def ack(self, entry_ids: list[bytes]) -> None:
        if entry_ids:
            pipe = self._client.pipeline(transaction=False)
            pipe.xack(self._keys.encode_jobs, ENCODER_GROUP, *entry_ids)
            pipe.xdel(self._keys.encode_jobs, *entry_ids)
            pipe.execute()

    def depth(self) -> int:
        for group in self._client.xinfo_groups(self._keys.encode_jobs):
            if group["name"] in (ENCODER_GROUP, ENCODER_GROUP.encode()):
                return int(group.get("lag") or 0) + int(group["pending"])
        return 0

    def _decode(self, entries) -> list[tuple[bytes, EncodeJob]]:
        out = []
        for entry_id, fields in entries:
            if fields is None:  # deleted while pending
                out.append((entry_id, EncodeJob(())))
                continue
            try:
                out.append((entry_id, job_decoder.decode(fields[STREAM_FIELD])))
            except (KeyError, msgspec.DecodeError) as exc:
                log.warning("encode job %s undecodable (%s): dropped", entry_id, exc)
                out.append((entry_id, EncodeJob(())))
        return out
