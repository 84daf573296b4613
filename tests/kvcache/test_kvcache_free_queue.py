"""FreeBlockQueue: O(1) doubly linked LRU list threaded through the blocks."""

import pytest

from kvserve.kvcache.block import Block
from kvserve.kvcache.free_queue import FreeBlockQueue


def ids(queue):
    return [b.block_id for b in queue]


def test_pops_in_insertion_order():
    blocks = [Block(i) for i in range(4)]
    queue = FreeBlockQueue(blocks)
    assert ids(queue) == [0, 1, 2, 3] and len(queue) == 4
    assert queue.popleft() is blocks[0]
    assert blocks[0].prev is None and blocks[0].next is None
    assert ids(queue) == [1, 2, 3] and len(queue) == 3


def test_remove_from_the_middle_keeps_links():
    blocks = [Block(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.remove(blocks[0])
    queue.remove(blocks[4])
    assert ids(queue) == [1, 3]
    assert blocks[1].next is blocks[3] and blocks[3].prev is blocks[1]
    assert len(queue) == 2


def test_append_goes_last_appendleft_goes_first():
    blocks = [Block(i) for i in range(4)]
    queue = FreeBlockQueue(blocks[1:3])
    queue.append(blocks[3])
    queue.appendleft(blocks[0])
    assert ids(queue) == [0, 1, 2, 3]


def test_popping_an_empty_queue_raises():
    queue = FreeBlockQueue()
    with pytest.raises(IndexError):
        queue.popleft()
    block = Block(7)
    queue.append(block)
    assert queue.popleft() is block
    assert len(queue) == 0
    with pytest.raises(IndexError):
        queue.popleft()
