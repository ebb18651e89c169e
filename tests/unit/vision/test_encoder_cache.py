"""EncoderCache (vision/encoder_cache.py): LRU by bytes, counters, invariants; and
through ModelRunner on the tiny gemma3-vision checkpoint: an image two requests carry is
fetched and encoded once, and a cache too small for two images encodes again what it
evicted (with the same result)."""

import io

import numpy as np
import pytest
import torch
from PIL import Image
from tests.support.runner_helpers import FakeMediaSource, MiniScheduler, make_runner, mm_inputs

from proto.messages import MediaItem
from vision.encoder_cache import EncoderCache

IMAGE, BOI, EOI, MM_TOKENS = 7, 6, 8, 4  # the tiny tokenizer's image tokens; soft tokens per image
EMBED_BYTES = MM_TOKENS * 64 * 4  # one image's embeddings: [4, 64] fp32


def embeds(value: float, rows: int = 4) -> torch.Tensor:
    return torch.full((rows, 64), float(value))  # rows * 256 bytes


def test_lru_eviction_by_bytes_and_counters():
    cache = EncoderCache(3 * 1024)
    for key in "abc":
        assert cache.put(key, embeds(ord(key)))
    assert len(cache) == 3 and cache.used_bytes == 3 * 1024
    assert cache.get("a")[0, 0] == ord("a")  # a is now the most recent: b goes first
    assert cache.get("z") is None
    assert cache.put("d", embeds(4.0))
    assert "b" not in cache and {"a", "c", "d"} == {k for k in "abcd" if k in cache}
    assert cache.put("e", embeds(5.0, rows=8))  # 2 KiB: c and then a make room
    assert [k for k in "abcde" if k in cache] == ["d", "e"]
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.evictions, stats.entries) == (1, 1, 3, 2)
    assert stats.used_bytes == 3 * 1024 == stats.capacity_bytes
    cache.check_integrity()


def test_oversized_entries_and_replacements():
    cache = EncoderCache(2048)
    kept = embeds(1.0)
    assert cache.put("a", kept)
    assert not cache.put("huge", embeds(2.0, rows=9))  # larger than the whole cache
    assert "huge" not in cache and "a" in cache and cache.evictions == 0
    assert cache.put("a", embeds(3.0, rows=2))  # the same key again: its new size counts
    assert cache.used_bytes == 512 and cache.get("a")[0, 0] == 3.0
    assert kept[0, 0] == 1.0  # a tensor handed out stays valid after its entry is replaced
    off = EncoderCache(0)
    assert not off.put("a", embeds(1.0)) and off.get("a") is None and len(off) == 0
    with pytest.raises(ValueError, match="must be >= 0"):
        EncoderCache(-1)
    cache.check_integrity()
    off.check_integrity()


# ---- through the runner ---------------------------------------------------------------------

def png(seed: int, width: int, height: int) -> MediaItem:
    rs = np.random.RandomState(seed)
    out = io.BytesIO()
    Image.fromarray(rs.randint(0, 256, (height, width, 3), dtype=np.uint8)).save(out, format="PNG")
    return MediaItem("encoded", width, height, out.getvalue(), "image/png")


def prompt(seed: int, num_images: int) -> list[int]:
    """Random text tokens with `num_images` images expanded as the processor does it."""
    rs = np.random.RandomState(seed)
    ids = [2]
    for _ in range(num_images):
        ids += [int(t) for t in rs.randint(9, 1536, 5)] + [BOI] + [IMAGE] * MM_TOKENS + [EOI]
    return ids + [int(t) for t in rs.randint(9, 1536, 5)]


def run(runner, requests: dict[str, tuple[list[int], list[str]]], one_at_a_time: bool) -> MiniScheduler:
    sched = MiniScheduler(runner, block_size=8, num_blocks=96, token_budget=512)
    for rid, (ids, hashes) in requests.items():
        sched.add(rid, ids, 3, mm_inputs(ids, IMAGE, hashes), logprobs=2)
        if one_at_a_time:
            sched.run()
    sched.run()
    return sched


def vision_stats(sched: MiniScheduler) -> tuple[int, int]:
    """(images encoded, encoder-cache hits) over the run."""
    stats = [o.vision for o in sched.outputs_seen if o.vision is not None]
    return sum(s.items_encoded for s in stats), sum(s.cache_hits for s in stats)


def test_an_image_two_requests_carry_is_encoded_once(vision_dir):
    media = FakeMediaSource()
    a, b = media.put(png(1, 40, 30)), media.put(png(2, 17, 60))
    runner = make_runner(vision_dir, block_size=8, num_blocks=96, media=media)
    # one after the other: the second finds the first's image in the cache
    sched = run(runner, {"r0": (prompt(3, 1), [a]), "r1": (prompt(4, 2), [b, a])}, one_at_a_time=True)
    assert media.fetches == [[a], [b]]
    assert vision_stats(sched) == (2, 1)
    assert runner.vision.cache.stats().hits == 1 and len(runner.vision.cache) == 2
    # in one step: fetched and encoded once, however many requests carry it
    media.fetches.clear()
    fresh = make_runner(vision_dir, block_size=8, num_blocks=96, media=media)
    together = run(fresh, {"r0": (prompt(3, 1), [a]), "r1": (prompt(4, 2), [b, a]), "r2": (prompt(5, 1), [a])},
                   one_at_a_time=False)
    assert [sorted(f) for f in media.fetches] == [sorted([a, b])]  # in the step's (map) order
    assert vision_stats(together) == (2, 0)
    for rid in ("r0", "r1"):  # the same numbers whichever way the embeddings came
        assert together.outputs(rid) == sched.outputs(rid) and together.logprobs[rid] == sched.logprobs[rid]


def test_a_small_cache_evicts_and_encodes_again(vision_dir):
    media = FakeMediaSource()
    a, b = media.put(png(6, 30, 30)), media.put(png(7, 50, 20))
    runner = make_runner(vision_dir, block_size=8, num_blocks=96, media=media,
                         encoder_cache_memory_bytes=EMBED_BYTES)  # room for one image
    assert runner.vision.cache.capacity_bytes == EMBED_BYTES
    sched = run(runner, {"r0": (prompt(8, 1), [a]), "r1": (prompt(9, 1), [b]), "r2": (prompt(8, 1), [a])},
                one_at_a_time=True)
    assert media.fetches == [[a], [b], [a]] and vision_stats(sched) == (3, 0)
    assert runner.vision.cache.stats().evictions == 2 and list(media.fetches[-1]) == [a]
    assert sched.outputs("r2") == sched.outputs("r0") and sched.logprobs["r2"] == sched.logprobs["r0"]
    runner.vision.cache.check_integrity()
