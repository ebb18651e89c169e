"""Automatic prefix caching in the kvstore: exact block ids, eviction order, LRU, hit
verification, sharing, hits after preemption, per-block extra keys (images), . Random
operation sequences checked against the K/V every slot holds: test_kv_random_ops.py. The
scheduler on top: test_prefix_cache_scheduler.py (and test_scheduler_images.py for images)."""

from kvstore.block_hash import hash_block
from kvstore.kv_cache_manager import KVCacheManager
from tests.support.prefix_cache_helpers import BS, P, colliding_hash


def free_order(kv: KVCacheManager) -> list[int]:
    return [block.block_id for block in kv.block_pool.free_queue]


def run(kv: KVCacheManager, rid: str, tokens: list[int], hashes: list[bytes] | None = None,
        computed: int | None = None, extra_keys: dict[int, tuple] | None = None) -> list[int]:
    """Admit a request with its cached prefix, 'compute' it up to `computed` tokens (all
    but the last by default), offer its full blocks to the cache; its block ids."""
    hashes = [] if hashes is None else hashes
    computed = len(tokens) - 1 if computed is None else computed
    cached = kv.find_cached_prefix(tokens, hashes, extra_keys)
    assert kv.allocate_slots(rid, computed, cached) is not None
    kv.cache_full_blocks(rid, tokens, hashes, computed, extra_keys)
    kv.check_integrity()
    return kv.block_ids(rid)


# -- kvstore: hand-written scenarios ---------------------------------------------------


def test_second_request_reuses_the_cached_prefix_exact_ids():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    assert run(kv, "a", P[:10] + [1], computed=11) == [0, 1, 2]  # blocks 0, 1 full
    assert sorted(b.block_id for b in kv.block_pool.cached.values()) == [0, 1]
    kv.free("a")  # 2 (not cached) to the head; 1 then 0 to the tail
    assert free_order(kv) == [2, 3, 4, 5, 6, 7, 1, 0]
    kv.check_integrity()

    hashes: list[bytes] = []
    cached = kv.find_cached_prefix(P[:8] + [7, 7, 7], hashes)
    assert [b.block_id for b in cached] == [0, 1] and len(hashes) == 2
    assert free_order(kv) == [2, 3, 4, 5, 6, 7, 1, 0]  # finding changes nothing
    assert kv.allocate_slots("b", 11, cached) == [0, 1, 2]  # hits, then the head
    assert free_order(kv) == [3, 4, 5, 6, 7]
    assert [kv.block_pool.blocks[i].ref_cnt for i in (0, 1, 2)] == [1, 1, 1]
    kv.check_integrity()


def test_last_token_is_always_computed():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    run(kv, "a", P[:8] + [9], computed=9)  # both blocks of P[:8] cached
    assert len(kv.find_cached_prefix(P[:8], [])) == 1  # 8 tokens: block 2 holds the last
    assert len(kv.find_cached_prefix(P[:9], [])) == 2
    assert kv.find_cached_prefix(P[:4], []) == []


def test_two_live_requests_share_blocks_by_refcount():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    assert run(kv, "a", P + [1]) == [0, 1, 2]  # 12 computed: all three cached
    assert run(kv, "b", P + [2, 3]) == [0, 1, 2, 3]  # shares a's three blocks
    assert [kv.block_pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 2, 1]
    kv.free("a")
    assert [kv.block_pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 1, 1]
    assert free_order(kv) == [4, 5, 6, 7]  # still used by b: nothing freed
    kv.free("b")
    assert free_order(kv) == [3, 4, 5, 6, 7, 2, 1, 0]  # b's partial block first
    kv.check_integrity()


def test_eviction_takes_empty_blocks_first_then_least_recently_used():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    run(kv, "a", P[:4] + [1, 1], computed=6)  # blocks 0 (cached), 1 (partial)
    run(kv, "b", [5, 5, 5, 5, 6], computed=5)  # blocks 2 (cached), 3 (partial)
    kv.free("a")
    kv.free("b")
    assert free_order(kv) == [3, 1, 4, 5, 0, 2]  # empty ones first, then a's, then b's
    assert kv.allocate_slots("c", 12) == [3, 1, 4]
    assert kv.block_pool.num_evictions == 0 and len(kv.block_pool.cached) == 2
    assert kv.allocate_slots("c", 16) == [5]
    assert kv.allocate_slots("c", 20) == [0]  # a's block: freed before b's
    assert kv.block_pool.num_evictions == 1 and kv.find_cached_prefix(P[:4] + [1], []) == []
    assert [b.block_id for b in kv.find_cached_prefix([5, 5, 5, 5, 6], [])] == [2]
    kv.check_integrity()


def test_a_hit_moves_a_free_cached_block_to_most_recently_used():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    run(kv, "a", P[:4] + [1], computed=5)  # 0 cached, 1 partial
    run(kv, "b", [5, 5, 5, 5, 6], computed=5)  # 2 cached, 3 partial
    kv.free("a")
    kv.free("b")
    assert free_order(kv) == [3, 1, 4, 5, 0, 2]
    assert run(kv, "c", P[:4] + [9], computed=5) == [0, 3]  # out of the middle, O(1)
    assert free_order(kv) == [1, 4, 5, 2]
    kv.free("c")
    assert free_order(kv) == [3, 1, 4, 5, 2, 0]  # 0 is now the most recently used
    assert kv.allocate_slots("d", 20) == [3, 1, 4, 5, 2]  # b's block evicted before a's
    kv.check_integrity()


