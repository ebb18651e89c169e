"""Per-request block tables over a BlockPool, with automatic prefix caching: the scheduler's
view of the KV cache.

A request's block table is the list of blocks holding its tokens in order: token at
position p lives in slot `table[p // block_size].block_id * block_size + p % block_size`.
The scheduler sends these ids to the worker; only the worker holds the memory.

Prefix caching (on unless `enable_prefix_caching=False`), in three calls:
1. `find_cached_prefix(token_ids, hashes)` -- before admitting a request: the longest run
   of cached blocks holding a prefix of its tokens, each hit verified (BlockKey), capped
   so its last token is computed again (the worker needs its logits). No side effects.
2. `allocate_slots(request_id, num_tokens, cached)` -- those blocks start the new table
   (ref_cnt += 1, out of the free queue), fresh blocks follow.
3. `cache_full_blocks(request_id, token_ids, hashes, num_computed_tokens)` -- after a step
   computed them: the table's blocks that are now full and computed enter the cache. A
   block whose content is already cached under another block stays out (the cached one
   serves later hits); the request's chain continues through the cached one.
The caller keeps each request's hash list (`hashes`, extended here as needed) for as long
as the request stays on this worker, so a preempted request does not hash again.

Invariants (checked by `check_integrity`):
- every block's ref_cnt equals the number of block tables holding it;
- free + referenced == num_blocks, and no free block is in any block table;
- a block table is never empty (a request without blocks has no entry), holds no block
  twice, and its chain state covers at most its blocks; the pool's own invariants hold.

Seams for later issues:
- copy-on-write / `n > 1`: `fork(parent_id, child_id)` copies the parent's table and
  increments each ref_cnt; a request about to write into a block with ref_cnt > 1 gets a
  fresh block plus a (src, dst) copy op for the worker;
- swap: a preempted request's blocks map to CPU block ids instead of being freed.
"""

from collections import Counter
from collections.abc import Sequence

from kvstore.block_hash import ROOT, BlockKey, HashFn, hash_block
from kvstore.block_pool import BlockPool, KVBlock


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks of size b needed for a tokens."""
    return -(-a // b)


class KVCacheManager:
    """Block tables for the requests of one worker, over `num_blocks` blocks of `block_size`."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn: HashFn = hash_block) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn  # tests pass a colliding one
        self.block_pool = BlockPool(num_blocks)
        self._tables: dict[str, list[KVBlock]] = {}
        # request id -> [table blocks already offered to the cache, serial of the cached
        # block holding the same content as the last of them (0: none yet)]
        self._chains: dict[str, list[int]] = {}

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

    def _block_hash(self, hashes: list[bytes], i: int, tokens: Sequence[int],
                    extra_keys: tuple) -> bytes:
        """hashes[i], computed and appended if the list stops at i (tokens: block i's)."""
        if i == len(hashes):
            hashes.append(self.hash_fn(hashes[i - 1] if i else ROOT, tokens, extra_keys))
        return hashes[i]

    def find_cached_prefix(self, token_ids: Sequence[int], hashes: list[bytes],
                           extra_keys: tuple = ()) -> list[KVBlock]:
        """The longest run of cached blocks holding token_ids' first blocks, at most
        (len(token_ids) - 1) // block_size of them. Changes nothing but `hashes` (the
        caller's list of this sequence's block hashes, extended only as far as the walk
        goes). Every hit is verified against the block's key, never trusted on the hash."""
        if not self.enable_prefix_caching:
            return []
        bs, cached = self.block_size, self.block_pool.cached
        blocks: list[KVBlock] = []
        parent_serial = 0
        for i in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            block = cached.get(self._block_hash(hashes, i, tokens, extra_keys))
            if block is None or block.block_key != (parent_serial, tokens, extra_keys):
                break
            blocks.append(block)
            parent_serial = block.serial
        return blocks

    def allocate_slots(self, request_id: str, num_tokens: int,
                       cached: Sequence[KVBlock] = ()) -> list[int] | None:
        """Make the request's table cover `num_tokens` tokens in total (its computed
        tokens plus those scheduled this step). `cached` (from find_cached_prefix, for a
        request holding no blocks yet) starts the table.

        Returns the ids of the blocks appended, cached ones first ([] when the table
        already covers them), or None when too few blocks are free -- in which case
        nothing is allocated, so the caller can preempt another request and call again.
        """
        pool = self.block_pool
        table = self._tables.get(request_id)
        if table is not None:
            assert not cached, f"request {request_id} already holds blocks"
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
                          num_computed_tokens: int, extra_keys: tuple = ()) -> None:
        """Offer the cache the request's blocks that its first `num_computed_tokens`
        tokens (K/V computed, so tokens known) fill, and that were not offered before."""
        chain = self._chains.get(request_id)
        num_full = num_computed_tokens // self.block_size
        if chain is None or num_full <= chain[0]:
            return
        bs, pool, table = self.block_size, self.block_pool, self._tables[request_id]
        for i in range(chain[0], num_full):
            tokens = tuple(token_ids[i * bs:(i + 1) * bs])
            block_hash = self._block_hash(hashes, i, tokens, extra_keys)
            key = BlockKey(chain[1], tokens, extra_keys)
            holder = pool.cached.get(block_hash)
            if holder is not None and holder.block_key == key:
                chain[1] = holder.serial  # the same content is cached already
                continue
            if holder is not None:  # a hash collision, or a block whose parent is gone
                pool.uncache(holder)
            chain[1] = pool.cache_block(table[i], block_hash, key)
        chain[0] = num_full

    def free(self, request_id: str) -> None:
        """Release the request's blocks (a no-op for a request holding none). Cached
        blocks stay in the cache until evicted.

        Tail blocks are freed first so they are evicted first (see BlockPool.free_blocks).
        """
        table = self._tables.pop(request_id, None)
        self._chains.pop(request_id, None)
        if table is not None:
            self.block_pool.free_blocks(reversed(table))

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table as ids ([] for a request holding none)."""
        return [block.block_id for block in self._tables.get(request_id, [])]

    def num_blocks_held(self, request_id: str) -> int:
        table = self._tables.get(request_id)
        return len(table) if table is not None else 0

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
            ids = [block.block_id for block in table]
            assert len(set(ids)) == len(ids), f"request {request_id} holds a block twice: {ids}"
            holders.update(ids)
            chain = self._chains.get(request_id)
            assert (chain is not None) == self.enable_prefix_caching, (
                f"request {request_id}: chain state {chain} with caching "
                f"{'on' if self.enable_prefix_caching else 'off'}")
            assert chain is None or chain[0] <= len(table), (
                f"request {request_id}: {chain[0]} blocks offered to the cache, {len(table)} held")
        assert self._chains.keys() <= self._tables.keys(), "chain state for a request without blocks"
        for block in self.block_pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"{block!r} is held by {holders[block.block_id]} block tables "
                f"but has ref_cnt {block.ref_cnt}")
            assert block.ref_cnt == 0 or block not in self.block_pool.free_queue, (
                f"{block!r} is in a block table and in the free queue")
