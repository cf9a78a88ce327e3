"""Host-to-device copies on the serving path go through pinned memory (``host_to_device``).

On CUDA a plain ``.to(device)`` of a pageable host tensor synchronises the stream: the host waits
for every queued kernel, so a round's draft steps could not be queued ahead of the GPU. Without a
GPU the rule is checked by routing ``host_to_device`` to a stand-in and refusing any other
``Tensor.to`` while a batch is built or slots are taken.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from specdecode_worker.engine import forward_batch  # noqa: E402
from specdecode_worker.engine.batch import Segment, make_batch  # noqa: E402
from specdecode_worker.engine.pools import TokenToKVPoolAllocator  # noqa: E402


@pytest.fixture
def staged(monkeypatch):
    """Every host tensor sent to the device through pinned staging; any plain ``.to`` fails."""
    sent = []

    def pinned_stand_in(host, device):
        sent.append(host.clone())
        return host.clone()

    def plain_copy(self, *args, **kwargs):
        raise AssertionError(f"a plain Tensor.to{args}: pageable host memory would synchronise the stream")

    monkeypatch.setattr(forward_batch, "host_to_device", pinned_stand_in)
    monkeypatch.setattr("specdecode_worker.engine.pools.host_to_device", pinned_stand_in)
    monkeypatch.setattr(torch.Tensor, "to", plain_copy)
    return sent


def test_a_batch_reaches_the_device_only_through_pinned_staging(staged):
    fb = make_batch([Segment(3, [7, 8], 5), Segment(1, [9], 2)], "cuda")
    assert fb.req_pool_indices.tolist() == [3, 1]
    assert fb.input_ids.tolist() == [7, 8, 9] and fb.positions.tolist() == [5, 6, 2]
    assert fb.seq_lens.tolist() == [7, 3]
    assert [t.tolist() for t in staged] == [[7, 8, 9], [5, 6, 2], [3, 1], [7, 3]]


def test_slots_reach_the_device_only_through_pinned_staging(staged):
    alloc = TokenToKVPoolAllocator(10, "cuda")
    assert alloc.alloc(3).tolist() == [1, 2, 3]
    assert [t.tolist() for t in staged] == [[1, 2, 3]]


# ---- slots freed after a round: read back to the host once, whatever the batch ----------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.eagle_heads import write_eagle_head
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
    from specdecode_worker.engine.pools import TokenToKVPoolAllocator
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