def test_equal_content_cached_once_and_chains_continue_through_it():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    # a and b both compute P from scratch (b admitted before a's blocks were cached).
    assert kv.allocate_slots("a", 12) == [0, 1, 2]
    assert kv.allocate_slots("b", 13) == [3, 4, 5, 6]
    kv.cache_full_blocks("a", P + [1], [], 12)
    hashes_b: list[bytes] = []
    kv.cache_full_blocks("b", P + [2], hashes_b, 13)
    assert sorted(b.block_id for b in kv.block_pool.cached.values()) == [0, 1, 2]  # not b's
    kv.allocate_slots("b", 17)
    kv.cache_full_blocks("b", P + [2] * 5, hashes_b, 17)  # b's 4th block chains on a's 3rd
    assert [b.block_id for b in kv.find_cached_prefix(P + [2] * 5, [])] == [0, 1, 2, 6]
    kv.free("b")
    assert free_order(kv) == [3, 4, 5, 7, 8, 9, 6]  # b's duplicates hold no hash: reused first
    kv.check_integrity()


def test_per_block_extra_keys_key_only_their_block_and_chain_on():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    image_a, image_b = {1: ("A",)}, {1: ("B",)}  # block 1 holds an image; 0 and 2 text
    assert run(kv, "a", P + [1], computed=12, extra_keys=image_a) == [0, 1, 2]
    assert kv.block_pool.blocks[1].block_key.extra_keys == ("A",)
    assert kv.block_pool.blocks[0].block_key.extra_keys == kv.block_pool.blocks[2].block_key.extra_keys == ()
    def hit(keys):
        return [b.block_id for b in kv.find_cached_prefix(P + [1], [], keys)]

    assert hit(image_a) == [0, 1, 2]  # the same image: all of it
    assert hit(image_b) == [0]  # another image: the text before it, not the text after
    assert hit(None) == hit({}) == [0]  # text only: block 1's keys are ()
    assert hit({2: ("A",)}) == [0]  # the key belongs to its block, not to the request
    # The same walk verifies keys, not only hashes: a hash function ignoring them finds the
    # block, the key check refuses it.
    blind = KVCacheManager(num_blocks=8, block_size=BS, hash_fn=lambda p, t, e: hash_block(p, t))
    run(blind, "a", P + [1], computed=12, extra_keys=image_a)
    assert [b.block_id for b in blind.find_cached_prefix(P + [1], [], image_b)] == [0]
    kv.check_integrity()


def test_a_hash_hit_is_verified_against_the_tokens():
    kv = KVCacheManager(num_blocks=8, block_size=BS, hash_fn=lambda p, t, e: b"same")
    run(kv, "a", P[:4] + [1], computed=5)
    assert kv.find_cached_prefix([9, 9, 9, 9, 1], []) == []  # same hash, other tokens
    assert [b.block_id for b in kv.find_cached_prefix(P[:4] + [2], [])] == [0]
    kv.check_integrity()


def test_a_hit_is_verified_against_the_whole_prefix():
    kv = KVCacheManager(num_blocks=8, block_size=BS, hash_fn=colliding_hash)
    X, Y, W = [1] * 4, [2] * 4, [3] * 4
    run(kv, "a", X + Y + [0], computed=9)  # X -> 0, Y -> 1 (after X)
    kv.free("a")
    run(kv, "c", W + Y + [0], computed=9)  # Y after W: same hash as a's Y, other K/V
    assert [b.block_id for b in kv.find_cached_prefix(W + Y + [0], [])] == [2, 3]
    # a's Y block lost its place to c's; X + Y must not be served c's Y.
    assert [b.block_id for b in kv.find_cached_prefix(X + Y + [0], [])] == [0]
    kv.free("c")
    run(kv, "d", X + Y + [0], computed=9)  # computes Y after X again: cached again
    assert [b.block_id for b in kv.find_cached_prefix(X + Y + [5], [])] == [0, kv.block_ids("d")[1]]
    kv.check_integrity()


def test_a_block_whose_parent_left_the_cache_is_not_served():
    kv = KVCacheManager(num_blocks=8, block_size=BS, hash_fn=colliding_hash)
    X, Y, W = [1] * 4, [2] * 4, [3] * 4
    run(kv, "a", X + Y + [0], computed=9)  # X -> 0, Y -> 1 (after X)
    kv.free("a")
    assert run(kv, "e", W + X + [0], computed=9) == [2, 3, 4]  # X after W replaces block 0
    assert free_order(kv) == [0, 5, 6, 7, 1]  # 0 lost its hash: with the empty ones
    assert kv.block_pool.blocks[1].block_hash is not None  # a's Y: cached, parent gone
    assert kv.find_cached_prefix(X + Y + [0], []) == []
    kv.free("e")
    assert run(kv, "f", X + Y + [0], computed=9) == [4, 0, 5]  # replaces the stale Y too
    assert kv.block_pool.blocks[1].block_hash is None
    assert [b.block_id for b in kv.find_cached_prefix(X + Y + [7], [])] == [4, 0]
    kv.check_integrity()


def test_prefix_caching_off():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    assert run(kv, "a", P[:8] + [0], computed=9) == [0, 1, 2]
    assert kv.block_pool.cached == {}
    kv.free("a")
    assert free_order(kv) == [0, 1, 2, 3]
    assert kv.find_cached_prefix(P[:8] + [0], []) == []
