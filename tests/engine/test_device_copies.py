"""Host-to-device copies on the serving path: each pass sends its metadata once, through pinned memory.

On CUDA a plain ``.to(device)`` of a pageable host tensor synchronises the stream: the host waits
for every queued kernel, so a round's draft steps could not be queued ahead of the GPU. And every
copy is a launch and a host wait of its own, so a pass packs its batch (and the slots it takes)
into one buffer and sends it once. Without a GPU the rules are checked by routing
``host_to_device`` to a stand-in that counts, and refusing any other ``Tensor.to`` while a batch
is built or slots are taken.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from specdecode_worker.engine import batch, forward_batch  # noqa: E402
from specdecode_worker.engine.batch import Segment, fresh_batch, make_batch  # noqa: E402
from specdecode_worker.engine.memory import kv_slots  # noqa: E402
from specdecode_worker.engine.memory.kv_slots import KVSlots  # noqa: E402
from specdecode_worker.engine.memory.pools import ReqToTokenPool, TokenToKVPoolAllocator  # noqa: E402


@pytest.fixture
def staged(monkeypatch):
    """Every host tensor sent to the device through pinned staging; any plain ``.to`` fails."""
    sent = []

    def pinned_stand_in(host, device):
        sent.append(host.clone())
        return host.clone()

    def plain_copy(self, *args, **kwargs):
        raise AssertionError(f"a plain Tensor.to{args}: pageable host memory would synchronise the stream")

    for module in (forward_batch, batch, kv_slots):
        monkeypatch.setattr(module, "host_to_device", pinned_stand_in)
    monkeypatch.setattr(torch.Tensor, "to", plain_copy)
    return sent


def test_a_batch_reaches_the_device_in_one_pinned_copy(staged):
    fb = make_batch([Segment(3, [7, 8], 5), Segment(1, [9], 2)], "cuda")
    assert fb.req_pool_indices.tolist() == [3, 1]
    assert fb.input_ids.tolist() == [7, 8, 9] and fb.positions.tolist() == [5, 6, 2]
    assert fb.seq_lens.tolist() == [7, 3]
    assert fb.logit_rows(last_only=True).tolist() == [1, 2]  # sent with the batch
    assert [t.tolist() for t in staged] == [[7, 8, 9, 5, 6, 2, 3, 1, 7, 3, 1, 2]]


def _slots(size: int = 32) -> KVSlots:
    return KVSlots(ReqToTokenPool(4, 16, "cpu"), TokenToKVPoolAllocator(size, "cpu"))


def test_a_batchs_reserved_slots_reach_the_device_in_one_pinned_copy(staged):
    slots = _slots()
    a, b = slots.open_row(), slots.open_row()
    slots.reserve([(a, 0, 3), (b, 4, 6)])
    assert len(staged) == 1
    assert slots.req_to_token[a, :3].tolist() == [1, 2, 3] and slots.req_to_token[b, 4:6].tolist() == [4, 5]


def test_a_fresh_batch_sends_its_slots_with_it_in_one_copy(staged):
    """A prefill chunk or a step where nobody drafts: new slots, where they go, and the batch, once."""
    slots = _slots()
    a, b = slots.open_row(), slots.open_row()
    fb = fresh_batch(slots, [Segment(a, [7, 8], 0), Segment(b, [9], 5)], "cuda")
    assert len(staged) == 1
    assert fb.out_cache_loc.tolist() == [1, 2, 3]
    assert slots.req_to_token[a, :2].tolist() == [1, 2] and slots.req_to_token[b, 5].item() == 3
    assert fb.input_ids.tolist() == [7, 8, 9] and fb.positions.tolist() == [0, 1, 5]
    assert fb.seq_lens.tolist() == [2, 6] and fb.logit_rows(last_only=True).tolist() == [1, 2]


# ---- slots freed after a round: read back to the host once, whatever the batch ----------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    pytest.importorskip("transformers")
    from devtools.eagle_heads import write_eagle_head
    from tests.engine_helpers import tiny_models

    root = tmp_path_factory.mktemp("copies")
    found = tiny_models(root)
    found["eagle"] = write_eagle_head(root / "eagle", found["target"], seed=2)
    return found


CASES = {"standalone": ("STANDALONE", "draft", {}), "eagle chain": ("EAGLE", "eagle", {}),
         "eagle tree": ("EAGLE", "eagle", dict(num_draft_tokens=6, speculative_num_steps=3, speculative_eagle_topk=3))}


@pytest.mark.parametrize("case", list(CASES))
def test_a_rounds_freed_slots_are_read_back_once_whatever_the_batch(models, case, monkeypatch):
    """On a GPU each free reads slots back from the device (a sync): a round frees its rejected
    positions (and a tree's scratch) in one read, never one per request."""
    from specdecode_worker.engine.memory.pools import TokenToKVPoolAllocator
    from specdecode_worker.engine.request import Request, SamplingParams
    from tests.engine_helpers import engine

    algorithm, draft, kw = CASES[case]
    frees, real = [], TokenToKVPoolAllocator.free
    monkeypatch.setattr(TokenToKVPoolAllocator, "free", lambda self, slots: frees.append(slots) or real(self, slots))

    def frees_per_round(batch: int) -> set[int]:
        eng = engine(models["target"], algorithm, models[draft], **kw)
        spec, counts = eng.speculator, []
        real_round = spec.decode_round

        def counted(reqs, *a, **k):
            before = len(frees)
            out = real_round(reqs, *a, **k)
            counts.append(len(frees) - before)
            return out

        spec.decode_round = counted
        reqs = [Request([1 + i, 5, 9, 2], SamplingParams(max_tokens=6, ignore_eos=True)) for i in range(batch)]
        for r in reqs:
            eng.submit(r)
        while not all(r.done.is_set() for r in reqs):
            eng.step()
        return set(counts)

    one, three = frees_per_round(1), frees_per_round(3)
    assert one == three and max(three) <= 2, (one, three)


# ---- slots of the requests a step ends: read back once for the whole group -----------------------


def _count_frees(monkeypatch) -> list:
    from specdecode_worker.engine.memory.pools import TokenToKVPoolAllocator

    frees, real = [], TokenToKVPoolAllocator.free
    monkeypatch.setattr(TokenToKVPoolAllocator, "free", lambda self, slots: frees.append(slots) or real(self, slots))
    return frees


def _counted(frees: list, fn, counts: list):
    def wrapper(*a, **k):
        before = len(frees)
        out = fn(*a, **k)
        counts.append(len(frees) - before)
        return out
    return wrapper


ENDING = {"plain": ("NONE", None, 5), "standalone": ("STANDALONE", "copy", 9),  # a copy accepts every draft
          "plain, at the first token": ("NONE", None, 1)}


@pytest.mark.parametrize("case", list(ENDING))
def test_requests_ending_in_one_step_are_read_back_once(models, case, monkeypatch):
    """Four requests reach max_tokens in the same step (after their round, or at their first token):
    their slots come back in one read, every slot comes back, and the output is the target's greedy."""
    from specdecode_worker.engine.request import Request, SamplingParams
    from tests.engine_helpers import assert_every_slot_back, engine, hf_greedy

    algorithm, draft, max_tokens = ENDING[case]
    frees = _count_frees(monkeypatch)
    eng = engine(models["target"], algorithm, models[draft] if draft else None, num_draft_tokens=4)
    in_round: list[int] = []
    eng.speculator.decode_round = _counted(frees, eng.speculator.decode_round, in_round)
    prompts = [[3 + i, 5, 9, 2, 11] for i in range(4)]
    reqs = [eng.submit(Request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))) for p in prompts]
    ending_steps = []  # (requests finished in the step, frees outside its round)
    while not all(r.done.is_set() for r in reqs):
        done_before, frees_before, rounds_before = sum(r.done.is_set() for r in reqs), len(frees), len(in_round)
        eng.step()
        outside = len(frees) - frees_before - sum(in_round[rounds_before:])
        ending_steps.append((sum(r.done.is_set() for r in reqs) - done_before, outside))
    assert (4, 1) in ending_steps, ending_steps  # all four in one step, one read
    assert all(outside == (ended > 0) for ended, outside in ending_steps), ending_steps
    pool = eng.target_runner.req_to_token_pool
    assert_every_slot_back(eng)
    assert pool.available_size() == pool.size
    assert [r.output_ids for r in reqs] == hf_greedy(models["target"], prompts, max_tokens)


@pytest.mark.parametrize("cache", [False, True], ids=["no cache", "prefix cache"])
def test_requests_retracted_together_are_read_back_once(models, monkeypatch, cache):
    """When the pool runs dry, one step retracts several requests: one read for all of them, and the
    output is still the target's greedy. (With the prefix cache their slots are read once into the
    cache, then evicted from it on the host.)"""
    from specdecode_worker.engine.memory.kv_slots import KVSlots
    from specdecode_worker.engine.request import Request, SamplingParams
    from tests.engine_helpers import assert_every_slot_back, engine, hf_greedy

    frees = _count_frees(monkeypatch)
    reads: list = []
    if cache:  # the one read of request rows is KVSlots._read_rows; the allocator then frees host slots
        real = KVSlots._read_rows
        monkeypatch.setattr(KVSlots, "_read_rows", lambda self, rows: reads.append(rows) or real(self, rows))
    eng = engine(models["target"], "STANDALONE", models["copy"], num_draft_tokens=4, prefix_cache=cache)
    prompts = [[3 + i, 5, 9] for i in range(4)]
    reqs = [eng.submit(Request(p, SamplingParams(max_tokens=20, ignore_eos=True))) for p in prompts]
    eng.step()  # all four admitted, prefilled and one round in
    alloc = eng.target_runner.token_to_kv_pool_allocator
    held = alloc.alloc(alloc.available_size())  # the pool runs dry: the step must retract
    make_room: list[int] = []
    _counted(reads if cache else frees, eng.scheduler.make_room, make_room)()
    # Each holds 8 slots and a round takes 5: four need 20, so the two newest go back (16 slots).
    assert eng.stats.retracted_requests == 2 and make_room == [1]
    alloc.free(held)
    while not all(r.done.is_set() for r in reqs):
        eng.step()
    assert_every_slot_back(eng)
    assert [r.output_ids for r in reqs] == hf_greedy(models["target"], prompts, 20)


