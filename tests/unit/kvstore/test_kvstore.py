"""kvstore (scheduler side): exact block ids, free-queue order, refcounts, integrity."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvstore.block_pool import BlockPool, KVBlock
from kvstore.free_queue import FreeBlockQueue
from kvstore.kv_cache_manager import KVCacheManager


def free_order(manager: KVCacheManager) -> list[int]:
    return [block.block_id for block in manager.block_pool.free_queue]


# -- free queue -----------------------------------------------------------------------


def test_free_queue_popleft_append_remove_from_middle():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    assert [b.block_id for b in queue] == [0, 1, 2, 3, 4]
    assert queue.popleft() is blocks[0]
    queue.remove(blocks[2])  # from the middle
    queue.remove(blocks[4])  # the last one
    assert [b.block_id for b in queue] == [1, 3]
    assert blocks[2] not in queue and blocks[3] in queue
    queue.append(blocks[0])
    queue.append(blocks[2])
    assert [b.block_id for b in queue] == [1, 3, 0, 2]
    assert len(queue) == 4
    queue.check_integrity()
    assert [b.block_id for b in queue.popleft_n(4)] == [1, 3, 0, 2]
    with pytest.raises(IndexError):
        queue.popleft()
    queue.check_integrity()


def test_free_queue_rejects_misuse():
    blocks = [KVBlock(i) for i in range(3)]
    queue = FreeBlockQueue(blocks)
    with pytest.raises(ValueError):
        queue.append(blocks[1])  # already queued
    queue.remove(blocks[1])
    with pytest.raises(ValueError):
        queue.remove(blocks[1])  # already out
    with pytest.raises(IndexError):
        queue.popleft_n(3)
    assert len(queue) == 2  # the failed popleft_n took nothing


def test_free_queue_integrity_catches_a_broken_link():
    blocks = [KVBlock(i) for i in range(3)]
    queue = FreeBlockQueue(blocks)
    blocks[2].prev_free = blocks[0]  # corrupt: should be blocks[1]
    with pytest.raises(AssertionError, match="wrong prev link"):
        queue.check_integrity()


# -- block pool -----------------------------------------------------------------------


def test_block_pool_refcounts_and_free_order():
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    assert [b.block_id for b in a] == [0, 1] and all(b.ref_cnt == 1 for b in a)
    assert pool.num_free_blocks == 2 and pool.usage == 0.5
    pool.touch([a[1]])  # shared by a second table (a prefix hit)
    assert a[1].ref_cnt == 2
    pool.free_blocks(reversed(a))
    assert a[1].ref_cnt == 1 and a[0].ref_cnt == 0
    assert [b.block_id for b in pool.free_queue] == [0, 2, 3]  # uncached: to the head
    pool.free_blocks([a[1]])
    assert [b.block_id for b in pool.free_queue] == [1, 0, 2, 3]
    with pytest.raises(ValueError, match="freed more times"):
        pool.free_blocks([a[1]])
    with pytest.raises(IndexError):
        pool.get_new_blocks(5)
    assert pool.num_free_blocks == 4
    pool.check_integrity()


# -- KV cache manager: hand-written scenarios -----------------------------------------


def test_allocate_grow_free_reallocate_exact_ids():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots("a", 5) == [0, 1]  # 5 tokens -> 2 blocks
    assert kv.allocate_slots("b", 4) == [2]  # exactly one full block
    assert kv.allocate_slots("a", 8) == []  # still fits in a's 2 blocks
    assert kv.allocate_slots("a", 9) == [3]  # crosses the block boundary
    assert kv.allocate_slots("b", 5) == [4]
    assert kv.block_ids("a") == [0, 1, 3] and kv.block_ids("b") == [2, 4]
    assert free_order(kv) == [5, 6, 7]
    kv.check_integrity()

    kv.free("a")  # nothing cached: 3, 1, 0 go to the head in that order
    assert free_order(kv) == [0, 1, 3, 5, 6, 7]
    assert kv.block_ids("a") == [] and kv.num_free_blocks == 6
    kv.check_integrity()

    assert kv.allocate_slots("c", 16) == [0, 1, 3, 5]  # head of the queue first
    assert kv.allocate_slots("a", 1) == [6]
    assert free_order(kv) == [7]
    kv.free("b")
    assert free_order(kv) == [2, 4, 7]
    kv.free("nobody")  # freeing a request without blocks is a no-op
    kv.check_integrity()


def test_allocate_slots_none_has_no_side_effects():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    assert kv.allocate_slots("a", 5) == [0, 1, 2]
    before = free_order(kv)
    assert kv.allocate_slots("a", 9) is None  # needs 2 more, 1 free
    assert kv.allocate_slots("b", 3) is None  # needs 2, 1 free
    assert kv.block_ids("a") == [0, 1, 2] and kv.block_ids("b") == []
    assert kv.request_ids() == ["a"]  # no empty table left behind for b
    assert free_order(kv) == before and kv.num_free_blocks == 1
    kv.check_integrity()
    assert kv.allocate_slots("a", 7) == [3]  # what does fit still works
    assert kv.allocate_slots("a", 0) == [] and kv.allocate_slots("b", 0) == []
    kv.check_integrity()


def test_check_integrity_names_the_broken_invariant():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate_slots("a", 4)
    kv.block_pool.blocks[0].ref_cnt = 2
    with pytest.raises(AssertionError, match=r"held by 1 block tables but has ref_cnt 2"):
        kv.check_integrity()

    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate_slots("a", 4)
    leaked = kv.block_pool.blocks[0]
    kv._tables["a"][0].remove(leaked)  # dropped from the table without being freed
    leaked.ref_cnt = 0
    with pytest.raises(AssertionError, match=r"missing from the free queue: \[0\]"):
        kv.check_integrity()


# -- KV cache manager: random operation sequences -------------------------------------

NUM_BLOCKS, BLOCK_SIZE = 16, 4


class KVCacheMachine(RuleBasedStateMachine):
    """Random allocate / append / free against a model of how many tokens each request
    holds; check_integrity() after every operation."""

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE)
        self.num_tokens: dict[str, int] = {}  # model: tokens covered per request
        self.next_id = 0

    def _expected_free(self) -> int:
        return NUM_BLOCKS - sum(-(-n // BLOCK_SIZE) for n in self.num_tokens.values())

    def _grow(self, request_id: str, num_tokens: int) -> bool:
        had = self.kv.block_ids(request_id)
        free_before = free_order(self.kv)
        new = self.kv.allocate_slots(request_id, num_tokens)
        if new is None:
            assert -(-num_tokens // BLOCK_SIZE) - len(had) > len(free_before)
            assert self.kv.block_ids(request_id) == had and free_order(self.kv) == free_before
            return False
        assert new == free_before[:len(new)]  # taken from the head, in queue order
        assert self.kv.block_ids(request_id) == had + new
        self.num_tokens[request_id] = max(num_tokens, self.num_tokens.get(request_id, 0))
        return True

    @rule(target=requests, num_tokens=st.integers(1, 40))
    def allocate(self, num_tokens):
        request_id = f"r{self.next_id}"
        self.next_id += 1
        self._grow(request_id, num_tokens)
        return request_id

    @rule(request_id=requests, extra=st.integers(1, 9))
    def append(self, request_id, extra):
        if request_id in self.num_tokens:
            self._grow(request_id, self.num_tokens[request_id] + extra)

    @rule(request_id=consumes(requests))
    def free(self, request_id):
        ids = self.kv.block_ids(request_id)
        free_before = free_order(self.kv)
        self.kv.free(request_id)
        self.num_tokens.pop(request_id, None)
        assert free_order(self.kv) == ids + free_before  # nothing cached: all to the head

    @invariant()
    def consistent(self):
        self.kv.check_integrity()
        assert self.kv.num_free_blocks == self._expected_free()


KVCacheMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase
