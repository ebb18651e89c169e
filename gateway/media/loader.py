"""The media of one request, from content parts to stored items: what the preflight calls.

    loader = MediaLoader.from_config(config, redis_client)      # one per gateway
    loaded = await loader.load([MediaPart("image", url, "messages[0].content[1].image_url.url"), ...])
    # → [LoadedImage(content_hash, width, height, mime, ...) | LoadedVideo(frames=(LoadedFrame(
    #     content_hash, width, height, timestamp_s, index), ...), ...)], in the parts' order

`load` first counts the parts against `--limit-mm-per-prompt` (nothing is fetched for a
request over it), then fetches, checks and stores every part concurrently: at most
`fetch_concurrency` parts of one request at once (network), and at most `decode_threads`
decodes in this gateway at once, each in a thread (CPU: a big image or video never runs on
the event loop). The first part that fails cancels the others and its 400 is the answer;
items already stored simply expire.

An image is stored as its file (`MediaItem` "encoded"), a video as its sampled frames
(`MediaItem` "rgb8", one per frame); the request then carries only their hashes, computed
from the bytes every time. An image whose bytes the store already holds (a camera frame sent
again in the next question) costs its hash, one Redis round trip that refreshes its TTL and
a read of its header: it passed the full decode when it was stored. A part's `uuid` (vLLM's
client-given id of an item) is recorded for later parts (gateway/media/uuids.py); a part with a
uuid and no data is that record, read back before anything is fetched (an unknown uuid fails
the request at once): no fetch, no decode, the same hashes. A part naming an uploaded file
(`file_id`, the Files API) is read from the file's record the same way, by `files`
(gateway/files/references.py): an unknown, deleted or expired id fails the request at once.
Such parts count against `--limit-mm-per-prompt` as any.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import redis.asyncio as aioredis

from gateway.config import GatewayConfig
from gateway.errors import OpenAIError, invalid
from gateway.media.address_policy import parse_networks
from gateway.media.fetch import FetchPolicy, MediaFetcher
from gateway.media.images import check_image, checked_before
from gateway.media.loaded import LoadedFrame, LoadedImage, LoadedMedia, LoadedVideo, MediaPart
from gateway.media.options import VideoSampling, parse_limits, parse_video_sampling
from gateway.media.store import MediaStore, encoded_hash
from gateway.media.uuids import SHARED_SCOPE, MediaUUIDs
from gateway.media.video import decode_video
from proto.keys import RedisKeys


@dataclass(frozen=True)
class MediaSettings:
    """GatewayConfig's media fields, parsed."""

    limits: Mapping[str, int] = field(default_factory=lambda: parse_limits("{}"))
    sampling: VideoSampling = VideoSampling()
    fetch: FetchPolicy = FetchPolicy()
    max_image_pixels: int = 2**25
    max_video_frames: int = 9000
    ttl_s: float = 3600.0

    @classmethod
    def from_config(cls, config: GatewayConfig) -> MediaSettings:
        return cls(limits=parse_limits(config.limit_mm_per_prompt),
                   sampling=parse_video_sampling(config.media_io_kwargs),
                   fetch=FetchPolicy(timeout_s=config.media_fetch_timeout_s, max_bytes=config.max_media_bytes,
                                     allowed_domains=tuple(d.lower() for d in config.allowed_media_domains),
                                     allowed_networks=parse_networks(",".join(config.allowed_media_networks)),
                                     allowed_local_path=config.allowed_local_media_path),
                   max_image_pixels=config.max_image_pixels, max_video_frames=config.max_video_frames,
                   ttl_s=config.media_ttl_s)


@dataclass
class LoaderStats:
    """Media this gateway took in (for its metrics); the store counts what it wrote."""

    images: int = 0
    videos: int = 0
    video_frames: int = 0  # kept after sampling
    by_uuid: int = 0  # parts without data, named by a uuid sent before (nothing fetched or decoded)


class FileImages(Protocol):
    """The images of uploaded files (gateway/files/references.py: `FileReferences`)."""

    async def recall(self, scope: str, parts: Sequence[MediaPart]) -> list[LoadedImage]:
        """The image each part's `file_id` names in `scope`; a 400 `file_not_found` for the
        first one that names none."""
        ...