# ---- copies per pass, counted on the serving path -------------------------------------------------

COPY_CASES = {"none": ("NONE", None, {}), "ngram": ("NGRAM", None, {}), "standalone": ("STANDALONE", "draft", {}),
              **CASES}


def _count_copies(monkeypatch) -> list:
    sent, real = [], forward_batch.host_to_device

    def counted(host, device):
        sent.append(host.numel())
        return real(host, device)

    for module in (forward_batch, batch, kv_slots):
        monkeypatch.setattr(module, "host_to_device", counted)
    return sent


@pytest.mark.parametrize("case", list(COPY_CASES))
def test_a_plain_step_and_a_prefill_are_one_copy_and_a_round_does_not_grow_with_the_batch(models, case, monkeypatch):
    """Greedy requests: a prefill pass and a step where nobody drafts send their batch and slots in
    one copy; so does an n-gram round (its proposals ride with its slots), and a draft model's or
    head's round sends one more per pass that starts from the host, as many at batch 4 as at 1."""
    from specdecode_worker.engine.request import Request, SamplingParams
    from tests.engine_helpers import engine

    algorithm, draft, kw = COPY_CASES[case]
    sent = _count_copies(monkeypatch)

    def copies(batch_size: int) -> tuple[set[int], set[int]]:
        eng = engine(models["target"], algorithm, models[draft] if draft else None, spec_policy="fixed", **kw)
        spec, prefills, rounds = eng.speculator, [], []
        for name, counts in (("prefill", prefills), ("decode_round", rounds)):
            setattr(spec, name, _counted(sent, getattr(spec, name), counts))
        # One prompt for all (it repeats, so n-gram lookups find proposals): every request drafts the
        # same lengths, so a round has one shape at any batch size.
        prompt = [3, 4, 5, 6, 3, 4, 5, 7]
        reqs = [Request(list(prompt), SamplingParams(max_tokens=8, ignore_eos=True)) for _ in range(batch_size)]
        for r in reqs:
            eng.submit(r)
        while not all(r.done.is_set() for r in reqs):
            eng.step()
        return set(prefills), set(rounds)

    (prefill_one, round_one), (prefill_four, round_four) = copies(1), copies(4)
    assert prefill_one == prefill_four == {1}
    assert round_one == round_four, (round_one, round_four)
    if algorithm == "NONE":
        assert round_one == {1}
