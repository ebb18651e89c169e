"""The scheduler-side pool of KV cache blocks: ids, reference counts, the free queue, and
the prefix cache (hash -> block, one map per KV cache group).

The pool holds no KV memory (the worker does); a block here is only an id the worker uses
as a cache address (slot = block_id * block_size + offset) plus bookkeeping.

A block is in one of three states:
- used: ref_cnt > 0, outside the free queue (it may also be cached);
- cached: ref_cnt == 0, holds a hash, in the free queue -- reusable by a prefix hit
  (`touch` takes it out of the middle of the queue in O(1)) until it is evicted;
- empty: ref_cnt == 0, no hash, in the free queue.

Eviction order is the free queue's order: empty blocks at the head (`free_blocks` puts
them there), cached blocks behind them from least to most recently freed (`free_blocks`
appends them). `get_new_blocks` takes from the head and drops the hash of a cached block
it takes -- that is the eviction.

Invariants (checked by `check_integrity`):
- used + cached + empty == num_blocks; the free queue holds exactly the ref_cnt-0 blocks;
- every empty block in the free queue comes before every cached one;
- a block holds a hash iff its group's cache maps that hash to it; a hashed block has a
  key and a serial, and serials are distinct across all groups.

KV cache groups (kvstore/kv_cache_groups.py): every group's blocks come from this one pool,
so memory moves freely between them; each group has its own prefix cache map
(`cached_groups[g]`), since the same tokens have different K/V in different layers.
`cached` is group 0's map (the only one of a model with one group).
"""

from collections.abc import Iterable

from kvstore.block_hash import BlockKey
from kvstore.free_queue import FreeBlockQueue, FreeListNode


class KVBlock(FreeListNode):
    """One block of `block_size` token slots. `ref_cnt` counts the block tables holding it."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "block_key", "serial", "group")

    def __init__(self, block_id: int) -> None:
        super().__init__()
        self.block_id = block_id
        self.ref_cnt = 0
        # Set together while the block is in the prefix cache, None/None/0 otherwise.
        self.block_hash: bytes | None = None
        self.block_key: BlockKey | None = None
        self.serial = 0
        self.group = 0  # the KV cache group whose prefix cache holds it (while hashed)

    def __repr__(self) -> str:
        cached = (f", group={self.group}, hash={self.block_hash.hex()[:8]}, serial={self.serial}"
                  if self.block_hash else "")
        return f"KVBlock(id={self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class BlockPool:
    """`num_blocks` blocks with ids 0..num_blocks-1, all empty at first, queued in id order,
    shared by `num_groups` KV cache groups."""

    def __init__(self, num_blocks: int, num_groups: int = 1) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # the prefix cache of each group: hash -> block
        self.cached_groups: tuple[dict[bytes, KVBlock], ...] = tuple({} for _ in range(num_groups))
        self.cached = self.cached_groups[0]
        self._last_serial = 0
        self.num_evictions = 0  # cached blocks reused for something else, for stats

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached + empty): what allocation can take."""
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def num_cached_free_blocks(self) -> int:
        """Blocks no request holds that still hold a hash (O(cached blocks))."""
        return sum(1 for cached in self.cached_groups for block in cached.values() if block.ref_cnt == 0)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take n blocks from the head of the free queue, each with ref_cnt 1, evicting
        the cached ones among them from the prefix cache.

        The caller checks `num_free_blocks` first; asking for more raises IndexError and
        takes nothing.
        """
        blocks: list[KVBlock] = self.free_queue.popleft_n(n)  # type: ignore[assignment]
        for block in blocks:
            assert block.ref_cnt == 0, f"{block!r} was in the free queue while referenced"
            block.ref_cnt = 1
            if block.block_hash is not None:
                self._drop_hash(block)
                self.num_evictions += 1
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add one reference to each block (a prefix hit); a cached block no request held
        leaves the free queue -- from wherever it is, in O(1)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference to each block; a block reaching 0 goes to the free queue:
        to the tail if it is cached (most recently used, evicted last), to the head if
        not (nothing to keep, reused first).

        Order matters: cached blocks are appended in the order given, so the first one is
        evicted first. Callers freeing a request pass its block table reversed (tail block
        first): a sequence's last blocks are the least likely to be shared as a prefix, so
        they should be evicted before its first ones (as vLLM does).
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"{block!r} freed more times than it was referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    # -- the prefix cache ----------------------------------------------------------------

    def cache_block(self, block: KVBlock, block_hash: bytes, key: BlockKey, group: int = 0) -> int:
        """Register a used, full, computed block of `group` under `block_hash`; returns its
        new serial. The hash must be free in that group (`uncache` a block holding it first)."""
        assert block.ref_cnt > 0 and block.block_hash is None, f"cannot cache {block!r}"
        cached = self.cached_groups[group]
        assert block_hash not in cached, "hash already cached"
        self._last_serial += 1
        block.block_hash, block.block_key, block.serial = block_hash, key, self._last_serial
        block.group = group
        cached[block_hash] = block
        return block.serial

    def uncache(self, block: KVBlock) -> None:
        """Drop a block from the prefix cache (it was replaced by a block with the same
        hash). A free one moves to the head of the free queue, with the empty blocks."""
        self._drop_hash(block)
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
            self.free_queue.appendleft(block)

    def _drop_hash(self, block: KVBlock) -> None:
        del self.cached_groups[block.group][block.block_hash]
        block.block_hash, block.block_key, block.serial = None, None, 0

    def check_integrity(self) -> None:
        """Raise AssertionError unless the invariants in the module docstring hold."""
        self.free_queue.check_integrity()
        free_ids = [block.block_id for block in self.free_queue]  # type: ignore[attr-defined]
        for block_id in free_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt == 0, f"{block!r} is in the free queue but referenced"
        referenced = [b.block_id for b in self.blocks if b.ref_cnt > 0]
        assert all(b.ref_cnt >= 0 for b in self.blocks), "a block has a negative ref_cnt"
        assert len(free_ids) + len(referenced) == self.num_blocks, (
            f"{len(free_ids)} free + {len(referenced)} referenced != {self.num_blocks} blocks: "
            f"unreferenced blocks missing from the free queue: "
            f"{sorted(set(range(self.num_blocks)) - set(free_ids) - set(referenced))}")
        hashed = [self.blocks[i].block_hash is not None for i in free_ids]
        assert hashed == sorted(hashed), (
            f"free queue: an empty block behind a cached one: {[self.blocks[i] for i in free_ids]}")
        num_cached = 0
        for group, cached in enumerate(self.cached_groups):
            for block_hash, block in cached.items():
                assert block.block_hash == block_hash and block.group == group, (
                    f"group {group}'s cache maps {block_hash.hex()} to {block!r}")
                assert block.block_key is not None and block.serial > 0, f"{block!r} has no key"
            num_cached += len(cached)
        num_hashed = sum(1 for b in self.blocks if b.block_hash is not None)
        assert num_hashed == num_cached, f"{num_hashed} blocks hold a hash, the caches map {num_cached}"
        serials = {b.serial for cached in self.cached_groups for b in cached.values()}
        assert len(serials) == num_cached, "serials repeat"
