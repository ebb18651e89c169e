"""The scheduler-side pool of KV cache blocks: ids, reference counts, the free queue.

The pool holds no KV memory (the worker does); a block here is only an id the worker uses
as a cache address (slot = block_id * block_size + offset) plus bookkeeping.

Invariants (checked by `check_integrity`):
- every block is either free (ref_cnt == 0, in the free queue) or referenced
  (ref_cnt > 0, outside the free queue): free + referenced == num_blocks;
- the free queue is ordered for eviction: `get_new_blocks` takes from its head,
  `free_blocks` appends to its tail.

Seam for prefix caching (next issue): a block keeps its `block_hash` while it sits in the
free queue, so a later request with the same prefix can take it back out of the middle
(`FreeBlockQueue.remove`, then ref_cnt += 1) instead of recomputing it; `get_new_blocks`
will then drop the hash of a cached block it evicts. Today `block_hash` stays None.
"""

from collections.abc import Iterable

from kvstore.free_queue import FreeBlockQueue, FreeListNode


class KVBlock(FreeListNode):
    """One block of `block_size` token slots. `ref_cnt` counts the block tables holding it."""

    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        super().__init__()
        self.block_id = block_id
        self.ref_cnt = 0
        # Hash of the full block's tokens chained on its parent's hash; None = not cached.
        self.block_hash: int | None = None

    def __repr__(self) -> str:
        return f"KVBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class BlockPool:
    """`num_blocks` blocks with ids 0..num_blocks-1, all free at first, queued in id order."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some request, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take n blocks from the head of the free queue, each with ref_cnt 1.

        The caller checks `num_free_blocks` first; asking for more raises IndexError and
        takes nothing.
        """
        blocks: list[KVBlock] = self.free_queue.popleft_n(n)  # type: ignore[assignment]
        for block in blocks:
            assert block.ref_cnt == 0, f"{block!r} was in the free queue while referenced"
            block.ref_cnt = 1
        return blocks

    def free_blocks(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference to each block; a block reaching 0 goes to the free queue tail.

        Order matters: blocks reaching 0 are appended in the order given, so the first
        one given is evicted first. Callers freeing a request pass its block table
        reversed (tail block first): a sequence's last blocks are the least likely to be
        shared as a prefix, so they should be reused before its first ones (as vLLM does).
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"{block!r} freed more times than it was referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def check_integrity(self) -> None:
        """Raise AssertionError unless the free queue is sound and holds exactly the
        blocks with ref_cnt 0."""
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
