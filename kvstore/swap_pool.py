"""The scheduler-side pool of a worker's CPU (swap) blocks, and the CPU block tables of the
requests swapped out into it: ids only, no prefix caching.

A request preempted by swapping has its GPU blocks copied into CPU blocks (the worker does
the copy; see proto/worker.proto `blocks_to_swap_out`), and copied back into fresh GPU
blocks when it resumes. Each CPU block belongs to exactly one swapped request, so there
are no reference counts: a block is either free or held.

Allocation takes the lowest free ids first (a heap), so ids are deterministic for tests.
"""

import heapq
from collections.abc import Sequence


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


class SwapTables:
    """Swapped-out requests' CPU block tables -- one per KV cache group, holes (None, blocks
    given back behind a sliding window) kept in place -- over a CpuBlockPool of `num_blocks`."""

    def __init__(self, num_blocks: int) -> None:
        self.pool = CpuBlockPool(num_blocks)
        self._tables: dict[str, list[list[int | None]]] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tables

    def get(self, request_id: str) -> list[list[int | None]] | None:
        return self._tables.get(request_id)

    def store(self, request_id: str, holes: Sequence[Sequence[bool]]) -> list[list[int | None]]:
        """CPU blocks for a request whose tables have a hole where `holes[g][i]`; its CPU
        tables. The caller checks pool.num_free_blocks first."""
        ids = iter(self.pool.allocate(sum(not hole for table in holes for hole in table)))
        tables = self._tables[request_id] = [[None if hole else next(ids) for hole in table] for table in holes]
        return tables

    def drop_before(self, request_id: str, limits: Sequence[int]) -> None:
        """Give back group g's CPU blocks before index limits[g] (behind its window)."""
        for table, limit in zip(self._tables[request_id], limits):
            self.pool.free(_held(table[:limit]))
            table[:limit] = [None] * min(limit, len(table))

    def release(self, request_id: str) -> list[list[int | None]] | None:
        """Forget the request's CPU tables and free their blocks; the tables (None: none held)."""
        tables = self._tables.pop(request_id, None)
        for table in tables or ():
            self.pool.free(_held(table))
        return tables

    def num_blocks_held(self, request_id: str) -> int:
        return sum(len(_held(table)) for table in self._tables.get(request_id, ()))

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        held = [i for tables in self._tables.values() for table in tables for i in _held(table)]
        assert len(held) == len(set(held)), "a CPU block is in two CPU tables"
        assert len(held) + self.pool.num_free_blocks == self.pool.num_blocks, (
            f"{len(held)} CPU blocks in tables + {self.pool.num_free_blocks} free != {self.pool.num_blocks}")


def _held(table: Sequence[int | None]) -> list[int]:
    return [block_id for block_id in table if block_id is not None]
