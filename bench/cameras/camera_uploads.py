"""bench/cameras/cameras.py's --upload mode: each camera uploads each frame with `POST /v1/files` at
the frame's capture time, and its questions name their frames by `file_id` (chat `file`
parts), never carrying pixels -- the camera pattern the encoder service (`pagedserve
encoder`) is for: it encodes each upload as it is stored, before any question names it.

    uploads = CameraUploads(client, args, jpegs, last)   # jpegs[k][i]: camera k's frame i
    await uploads.preroll()            # the frames captured before the clock starts
    uploads.start(t0)                  # a task per camera: frame i at t0 + capture_s(args, i)
    ids = await uploads.ready(k, window)   # a question waits for its frames' uploads
    await uploads.finish(); await uploads.delete_all()   # best effort
    uploads.summary(pctl)              # uploads, failures, latency, lag behind capture

A camera uploads its frames one after another, each at its capture time or, when the one
before is still uploading, as soon as that returns (its lag behind the capture). A question
waits for the uploads of its frames to have returned (its `upload_wait_s`); a frame whose
upload failed is left out of the question (counted as missing).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import httpx

DELETE_CONCURRENCY = 16


@dataclass
class Upload:
    camera: int
    index: int
    at_s: float  # its capture time, from the start (below 0: captured, and uploaded, before it)
    bytes: int = 0  # the JPEG's
    lag_s: float = 0.0  # sent this late behind its capture (the camera's upload before still going)
    latency_s: float = 0.0  # the POST, sent to answered
    file_id: str | None = None
    error: str | None = None


def capture_s(args, index: int) -> float:
    """When a camera captures its frame `index`, from the start: frame N - 1 at 0, so the
    first question already has N frames."""
    return (index - args.frames + 1) / args.fps


async def upload_file(client: httpx.AsyncClient, args, name: str, data: bytes) -> str:
    """POST /v1/files (purpose "vision"): the file's id; raises on any failure."""
    reply = await client.post("files", files={"file": (name, data, "image/jpeg")}, data={"purpose": "vision"},
                              headers={"Authorization": f"Bearer {args.api_key}"})
    if reply.status_code != 200:
        raise RuntimeError(f"HTTP {reply.status_code}: {reply.text[:200]}")
    return reply.json()["id"]


async def delete_files(client: httpx.AsyncClient, args, file_ids: list[str]) -> int:
    """DELETE /v1/files/{id} for each; how many were deleted (best effort: failures ignored)."""
    gate = asyncio.Semaphore(DELETE_CONCURRENCY)

    async def one(file_id: str) -> bool:
        async with gate:
            try:
                reply = await client.delete(f"files/{file_id}", headers={"Authorization": f"Bearer {args.api_key}"})
                return reply.status_code == 200
            except httpx.HTTPError:
                return False

    return sum(await asyncio.gather(*(one(f) for f in file_ids)))


def file_parts(file_ids: list[str | None]) -> list[dict]:
    """Chat `file` parts naming the uploaded frames (a failed upload, None, left out)."""
    return [{"type": "file", "file": {"file_id": f}} for f in file_ids if f is not None]


class CameraUploads:
    def __init__(self, client: httpx.AsyncClient, args, jpegs: list[list[bytes]], last: list[int]):
        """`last[k]`: the newest frame a question of camera k can name (no later frame is uploaded)."""
        self._client, self._args, self._jpegs = client, args, jpegs
        self.uploads = [[Upload(k, i, capture_s(args, i), len(jpegs[k][i])) for i in range(last[k] + 1)]
                        for k in range(len(last))]
        loop = asyncio.get_running_loop()
        self._done = [[loop.create_future() for _ in camera] for camera in self.uploads]
        self._tasks: list[asyncio.Task] = []
        self.deleted = 0

    async def _upload(self, u: Upload, start: float | None) -> None:
        if start is not None:
            u.lag_s = max(0.0, time.perf_counter() - start - u.at_s)
        sent = time.perf_counter()
        try:
            u.file_id = await upload_file(self._client, self._args, f"s{self._args.seed}-cam{u.camera}-{u.index}.jpg",
                                          self._jpegs[u.camera][u.index])
        except Exception as exc:  # a failed upload is reported, not fatal
            u.error = f"{type(exc).__name__}: {exc}"[:300]
        u.latency_s = time.perf_counter() - sent
        self._done[u.camera][u.index].set_result(u.file_id)

    async def preroll(self) -> None:
        """Upload the frames captured before the start (each camera's in order, the cameras at once)."""
        async def camera(uploads: list[Upload]) -> None:
            for u in uploads:
                if u.at_s < 0:
                    await self._upload(u, None)

        await asyncio.gather(*(camera(c) for c in self.uploads))

    def start(self, start: float) -> None:
        """A task per camera uploading its other frames, each at `start` + its capture time."""
        async def camera(uploads: list[Upload]) -> None:
            for u in uploads:
                if u.at_s >= 0:
                    await asyncio.sleep(max(0.0, start + u.at_s - time.perf_counter()))
                    await self._upload(u, start)

        self._tasks = [asyncio.create_task(camera(c)) for c in self.uploads]

    async def ready(self, camera: int, window: range) -> list[str | None]:
        """The file ids of camera `camera`'s frames `window` once each upload has returned
        (None: it failed)."""
        return list(await asyncio.gather(*(self._done[camera][i] for i in window)))

    async def finish(self) -> None:
        await asyncio.gather(*self._tasks)

    async def delete_all(self, extra: list[str] | None = None) -> None:
        """Delete every file uploaded (and `extra`), best effort."""
        ids = [u.file_id for c in self.uploads for u in c if u.file_id is not None] + (extra or [])
        self.deleted = await delete_files(self._client, self._args, ids)

    def summary(self, pctl: Callable[[list[float]], dict]) -> dict:
        every = [u for c in self.uploads for u in c]
        ok = [u for u in every if u.error is None]
        return {"frames_uploaded": len(ok), "uploads_failed": len(every) - len(ok),
                "upload_errors": sorted({u.error for u in every if u.error})[:5],
                "upload_latency_s": pctl([u.latency_s for u in ok]),
                "upload_lag_s": pctl([u.lag_s for u in every if u.at_s >= 0]),
                "upload_jpeg_mb": sum(u.bytes for u in every) / 1e6, "files_deleted": self.deleted,
                "uploads": [asdict(u) for u in every]}
