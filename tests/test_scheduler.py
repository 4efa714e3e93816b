"""Scheduler: admission, chunked prefill under the token budget, preemption, FCFS.

No model: a step is simulated by handing update_from_output a dummy token for every
sequence that the step completes.
"""

from macinfer.core.block_pool import BlockPool
from macinfer.core.sampling import SamplingParams
from macinfer.core.scheduler import ScheduledSequence, Scheduler, SchedulerConfig
from macinfer.core.sequence import Sequence, SequenceStatus


def make(num_blocks, block_size, max_num_seqs, budget):
    pool = BlockPool(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_num_seqs, budget), pool), pool


def sq(rid, n):
    return Sequence(rid, list(range(n)), SamplingParams(max_tokens=100))


def step(sched):
    out = sched.schedule()
    plan = [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled]
    sched.update_from_output(out, [7 if s.samples else None for s in out.scheduled])
    return out, plan


def queue(pool):
    return [b.block_id for b in pool.free_block_queue]


def test_chunked_prefill_under_token_budget():
    sched, pool = make(num_blocks=9, block_size=4, max_num_seqs=4, budget=8)
    a, b = sq("a", 10), sq("b", 3)
    sched.add(a)
    sched.add(b)
    out, plan = step(sched)
    assert plan == [("a", 8)]  # the budget cuts a's prompt; b must wait
    assert a.block_table == [1, 2] and a.num_computed_tokens == 8 and a.num_output_tokens == 0
    assert list(sched.waiting) == [b]
    out, plan = step(sched)
    assert plan == [("a", 2), ("b", 3)]  # a's last chunk, then b is admitted
    assert a.block_table == [1, 2, 3] and b.block_table == [4]
    assert a.num_output_tokens == 1 and b.num_output_tokens == 1
    out, plan = step(sched)
    assert plan == [("a", 1), ("b", 1)]  # both decode in one step
    assert a.block_table == [1, 2, 3] and b.block_table == [4]
    assert queue(pool) == [5, 6, 7, 8]


def test_decodes_go_before_a_long_prompt():
    sched, pool = make(num_blocks=17, block_size=4, max_num_seqs=4, budget=8)
    a = sq("a", 3)
    sched.add(a)
    assert step(sched)[1] == [("a", 3)]
    c = sq("c", 20)
    sched.add(c)
    assert step(sched)[1] == [("a", 1), ("c", 7)]
    assert step(sched)[1] == [("a", 1), ("c", 7)]
    assert step(sched)[1] == [("a", 1), ("c", 6)]  # c's last chunk samples its first token
    assert c.num_output_tokens == 1
    assert step(sched)[1] == [("a", 1), ("c", 1)]


def test_preempts_newest_and_recomputes_later():
    sched, pool = make(num_blocks=4, block_size=2, max_num_seqs=4, budget=8)  # 3 usable blocks
    a, b, c = sq("a", 2), sq("b", 2), sq("c", 1)
    sched.add(a)
    sched.add(b)
    assert step(sched)[1] == [("a", 2), ("b", 2)]
    assert a.block_table == [1] and b.block_table == [2]
    sched.add(c)
    out, plan = step(sched)
    # a takes the last free block for slot 2; b (newest) needs one too: preempted.
    assert plan == [("a", 1)]
    assert out.preempted == [b] and sched.num_preemptions == 1
    assert a.block_table == [1, 3]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0 and b.block_table == []
    assert b.token_ids == [0, 1, 7]  # its output is kept and will be recomputed
    assert list(sched.waiting) == [b, c]  # preempted goes first; nothing admitted this step
    assert queue(pool) == [2]
    out, plan = step(sched)
    assert plan == [("a", 1)]  # b needs 2 blocks, 1 free; c may not overtake b
    assert list(sched.waiting) == [b, c]
    sched.abort("a")
    assert queue(pool) == [2, 3, 1]
    out, plan = step(sched)
    assert plan == [("b", 3), ("c", 1)]  # b recomputes prompt + output at once
    assert b.block_table == [2, 3] and c.block_table == [1]
    assert b.token_ids == [0, 1, 7, 7]


def test_preempted_victim_already_scheduled_is_unscheduled():
    sched, pool = make(num_blocks=4, block_size=2, max_num_seqs=4, budget=8)
    c, d = sq("c", 6), sq("d", 2)
    # Running order [c, d]: c (older) mid-prefill, d (newer) decoding.
    for seq, computed, n in ((c, 2, 2), (d, 1, 1)):
        seq.status = SequenceStatus.RUNNING
        assert pool.allocate_slots(seq, n)
        seq.num_computed_tokens = computed
        sched.running.append(seq)
    assert c.block_table == [1] and d.block_table == [2] and queue(pool) == [3]
    out = sched.schedule()
    # d is scheduled first (decodes first); c's chunk needs 2 blocks -> d preempted
    # and removed from the step, its budget given back.
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("c", 4)]
    assert out.preempted == [d] and c.block_table == [1, 3, 2]


def test_request_that_outgrows_the_pool_finishes_with_length():
    sched, pool = make(num_blocks=3, block_size=2, max_num_seqs=4, budget=8)  # 4 token slots
    a = sq("a", 4)
    sched.add(a)
    assert step(sched)[1] == [("a", 4)]
    out, plan = step(sched)  # slot 4 would need a 3rd block: can never fit
    assert plan == [] and out.finished == [a]
    assert a.status is SequenceStatus.FINISHED_LENGTH
    assert queue(pool) == [2, 1] and not sched.has_unfinished()


def test_fcfs_no_overtaking_and_max_num_seqs():
    sched, pool = make(num_blocks=4, block_size=4, max_num_seqs=4, budget=32)  # 3 usable blocks
    a, b, c = sq("a", 8), sq("b", 8), sq("c", 2)
    for s in (a, b, c):
        sched.add(s)
    assert step(sched)[1] == [("a", 8)]  # b does not fit; c, which would, waits behind it
    assert list(sched.waiting) == [b, c]

    sched, pool = make(num_blocks=16, block_size=4, max_num_seqs=2, budget=32)
    seqs = [sq(r, 2) for r in "xyz"]
    for s in seqs:
        sched.add(s)
    assert step(sched)[1] == [("x", 2), ("y", 2)]
    assert step(sched)[1] == [("x", 1), ("y", 1)]
    sched.finish(seqs[0], SequenceStatus.FINISHED_STOPPED)
    assert step(sched)[1] == [("y", 1), ("z", 2)]


def test_abort_frees_blocks_everywhere():
    sched, pool = make(num_blocks=8, block_size=2, max_num_seqs=4, budget=4)
    a, b = sq("a", 4), sq("b", 6)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert a.block_table == [1, 2] and list(sched.waiting) == [b]
    assert sched.abort("b") is b and b.status is SequenceStatus.FINISHED_ABORTED
    assert sched.abort("a") is a and sched.abort("a") is None
    assert not sched.has_unfinished()
    assert pool.get_num_free_blocks() == pool.num_usable_blocks and pool.req_to_blocks == {}


def test_scheduled_sequence_samples_only_when_caught_up():
    s = sq("a", 5)
    assert not ScheduledSequence(s, 4).samples
    assert ScheduledSequence(s, 5).samples
