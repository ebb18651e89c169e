"""Per-request block tables over a BlockPool, with automatic prefix caching: the scheduler's
view of the KV cache.

A request's block table is the list of blocks holding its tokens in order: token at
position p lives in slot `table[p // block_size].block_id * block_size + p % block_size`.
The scheduler sends these ids to the worker; only the worker holds the memory. A request
has one table per KV cache group (`group_windows`, kvstore/kv_cache_groups.py: Gemma 3's
global and sliding layers), all of one length and all from the one pool; one group is the
plain case. Ids cross the API group after group: `allocate_slots` returns each group's new
ids in turn (the same count for each), `block_ids` each group's table in turn.

Prefix caching (on unless `enable_prefix_caching=False`), in three calls:
1. `find_cached_prefix(token_ids, hashes, extra_keys, fit)` -- before admitting a request:
   the longest run of cached blocks holding a prefix of its tokens in every group, each hit
   verified (BlockKey; across groups: kvstore/prefix_hit.py), capped so its last token is
   computed again (the worker needs its logits). No side effects.
2. `allocate_slots(request_id, num_tokens, cached)` -- those blocks start the new tables
   (ref_cnt += 1, out of the free queue), fresh blocks follow.
3. `cache_full_blocks(request_id, token_ids, hashes, num_computed_tokens, extra_keys)` --
   after a step computed them: the tables' blocks now full and computed enter their group's
   cache. A block whose content is cached already stays out (the cached one serves later
   hits); the request's chain continues through the cached one.
The caller keeps each request's hash list (`hashes`, extended here as needed) while the
request stays on this worker, so a preempted request does not hash again. `extra_keys`
(kvstore/block_hash.py BlockExtraKeys, e.g. the images a block holds) must be the same in
every call for one request; None means () for every block.

Sliding windows (a group with window W: Mistral's one group, Gemma 3's sliding ones):
`allocate_slots(..., num_computed_tokens=c)` first gives back the group's blocks wholly
behind the window of the request's next query (positions < c - W + 1), so a long request
holds about W + one block there. Their place becomes a hole (None), sent to the worker as
`HOLE_BLOCK_ID`, which no kernel lets count. With prefix caching a block is dropped only
once offered to the cache, so the cached chain stays whole for later hits.

Swap (`swap_out`, `swap_in`: preemption without recompute, the CPU tables in
kvstore/swap_pool.py) and copy-on-write (`fork`, `copy_on_write`: parallel sampling) act
on every group; they return the (src, dst) block pairs the worker copies.

Invariants: listed, and checked, in kvstore/kv_cache_integrity.py; `check_integrity`
asserts them. This module holds the manager: the tables, the prefix-cache chains, the
sliding windows' holes, swap and copy-on-write.
"""

from collections.abc import Callable, Sequence

from kvstore.block_hash import BlockExtraKeys, BlockKey, HashFn, block_hash_at, hash_block
from kvstore.block_pool import BlockPool, KVBlock
from kvstore.kv_cache_integrity import check_block_tables
from kvstore.prefix_hit import PrefixHit, find_hit
from kvstore.swap_pool import SwapTables


HOLE_BLOCK_ID = 0  # what a table's hole (a block dropped behind the window) is sent as
CLOSED = -1  # a chain state's serial when the request offers no more blocks to the cache

