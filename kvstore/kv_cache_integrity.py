"""The KV cache manager's invariants (kvstore/kv_cache_manager.py), checked over its state:
`KVCacheManager.check_integrity` hands its pool, swap tables, block tables and chain states
to `check_block_tables`, which raises AssertionError with a clear message unless they hold:

- every block's ref_cnt equals the number of block tables holding it; a block is in one
  group's tables (and cache) only; free + referenced == num_blocks, and no free block is in
  a table; the pool's own invariants hold;
- a request's tables are never empty (a request without blocks has no entry), have equal
  lengths, hold no block twice, and its chain state covers at most its blocks;
- holes only in sliding groups, and only before the request's live blocks;
- a request holds GPU blocks or CPU blocks, never both; every CPU block is held by exactly
  one swapped request's CPU table or free.

Read only: nothing here changes the state it checks.
"""

from collections import Counter
from collections.abc import Mapping, Sequence

from kvstore.block_pool import BlockPool, KVBlock
from kvstore.swap_pool import SwapTables


def check_block_tables(block_pool: BlockPool, swapped: SwapTables,
                       tables_of: Mapping[str, Sequence[Sequence[KVBlock | None]]],
                       chains: Mapping[str, Sequence[int]], group_windows: Sequence[int | None],
                       enable_prefix_caching: bool) -> None:
    """Raise AssertionError with a clear message unless every invariant above holds, for
    `tables_of` (request id -> its table in each group; None: a hole behind the window)
    and `chains` (request id -> its prefix-cache chain state) over `block_pool`, with the
    swapped-out requests' CPU tables in `swapped`."""
    block_pool.check_integrity()
    holders: Counter[int] = Counter()
    group_of: dict[int, int] = {}
    for request_id, tables in tables_of.items():
        assert len(tables) == len(group_windows), f"request {request_id}: {len(tables)} tables"
        assert tables[0], f"request {request_id} has an empty block table entry"
        assert len({len(table) for table in tables}) == 1, (
            f"request {request_id}: tables of different lengths {[len(t) for t in tables]}")
        for g, (table, window) in enumerate(zip(tables, group_windows)):
            live = [block for block in table if block is not None]
            assert window is not None or len(live) == len(table), (
                f"request {request_id}: holes in group {g}'s table without a sliding window")
            assert all(b is None for b in table[:len(table) - len(live)]), (
                f"request {request_id}: a hole after a live block in group {g}")
            ids = [block.block_id for block in live]
            assert len(set(ids)) == len(ids), f"request {request_id} holds a block twice: {ids}"
            for block in live:
                assert group_of.setdefault(block.block_id, g) == g, (
                    f"{block!r} is in group {g}'s and group {group_of[block.block_id]}'s tables")
                assert block.block_hash is None or block.group == g, (
                    f"{block!r} in group {g}'s table is cached in group {block.group}'s")
            holders.update(ids)
        chain = chains.get(request_id)
        assert (chain is not None) == enable_prefix_caching, (
            f"request {request_id}: chain state {chain} with caching "
            f"{'on' if enable_prefix_caching else 'off'}")
        assert chain is None or chain[0] <= len(tables[0]), (
            f"request {request_id}: {chain[0]} blocks offered to the cache, {len(tables[0])} held")
    assert chains.keys() <= tables_of.keys(), "chain state for a request without blocks"
    swapped.check_integrity()
    both = [rid for rid in tables_of if rid in swapped]
    assert not both, f"requests holding GPU and CPU blocks: {both}"
    for block in block_pool.blocks:
        assert block.ref_cnt == holders[block.block_id], (
            f"{block!r} is held by {holders[block.block_id]} block tables "
            f"but has ref_cnt {block.ref_cnt}")
        assert block.ref_cnt == 0 or block not in block_pool.free_queue, (
            f"{block!r} is in a block table and in the free queue")
