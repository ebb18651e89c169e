"""Per-request block tables over a BlockPool, with automatic prefix caching: the scheduler's
view of the KV cache.

A request's block table is the list of blocks holding its tokens in order: token at
position p lives in slot `table[p // block_size].block_id * block_size + p % block_size`.
The scheduler sends these ids to the worker; only the worker holds the memory.

Prefix caching (on unless `enable_prefix_caching=False`), in three calls:
1. `find_cached_prefix(token_ids, hashes, extra_keys)` -- before admitting a request: the
   longest run of cached blocks holding a prefix of its tokens, each hit verified
   (BlockKey), capped so its last token is computed again (the worker needs its logits).
   No side effects.
2. `allocate_slots(request_id, num_tokens, cached)` -- those blocks start the new table
   (ref_cnt += 1, out of the free queue), fresh blocks follow.
3. `cache_full_blocks(request_id, token_ids, hashes, num_computed_tokens, extra_keys)` --
   after a step computed them: the table's blocks that are now full and computed enter
   the cache. A block whose content is already cached under another block stays out (the
   cached one serves later hits); the request's chain continues through the cached one.
The caller keeps each request's hash list (`hashes`, extended here as needed) for as long
as the request stays on this worker, so a preempted request does not hash again.
`extra_keys` (kvstore/block_hash.py, BlockExtraKeys: block index -> that block's extra
keys, e.g. the images it holds) must be the same in every call for one request; None (or
empty) means () for every block, the text-only case, which costs nothing extra.

Invariants (checked by `check_integrity`):
- every block's ref_cnt equals the number of block tables holding it;
- free + referenced == num_blocks, and no free block is in any block table;
- a block table is never empty (a request without blocks has no entry), holds no block
  twice, and its chain state covers at most its blocks; the pool's own invariants hold.

Swap (preemption without recompute), over a second pool of CPU block ids
(kvstore/swap_pool.py, no prefix caching there):
- `swap_out(request_id)` -- the request's GPU blocks are released (as `free` does) and
  its table moves to fresh CPU blocks; returns the (gpu, cpu) pairs the worker copies;
- `swap_in(request_id)` -- fresh GPU blocks, CPU blocks released; returns (cpu, gpu)
  pairs. The new table is offered to the prefix cache again from its first block.

Copy-on-write (parallel sampling, `n > 1`):
- `fork(parent_id, child_id)` -- the child's table is the parent's, every block's
  ref_cnt + 1 (the partly filled last block too);
- `copy_on_write(request_id, num_computed_tokens)` -- before a request writes into its
  last block: if that block is partly filled and shared, the request gets a fresh block
  in its place and the worker copies the old one into it (the returned (src, dst) pair).

Sliding windows (`sliding_window=W`, for models whose every layer attends to the last W
keys only): `allocate_slots(..., num_computed_tokens=c)` first gives back the request's
blocks wholly behind the window of its next query (every position < c - W + 1), so a long
generation holds about W + one block of KV. Their place in the table becomes a hole
(None); its position is kept so later blocks keep their indices. A hole is sent to the
worker as block id `HOLE_BLOCK_ID`: kernels never let a key behind the window count (the
C and Triton kernels do not read it; the torch path reads it and masks it out). With
prefix caching, a block is dropped only once it was offered to the cache (the chain of
cached blocks stays whole, so a later request can still hit the prefix).

Invariants (checked by `check_integrity`), in addition to those above:
- a request holds GPU blocks or CPU blocks, never both; every CPU block is held by
  exactly one swapped request's CPU table or free.
- holes only where a window is set, and only before the request's live blocks.
"""

from collections import Counter
from collections.abc import Sequence

from kvstore.block_hash import ROOT, BlockExtraKeys, BlockKey, HashFn, hash_block
from kvstore.block_pool import BlockPool, KVBlock
from kvstore.swap_pool import CpuBlockPool


