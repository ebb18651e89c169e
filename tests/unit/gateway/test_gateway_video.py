"""Video in the gateway's media layer (gateway/media/video.py, loader.py): files encoded here
with PyAV, sampled by num_frames / fps as vLLM's loader does, frames checked by their colour
and timestamp, refusals as 400s, decoding in a thread, frames stored once in Redis."""

import base64
import io
import threading
import uuid

import av
import pytest
import redis.asyncio as aioredis
from PIL import Image

from gateway.errors import OpenAIError
from gateway.media import loader as loader_module
from gateway.media.loader import LoadedVideo, MediaLoader, MediaPart, MediaSettings
from gateway.media.options import VideoSampling, parse_limits
from gateway.media.store import MediaStore, content_hash
from gateway.media.video import decode_video
from tests.support.media_helpers import color, make_video
from proto.keys import RedisKeys

PARAM = "messages[0].content[0].video_url.url"
SIZE = (64, 48)
RATE = 10


MP4 = make_video()


def decode(data: bytes = MP4, sampling: VideoSampling = VideoSampling(), max_pixels: int = 2**25,
           max_frames: int = 9000):
    return decode_video(data, sampling=sampling, max_pixels=max_pixels, max_frames=max_frames, param=PARAM)


def center(frame) -> tuple[int, int, int]:
    image = Image.frombytes("RGB", (frame.width, frame.height), frame.rgb)
    return image.getpixel((frame.width // 2, frame.height // 2))


def close(a, b, tolerance: int = 12) -> bool:
    return all(abs(x - y) <= tolerance for x, y in zip(a, b))


def assert_frames(video, indices: list[int]) -> None:
    assert [f.index for f in video.frames] == indices
    assert [f.timestamp_s for f in video.frames] == pytest.approx([i / RATE for i in indices])
    for frame in video.frames:
        assert (frame.width, frame.height) == SIZE and len(frame.rgb) == SIZE[0] * SIZE[1] * 3
        assert close(center(frame), color(frame.index)), (frame.index, center(frame))


@pytest.mark.parametrize("sampling, indices", [
    (VideoSampling(), list(range(20))),  # 32 asked, 20 there: all of them
    (VideoSampling(num_frames=5), [0, 4, 9, 14, 19]),  # linspace(0, 19, 5) as ints
    (VideoSampling(num_frames=1), [0]),
    (VideoSampling(num_frames=-1, fps=2), [0, 6, 12, 19]),  # 2 s at 2 fps: 4 frames
    (VideoSampling(num_frames=3, fps=2), [0, 9, 19]),  # the fewer of the two
    (VideoSampling(num_frames=-1, fps=0.1), [0]),  # under one frame: still one
    (VideoSampling(num_frames=-1, fps=30), list(range(20))),  # more than the video has
])
def test_sampling_by_num_frames_and_fps(sampling, indices):
    video = decode(sampling=sampling)
    assert (video.total_frames, video.fps, video.duration_s) == (20, 10.0, 2.0)
    assert_frames(video, indices)


@pytest.mark.parametrize("container, codec", [("webm", "libvpx-vp9"), ("avi", "mjpeg"), ("matroska", "mpeg4")])
def test_other_containers_and_codecs(container, codec):
    video = decode(make_video(container, codec), VideoSampling(num_frames=4))
    assert video.total_frames == 20
    assert_frames(video, [0, 6, 12, 19])


def test_frame_items_hash_their_pixels():
    first, second = decode(sampling=VideoSampling(num_frames=2)).frames
    item = first.item()
    assert (item.kind, item.width, item.height, item.mime) == ("rgb8", 64, 48, "")
    again = decode(sampling=VideoSampling(num_frames=2)).frames[0].item()
    assert content_hash(again) == content_hash(item) != content_hash(second.item())


def audio_only() -> bytes:
    out = io.BytesIO()
    with av.open(out, "w", format="mp4") as container:
        stream = container.add_stream("aac", rate=8000)
        frame = av.AudioFrame(format="fltp", layout="mono", samples=1024)
        frame.sample_rate = 8000
        for plane in frame.planes:
            plane.update(bytes(plane.buffer_size))
        for packet in stream.encode(frame):
            container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return out.getvalue()


def png_bytes() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, "PNG")
    return out.getvalue()


@pytest.mark.parametrize("data, kwargs, code, words", [
    (b"definitely not a video" * 50, {}, "invalid_video", ["could not be decoded"]),
    (MP4[: len(MP4) // 2], {}, "invalid_video", ["could not be decoded"]),  # mp4 cut: no index
    (png_bytes(), {}, "invalid_video", ["could not be decoded"]),  # an image is not a video here
    (b"#EXTM3U\n#EXTINF:1,\nfile:///etc/passwd\n#EXT-X-ENDLIST\n", {}, "invalid_video", []),
    (audio_only(), {}, "invalid_video", ["no video stream"]),
    (MP4, {"max_frames": 19}, "video_too_long", ["more than 19 frames"]),
    (MP4, {"max_pixels": 64 * 48 - 1}, "video_too_large", ["64x48 = 3072 pixels"]),
])
def test_videos_that_are_refused(data, kwargs, code, words):
    with pytest.raises(OpenAIError) as exc_info:
        decode(data, **kwargs)
    error = exc_info.value
    assert (error.status, error.code, error.param) == (400, code, PARAM), error.message
    for word in words:
        assert word in error.message, error.message


@pytest.mark.anyio
async def test_loader_stores_frames_decoded_in_a_thread(redis_url, monkeypatch):
    """Decoding runs in a worker thread, never on the event loop: a long video cannot stall
    the gateway."""
    threads = []

    def recording(*args, **kwargs):
        threads.append(threading.current_thread())
        return decode_video(*args, **kwargs)

    monkeypatch.setattr(loader_module, "decode_video", recording)
    client = aioredis.Redis.from_url(redis_url)
    settings = MediaSettings(sampling=VideoSampling(num_frames=4), limits=parse_limits('{"video": 2}'))
    store = MediaStore(client, RedisKeys(f"media-test-{uuid.uuid4().hex[:8]}"), ttl_s=60)
    loader = MediaLoader(settings, store)
    url = f"data:video/mp4;base64,{base64.b64encode(MP4).decode()}"
    try:
        first, second = await loader.load([MediaPart("video", url, PARAM),
                                            MediaPart("video", url, "messages[0].content[1].video_url.url")])
        loop_thread = threading.current_thread()
        assert len(threads) == 2 and all(t is not loop_thread for t in threads)  # off the event loop
        assert isinstance(first, LoadedVideo) and first.kind == "video"
        assert [f.index for f in first.frames] == [0, 6, 12, 19]
        assert [f.timestamp_s for f in first.frames] == pytest.approx([0.0, 0.6, 1.2, 1.9])
        assert (first.total_frames, first.fps, first.duration_s) == (20, 10.0, 2.0)
        # The same video twice: the same four items, written once.
        assert [f.content_hash for f in first.frames] == [f.content_hash for f in second.frames]
        assert store.stats.items_written == 4 and store.stats.items_reused == 4
        assert loader.stats.videos == 2 and loader.stats.video_frames == 8
        stored = await store.get(first.frames[3].content_hash)
        assert stored.kind == "rgb8" and (stored.width, stored.height) == SIZE
        assert close(Image.frombytes("RGB", SIZE, stored.data).getpixel((32, 24)), color(19))

        # A per-request sampling overrides the server's.
        (only,) = await loader.load([MediaPart("video", url, PARAM)], sampling=VideoSampling(num_frames=2))
        assert [f.index for f in only.frames] == [0, 19]

        with pytest.raises(OpenAIError) as exc_info:
            await loader.load([MediaPart("video", "data:video/mp4;base64,AAAA", PARAM)])
        assert exc_info.value.code == "invalid_video" and exc_info.value.param == PARAM
        with pytest.raises(OpenAIError) as exc_info:  # an image's mime type on a video part
            await loader.load([MediaPart("video", "data:image/png;base64,AAAA", PARAM)])
        assert exc_info.value.code == "invalid_media_type"
    finally:
        await loader.aclose()
        await client.aclose()

