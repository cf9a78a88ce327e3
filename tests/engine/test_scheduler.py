"""The scheduler and KV slots without a model: admission, retraction, the commit, and slots
given back together. Expected values are counted by hand from the pool sizes below; the engine
tests (test_engine_scheduling.py) check the same rules with real passes."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from specdecode_worker.engine.memory.kv_slots import KVSlots  # noqa: E402
from specdecode_worker.engine.memory.pools import ReqToTokenPool, TokenToKVPoolAllocator  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402
from specdecode_worker.engine.scheduler import Scheduler  # noqa: E402
from specdecode_worker.engine.stats import Stats  # noqa: E402

PER_ROUND = 4  # slots a decoding request may hold beyond its tokens in one round (k = 3)


def slots(rows=4, tokens=64, context=32) -> KVSlots:
    return KVSlots(ReqToTokenPool(rows, context, "cpu"), TokenToKVPoolAllocator(tokens, "cpu"))


def request(prompt_len=8, max_tokens=4, eos=frozenset()) -> Request:
    return Request(list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), eos_token_ids=eos)


def scheduler(kv: KVSlots, **kw) -> tuple[Scheduler, list[Request], list[int]]:
    s = Scheduler(kv, PER_ROUND, Stats(), **kw)
    return s, s.left


def test_kv_slots_reserve_release_and_restore():
    kv = slots(rows=2, tokens=10)
    row = kv.open_row()
    kv.reserve([(row, 0, 6)])
    assert (kv.free_slots(), kv.free_rows(), kv.used()) == (4, 1, 6)
    held = kv.req_to_token[row, :6].tolist()
    assert sorted(held) == [1, 2, 3, 4, 5, 6]  # slot 0 is padding, never handed out
    kv.release([(row, 4, 6)])  # two rejected positions
    assert kv.free_slots() == 6
    before = kv.snapshot()
    kv.fresh(3)
    other = kv.open_row()
    kv.reserve([(other, 0, 2)])
    kv.restore(before)  # the warm-up's undo: the same free lists, in the same order
    assert kv.free_slots() == 6 and kv.free_rows() == 1
    assert kv.snapshot().slots.tolist() == before.slots.tolist()
    kv.close_rows([(row, 4)])
    assert (kv.free_slots(), kv.free_rows()) == (10, 2)


def test_the_free_list_hands_out_first_freed_first_over_many_wraps():
    """Against a deque: any mix of takes and gives returns the same slots in the same order."""
    from collections import deque
    import random

    allocator, model = TokenToKVPoolAllocator(7, "cpu"), deque(range(1, 8))
    held: list[int] = []
    rng = random.Random(0)
    for _ in range(300):
        if held and rng.random() < 0.5:
            give = [held.pop(rng.randrange(len(held))) for _ in range(rng.randint(1, len(held)))]
            allocator.free(torch.tensor(give))
            model.extend(give)
        else:
            n = rng.randint(0, len(model))
            got = allocator.alloc(n).tolist()
            assert got == [model.popleft() for _ in range(n)]
            held += got
        assert allocator.available_size() == len(model)
        assert allocator.free_slots().tolist() == list(model)
    with pytest.raises(RuntimeError, match="freed twice"):
        allocator.free(torch.arange(1, 9))


def test_admission_counts_expected_growth_and_retracted_requests_come_first():
    kv = slots(rows=4, tokens=40)
    s, _ = scheduler(kv, new_token_ratio=0.5)
    a, b, c = request(8, 8), request(8, 8), request(8, 8)
    for r in (a, b, c):
        s.add(r)
    # each expects 8 prompt + 4 round + ceil(0.5 x 8) = 16 slots: two fit in 40, the third waits
    assert s.admit() == [a, b]
    assert s.num_waiting == 1 and [r.prefill_ids for r in (a, b)] == [a.prompt_ids, b.prompt_ids]
    assert s.prefill_chunk() == ([a, b], [8, 8])


def test_make_room_retracts_the_newest_and_it_returns_before_new_requests():
    kv = slots(rows=4, tokens=24)
    s, released = scheduler(kv, new_token_ratio=0.0)
    old, new, later = request(8, 8), request(8, 8), request(2, 2)
    s.add(old)
    s.add(new)
    assert s.admit() == [old, new]  # 8 + 4 each with no growth expected: 24 slots
    for r in (old, new):  # both prefilled: 16 of 24 slots held
        kv.reserve([(r.req_idx, 0, 8)])
        r.kv_len, r.prefill_ids = 8, None
        r.output_ids.append(5)
    s.add(later)
    s.make_room()  # two rounds need 8 slots, 8 are free: nothing to do
    assert s.running == [old, new]
    kv.reserve([(old.req_idx, 8, 12)])  # the old one grew by a round's slots: only 4 free now
    old.kv_len = 12
    s.make_room()
    assert s.running == [old] and released == [new] and new.retractions == 1
    assert (new.req_idx, new.kv_len, kv.free_slots()) == (None, 0, 12)
    assert s.num_waiting == 2
    s.finish(old, reason="stop")
    # The retracted one comes back first, now expecting all it may still generate (8 + 4 + 7 of 24
    # slots), recomputed from prompt + committed tokens but the last; the new one waits behind it.
    assert s.admit() == [new] and s.num_waiting == 1
    assert new.prefill_ids == new.prompt_ids


def test_commit_stops_at_eos_or_max_tokens_and_ending_together_returns_slots_once():
    kv = slots(rows=4, tokens=64)
    s, released = scheduler(kv)
    a, b = request(4, 8, eos=frozenset({99})), request(4, 3)
    updates = []
    for r in (a, b):
        r.on_update = lambda r, toks: updates.append((r.rid, toks))
        s.add(r)
    s.admit()
    for r in (a, b):
        kv.reserve([(r.req_idx, 0, 4)])
        r.kv_len, r.prefill_ids = 4, None
    with s.ending_together():
        s.commit(a, [7, 99, 8])  # stops at EOS: the token after it is dropped
        s.commit(b, [1, 2, 3, 4])  # stops at max_tokens 3
        assert kv.free_slots() == 56 and not a.done.is_set()  # given back when the block ends
    assert kv.free_slots() == 64 and kv.free_rows() == 4
    assert (a.output_ids, a.finish_reason, b.output_ids, b.finish_reason) == ([7, 99], "stop", [1, 2, 3], "length")
    assert a.done.is_set() and b.done.is_set() and released == [a, b]
    assert updates == [(a.rid, [7, 99]), (b.rid, [1, 2, 3]), (a.rid, None), (b.rid, None)]
    assert s.stats.generated_tokens == 5 and s.stats.finished_requests == 2 and s.idle


def test_submissions_from_other_threads_are_all_admitted():
    kv = slots(rows=64, tokens=4096)
    s, _ = scheduler(kv)
    reqs = [request(2, 1) for _ in range(200)]
    threads = [threading.Thread(target=lambda part=reqs[i::4]: [s.add(r) for r in part]) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    admitted = s.admit()
    assert len(admitted) == 64 and s.num_waiting == 136
    assert len({r.rid for r in admitted}) == 64
