"""The free block queue: a doubly linked list threaded through the blocks themselves.

Like vLLM's FreeKVCacheBlockQueue. A deque would give O(1) popleft and append but O(n)
removal from the middle, which prefix caching needs when a free (but still cached) block
is hit again and must leave the queue. The links live in the block objects, so removal is
O(1) given the block, and nothing is allocated per operation.

Order is eviction order: `popleft` hands out the block at the head; the pool puts a freed
block at the tail (`append`) or, when it holds nothing worth keeping, at the head
(`appendleft`). Two sentinel nodes (head and tail) remove every empty-list special case.

Invariants (checked by `check_integrity`):
- a node is in the queue iff both its links are set; a node outside has both links None;
- walking forward from the head sentinel visits `num_free_blocks` distinct blocks and
  ends at the tail sentinel, and every node's `prev_free` is the node visited before it.
"""

from collections.abc import Iterable, Iterator


class FreeListNode:
    """The links a block carries so it can sit in a FreeBlockQueue (both None when out)."""

    __slots__ = ("prev_free", "next_free")

    def __init__(self) -> None:
        self.prev_free: FreeListNode | None = None
        self.next_free: FreeListNode | None = None


class FreeBlockQueue:
    """Blocks not referenced by any request, in eviction order (head leaves first)."""

    def __init__(self, blocks: Iterable[FreeListNode]) -> None:
        self._head = FreeListNode()  # sentinels: never handed out
        self._tail = FreeListNode()
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __contains__(self, block: FreeListNode) -> bool:
        return block.next_free is not None

    def popleft(self) -> FreeListNode:
        """Remove and return the block at the head. Raises IndexError when empty."""
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free blocks")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[FreeListNode]:
        """Remove and return the first n blocks in queue order. Raises IndexError (and
        removes nothing) when fewer than n are free."""
        if n > self.num_free_blocks:
            raise IndexError(f"asked for {n} blocks, only {self.num_free_blocks} free")
        return [self.popleft() for _ in range(n)]

    def remove(self, block: FreeListNode) -> None:
        """Unlink a block from anywhere in the queue in O(1)."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError("block is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: FreeListNode) -> None:
        """Put a block at the tail: it is evicted after every block already here."""
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError("block is already in the free queue")
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def appendleft(self, block: FreeListNode) -> None:
        """Put a block at the head: it is evicted before every block already here."""
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError("block is already in the free queue")
        first = self._head.next_free
        first.prev_free = block
        block.next_free = first
        block.prev_free = self._head
        self._head.next_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[FreeListNode]:
        """Head to tail (eviction order). Do not mutate the queue while iterating."""
        node = self._head.next_free
        while node is not self._tail:
            yield node
            node = node.next_free

    def check_integrity(self) -> None:
        """Raise AssertionError unless the links form one consistent list of distinct
        blocks whose length is num_free_blocks."""
        seen: set[int] = set()
        prev = self._head
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None, "free queue: broken forward link (None before the tail)"
            assert id(node) not in seen, f"free queue: {node!r} appears twice"
            assert node.prev_free is prev, f"free queue: {node!r} has a wrong prev link"
            assert len(seen) < self.num_free_blocks, (
                f"free queue: more nodes than num_free_blocks={self.num_free_blocks}")
            seen.add(id(node))
            prev, node = node, node.next_free
        assert self._tail.prev_free is prev, "free queue: tail sentinel has a wrong prev link"
        assert len(seen) == self.num_free_blocks, (
            f"free queue: {len(seen)} nodes linked but num_free_blocks={self.num_free_blocks}")