HOLE_BLOCK_ID = 0  # what a table's hole (a block dropped behind the window) is sent as
CLOSED = -1  # a chain state's serial when the request offers no more blocks to the cache


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks of size b needed for a tokens."""
    return -(-a // b)


class KVCacheManager:
    """Block tables for the requests of one worker, over `num_blocks` blocks of `block_size`."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn: HashFn = hash_block, num_cpu_blocks: int = 0,
                 sliding_window: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn  # tests pass a colliding one
        self.block_pool = BlockPool(num_blocks)
        self._tables: dict[str, list[KVBlock | None]] = {}  # None: a hole behind the window
        # request id -> [table blocks already offered to the cache, serial of the cached
        # block holding the same content as the last of them (0: none yet; CLOSED: the
        # request offers no more blocks)]
        self._chains: dict[str, list[int]] = {}
        self.cpu_pool = CpuBlockPool(num_cpu_blocks)
        self._cpu_tables: dict[str, list[int | None]] = {}  # swapped-out request id -> CPU block ids

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
        """Blocks a table needs to hold num_tokens tokens."""
        return cdiv(num_tokens, self.block_size)

    def _block_hash(self, hashes: list[bytes], i: int, tokens: Sequence[int], keys: tuple) -> bytes:
        """hashes[i], computed and appended if the list stops at i (tokens, keys: block i's)."""
        if i == len(hashes):
            hashes.append(self.hash_fn(hashes[i - 1] if i else ROOT, tokens, keys))
        return hashes[i]

    def find_cached_prefix(self, token_ids: Sequence[int], hashes: list[bytes],
                           extra_keys: BlockExtraKeys | None = None) -> list[KVBlock]:
        """The longest run of cached blocks holding token_ids' first blocks with their
        extra keys, at most (len(token_ids) - 1) // block_size of them. Changes nothing
        but `hashes` (the caller's list of this sequence's block hashes, extended only as
        far as the walk goes). Every hit is verified against the block's key (tokens and
        extra keys), never trusted on the hash."""
        if not self.enable_prefix_caching:
            return []
        bs, cached = self.block_size, self.block_pool.cached
        keys_of = extra_keys.get if extra_keys else None
        blocks: list[KVBlock] = []
        parent_serial = 0
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            keys = () if keys_of is None else keys_of(i, ())
            block = cached.get(self._block_hash(hashes, i, tokens, keys))
            if block is None or block.block_key != (parent_serial, tokens, keys):
                break
            blocks.append(block)
            parent_serial = block.serial
        return blocks

    def allocate_slots(self, request_id: str, num_tokens: int,
                       cached: Sequence[KVBlock] = (), num_computed_tokens: int = 0) -> list[int] | None:
        """Make the request's table cover `num_tokens` tokens in total (its computed
        tokens plus those scheduled this step). `cached` (from find_cached_prefix, for a
        request holding no blocks yet) starts the table. With a sliding window, the
        blocks behind the window of position `num_computed_tokens` (the step's first
        query) are given back first (`drop_behind_window`).

        Returns the ids of the blocks appended, cached ones first ([] when the table
        already covers them), or None when too few blocks are free -- in which case
        nothing is allocated, so the caller can preempt another request and call again.
        """
        pool = self.block_pool
        table = self._tables.get(request_id)
        if table is not None:
            assert not cached, f"request {request_id} already holds blocks"
            self.drop_behind_window(request_id, num_computed_tokens)
            num_new = cdiv(num_tokens, self.block_size) - len(table)
            if num_new <= 0:
                return []  # the common decode step
            if num_new > pool.num_free_blocks:
                return None
            new_blocks = pool.get_new_blocks(num_new)
            table.extend(new_blocks)
            return [block.block_id for block in new_blocks]
        num_new = cdiv(num_tokens, self.block_size) - len(cached)
        if num_new < 0:
            raise ValueError(f"{len(cached)} cached blocks for {num_tokens} tokens")
        if num_new == 0 and not cached:
            return []
        # Cached blocks no request holds sit in the free queue: they count against it.
        if num_new + sum(1 for b in cached if b.ref_cnt == 0) > pool.num_free_blocks:
            return None
        pool.touch(cached)
        table = self._tables[request_id] = [*cached, *pool.get_new_blocks(num_new)]
        if self.enable_prefix_caching:
            self._chains[request_id] = [len(cached), cached[-1].serial if cached else 0]
        return [block.block_id for block in table]

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], hashes: list[bytes],
                          num_computed_tokens: int, extra_keys: BlockExtraKeys | None = None) -> None:
        """Offer the cache the request's blocks that its first `num_computed_tokens`
        tokens (K/V computed, so tokens known) fill, and that were not offered before."""
        chain = self._chains.get(request_id)
        num_full = num_computed_tokens // self.block_size
        if chain is None or chain[1] == CLOSED or num_full <= chain[0]:
            return
        bs, pool, table = self.block_size, self.block_pool, self._tables[request_id]
        keys_of = extra_keys.get if extra_keys else None
        for i in range(chain[0], num_full):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            keys = () if keys_of is None else keys_of(i, ())
            block_hash = self._block_hash(hashes, i, tokens, keys)
            key = BlockKey(chain[1], tokens, keys)
            holder = pool.cached.get(block_hash)
            if holder is not None and holder.block_key == key:
                chain[1] = holder.serial  # the same content is cached already
                continue
            if holder is not None:  # a hash collision, or a block whose parent is gone
                pool.uncache(holder)
            chain[1] = pool.cache_block(table[i], block_hash, key)
        chain[0] = num_full

    def drop_behind_window(self, request_id: str, num_computed_tokens: int) -> int:
        """Give back the request's blocks that hold only positions behind the window of
        position `num_computed_tokens` (< num_computed_tokens - W + 1), leaving holes; with
        prefix caching only blocks already offered to the cache. Returns how many."""
        table = self._tables.get(request_id)
        if self.sliding_window is None or table is None:
            return 0
        limit = max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size
        chain = self._chains.get(request_id)
        if chain is not None and chain[1] != CLOSED:
            limit = min(limit, chain[0])
        dropped = [block for block in table[:limit] if block is not None]
        table[:limit] = [None] * min(limit, len(table))
        self.block_pool.free_blocks(reversed(dropped))  # the prefix's first block evicted last
        return len(dropped)

    def free(self, request_id: str) -> None:
        """Release the request's blocks, GPU or CPU (a no-op for a request holding none).
        Cached blocks stay in the cache until evicted.

        Tail blocks are freed first so they are evicted first (see BlockPool.free_blocks).
        """
        table = self._tables.pop(request_id, None)
        self._chains.pop(request_id, None)
        if table is not None:
            self.block_pool.free_blocks(reversed(_live(table)))
        cpu_table = self._cpu_tables.pop(request_id, None)
        if cpu_table is not None:
            self.cpu_pool.free(_live(cpu_table))

    # -- swap --------------------------------------------------------------------------

    @property
    def num_cpu_blocks(self) -> int:
        return self.cpu_pool.num_blocks

    def can_swap_out(self, request_id: str) -> bool:
        """True iff the request holds GPU blocks and the CPU pool has room for all of them."""
        table = self._tables.get(request_id)
        return table is not None and len(_live(table)) <= self.cpu_pool.num_free_blocks

    def swap_out(self, request_id: str) -> list[tuple[int, int]]:
        """Move the request's table to CPU blocks (holes stay holes); returns (gpu block,
        cpu block) pairs in table order, for the worker to copy before those GPU blocks
        are written again. The GPU blocks are released as by `free` (cached ones stay
        cached). Check `can_swap_out` first."""
        table = self._tables[request_id]
        cpu_ids = iter(self.cpu_pool.allocate(len(_live(table))))
        cpu_table = [None if block is None else next(cpu_ids) for block in table]
        pairs = [(block.block_id, cpu_id) for block, cpu_id in zip(table, cpu_table) if block is not None]
        self.free(request_id)
        self._cpu_tables[request_id] = cpu_table
        return pairs

    def num_swapped_blocks(self, request_id: str) -> int:
        """CPU blocks the request holds (0 unless it is swapped out)."""
        return len(_live(self._cpu_tables.get(request_id, ())))

    def swap_in(self, request_id: str, num_tokens: int | None = None) -> list[tuple[int, int]] | None:
        """Move a swapped-out request back to fresh GPU blocks; returns (cpu block, gpu
        block) pairs in table order, or None (nothing changed) when too few GPU blocks are
        free -- for its swapped blocks, or for `num_tokens` tokens in all when given (so
        the caller can then `allocate_slots` its next tokens without failing)."""
        cpu_table = self._cpu_tables[request_id]
        live = _live(cpu_table)
        holes = len(cpu_table) - len(live)
        need = max(len(live), cdiv(num_tokens, self.block_size) - holes if num_tokens else 0)
        if need > self.block_pool.num_free_blocks:
            return None
        fresh = iter(self.block_pool.get_new_blocks(len(live)))
        table = self._tables[request_id] = [None if c is None else next(fresh) for c in cpu_table]
        if self.enable_prefix_caching:  # offered to the cache again as they fill up, from
            # block 0; a table with holes cannot chain from block 0, so it offers none
            self._chains[request_id] = [len(table), CLOSED] if holes else [0, 0]
        del self._cpu_tables[request_id]
        self.cpu_pool.free(live)
        return [(c, block.block_id) for c, block in zip(cpu_table, table) if block is not None]

    # -- copy-on-write -------------------------------------------------------------------

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent's table (ref_cnt + 1 each), and
        its prefix-cache chain state."""
        assert child_id not in self._tables and child_id not in self._cpu_tables, (
            f"request {child_id} already holds blocks")
        table = self._tables[parent_id]
        self.block_pool.touch(_live(table))
        self._tables[child_id] = list(table)
        if parent_id in self._chains:
            self._chains[child_id] = list(self._chains[parent_id])

    def copy_on_write(self, request_id: str, num_computed_tokens: int) -> tuple[int, int] | None | bool:
        """Make the request's last block its own before it writes past
        `num_computed_tokens`: when that block is partly filled and shared, swap in a
        fresh block and return the (src, dst) pair the worker must copy. Returns None
        when nothing needs copying, False when no block is free (nothing changed)."""
        table = self._tables.get(request_id)
        if (table is None or num_computed_tokens % self.block_size == 0
                or len(table) != cdiv(num_computed_tokens, self.block_size)
                or table[-1] is None or table[-1].ref_cnt == 1):
            return None
        if self.block_pool.num_free_blocks < 1:
            return False
        old = table[-1]
        (new,) = self.block_pool.get_new_blocks(1)
        table[-1] = new
        self.block_pool.free_blocks([old])
        return old.block_id, new.block_id

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table as ids ([] for a request holding none; a hole behind
        the window as HOLE_BLOCK_ID)."""
        return [HOLE_BLOCK_ID if block is None else block.block_id
                for block in self._tables.get(request_id, [])]

    def num_blocks_held(self, request_id: str) -> int:
        """Blocks the request holds (holes behind the window not counted)."""
        return len(_live(self._tables.get(request_id, ())))

    def table_length(self, request_id: str) -> int:
        """Entries of the request's GPU or CPU block table, holes behind the window included:
        cdiv(tokens it covers, block_size)."""
        return len(self._tables.get(request_id) or self._cpu_tables.get(request_id) or ())

    def request_ids(self) -> list[str]:
        """Requests holding at least one block."""
        return list(self._tables)

    def num_shared_references(self) -> int:
        """References beyond the first to each block (sum of ref_cnt - 1 over used
        blocks): how many full blocks block tables count twice. O(num_blocks)."""
        return sum(b.ref_cnt - 1 for b in self.block_pool.blocks if b.ref_cnt > 1)

    def check_integrity(self) -> None:
        """Raise AssertionError with a clear message unless every invariant above holds."""
        self.block_pool.check_integrity()
        holders: Counter[int] = Counter()
        for request_id, table in self._tables.items():
            assert table, f"request {request_id} has an empty block table entry"
            live = _live(table)
            assert self.sliding_window is not None or len(live) == len(table), (
                f"request {request_id} has holes in its table without a sliding window")
            assert all(b is None for b in table[:len(table) - len(live)]), (
                f"request {request_id}: a hole after a live block")
            ids = [block.block_id for block in live]
            assert len(set(ids)) == len(ids), f"request {request_id} holds a block twice: {ids}"
            holders.update(ids)
            chain = self._chains.get(request_id)
            assert (chain is not None) == self.enable_prefix_caching, (
                f"request {request_id}: chain state {chain} with caching "
                f"{'on' if self.enable_prefix_caching else 'off'}")
            assert chain is None or chain[0] <= len(table), (
                f"request {request_id}: {chain[0]} blocks offered to the cache, {len(table)} held")
        assert self._chains.keys() <= self._tables.keys(), "chain state for a request without blocks"
        self.cpu_pool.check_integrity()
        assert not self._cpu_tables.keys() & self._tables.keys(), (
            f"requests holding GPU and CPU blocks: {self._cpu_tables.keys() & self._tables.keys()}")
        cpu_held = [i for ids in self._cpu_tables.values() for i in _live(ids)]
        assert len(cpu_held) == len(set(cpu_held)), "a CPU block is in two CPU tables"
        assert len(cpu_held) + self.cpu_pool.num_free_blocks == self.cpu_pool.num_blocks, (
            f"{len(cpu_held)} CPU blocks in tables + {self.cpu_pool.num_free_blocks} free "
            f"!= {self.cpu_pool.num_blocks}")
        for block in self.block_pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"{block!r} is held by {holders[block.block_id]} block tables "
                f"but has ref_cnt {block.ref_cnt}")
            assert block.ref_cnt == 0 or block not in self.block_pool.free_queue, (
                f"{block!r} is in a block table and in the free queue")


def _live(table: Sequence) -> list:
    """A table's entries without its holes."""
    return [entry for entry in table if entry is not None]
