"""O(1) LRU queue of free blocks: a doubly linked list threaded through them.

Allocation pops the head (least recently freed); freeing pushes to the tail.
A prefix hit on a free block unlinks it from wherever it sits, in O(1).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from .block import Block


class FreeBlockQueue:
    """Doubly linked list of blocks with sentinel ends (no empty-list branches)."""

    def __init__(self, blocks: Iterable[Block] = ()) -> None:
        # Sentinels are never handed out; they only remove edge cases.
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next = self._tail
        self._tail.prev = self._head
        # A plain attribute: the manager reads it on every allocation, and
        # len() on a Python class costs a method call.
        self.size = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.size

    def append(self, block: Block) -> None:
        """Insert at the tail: evicted last."""
        last = self._tail.prev
        block.prev = last
        block.next = self._tail
        last.next = block
        self._tail.prev = block
        self.size += 1

    def appendleft(self, block: Block) -> None:
        """Insert at the head: handed out first."""
        first = self._head.next
        block.prev = self._head
        block.next = first
        first.prev = block
        self._head.next = block
        self.size += 1

    def popleft(self) -> Block:
        """Remove and return the head block; IndexError when empty."""
        block = self._head.next
        if block is self._tail:
            raise IndexError("pop from an empty FreeBlockQueue")
        self.remove(block)
        return block

    def popleft_n(self, count: int) -> list[Block]:
        """Remove and return the first ``count`` blocks in one pass (prefill
        allocates dozens at a time; this saves two calls per block)."""
        if count > self.size:
            raise IndexError(f"asked for {count} blocks, {self.size} queued")
        taken = []
        node = self._head.next
        for _ in range(count):
            taken.append(node)
            nxt = node.next
            node.prev = node.next = None
            node = nxt
        self._head.next = node
        node.prev = self._head
        self.size -= count
        return taken

    def remove(self, block: Block) -> None:
        """Unlink a block that is in this queue."""
        prev, nxt = block.prev, block.next
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self.size -= 1

    def __iter__(self) -> Iterator[Block]:
        """Head to tail; for tests and debugging, not the hot path."""
        node = self._head.next
        while node is not self._tail:
            yield node
            node = node.next
