"""Per-request block tables over a BlockPool: the scheduler's view of the KV cache.

A request's block table is the list of blocks holding its tokens in order: token at
position p lives in slot `table[p // block_size].block_id * block_size + p % block_size`.
The scheduler sends these ids to the worker; only the worker holds the memory.

Invariants (checked by `check_integrity`):
- every block's ref_cnt equals the number of block tables holding it;
- free + referenced == num_blocks, and no free block is in any block table;
- a block table is never empty (a request without blocks has no entry).

Seams for later issues:
- prefix caching: `get_computed_blocks(token_ids) -> (blocks, num_computed_tokens)` finds
  cached full blocks; `allocate_slots` then takes them as a prefix of the new table
  (ref_cnt += 1, removed from the free queue) and hashes newly filled full blocks;
- copy-on-write / `n > 1`: `fork(parent_id, child_id)` copies the parent's table and
  increments each ref_cnt; a request about to write into a block with ref_cnt > 1 gets a
  fresh block plus a (src, dst) copy op for the worker;
- swap: a preempted request's blocks map to CPU block ids instead of being freed.
"""

from collections import Counter

from kvstore.block_pool import BlockPool, KVBlock


def cdiv(a: int, b: int) -> int:
    """Ceiling division: blocks of size b needed for a tokens."""
    return -(-a // b)


class KVCacheManager:
    """Block tables for the requests of one worker, over `num_blocks` blocks of `block_size`."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self._tables: dict[str, list[KVBlock]] = {}

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

    def allocate_slots(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Make the request's table cover `num_tokens` tokens in total (its computed
        tokens plus those scheduled this step).

        Returns the ids of the blocks appended ([] when the table already covers them), or
        None when too few blocks are free -- in which case nothing is allocated, so the
        caller can preempt another request and call again.
        """
        table = self._tables.get(request_id, [])
        num_new = self.num_blocks_for(num_tokens) - len(table)
        if num_new <= 0:
            return []
        if num_new > self.block_pool.num_free_blocks:
            return None
        new_blocks = self.block_pool.get_new_blocks(num_new)
        self._tables[request_id] = table + new_blocks
        return [block.block_id for block in new_blocks]

    def free(self, request_id: str) -> None:
        """Release the request's blocks (a no-op for a request holding none).

        Tail blocks are freed first so they are evicted first (see BlockPool.free_blocks).
        """
        table = self._tables.pop(request_id, None)
        if table is not None:
            self.block_pool.free_blocks(reversed(table))

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table as ids ([] for a request holding none)."""
        return [block.block_id for block in self._tables.get(request_id, [])]

    def request_ids(self) -> list[str]:
        """Requests holding at least one block."""
        return list(self._tables)

    def check_integrity(self) -> None:
        """Raise AssertionError with a clear message unless every invariant above holds."""
        self.block_pool.check_integrity()
        holders: Counter[int] = Counter()
        for request_id, table in self._tables.items():
            assert table, f"request {request_id} has an empty block table entry"
            ids = [block.block_id for block in table]
            assert len(set(ids)) == len(ids), f"request {request_id} holds a block twice: {ids}"
            holders.update(ids)
        for block in self.block_pool.blocks:
            assert block.ref_cnt == holders[block.block_id], (
                f"{block!r} is held by {holders[block.block_id]} block tables "
                f"but has ref_cnt {block.ref_cnt}")
            assert block.ref_cnt == 0 or block not in self.block_pool.free_queue, (
                f"{block!r} is in a block table and in the free queue")
