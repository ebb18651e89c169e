"""Random operation sequences over the block pool and its tables (hypothesis state
machines): admit with prefix hits, compute and decode in chunks, finish, preempt by
recompute or by swap, resume, fork and copy on write, evict -- with one KV cache group
(full attention; every layer sliding, Mistral) or several (a global group and sliding ones,
Gemma 3's kinds: kvstore/kv_cache_groups.py), with the real hash and a colliding one.

Every slot remembers the prefix its K/V were computed from (tokens, and the extra keys of
its block and the blocks before), written into each group's blocks as each group's layers
write theirs. The invariants prove, after every operation, that no hit serves wrong K/V in
any group, that nothing overwrites a live request's K/V (every key its next query's window
reaches, in every group), that a cached block holds the tokens of its key, and that
check_integrity() holds -- whatever the hash function does."""

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstore.block_hash import hash_block
from kvstore.kv_cache_manager import KVCacheManager, cdiv
from kvstore.prefix_hit import PrefixHit, first_needed
from tests.support.prefix_cache_helpers import BS, P, colliding_hash

NUM_BLOCKS = 12  # per group
PREFIXES = [[], P[:4], P[:8], P, [7, 7, 7, 7, 8, 8], [0] * 4, P[:4] + [0] * 4]
# Per-block extra keys (images in blocks 1, or 0 and 1) over the same tokens: K/V differ.
EXTRA_KEYS = [None, None, {1: ("A",)}, {1: ("B",)}, {0: ("A",), 1: ("A", "B")}]