class MediaLoader:
    def __init__(self, settings: MediaSettings, store: MediaStore, fetcher: MediaFetcher | None = None, *,
                 uuids: MediaUUIDs | None = None, files: FileImages | None = None, fetch_concurrency: int = 4,
                 decode_threads: int | None = None):
        """`uuids`: where parts' uuids are recorded (by default beside `store`'s items);
        `files`: the uploaded files parts may name (None: a part by file_id is refused)."""
        self.settings = settings
        self.store = store
        self.uuids = uuids or MediaUUIDs(store.client, store.keys, settings.ttl_s)
        self.files = files
        self.fetcher = fetcher or MediaFetcher(settings.fetch)
        self.stats = LoaderStats()
        self._fetch_concurrency = fetch_concurrency
        self._decoding = asyncio.Semaphore(decode_threads or min(4, os.cpu_count() or 1))

    @classmethod
    def from_config(cls, config: GatewayConfig, client: aioredis.Redis,
                    files: FileImages | None = None) -> MediaLoader:
        """The gateway's loader, storing through `client` (flags checked again: a bad value
        set on a GatewayConfig built in code fails here, at startup)."""
        try:
            settings = MediaSettings.from_config(config)
        except ValueError as exc:
            raise ValueError(f"gateway media settings: {exc}") from None
        return cls(settings, MediaStore(client, RedisKeys(config.key_prefix), settings.ttl_s), files=files)

    async def aclose(self) -> None:
        await self.fetcher.aclose()

    def check_limits(self, parts: Sequence[MediaPart]) -> None:
        """400 for more parts of a kind than `--limit-mm-per-prompt` allows (vLLM's message),
        naming the first part over the limit."""
        seen: dict[str, int] = {}
        for part in parts:
            seen[part.kind] = seen.get(part.kind, 0) + 1
            limit = self.settings.limits.get(part.kind, 0)
            if seen[part.kind] > limit:
                total = sum(p.kind == part.kind for p in parts)
                message = (f"This server does not accept {part.kind} input." if limit == 0 else
                           f"At most {limit} {part.kind}(s) may be provided in one prompt; this "
                           f"request has {total}.")
                raise invalid(message, param=part.param, code="too_many_media_items")

    async def load(self, parts: Sequence[MediaPart], sampling: VideoSampling | None = None,
                   scope: str = SHARED_SCOPE) -> list[LoadedMedia]:
        """Every part fetched, checked and stored, or (without data) named by its uuid, in
        order (`sampling`: this request's video sampling, the server's by default; `scope`:
        whose uuids, gateway/media/uuids.py)."""
        self.check_limits(parts)
        if not parts:
            return []
        # a uuid a part with data sends in this request: its last such part, for the others
        sent = {(p.kind, p.uuid): i for i, p in enumerate(parts) if not p.by_uuid and p.uuid is not None}
        earlier = [p for p in parts if p.by_uuid and (p.kind, p.uuid) not in sent]
        recalled = iter(await self.uuids.recall(scope, earlier))  # first: an unknown uuid fetches nothing
        uploaded = iter(await self._recall_files(scope, [p for p in parts if p.by_file]))
        data = [i for i, p in enumerate(parts) if not (p.by_uuid or p.by_file)]
        fetching = asyncio.Semaphore(self._fetch_concurrency)
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._load_one(parts[i], fetching, sampling or self.settings.sampling))
                         for i in data]
        except BaseExceptionGroup as failed:
            raise _first_error(failed) from None
        loaded = {i: task.result() for i, task in zip(data, tasks)}
        await self.uuids.remember(scope, [(parts[i], loaded[i]) for i in sent.values()])
        self.stats.by_uuid += sum(p.by_uuid for p in parts)
        out: list[LoadedMedia] = []
        for i, part in enumerate(parts):
            if i in loaded:
                out.append(loaded[i])
            elif part.by_file:
                out.append(next(uploaded))
            elif (part.kind, part.uuid) in sent:
                out.append(replace(loaded[sent[(part.kind, part.uuid)]], param=part.param, uuid=part.uuid))
            else:
                out.append(next(recalled))
        return out

    async def _recall_files(self, scope: str, parts: Sequence[MediaPart]) -> list[LoadedImage]:
        if not parts:
            return []
        if self.files is None:
            raise invalid("This server keeps no files: send the image in the part itself.",
                          param=parts[0].param, code="file_not_found")
        return await self.files.recall(scope, parts)

    async def _load_one(self, part: MediaPart, fetching: asyncio.Semaphore,
                        sampling: VideoSampling) -> LoadedMedia:
        if not part.url:
            raise invalid(f"The {part.kind} part's URL is empty.", param=part.param, code="invalid_media_url")
        async with fetching:
            fetched = await self.fetcher.fetch(part.url, part.kind, part.param)
        if part.kind == "image":
            digest = encoded_hash(fetched.data)
            if await self.store.refresh(digest):  # stored before, so checked before: no decode
                image = checked_before(fetched.data, max_pixels=self.settings.max_image_pixels, param=part.param)
            else:
                async with self._decoding:
                    image = await asyncio.to_thread(check_image, fetched.data,
                                                    max_pixels=self.settings.max_image_pixels, param=part.param)
                digest = await self.store.put(image.item())
            self.stats.images += 1
            return LoadedImage(digest, image.width, image.height, image.mime, part.param, part.uuid)
        async with self._decoding:
            video = await asyncio.to_thread(decode_video, fetched.data, sampling=sampling,
                                            max_pixels=self.settings.max_image_pixels,
                                            max_frames=self.settings.max_video_frames, param=part.param)
        digests = [await self.store.put(frame.item()) for frame in video.frames]
        self.stats.videos += 1
        self.stats.video_frames += len(video.frames)
        frames = tuple(LoadedFrame(digest, f.width, f.height, f.timestamp_s, f.index)
                       for digest, f in zip(digests, video.frames))
        return LoadedVideo(frames, video.total_frames, video.fps, video.duration_s, part.param, part.uuid)


def _first_error(group: BaseExceptionGroup) -> BaseException:
    """What to raise for a failed load: an unexpected error first (it is a bug, and must not
    hide behind a 400), else the first OpenAIError."""
    leaves: list[BaseException] = []

    def walk(exc: BaseException) -> None:
        if isinstance(exc, BaseExceptionGroup):
            for inner in exc.exceptions:
                walk(inner)
        else:
            leaves.append(exc)

    walk(group)
    unexpected = [e for e in leaves if not isinstance(e, OpenAIError)]
    return (unexpected or leaves)[0]
