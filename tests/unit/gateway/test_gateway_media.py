"""The gateway's media layer (gateway/media/): the flags, image checks with PIL, the Redis
store, and the loader's limits (fetching: tests/unit/gateway/test_media_fetch.py). Every refusal is a 400
with OpenAI's error fields, naming the content part."""

import argparse
import hashlib
import io
import struct
import uuid
import zlib

import pytest
import redis.asyncio as aioredis
from PIL import Image

from compose.launcher import free_port
from gateway.config import GatewayConfig, add_cli_args, config_from_args
from gateway.errors import OpenAIError
from gateway.media.address_policy import parse_networks
from gateway.media.fetch import FetchPolicy
from gateway.media.images import check_image
from gateway.media.loader import LoadedImage, MediaLoader, MediaPart, MediaSettings
from gateway.media.options import VideoSampling, parse_limits, parse_video_sampling
from gateway.media.store import MediaStore, content_hash
from proto.env_flags import EnvFlags
from proto.keys import RedisKeys
from proto.messages import MediaItem
from tests.support.media_helpers import PARAM, data_url, png, refused
from tests.support.media_server import MediaHandler

def encode(image: Image.Image, fmt: str, **save) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **save)
    return out.getvalue()


def png_header(width: int, height: int) -> bytes:
    """A PNG that declares a size and holds no pixels: a decompression bomb's header."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IEND", b""))


# ---- flags ---------------------------------------------------------------------------------


def gateway_parser() -> argparse.ArgumentParser:
    flags = EnvFlags(argparse.ArgumentParser())
    add_cli_args(flags)
    return flags.parser


def test_media_flags_defaults_env_and_vllm_syntax(monkeypatch):
    config = config_from_args(gateway_parser().parse_args(["--model", "m"]))
    assert config.limit_mm_per_prompt == GatewayConfig(model="m").limit_mm_per_prompt
    assert config.allowed_media_domains == () and config.allowed_local_media_path is None
    assert config.allowed_media_networks == ()  # safe by default: no internal address fetched
    settings = MediaSettings.from_config(config)
    assert dict(settings.limits) == {"image": 8, "video": 1}
    assert settings.sampling == VideoSampling(num_frames=32, fps=-1.0)
    assert settings.fetch == FetchPolicy(timeout_s=10.0, max_bytes=20 * 2**20)

    monkeypatch.setenv("PAGEDSERVE_MAX_MEDIA_BYTES", "1000")
    monkeypatch.setenv("PAGEDSERVE_ALLOWED_MEDIA_DOMAINS", "a.example, B.example")
    monkeypatch.setenv("PAGEDSERVE_ALLOWED_MEDIA_NETWORKS", "10.0.0.0/8, fd00::/8,10.0.0.0/8")
    args = gateway_parser().parse_args([
        "--model", "m", "--limit-mm-per-prompt", '{"image": {"count": 2, "width": 512}, "video": 0}',
        "--media-io-kwargs", '{"video": {"num_frames": 4, "fps": 1.5}}',
        "--allowed-local-media-path", "/srv/media", "--media-fetch-timeout-s", "2.5", "--media-ttl-s", "60"])
    config = config_from_args(args)
    assert config.allowed_media_domains == ("a.example", "b.example")
    assert config.allowed_media_networks == ("10.0.0.0/8", "fd00::/8")
    assert config.max_media_bytes == 1000 and config.media_fetch_timeout_s == 2.5
    settings = MediaSettings.from_config(config)
    assert dict(settings.limits) == {"image": 2, "video": 0}
    assert settings.sampling == VideoSampling(num_frames=4, fps=1.5)
    assert settings.fetch.allowed_local_path == "/srv/media" and settings.ttl_s == 60.0
    assert [str(n) for n in settings.fetch.allowed_networks] == ["10.0.0.0/8", "fd00::/8"]
    config = config_from_args(gateway_parser().parse_args(["--model", "m", "--allowed-media-networks",
                                                           "192.168.10.0/24,127.0.0.1"]))
    assert config.allowed_media_networks == ("192.168.10.0/24", "127.0.0.1/32")  # the flag wins over the env


@pytest.mark.parametrize("flag, value, words", [
    ("--limit-mm-per-prompt", "image=2", "not JSON"),
    ("--limit-mm-per-prompt", '{"image": -1}', "count >= 0"),
    ("--media-io-kwargs", '{"video": {"frames": 4}}', "unknown video option"),
    ("--media-io-kwargs", '{"video": {"num_frames": 0}}', "num_frames"),
    ("--media-io-kwargs", '{"audio": {}}', "unknown media kind"),
    ("--allowed-media-networks", "10.0.0.0/33", "'10.0.0.0/33' is not a network in CIDR notation"),
    ("--allowed-media-networks", "192.168.1.5/24", "has host bits set"),
    ("--allowed-media-networks", "10.0.0.0/8,lan", "'lan' is not a network"),
])
def test_bad_media_flags_fail_at_startup(capsys, flag, value, words):
    with pytest.raises(SystemExit):
        gateway_parser().parse_args(["--model", "m", flag, value])
    assert words in capsys.readouterr().err


def test_limits_keep_defaults_for_kinds_left_out():
    assert parse_limits('{"image": 3}') == {"image": 3, "video": 1}
    assert parse_video_sampling('{"video": {"fps": 2}}') == VideoSampling(num_frames=32, fps=2.0)


# ---- images --------------------------------------------------------------------------------


def rgba() -> Image.Image:
    image = Image.new("RGBA", (17, 9), (10, 20, 30, 128))
    image.putpixel((3, 4), (255, 0, 0, 0))
    return image


GIF_COLORS = [(255, 0, 0), (0, 255, 0), (0, 0, 255)]
GIF_FRAMES = [Image.new("RGB", (20, 10), color) for color in GIF_COLORS]

IMAGES = {
    "png-rgb": (png((31, 7)), "PNG", "image/png", (31, 7), "RGB"),
    "jpeg": (encode(Image.new("RGB", (40, 30), (9, 90, 200)), "JPEG", quality=90), "JPEG", "image/jpeg",
             (40, 30), "RGB"),
    "png-rgba": (encode(rgba(), "PNG"), "PNG", "image/png", (17, 9), "RGBA"),
    "png-grayscale": (encode(Image.new("L", (5, 50), 77), "PNG"), "PNG", "image/png", (5, 50), "L"),
    "png-palette": (encode(Image.new("RGB", (12, 12), (1, 2, 3)).convert("P"), "PNG"), "PNG", "image/png",
                    (12, 12), "P"),
    "gif-animated": (encode(GIF_FRAMES[0], "GIF", save_all=True, append_images=GIF_FRAMES[1:]), "GIF",
                     "image/gif", (20, 10), "P"),
    "webp": (encode(Image.new("RGB", (16, 16), (5, 6, 7)), "WEBP"), "WEBP", "image/webp", (16, 16), "RGB"),
    "bmp": (encode(Image.new("RGB", (3, 2), (5, 6, 7)), "BMP"), "BMP", "image/bmp", (3, 2), "RGB"),
}


@pytest.mark.parametrize("name", IMAGES)
def test_images_that_are_accepted(name):
    data, fmt, mime, size, mode = IMAGES[name]
    checked = check_image(data, max_pixels=2**25, param=PARAM)
    assert (checked.format, checked.mime, (checked.width, checked.height), checked.mode) == (fmt, mime, size, mode)
    item = checked.item()
    assert item == MediaItem(kind="encoded", width=size[0], height=size[1], data=data, mime=mime)
    assert content_hash(item) == hashlib.sha256(data).hexdigest()  # the file's own sha256


def test_gif_keeps_its_first_frame():
    data = IMAGES["gif-animated"][0]
    with Image.open(io.BytesIO(data)) as image:  # what the worker will do with the stored bytes
        assert image.n_frames == 3 and image.convert("RGB").getpixel((0, 0)) == GIF_COLORS[0]


@pytest.mark.parametrize("data, code, words", [
    (b"hello, this is text", "invalid_image", ["not a valid image"]),
    (png()[: len(png()) // 2], "invalid_image", ["truncated or corrupt"]),
    (IMAGES["jpeg"][0][:300], "invalid_image", ["JPEG image is truncated or corrupt"]),
    (png()[:60] + b"\xff" * 20 + png()[80:], "invalid_image", ["corrupt"]),
    (encode(Image.new("RGB", (8, 8)), "TIFF"), "unsupported_image_format", ["TIFF is not supported"]),
    (encode(Image.new("RGB", (8, 8)), "ICO"), "unsupported_image_format", ["ICO"]),
    (png_header(6000, 6000), "image_too_large", ["6000x6000", "limit is 33554432"]),  # no pixel decoded
    (png_header(100_000, 100_000), "image_too_large", ["33554432"]),  # past PIL's own bomb limit
    (png_header(0, 10), "invalid_image", []),  # no pixels: PIL does not even identify it
])
def test_images_that_are_refused(data, code, words):
    with pytest.raises(OpenAIError) as exc_info:
        check_image(data, max_pixels=2**25, param=PARAM)
    refused(exc_info, code, *words)


def test_pixel_cap_is_a_setting():
    with pytest.raises(OpenAIError) as exc_info:
        check_image(png((20, 20)), max_pixels=399, param=PARAM)
    refused(exc_info, "image_too_large", "20x20 = 400 pixels", "limit is 399")
    assert check_image(png((20, 20)), max_pixels=400, param=PARAM).width == 20


# ---- the store, on a real Redis -------------------------------------------------------------


@pytest.mark.anyio
async def test_store_round_trip_nx_and_ttl(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    keys = RedisKeys(f"media-test-{uuid.uuid4().hex[:8]}")
    store = MediaStore(client, keys, ttl_s=30)
    try:
        image = check_image(png(), max_pixels=2**25, param=PARAM).item()
        digest = await store.put(image)
        assert digest == hashlib.sha256(png()).hexdigest()
        assert await store.get(digest) == image
        assert 29 < await store.ttl_s(digest) <= 30
        assert (store.stats.items_written, store.stats.items_reused) == (1, 0)
        assert store.stats.bytes_written == len(await client.get(keys.media(digest)))

        # A repeat writes nothing and starts the TTL again.
        await client.pexpire(keys.media(digest), 2000)
        assert await store.ttl_s(digest) <= 2
        assert await store.put(MediaItem("encoded", image.width, image.height, png(), "image/png")) == digest
        assert 29 < await store.ttl_s(digest) <= 30
        assert (store.stats.items_written, store.stats.items_reused) == (1, 1)

        # NX: a different value under an existing key is never written over it.
        await client.set(keys.media(digest), b"other", keepttl=True)
        await store.put(image)
        assert await client.get(keys.media(digest)) == b"other"
        await client.delete(keys.media(digest))

        # Raw frames: the shape is part of the hash; the same pixels are one item.
        pixels = bytes(range(24))
        wide, tall = MediaItem("rgb8", 4, 2, pixels), MediaItem("rgb8", 2, 4, pixels)
        assert await store.put(wide) != await store.put(tall)
        assert content_hash(wide) == hashlib.sha256(b"rgb8:4x2:" + pixels).hexdigest()
        assert await store.put(MediaItem("rgb8", 4, 2, bytes(pixels))) == content_hash(wide)
        assert await store.get("0" * 64) is None
    finally:
        await client.aclose()


@pytest.mark.anyio
async def test_store_without_redis_is_a_503():
    client = aioredis.Redis.from_url(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=1)
    store = MediaStore(client, RedisKeys("x"), ttl_s=30)
    with pytest.raises(OpenAIError) as exc_info:
        await store.put(MediaItem("encoded", 1, 1, b"x", "image/png"))
    assert exc_info.value.status == 503 and exc_info.value.code == "redis_unavailable"
    await client.aclose()


# ---- the loader ------------------------------------------------------------------------------


def part(url: str, i: int = 0, kind: str = "image") -> MediaPart:
    return MediaPart(kind, url, f"messages[0].content[{i}].{kind}_url.url")


@pytest.mark.anyio
async def test_loader_loads_in_order_and_dedupes(redis_url, http_server, tmp_path):
    client = aioredis.Redis.from_url(redis_url)
    keys = RedisKeys(f"media-test-{uuid.uuid4().hex[:8]}")
    (tmp_path / "c.png").write_bytes(IMAGES["png-rgba"][0])
    # the server is on loopback: opened explicitly (by default the gateway fetches no internal address)
    settings = MediaSettings(fetch=FetchPolicy(allowed_local_path=str(tmp_path),
                                               allowed_networks=parse_networks("127.0.0.0/8")))
    loader = MediaLoader(settings, MediaStore(client, keys, ttl_s=60))
    try:
        parts = [part(data_url(IMAGES["jpeg"][0], "image/jpeg"), 0), part(f"{http_server}/ok.png", 1),
                 part("c.png", 2), MediaPart("image", data_url(MediaHandler.image), "input[0].content[3].image_url",
                                             uuid="client-id")]
        loaded = await loader.load(parts)
        assert [type(x) for x in loaded] == [LoadedImage] * 4
        assert [x.param for x in loaded] == [p.param for p in parts]
        assert [(x.width, x.height, x.mime) for x in loaded] == [
            (40, 30, "image/jpeg"), (32, 24, "image/png"), (17, 9, "image/png"), (32, 24, "image/png")]
        assert loaded[1].content_hash == loaded[3].content_hash == hashlib.sha256(MediaHandler.image).hexdigest()
        assert loaded[3].uuid == "client-id"
        stored = await loader.store.get(loaded[2].content_hash)
        assert stored.data == IMAGES["png-rgba"][0] and stored.kind == "encoded"
        assert loader.stats.images == 4 and loader.store.stats.items_written == 3
        assert await loader.load([]) == []
    finally:
        await loader.aclose()
        await client.aclose()


@pytest.mark.anyio
async def test_an_image_stored_before_is_not_decoded_again(redis_url):
    """Bytes the store holds passed the full decode when stored: sent again they cost their
    hash, a TTL refresh and their header. Shown with a JPEG whose scan is cut short, stored
    directly: loaded through the store it is taken (only a decode would fail it), not
    stored it is refused as truncated."""
    client = aioredis.Redis.from_url(redis_url)
    keys = RedisKeys(f"media-test-{uuid.uuid4().hex[:8]}")
    loader = MediaLoader(MediaSettings(), MediaStore(client, keys, ttl_s=60))
    whole = IMAGES["jpeg"][0]
    cut = whole[:-20]  # the header whole, the scan cut short
    try:
        with pytest.raises(OpenAIError) as refusal:
            await loader.load([part(data_url(cut, "image/jpeg"))])
        assert refusal.value.body()["error"]["code"] == "invalid_image"
        await loader.store.put(MediaItem(kind="encoded", width=40, height=30, data=cut, mime="image/jpeg"), ttl_s=5)
        [again] = await loader.load([part(data_url(cut, "image/jpeg"))])
        assert (again.content_hash, again.width, again.height, again.mime) == (
            hashlib.sha256(cut).hexdigest(), 40, 30, "image/jpeg")
        assert await loader.store.ttl_s(again.content_hash) > 5  # refreshed to the store's TTL
        [first, second] = await loader.load([part(data_url(whole, "image/jpeg"))] * 2)
        assert first == second and loader.store.stats.items_written == 2  # cut, whole
        assert loader.store.stats.items_reused >= 2
    finally:
        await loader.aclose()
        await client.aclose()


@pytest.mark.anyio
async def test_loader_refusals_name_the_part(redis_url):
    client = aioredis.Redis.from_url(redis_url)
    settings = MediaSettings(limits=parse_limits('{"image": 2, "video": 0}'))
    loader = MediaLoader(settings, MediaStore(client, RedisKeys(f"media-test-{uuid.uuid4().hex[:8]}"), 60))
    good = data_url(png())
    try:
        with pytest.raises(OpenAIError) as exc_info:
            await loader.load([part(good, 0), part(good, 1), part(good, 2)])
        refused(exc_info, "too_many_media_items", "At most 2 image(s) may be provided in one prompt",
                "has 3", param="messages[0].content[2].image_url.url")
        with pytest.raises(OpenAIError) as exc_info:
            await loader.load([part(good, 0), part("data:video/mp4;base64,AAAA", 1, "video")])
        refused(exc_info, "too_many_media_items", "does not accept video",
                param="messages[0].content[1].video_url.url")
        # Nothing was fetched or stored for a request over the limit.
        assert loader.stats.images == 0 and loader.store.stats.items_written == 0

        with pytest.raises(OpenAIError) as exc_info:  # one bad part among good ones
            await loader.load([part(good, 0), part("data:image/png;base64,!!", 1)])
        refused(exc_info, "invalid_base64", param="messages[0].content[1].image_url.url")
        with pytest.raises(OpenAIError) as exc_info:
            await loader.load([part(data_url(b"GIF89a not really"), 4)])
        refused(exc_info, "invalid_image", param="messages[0].content[4].image_url.url")
        with pytest.raises(OpenAIError) as exc_info:
            await loader.load([MediaPart("image", "", "messages[0].content[0].image_url.url", uuid="u")])
        refused(exc_info, "invalid_media_url", "empty", param="messages[0].content[0].image_url.url")
    finally:
        await loader.aclose()
        await client.aclose()


def test_loader_from_config_checks_its_settings(redis_url):
    with pytest.raises(ValueError, match="gateway media settings"):
        MediaLoader.from_config(GatewayConfig(model="m", limit_mm_per_prompt="[]"),
                                aioredis.Redis.from_url(redis_url))
    loader = MediaLoader.from_config(GatewayConfig(model="m", max_media_bytes=5, key_prefix="p"),
                                     aioredis.Redis.from_url(redis_url))
    assert loader.settings.fetch.max_bytes == 5
