"""BlockPool: exact block ids, free-queue order, ref counts, no leaks."""

import pytest

from macinfer.core.block_pool import BlockPool
from macinfer.core.sampling import SamplingParams
from macinfer.core.sequence import Sequence


def ids(blocks):
    return [b.block_id for b in blocks]


def queue(pool):
    return [b.block_id for b in pool.free_block_queue]


def seq(rid, n):
    return Sequence(rid, list(range(n)), SamplingParams())


def test_fresh_pool_reserves_null_block():
    pool = BlockPool(num_blocks=6, block_size=4)
    assert pool.num_usable_blocks == 5
    assert queue(pool) == [1, 2, 3, 4, 5]
    assert pool.null_block.block_id == 0 and pool.null_block.ref_cnt == 1


def test_get_and_free_follow_fifo_order():
    pool = BlockPool(num_blocks=6, block_size=4)
    a = pool.get_new_blocks(2)
    b = pool.get_new_blocks(1)
    assert ids(a) == [1, 2] and ids(b) == [3]
    assert [x.ref_cnt for x in a + b] == [1, 1, 1]
    assert queue(pool) == [4, 5]
    pool.free_blocks([a[1], a[0]])
    assert queue(pool) == [4, 5, 2, 1]  # freed blocks join the tail, in the order given
    assert ids(pool.get_new_blocks(3)) == [4, 5, 2]
    assert queue(pool) == [1]


def test_ref_cnt_keeps_shared_block_out_of_queue():
    pool = BlockPool(num_blocks=4, block_size=2)
    (blk,) = pool.get_new_blocks(1)
    blk.ref_cnt += 1  # a second holder (what prefix sharing will do)
    pool.free_blocks([blk])
    assert blk.ref_cnt == 1 and queue(pool) == [2, 3]
    pool.free_blocks([blk])
    assert blk.ref_cnt == 0 and queue(pool) == [2, 3, 1]


def test_cannot_over_allocate_or_free_null_block():
    pool = BlockPool(num_blocks=3, block_size=2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert queue(pool) == [1, 2]  # nothing taken by the failed call
    with pytest.raises(AssertionError):
        pool.free_blocks([pool.null_block])
    with pytest.raises(ValueError):
        BlockPool(num_blocks=1)


def test_allocate_slots_grows_block_table_exactly():
    pool = BlockPool(num_blocks=8, block_size=4)
    s = seq("a", 10)
    assert pool.num_new_blocks(s, 10) == 3
    assert pool.allocate_slots(s, 8)  # a first chunk of 8 tokens: 2 blocks
    assert s.block_table == [1, 2]
    s.num_computed_tokens = 8
    assert pool.allocate_slots(s, 2)
    assert s.block_table == [1, 2, 3]
    s.num_computed_tokens = 10
    assert pool.allocate_slots(s, 2)  # slots 10, 11 fit in block 3
    assert s.block_table == [1, 2, 3]
    s.num_computed_tokens = 12
    assert pool.allocate_slots(s, 1)  # slot 12 needs a 4th block
    assert s.block_table == [1, 2, 3, 4]
    assert queue(pool) == [5, 6, 7]


def test_allocate_slots_all_or_nothing():
    pool = BlockPool(num_blocks=4, block_size=4)  # 3 usable blocks
    a, b = seq("a", 8), seq("b", 8)
    assert pool.allocate_slots(a, 8) and a.block_table == [1, 2]
    assert not pool.can_allocate(b, 8)
    assert not pool.allocate_slots(b, 8)
    assert b.block_table == [] and queue(pool) == [3]


def test_free_releases_tail_first_and_leaks_nothing():
    pool = BlockPool(num_blocks=8, block_size=2)
    a, b = seq("a", 5), seq("b", 3)
    pool.allocate_slots(a, 5)
    pool.allocate_slots(b, 3)
    assert a.block_table == [1, 2, 3] and b.block_table == [4, 5]
    pool.free(a)
    assert a.block_table == [] and queue(pool) == [6, 7, 3, 2, 1]
    pool.free(b)
    assert queue(pool) == [6, 7, 3, 2, 1, 5, 4]
    assert pool.get_num_free_blocks() == pool.num_usable_blocks
    assert all(blk.ref_cnt == 0 for blk in pool.blocks[1:])
    assert pool.req_to_blocks == {}
    assert pool.usage == 0.0
