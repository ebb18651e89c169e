"""The scheduler-side pool of a worker's CPU (swap) blocks: ids only, no prefix caching.

A request preempted by swapping has its GPU blocks copied into CPU blocks (the worker does
the copy; see proto/worker.proto `blocks_to_swap_out`), and copied back into fresh GPU
blocks when it resumes. Each CPU block belongs to exactly one swapped request, so there
are no reference counts: a block is either free or held.

Allocation takes the lowest free ids first (a heap), so ids are deterministic for tests.
"""

import heapq


class CpuBlockPool:
    """`num_blocks` CPU blocks with ids 0..num_blocks-1 (0 blocks: swapping impossible)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))  # a heap (sorted is a valid heap)
        self._held: set[int] = set()

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n free block ids, lowest first. The caller checks num_free_blocks first;
        asking for more raises IndexError and takes nothing."""
        if n > len(self._free):
            raise IndexError(f"{n} CPU blocks asked for, {len(self._free)} free")
        ids = [heapq.heappop(self._free) for _ in range(n)]
        self._held.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        for block_id in ids:
            if block_id not in self._held:
                raise ValueError(f"CPU block {block_id} freed but not held")
            self._held.remove(block_id)
            heapq.heappush(self._free, block_id)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), f"a CPU block is free twice: {sorted(self._free)}"
        assert not free & self._held, f"CPU blocks both free and held: {sorted(free & self._held)}"
        assert free | self._held == set(range(self.num_blocks)), (
            f"CPU blocks lost: {sorted(set(range(self.num_blocks)) - free - self._held)}")
