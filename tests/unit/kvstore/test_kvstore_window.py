"""Sliding windows in the kvstore: the blocks wholly behind the window of a request's next
query go back to the pool (exact ids), a long generation holds about window + one block,
prefix caching keeps its chain (a block is dropped only once offered to the cache), and
swap, fork, free and integrity hold with holes in the tables. Random sequences:
test_prefix_cache.py's windowed machines."""

from kvstore.kv_cache_manager import HOLE_BLOCK_ID, KVCacheManager, cdiv

BS, W = 4, 8


def free_order(kv: KVCacheManager) -> list[int]:
    return [block.block_id for block in kv.block_pool.free_queue]


def step(kv: KVCacheManager, rid: str, tokens: list[int], hashes: list[bytes], computed: int,
         upto: int) -> list[int] | None:
    """Allocate for tokens [computed, upto) (dropping behind the window first), 'compute'
    them and offer the full blocks to the cache; the ids appended."""
    ids = kv.allocate_slots(rid, upto, num_computed_tokens=computed)
    if ids is not None:
        kv.cache_full_blocks(rid, tokens, hashes, upto)
    kv.check_integrity()
    return ids


def test_blocks_behind_the_window_go_back_exact_ids():
    kv = KVCacheManager(16, BS, group_windows=(W,))
    tokens, hashes = list(range(100, 121)), []
    assert step(kv, "a", tokens, hashes, 0, 20) == [0, 1, 2, 3, 4]
    # The next query, at position 20, sees keys 13..20: blocks 0-2 (positions 0-11) are
    # given back (cached, so to the tail of the free queue, the first block last).
    assert step(kv, "a", tokens, hashes, 20, 21) == [5]
    assert kv.block_ids("a") == [HOLE_BLOCK_ID] * 3 + [3, 4, 5]
    assert kv.num_blocks_held("a") == 3
    assert free_order(kv) == [*range(6, 16), 2, 1, 0]
    assert all(kv.block_pool.blocks[i].block_hash is not None for i in (0, 1, 2))
    kv.free("a")
    kv.check_integrity()
    assert kv.num_free_blocks == 16


def test_a_long_generation_holds_about_window_plus_one_block():
    kv = KVCacheManager(64, BS, group_windows=(W,))
    tokens, hashes = list(range(300)), []
    step(kv, "a", tokens, hashes, 0, 10)
    held = []
    for computed in range(10, 299):
        assert step(kv, "a", tokens, hashes, computed, computed + 1) is not None
        held.append(kv.num_blocks_held("a"))
    assert max(held) == cdiv(W, BS) + 1
    assert len(kv.block_ids("a")) == cdiv(299, BS)  # positions keep their table index
    without = KVCacheManager(100, BS)
    without.allocate_slots("a", 299)
    assert without.num_blocks_held("a") == 75


def test_only_blocks_offered_to_the_cache_are_dropped():
    """A chunk whose blocks are not offered yet (the step ran ahead of the update) keeps
    them until they are: the cached chain from block 0 stays whole, so a request with the
    same prefix still hits all of it."""
    kv = KVCacheManager(32, BS, group_windows=(W,))
    tokens, hashes = list(range(200, 240)), []
    assert kv.allocate_slots("a", 24) is not None  # computed, not offered to the cache yet
    assert kv.allocate_slots("a", 25, num_computed_tokens=24) == [6]
    assert kv.num_blocks_held("a") == 7  # nothing dropped: none was offered
    kv.cache_full_blocks("a", tokens, hashes, 24)
    assert step(kv, "a", tokens, hashes, 25, 26) == []
    assert kv.num_blocks_held("a") == 3  # blocks 0-3 (positions < 18) went back, cached
    other_hashes: list[bytes] = []
    hit = kv.find_cached_prefix(tokens[:25], other_hashes)
    assert [b.block_id for b in hit] == [0, 1, 2, 3, 4, 5]
    assert kv.allocate_slots("b", 25, hit) == [0, 1, 2, 3, 4, 5, 7]
    kv.check_integrity()


def test_without_prefix_caching_blocks_go_back_at_once():
    kv = KVCacheManager(16, BS, enable_prefix_caching=False, group_windows=(W,))
    kv.allocate_slots("a", 24)
    # blocks 0-3 (positions < 17) go back uncached, to the head of the free queue, and the
    # next block is one of them
    assert kv.allocate_slots("a", 25, num_computed_tokens=24) == [0]
    assert kv.block_ids("a") == [HOLE_BLOCK_ID] * 4 + [4, 5, 0] and kv.num_blocks_held("a") == 3
    kv.check_integrity()


def test_swap_keeps_the_holes():
    kv = KVCacheManager(16, BS, num_cpu_blocks=8, group_windows=(W,))
    tokens, hashes = list(range(50, 80)), []
    step(kv, "a", tokens, hashes, 0, 24)
    step(kv, "a", tokens, hashes, 24, 25)
    assert kv.num_blocks_held("a") == 3 and kv.can_swap_out("a")
    pairs = kv.swap_out("a")
    assert [gpu for gpu, _ in pairs] == [4, 5, 6] and kv.num_swapped_blocks("a") == 3
    kv.check_integrity()
    back = kv.swap_in("a")
    assert len(back) == 3 and kv.num_blocks_held("a") == 3
    assert kv.block_ids("a")[:4] == [HOLE_BLOCK_ID] * 4
    kv.check_integrity()
    # a table with holes cannot chain from block 0: it offers the cache nothing more
    cached_before = len(kv.block_pool.cached)
    step(kv, "a", tokens, hashes, 25, 29)
    assert len(kv.block_pool.cached) == cached_before
    kv.free("a")
    kv.check_integrity()
    assert kv.num_free_blocks == 16 and kv.cpu_pool.num_free_blocks == 8


def test_fork_shares_the_live_blocks_and_the_holes():
    kv = KVCacheManager(16, BS, group_windows=(W,))
    tokens, hashes = list(range(60, 90)), []
    step(kv, "p", tokens, hashes, 0, 24)
    step(kv, "p", tokens, hashes, 24, 26)
    kv.fork("p", "c0")
    kv.fork("p", "c1")
    kv.free("p")
    kv.check_integrity()
    assert kv.block_ids("c0") == kv.block_ids("c1")
    assert kv.allocate_slots("c0", 30, num_computed_tokens=26) == [7]
    kv.check_integrity()
    kv.free("c0")
    kv.free("c1")
    kv.check_integrity()
    assert kv.num_free_blocks == 16