class PrefixCacheMachine(RuleBasedStateMachine):
    hash_fn = staticmethod(hash_block)
    windows: tuple[int | None, ...] = (None,)  # each KV cache group's window

    @initialize()
    def setup(self):
        self.kv = KVCacheManager(NUM_BLOCKS * len(self.windows), BS, hash_fn=self.hash_fn,
                                 num_cpu_blocks=NUM_BLOCKS, group_windows=self.windows)
        self.slots: dict[tuple[int, int], tuple] = {}  # (block, offset) -> prefix of its K/V
        self.cpu_slots: dict[tuple[int, int], tuple] = {}  # the same for CPU blocks
        self.live: dict[str, dict] = {}
        self.waiting: dict[str, dict] = {}
        self.swapped: dict[str, dict] = {}
        self.next_id = 0

    def _tables(self, rid: str) -> list[list[int]]:
        ids, groups = self.kv.block_ids(rid), len(self.windows)
        k = len(ids) // groups
        return [ids[g * k:(g + 1) * k] for g in range(groups)]

    def _compute(self, rid: str, req: dict, upto: int) -> None:
        for table in self._tables(rid):
            for pos in range(req["computed"], upto):
                block_id = table[pos // BS]
                assert self.kv.block_pool.blocks[block_id].ref_cnt == 1, "write into a shared block"
                self.slots[(block_id, pos % BS)] = _kv_of(req, pos)
        req["computed"] = upto
        self.kv.cache_full_blocks(rid, req["tokens"], req["hashes"], upto, req["keys"])

    def _admit(self, rid: str, req: dict, chunk: int) -> None:
        tokens, before = req["tokens"], free_order(self.kv)
        cached = self.kv.find_cached_prefix(tokens, req["hashes"], req["keys"])
        m = len(cached)
        assert m <= (len(tokens) - 1) // BS and free_order(self.kv) == before
        hit = cached.groups if isinstance(cached, PrefixHit) else (cached,)
        assert len(hit) == len(self.windows) or not cached
        for blocks, window in zip(hit, self.windows):  # the hit holds exactly this prefix's K/V
            first = first_needed(m, BS, window)
            assert len(blocks) == m and all(b is not None for b in blocks[first:])
            for pos in range(first * BS, m * BS):
                assert self.slots[(blocks[pos // BS].block_id, pos % BS)] == _kv_of(req, pos)
        upto = min(len(tokens), m * BS + chunk)
        ids = self.kv.allocate_slots(rid, upto, cached)
        if ids is None:
            live = [b for blocks in hit for b in blocks if b is not None]
            need = len(self.windows) * (cdiv(upto, BS) - m) + sum(b.ref_cnt == 0 for b in live)
            assert need > len(before) and free_order(self.kv) == before
            self.waiting[rid] = req
            return
        if len(self.windows) == 1:  # exact ids: the hit's, then the free queue's head
            hit_ids = [b.block_id for b in cached]
            assert ids[:m] == hit_ids
            assert ids[m:] == [i for i in before if i not in hit_ids][:len(ids) - m]
        req["computed"] = m * BS
        self.live[rid] = req
        self._compute(rid, req, upto)

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 2), max_size=9),
          chunk=st.integers(1, 16), keys=st.sampled_from(EXTRA_KEYS))
    def admit(self, prefix, suffix, chunk, keys):
        rid, self.next_id = f"r{self.next_id}", self.next_id + 1
        self._admit(rid, dict(tokens=prefix + suffix or [0], computed=0, hashes=[], keys=keys), chunk)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99), chunk=st.integers(1, 8), token=st.integers(0, 2))
    def advance(self, pick, chunk, token):
        rid = sorted(self.live)[pick % len(self.live)]
        req = self.live[rid]
        if req["computed"] == len(req["tokens"]):
            req["tokens"].append(token)  # the token the last step sampled
        upto = min(len(req["tokens"]), req["computed"] + chunk)
        before = free_order(self.kv)
        if self.kv.allocate_slots(rid, upto, num_computed_tokens=req["computed"]) is None:
            grow = cdiv(upto, BS) - len(self._tables(rid)[0])
            assert len(self.windows) * grow > len(self.kv.block_pool.free_queue)
            assert any(w is not None for w in self.windows) or free_order(self.kv) == before
            return
        self._compute(rid, req, upto)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99), preempt=st.booleans())
    def finish_or_preempt(self, pick, preempt):
        rid = sorted(self.live)[pick % len(self.live)]
        req = self.live.pop(rid)
        self.kv.free(rid)
        if preempt:  # recompute later; its tokens and hashes stay
            req["computed"] = 0
            self.waiting[rid] = req

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99))
    def swap_out(self, pick):
        rid = sorted(self.live)[pick % len(self.live)]
        if not self.kv.can_swap_out(rid):
            return
        pairs = self.kv.swap_out(rid)
        for gpu, cpu in pairs:  # the worker's copy
            for off in range(BS):
                if (gpu, off) in self.slots:
                    self.cpu_slots[(cpu, off)] = self.slots[(gpu, off)]
        self.swapped[rid] = self.live.pop(rid)

    @precondition(lambda self: self.swapped)
    @rule(pick=st.integers(0, 99))
    def swap_in(self, pick):
        rid = sorted(self.swapped)[pick % len(self.swapped)]
        req = self.swapped[rid]
        pairs = self.kv.swap_in(rid, req["computed"], req["computed"])
        if pairs is None:
            return
        for cpu, gpu in pairs:
            for off in range(BS):
                if (cpu, off) in self.cpu_slots:
                    self.slots[(gpu, off)] = self.cpu_slots[(cpu, off)]
        self.live[rid] = self.swapped.pop(rid)

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 99), token=st.integers(0, 2))
    def fork_and_write(self, pick, token):
        """A child shares the parent's blocks, copies its partly filled last ones on write,
        and computes one more token of its own."""
        rid = sorted(self.live)[pick % len(self.live)]
        parent = self.live[rid]
        child_id, self.next_id = f"r{self.next_id}", self.next_id + 1
        self.kv.fork(rid, child_id)
        child = dict(tokens=list(parent["tokens"][:parent["computed"]]) + [token],
                     computed=parent["computed"], hashes=list(parent["hashes"]), keys=parent["keys"])
        pairs = self.kv.copy_on_write(child_id, child["computed"])
        if pairs is None or self.kv.allocate_slots(child_id, child["computed"] + 1,
                                                   num_computed_tokens=child["computed"]) is None:
            self.kv.free(child_id)
            return
        for src, dst in pairs:
            for off in range(BS):
                if (src, off) in self.slots:
                    self.slots[(dst, off)] = self.slots[(src, off)]
        self.live[child_id] = child
        self._compute(child_id, child, child["computed"] + 1)

    @precondition(lambda self: self.waiting)
    @rule(pick=st.integers(0, 99), chunk=st.integers(1, 16))
    def resume(self, pick, chunk):
        rid = sorted(self.waiting)[pick % len(self.waiting)]
        self._admit(rid, self.waiting.pop(rid), chunk)

    @rule(n=st.integers(1, NUM_BLOCKS))
    def evict(self, n):
        pool = self.kv.block_pool
        before = free_order(self.kv)
        if n > len(before):
            return
        empty = [i for i in before if pool.blocks[i].block_hash is None]
        blocks = pool.get_new_blocks(n)
        assert [b.block_id for b in blocks] == before[:n]  # empty ones first, then LRU
        assert before[:len(empty)] == empty
        assert all(b.block_hash is None for b in blocks) and pool.num_evictions >= 0
        pool.free_blocks(blocks)

    @invariant()
    def consistent(self):
        if not hasattr(self, "kv"):
            return
        self.kv.check_integrity()
        for rid, req in self.live.items():  # nobody overwrote a live request's K/V
            tables = self._tables(rid)
            holes = self.kv.num_holes(rid)  # blocks given back: behind the window
            for table, window, num_holes in zip(tables, self.windows, holes):
                assert len(table) == cdiv(req["computed"], BS)
                # with a window, only the keys its next query sees must be there
                first = 0 if window is None else max(0, req["computed"] - window + 1)
                assert num_holes * BS <= first, (rid, num_holes, req["computed"])
                for pos in range(first, req["computed"]):
                    assert self.slots[(table[pos // BS], pos % BS)] == _kv_of(req, pos)
        for cached in self.kv.block_pool.cached_groups:  # a cached block holds its key's tokens
            for block in cached.values():
                held = tuple(self.slots[(block.block_id, off)][0][-1] for off in range(BS))
                assert held == block.block_key.token_ids
                assert self.slots[(block.block_id, 0)][1][-1] == block.block_key.extra_keys


def free_order(kv: KVCacheManager) -> list[int]:
    return [block.block_id for block in kv.block_pool.free_queue]


def _kv_of(req: dict, pos: int) -> tuple[tuple[int, ...], tuple[tuple, ...]]:
    """What the K/V at `pos` of a request of the machine depend on: its tokens up to there
    and the extra keys of every block up to its own."""
    keys = req["keys"] or {}
    return tuple(req["tokens"][:pos + 1]), tuple(keys.get(i, ()) for i in range(pos // BS + 1))


class CollidingPrefixCacheMachine(PrefixCacheMachine):
    hash_fn = staticmethod(colliding_hash)


class WindowedPrefixCacheMachine(PrefixCacheMachine):
    windows = (6,)


class WindowedCollidingPrefixCacheMachine(PrefixCacheMachine):
    hash_fn = staticmethod(colliding_hash)
    windows = (5,)


class HybridPrefixCacheMachine(PrefixCacheMachine):
    windows = (None, 6, 6)  # a global group and two sliding ones


class HybridCollidingPrefixCacheMachine(PrefixCacheMachine):
    hash_fn = staticmethod(colliding_hash)
    windows = (None, 5)


settings_ = settings(max_examples=60, stateful_step_count=50, deadline=None)
TestPrefixCacheMachine = PrefixCacheMachine.TestCase
TestCollidingPrefixCacheMachine = CollidingPrefixCacheMachine.TestCase
TestWindowedPrefixCacheMachine = WindowedPrefixCacheMachine.TestCase
TestWindowedCollidingPrefixCacheMachine = WindowedCollidingPrefixCacheMachine.TestCase
TestHybridPrefixCacheMachine = HybridPrefixCacheMachine.TestCase
TestHybridCollidingPrefixCacheMachine = HybridCollidingPrefixCacheMachine.TestCase
for case in (TestPrefixCacheMachine, TestCollidingPrefixCacheMachine, TestWindowedPrefixCacheMachine,
             TestWindowedCollidingPrefixCacheMachine, TestHybridPrefixCacheMachine,
             TestHybridCollidingPrefixCacheMachine):
    case.settings = settings_