Table = list[KVBlock | None]  # one group's block table; None: a hole behind the window


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks of size b needed for a tokens."""
    return -(-a // b)


class KVCacheManager:
    """Block tables for the requests of one worker, over `num_blocks` blocks of `block_size`,
    one table per KV cache group (`group_windows`: each group's window, None for full
    attention; group 0 anchors prefix caching -- kvstore/kv_cache_groups.py)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn: HashFn = hash_block, num_cpu_blocks: int = 0,
                 group_windows: Sequence[int | None] = (None,)) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not group_windows:
            raise ValueError("at least one KV cache group")
        for window in group_windows:
            if window is not None and window < 1:
                raise ValueError(f"sliding_window must be >= 1, got {window}")
        self.block_size = block_size
        self.group_windows = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        self._windowed = any(w is not None for w in self.group_windows)
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn  # tests pass a colliding one
        self.block_pool = BlockPool(num_blocks, self.num_groups)
        self._tables: dict[str, list[Table]] = {}  # request id -> its table in each group
        # request id -> [table blocks already offered to the cache, serial of the anchor's
        # cached block holding the same content as the last of them (0: none yet; CLOSED:
        # the request offers no more blocks)]
        self._chains: dict[str, list[int]] = {}
        self._swapped = SwapTables(num_cpu_blocks)  # swapped-out requests' CPU tables
        self.cpu_pool = self._swapped.pool

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks a table needs to hold num_tokens tokens (in each group)."""
        return cdiv(num_tokens, self.block_size)

    def find_cached_prefix(self, token_ids: Sequence[int], hashes: list[bytes],
                           extra_keys: BlockExtraKeys | None = None,
                           fit: Callable[[int], int] | None = None) -> list[KVBlock]:
        """The longest run of cached blocks holding token_ids' first blocks with their
        extra keys, at most (len(token_ids) - 1) // block_size of them, that every group
        holds and `fit` accepts (`fit(m)`: the largest hit <= m blocks the caller can take,
        e.g. one not ending inside an image): kvstore/prefix_hit.py `find_hit`. Changes
        nothing but `hashes` (the caller's list of this sequence's block hashes, extended
        only as far as the walk goes). With several groups, a PrefixHit."""
        if not self.enable_prefix_caching:
            return []
        return find_hit(self.block_pool.cached_groups, self.group_windows, self.block_size, self.hash_fn,
                        token_ids, hashes, extra_keys, fit)

    def allocate_slots(self, request_id: str, num_tokens: int,
                       cached: Sequence[KVBlock] = (), num_computed_tokens: int = 0) -> list[int] | None:
        """Make the request's tables cover `num_tokens` tokens in total (its computed
        tokens plus those scheduled this step). `cached` (from find_cached_prefix, for a
        request holding no blocks yet) starts the tables. In sliding groups, the blocks
        behind the window of position `num_computed_tokens` (the step's first query) are
        given back first (`drop_behind_window`).

        Returns the ids of the blocks appended, group after group, each group the same
        count (cached ones first, a hole as HOLE_BLOCK_ID; [] when the tables already
        cover them), or None when too few blocks are free -- in which case nothing is
        allocated, so the caller can preempt another request and call again.
        """
        pool = self.block_pool
        tables = self._tables.get(request_id)
        if tables is not None:
            assert not cached, f"request {request_id} already holds blocks"
            if self._windowed:
                self.drop_behind_window(request_id, num_computed_tokens)
            num_new = cdiv(num_tokens, self.block_size) - len(tables[0])
            if num_new <= 0:
                return []  # the common decode step
            if num_new * self.num_groups > pool.num_free_blocks:
                return None
            new_ids = []
            for table in tables:
                new_blocks = pool.get_new_blocks(num_new)
                table.extend(new_blocks)
                new_ids.extend(block.block_id for block in new_blocks)
            return new_ids
        hit = (cached.groups if isinstance(cached, PrefixHit)
               else (cached,) if cached else ((),) * self.num_groups)
        assert len(hit) == self.num_groups, f"a hit of {len(hit)} group(s) for {self.num_groups} groups"
        num_cached = len(cached)
        num_new = cdiv(num_tokens, self.block_size) - num_cached
        if num_new < 0:
            raise ValueError(f"{num_cached} cached blocks for {num_tokens} tokens")
        if num_new == 0 and not cached:
            return []
        live = [block for blocks in hit for block in blocks if block is not None]
        # Cached blocks no request holds sit in the free queue: they count against it.
        if num_new * self.num_groups + sum(1 for b in live if b.ref_cnt == 0) > pool.num_free_blocks:
            return None
        pool.touch(live)
        self._tables[request_id] = [[*blocks, *pool.get_new_blocks(num_new)] for blocks in hit]
        if self.enable_prefix_caching:
            self._chains[request_id] = [num_cached, cached[-1].serial if cached else 0]
        return self.block_ids(request_id)

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], hashes: list[bytes],
                          num_computed_tokens: int, extra_keys: BlockExtraKeys | None = None) -> None:
        """Offer the cache the request's blocks that its first `num_computed_tokens`
        tokens (K/V computed, so tokens known) fill, and that were not offered before:
        the anchor's keyed on its chain, every other group's on the anchor's serials."""
        chain = self._chains.get(request_id)
        num_full = num_computed_tokens // self.block_size
        if chain is None or chain[1] == CLOSED or num_full <= chain[0]:
            return
        bs, tables = self.block_size, self._tables[request_id]
        anchor, others = tables[0], tables[1:]
        keys_of = extra_keys.get if extra_keys else None
        for i in range(chain[0], num_full):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            keys = () if keys_of is None else keys_of(i, ())
            block_hash = block_hash_at(hashes, i, tokens, keys, self.hash_fn)
            chain[1] = self._offer(0, anchor[i], block_hash, BlockKey(chain[1], tokens, keys))
            for g, table in enumerate(others, 1):
                if table[i] is not None:
                    self._offer(g, table[i], block_hash, BlockKey(chain[1], tokens, keys))
        chain[0] = num_full

    def _offer(self, group: int, block: KVBlock | None, block_hash: bytes, key: BlockKey) -> int:
        """Cache `block` of `group` under `block_hash` unless the same content is cached
        already; returns the serial of the cached block holding it."""
        pool = self.block_pool
        holder = pool.cached_groups[group].get(block_hash)
        if holder is not None and holder.block_key == key:
            return holder.serial  # the same content is cached already
        if holder is not None:  # a hash collision, or a block whose parent is gone
            pool.uncache(holder)
        assert block is not None, "the anchor group's blocks are offered before they are dropped"
        return pool.cache_block(block, block_hash, key, group)

    def drop_behind_window(self, request_id: str, num_computed_tokens: int) -> int:
        """Give back the request's blocks, in sliding groups, that hold only positions
        behind the window of position `num_computed_tokens` (< num_computed_tokens - W + 1),
        leaving holes; with prefix caching only blocks already offered to the cache.
        Returns how many."""
        tables = self._tables.get(request_id)
        if not self._windowed or tables is None:
            return 0
        chain = self._chains.get(request_id)
        offered = chain[0] if chain is not None and chain[1] != CLOSED else None
        num_dropped = 0
        for table, window in zip(tables, self.group_windows):
            if window is None:
                continue
            limit = max(0, num_computed_tokens - window + 1) // self.block_size
            if offered is not None:
                limit = min(limit, offered)
            dropped = [block for block in table[:limit] if block is not None]
            table[:limit] = [None] * min(limit, len(table))
            self.block_pool.free_blocks(reversed(dropped))  # the prefix's first block evicted last
            num_dropped += len(dropped)
        return num_dropped

    def free(self, request_id: str) -> None:
        """Release the request's blocks, GPU or CPU (a no-op for a request holding none).
        Cached blocks stay in the cache until evicted.

        Tail blocks are freed first so they are evicted first (see BlockPool.free_blocks),
        and the anchor group's last, so its chain outlives the other groups' blocks.
        """
        self._free_gpu(request_id)
        self._swapped.release(request_id)

    def _free_gpu(self, request_id: str) -> None:
        tables = self._tables.pop(request_id, None)
        self._chains.pop(request_id, None)
        if tables is not None:
            for table in reversed(tables):
                self.block_pool.free_blocks(reversed(_live(table)))

    # -- swap --------------------------------------------------------------------------

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu_pool.num_blocks

    def can_swap_out(self, request_id: str) -> bool:
        """True iff the request holds GPU blocks and the CPU pool has room for all of them."""
        return request_id in self._tables and self.num_blocks_held(request_id) <= self.cpu_pool.num_free_blocks

    def swap_out(self, request_id: str) -> list[tuple[int, int]]:
        """Move the request's tables to CPU blocks (holes stay holes); returns (gpu block,
        cpu block) pairs, group after group in table order, for the worker to copy before
        those GPU blocks are written again. The GPU blocks are released as by `free`
        (cached ones stay cached). Check `can_swap_out` first."""
        tables = self._tables[request_id]
        cpu_tables = self._swapped.store(request_id, [[block is None for block in table] for table in tables])
        pairs = [(block.block_id, cpu_id) for table, cpu_table in zip(tables, cpu_tables)
                 for block, cpu_id in zip(table, cpu_table) if block is not None]
        self._free_gpu(request_id)
        return pairs

    def num_swapped_blocks(self, request_id: str) -> int:
        """CPU blocks the request holds (0 unless it is swapped out)."""
        return self._swapped.num_blocks_held(request_id)

    def swap_in(self, request_id: str, num_tokens: int | None = None,
                num_computed_tokens: int = 0) -> list[tuple[int, int]] | None:
        """Move a swapped-out request back to fresh GPU blocks; returns (cpu block, gpu
        block) pairs, group after group in table order, or None (nothing else changed) when
        too few GPU blocks are free -- for its swapped blocks, or for `num_tokens` tokens in
        all when given (so the caller can then `allocate_slots` its next tokens without
        failing). In sliding groups, the CPU blocks behind the window of position
        `num_computed_tokens` are given back first, as allocate_slots would right after."""
        if self._windowed:
            self._swapped.drop_before(request_id, [
                0 if window is None else max(0, num_computed_tokens - window + 1) // self.block_size
                for window in self.group_windows])
        cpu_tables = self._swapped.get(request_id)
        live = [_live(t) for t in cpu_tables]
        grow = max(0, cdiv(num_tokens, self.block_size) - len(cpu_tables[0])) if num_tokens else 0
        if sum(map(len, live)) + grow * self.num_groups > self.block_pool.num_free_blocks:
            return None
        tables = []
        for cpu_table, ids in zip(cpu_tables, live):
            fresh = iter(self.block_pool.get_new_blocks(len(ids)))
            tables.append([None if c is None else next(fresh) for c in cpu_table])
        self._tables[request_id] = tables
        if self.enable_prefix_caching:  # offered to the cache again as they fill up, from
            # block 0; an anchor table with holes cannot chain from block 0, so it offers none
            anchor_holes = len(live[0]) < len(cpu_tables[0])
            self._chains[request_id] = [len(tables[0]), CLOSED] if anchor_holes else [0, 0]
        self._swapped.release(request_id)
        return [(c, block.block_id) for cpu_table, table in zip(cpu_tables, tables)
                for c, block in zip(cpu_table, table) if block is not None]

    # -- copy-on-write -------------------------------------------------------------------

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent's tables (ref_cnt + 1 each), and
        its prefix-cache chain state."""
        assert child_id not in self._tables and child_id not in self._swapped, (
            f"request {child_id} already holds blocks")
        tables = self._tables[parent_id]
        for table in tables:
            self.block_pool.touch(_live(table))
        self._tables[child_id] = [list(table) for table in tables]
        if parent_id in self._chains:
            self._chains[child_id] = list(self._chains[parent_id])

    def copy_on_write(self, request_id: str, num_computed_tokens: int) -> list[tuple[int, int]] | None:
        """Make the request's last block (in each group) its own before it writes past
        `num_computed_tokens`: where that block is partly filled and shared, swap in a
        fresh block; returns the (src, dst) pairs the worker must copy ([] when nothing
        needs copying), or None when too few blocks are free (nothing changed)."""
        tables = self._tables.get(request_id)
        if (tables is None or num_computed_tokens % self.block_size == 0
                or len(tables[0]) != cdiv(num_computed_tokens, self.block_size)):
            return []
        shared = [table for table in tables if table[-1] is not None and table[-1].ref_cnt > 1]
        if len(shared) > self.block_pool.num_free_blocks:
            return None
        pairs = []
        for table in shared:
            old = table[-1]
            (new,) = self.block_pool.get_new_blocks(1)
            table[-1] = new
            self.block_pool.free_blocks([old])
            pairs.append((old.block_id, new.block_id))
        return pairs

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block tables as ids, group after group ([] for a request holding
        none; a hole behind the window as HOLE_BLOCK_ID)."""
        return [HOLE_BLOCK_ID if block is None else block.block_id
                for table in self._tables.get(request_id, ()) for block in table]

    def num_blocks_held(self, request_id: str) -> int:
        """Blocks the request holds in all groups (holes behind the window not counted)."""
        return sum(len(_live(table)) for table in self._tables.get(request_id, ()))

    def num_holes(self, request_id: str) -> list[int]:
        """Each group's holes in the request's GPU or CPU table (blocks given back behind
        the window)."""
        tables = self._tables.get(request_id) or self._swapped.get(request_id) or ()
        return [len(table) - len(_live(table)) for table in tables]

    def table_length(self, request_id: str) -> int:
        """Entries of the request's GPU or CPU block table in each group, holes behind the
        window included: cdiv(tokens it covers, block_size)."""
        tables = self._tables.get(request_id) or self._swapped.get(request_id)
        return len(tables[0]) if tables else 0

    def request_ids(self) -> list[str]:
        """Requests holding at least one block."""
        return list(self._tables)

    def blocks_per_group(self) -> list[int]:
        """Distinct blocks the requests' tables hold in each group. O(table entries)."""
        held: list[set[int]] = [set() for _ in range(self.num_groups)]
        for tables in self._tables.values():
            for ids, table in zip(held, tables):
                ids.update(block.block_id for block in table if block is not None)
        return [len(ids) for ids in held]

    def num_shared_references(self) -> int:
        """References beyond the first to each block (sum of ref_cnt - 1 over used
        blocks): how many full blocks block tables count twice. O(num_blocks)."""
        return sum(b.ref_cnt - 1 for b in self.block_pool.blocks if b.ref_cnt > 1)

    def check_integrity(self) -> None:
        """Raise AssertionError with a clear message unless every invariant holds
        (kvstore/kv_cache_integrity.py)."""
        check_block_tables(self.block_pool, self._swapped, self._tables, self._chains, self.group_windows,
                           self.enable_prefix_caching)


def _live(table: Sequence) -> list:
    """A table's entries without its holes."""
    return [entry for entry in table if entry is not None]
