"""The Triton paged-attention kernels against the torch-native backends.

Without a GPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``), which executes
them with numpy: the same index arithmetic, masks and online softmax as on a GPU, exactly. Triton
reads the variable when a function is decorated, its own library's included, so it must be set
before triton is first imported: tests/conftest.py sets it for the whole run on a machine without
a GPU (transformers may import triton while tests are collected), and tests/triton_interpreter.py sets it when run
alone, failing at once if triton came first. ``test_kernels_run_under_the_interpreter`` checks it
took effect. With a GPU the same tests run the compiled kernels on it, and the variable is left
alone, so the CUDA tests of the same process keep real kernels.
"""

from __future__ import annotations

import pytest
from specdecode_worker.engine.kernels import triton_attention as ta  # noqa: E402
from specdecode_worker.engine.kernels import triton_backend as tb  # noqa: E402
from specdecode_worker.engine.kernels.attention import TorchNativeAttnBackend  # noqa: E402
from specdecode_worker.engine.memory.pools import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from specdecode_worker.engine.speculation.tree import ancestor_mask  # noqa: E402
from specdecode_worker.engine.kernels.tree_attention import TreeAttnBackend, TreeForwardBatch  # noqa: E402

from tests.triton_interpreter import (  # noqa: E402, F401
    CUDA, DEVICE, E4M3_ON_DEVICE, assert_capture_makes_its_own_metadata, paged_batch, poison_dead_slots, torch, triton,
)

POOL = 720
CTX = 96
D = 16
SCALE = D ** -0.5


def _pools(kv_heads: int, kv_dtype=torch.float32, seed: int = 0, num_reqs: int = 6):
    """Pools with random K/V in every slot and each request's positions on its own shuffled slots."""
    g = torch.Generator().manual_seed(seed)
    req_pool = ReqToTokenPool(num_reqs + 1, CTX, DEVICE)
    kv = MHATokenToKVPool(POOL, 1, kv_heads, D, D, kv_dtype, DEVICE)
    kv.k_buffer[0].copy_(torch.randn(POOL + 1, kv_heads, D, generator=g).to(DEVICE, kv_dtype))
    kv.v_buffer[0].copy_(torch.randn(POOL + 1, kv_heads, D, generator=g).to(DEVICE, kv_dtype))
    slots = torch.randperm(POOL, generator=g) + 1
    for r in range(num_reqs + 1):
        req_pool.req_to_token[r] = slots[r * CTX : (r + 1) * CTX]
    return req_pool, kv, g


def _randn(*shape, g):
    return torch.randn(*shape, generator=g).to(DEVICE)


def _run(backend_cls, req_pool, kv, window, q, k, v, fb):
    return backend_cls(req_pool, kv, window).forward(q, k, v, 0, fb, SCALE)


def _spread(x, real, rows: int, g):
    """``x`` at rows ``real`` of a padded batch of ``rows`` rows, other values in the padding rows."""
    out = _randn(rows, *x.shape[1:], g=g)
    out[real] = x
    return out


def _compare(kv_heads, group, seq_lens, extend_lens, window=None, kv_dtype=torch.float32, seed=0):
    req_pool, kv, g = _pools(kv_heads, kv_dtype, seed)
    reqs = list(range(1, len(seq_lens) + 1))
    fb = paged_batch(req_pool, seq_lens, extend_lens, reqs)
    n = sum(extend_lens)
    q = _randn(n, kv_heads * group, D, g=g)
    k = _randn(n, kv_heads, D, g=g)
    v = _randn(n, kv_heads, D, g=g)
    want = _run(TorchNativeAttnBackend, req_pool, kv, window, q, k, v, fb)
    got = _run(tb.TritonAttnBackend, req_pool, kv, window, q, k, v, fb)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    return got


@pytest.mark.skipif(CUDA, reason="with a GPU the kernels are compiled for it")
def test_kernels_run_under_the_interpreter():
    from triton.runtime.interpreter import InterpretedFunction

    for kernel in (ta._decode_partial_kernel, ta._decode_reduce_kernel, ta._extend_kernel, ta._verify_partial_kernel):
        assert isinstance(kernel, InterpretedFunction)


@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_mixed_lengths_and_gqa(group):
    # Lengths below, at and above one 64-key block, split over several programs and reduced.
    _compare(kv_heads=2, group=group, seq_lens=[1, 5, 64, 65, 96], extend_lens=[1] * 5)


def test_decode_splits_cover_every_key_whatever_their_number():
    req_pool, kv, g = _pools(kv_heads=2)
    fb = paged_batch(req_pool, [3, 90, 40], [1, 1, 1], [1, 2, 3])
    q = _randn(3, 4, D, g=g)
    k_buf, v_buf = kv.k_buffer[0], kv.v_buffer[0]
    want = TorchNativeAttnBackend(req_pool, kv, None)._decode(q, k_buf, v_buf, fb, SCALE)
    for splits in (1, 3, 16):
        got = ta.decode_attention(q, k_buf, v_buf, req_pool.req_to_token, fb.req_pool_indices, fb.seq_lens,
                                  SCALE, None, splits)
        torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_decode_reads_only_live_slots():
    # Poison every slot outside the requests' live positions: a read of one would show as NaN.
    req_pool, kv, g = _pools(kv_heads=1)
    seq_lens, reqs = [7, 30], [1, 2]
    poison_dead_slots(req_pool, reqs, seq_lens, kv.k_buffer[0], kv.v_buffer[0])
    fb = paged_batch(req_pool, seq_lens, [1, 1], reqs)
    q = _randn(2, 4, D, g=g)
    out = ta.decode_attention(q, kv.k_buffer[0], kv.v_buffer[0], req_pool.req_to_token, fb.req_pool_indices,
                              fb.seq_lens, SCALE, None, 4)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_pools_are_upcast_inside_the_kernels(kv_dtype):
    if kv_dtype == torch.float8_e4m3fn and not E4M3_ON_DEVICE:
        pytest.skip("Triton has no e4m3 before sm_89 (the engine keeps torch-native there)")
    _compare(kv_heads=2, group=4, seq_lens=[9, 70], extend_lens=[1, 1], kv_dtype=kv_dtype)  # decode
    _compare(kv_heads=2, group=4, seq_lens=[9, 70], extend_lens=[9, 4], kv_dtype=kv_dtype)  # split-KV verify
    _compare(kv_heads=2, group=4, seq_lens=[30, 70], extend_lens=[30, 4], kv_dtype=kv_dtype)  # extend


@pytest.mark.parametrize("group", [1, 4, 8])
def test_extend_prefill_and_chain_verify_in_one_launch(group):
    # A whole prompt (no prefix), a prompt over a prefix, and two verify rows of k + 1 = 4 tokens.
    _compare(kv_heads=2, group=group, seq_lens=[20, 90, 33, 7], extend_lens=[20, 70, 4, 4])


def _verify(req_pool, kv, fb, q, window, splits):
    backend = tb.TritonAttnBackend(req_pool, kv, window)
    q_start, q_lens, linear_lens, max_q_len, extra = backend._meta(fb, q.device)
    return ta.verify_attention(q, kv.k_buffer[0], kv.v_buffer[0], req_pool.req_to_token, fb.req_pool_indices,
                               q_start, q_lens, linear_lens, fb.positions, max_q_len, SCALE, window, splits, extra)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_verify_splits_cover_every_key_whatever_their_number(group, window):
    """Ragged verify rows (1 to 8 new tokens, contexts below, at and above a 64-key block) split
    1, 3 or 16 ways: every split count gives the torch-native rows."""
    req_pool, kv, g = _pools(kv_heads=2, seed=11)
    seq_lens, extend_lens = [4, 64, 65, 96, 30], [4, 8, 1, 5, 2]
    fb = paged_batch(req_pool, seq_lens, extend_lens, [1, 2, 3, 4, 5])
    n = sum(extend_lens)
    q, k, v = _randn(n, 2 * group, D, g=g), _randn(n, 2, D, g=g), _randn(n, 2, D, g=g)
    want = _run(TorchNativeAttnBackend, req_pool, kv, window, q, k, v, fb)  # writes the new K/V too
    for splits in (1, 3, 16):
        torch.testing.assert_close(_verify(req_pool, kv, fb, q, window, splits), want, atol=2e-5, rtol=2e-5)


def test_verify_reads_only_live_slots():
    req_pool, kv, g = _pools(kv_heads=1, seed=12)
    seq_lens, reqs = [7, 90], [1, 2]
    poison_dead_slots(req_pool, reqs, seq_lens, kv.k_buffer[0], kv.v_buffer[0])
    fb = paged_batch(req_pool, seq_lens, [4, 4], reqs)
    out = _verify(req_pool, kv, fb, _randn(8, 4, D, g=g), None, 5)
    assert torch.isfinite(out).all()


def test_a_row_that_sees_no_key_gets_zeros_not_nan():
    """A tree row whose mask is empty, with no prefix: every split is empty (a padding request of
    a tree graph can be one). The reduce must not divide by zero."""
    req_pool, kv, g = _pools(kv_heads=1, seed=13)
    fb = _tree_batch(req_pool, [0], [[-1, 0, 0]])
    fb.mask[0, 2] = 0  # the last node sees nothing, itself included
    out = _verify(req_pool, kv, fb, _randn(3, 2, D, g=g), None, 4)
    assert torch.isfinite(out).all() and out[2].eq(0).all() and out[:2].abs().sum() > 0


def test_the_backend_verifies_few_tokens_split_and_extends_long_ones(monkeypatch):
    """Verify-sized passes (new tokens x group within ``VERIFY_MAX_ROWS``) take the split-KV
    kernel, prefill chunks the extend kernel, and single tokens the decode kernel."""
    calls = []
    for name in ("decode_attention", "verify_attention", "extend_attention"):
        real = getattr(tb, name)
        monkeypatch.setattr(tb, name, lambda *a, _n=name, _r=real, **kw: calls.append(_n) or _r(*a, **kw))
    _compare(kv_heads=2, group=4, seq_lens=[20, 50], extend_lens=[1, 1])
    _compare(kv_heads=2, group=4, seq_lens=[20, 50], extend_lens=[16, 4])
    _compare(kv_heads=2, group=4, seq_lens=[20, 50], extend_lens=[17, 4])
    assert calls == ["decode_attention", "verify_attention", "extend_attention"]
    assert tb.verify_fits(16, 4) and not tb.verify_fits(17, 4) and tb.verify_fits(8, 8)


def test_extend_with_uniform_verify_lengths_builds_metadata_on_device():
    out = _compare(kv_heads=1, group=4, seq_lens=[12, 50, 81], extend_lens=[4, 4, 4])
    assert out.shape == (12, 4, D)


@pytest.mark.parametrize("window", [1, 8, 40])
def test_sliding_window(window):
    _compare(kv_heads=2, group=2, seq_lens=[3, 50, 90], extend_lens=[1, 1, 1], window=window)
    _compare(kv_heads=2, group=2, seq_lens=[30, 90, 12], extend_lens=[30, 5, 4], window=window)


def _tree_batch(req_pool, prefix_lens, trees, queries=None):
    """One draft tree per request (all of one size) in spare slots at positions prefix + depth; the
    last ``queries`` nodes (default: all, as verification) are the new tokens and every node is a
    key under the ancestor mask, as a draft-tree step reads its expanded nodes."""
    used = set(req_pool.req_to_token[1 : len(trees) + 1].flatten().tolist())
    spare = [s for s in range(1, POOL + 1) if s not in used]
    width = len(trees[0])
    n = queries or width
    slots, key_pos, masks = [], [], []
    for p, parents in zip(prefix_lens, trees):
        depth = [0] * len(parents)
        for i, par in enumerate(parents):
            depth[i] = 0 if par < 0 else depth[par] + 1
        slots.append(spare[:width])
        spare = spare[width:]
        key_pos.append([p + d for d in depth])
        masks.append(ancestor_mask(parents)[-n:])
    slots, key_pos = torch.tensor(slots, device=DEVICE), torch.tensor(key_pos, device=DEVICE)
    seq = [p + width for p in prefix_lens]
    return TreeForwardBatch(
        input_ids=torch.zeros(len(trees) * n, dtype=torch.int64, device=DEVICE),
        positions=key_pos[:, -n:].reshape(-1), out_cache_loc=slots[:, -n:].reshape(-1),
        req_pool_indices=torch.arange(1, len(trees) + 1, device=DEVICE), seq_lens=torch.tensor(seq, device=DEVICE),
        extend_lens=[n] * len(trees), seq_lens_cpu=seq, prefix_lens=torch.tensor(prefix_lens, device=DEVICE),
        prefix_lens_cpu=prefix_lens, key_slots=slots, key_positions=key_pos,
        mask=torch.stack(masks).to(DEVICE, torch.int8),
    )


@pytest.mark.parametrize("queries", [None, 3])
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("group", [1, 4])
def test_tree_masked_attention(group, window, queries):
    """Verification (every node a query) and a draft-tree step (the last nodes query all of them)."""
    req_pool, kv, g = _pools(kv_heads=2, seed=3)
    trees = [[-1, 0, 0, 1, 1, 2, 3], [-1, 0, 1, 2, 3, 4, 5], [-1, 0, 0, 0, 1, 2, 4]]
    fb = _tree_batch(req_pool, [5, 66, 1], trees, queries)
    n = sum(fb.extend_lens)
    q = _randn(n, 2 * group, D, g=g)
    k = _randn(n, 2, D, g=g)
    v = _randn(n, 2, D, g=g)
    want = _run(TreeAttnBackend, req_pool, kv, window, q, k, v, fb)
    got = _run(tb.TritonAttnBackend, req_pool, kv, window, q, k, v, fb)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_tree_mask_changes_the_answer():
    # The same nodes under a chain mask instead of the tree's give other outputs: the mask is read.
    req_pool, kv, g = _pools(kv_heads=1, seed=4)
    fb = _tree_batch(req_pool, [10], [[-1, 0, 0, 0]])
    q, k, v = (_randn(4, 1, D, g=g) for _ in range(3))
    backend = tb.TritonAttnBackend(req_pool, kv, None)
    tree_out = backend.forward(q, k, v, 0, fb, SCALE)
    fb.mask = ancestor_mask([-1, 0, 1, 2])[None].to(DEVICE, torch.int8)
    chain_out = tb.TritonAttnBackend(req_pool, kv, None).forward(q, k, v, 0, fb, SCALE)
    torch.testing.assert_close(tree_out[:2], chain_out[:2])  # root and first child see the same keys
    assert not torch.allclose(tree_out[2:], chain_out[2:])


def test_decode_splits_depend_on_batch_size_only():
    assert ta.decode_num_splits(1, 8, 132) == 16
    assert ta.decode_num_splits(64, 8, 132) == 1
    assert ta.decode_num_splits(4, 8, 132) == 9
    assert ta.decode_num_splits(4, 8, 200) == ta.decode_num_splits(4, 8, 160) == 10  # SMs capped for the planner
    assert ta.decode_workspace_bytes(2, 4, 16, 3) == 2 * 4 * 3 * 17 * 4


def test_backend_choice(monkeypatch):
    from specdecode_worker.engine.kernels.attention import ATTENTION_BACKEND_ENV, attention_backend_name
    from specdecode_worker.errors import InputError

    monkeypatch.delenv(ATTENTION_BACKEND_ENV, raising=False)
    assert attention_backend_name("cpu") == "torch_native"
    assert attention_backend_name("cuda:0") == "triton"
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "torch_native")
    assert attention_backend_name("cuda:0") == "torch_native"
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "flash")
    with pytest.raises(InputError, match="one of auto, triton, torch_native"):
        attention_backend_name("cpu")
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(InputError, match="TRITON_INTERPRET=1"):
        attention_backend_name("cpu")


@pytest.mark.slow
@pytest.mark.skipif(CUDA, reason="tests/gpu/test_engine_cuda.py runs the engine on a GPU")
@pytest.mark.parametrize("case", ["STANDALONE", "EAGLE3-tree"])
def test_engine_greedy_output_is_the_same_on_both_backends(case, tmp_path, monkeypatch):
    """Whole engine runs: prefill, target and draft decode, chain and tree verification, EAGLE draft steps."""
    from specdecode_worker.engine.kernels.attention import ATTENTION_BACKEND_ENV
    from specdecode_worker.engine.request import Request, SamplingParams

    from devtools.eagle_heads import write_eagle3_head
    from tests.engine_helpers import engine, run_all
    from devtools.tiny_models import write_tiny_model, write_tiny_pair

    algorithm, _, variant = case.partition("-")
    extra = {}
    if algorithm == "EAGLE3":
        target = write_tiny_model(tmp_path / "small", "llama", seed=0, weight_scale=3.0, vocab_size=8,
                                  num_hidden_layers=4)
        draft = write_eagle3_head(tmp_path / "eagle3", target, draft_vocab=6, seed=3)
        extra = dict(num_draft_tokens=4, speculative_num_steps=2, speculative_eagle_topk=2)
    else:
        target, draft = write_tiny_pair(tmp_path)
        draft = draft if algorithm == "STANDALONE" else None
    prompts = [[3, 4, 5, 6, 7, 3, 4], [5, 6], [7, 7, 3]]

    def outputs(backend: str):
        monkeypatch.setenv(ATTENTION_BACKEND_ENV, backend)
        eng = engine(target, algorithm, draft, **extra)
        assert type(eng.target_runner.backend).__name__ == (
            "TritonAttnBackend" if backend == "triton" else "TorchNativeAttnBackend")
        reqs = run_all(eng, [Request(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in prompts])
        return [r.output_ids for r in reqs]

    want = outputs("torch_native")
    assert outputs("triton") == want


@pytest.mark.parametrize("tokens_per_req", [1, 4])
def test_padded_graph_batch_gives_the_eager_rows(tokens_per_req):
    """What a graph replays: the batch staged into static buffers of a larger captured size.

    The real rows equal an eager run of the batch alone; padding rows write only KV slot 0.
    """
    from specdecode_worker.engine.cuda_graph import GraphInputs, capture_sizes, padded_size

    req_pool, kv, g = _pools(kv_heads=2, seed=5)
    seq_lens = [9, 77, 33]
    fb = paged_batch(req_pool, seq_lens, [tokens_per_req] * 3, [2, 4, 6])
    n = sum(fb.extend_lens)
    q, k, v = _randn(n, 8, D, g=g), _randn(n, 2, D, g=g), _randn(n, 2, D, g=g)
    eager = tb.TritonAttnBackend(req_pool, kv, None).forward(q, k, v, 0, fb, SCALE)

    sizes = capture_sizes(8)
    bs = padded_size(sizes, fb.batch_size)
    assert bs == 4
    inputs = GraphInputs(8, tokens_per_req, DEVICE)
    inputs.stage(fb, bs)
    static = inputs.batch(bs)
    assert inputs.accepts(fb) and static.seq_lens.tolist() == seq_lens + [tokens_per_req]
    pad = slice(n, bs * tokens_per_req)
    assert static.out_cache_loc[pad].eq(0).all() and static.req_pool_indices[3] == 0
    padded = lambda x: torch.cat([x, torch.zeros(bs * tokens_per_req - n, *x.shape[1:], device=DEVICE)])  # noqa: E731
    before = kv.k_buffer[0].clone()
    replayed = tb.TritonAttnBackend(req_pool, kv, None).forward(padded(q), padded(k), padded(v), 0, static, SCALE)
    torch.testing.assert_close(replayed[:n], eager)
    changed = (kv.k_buffer[0] != before).any(dim=(1, 2)).nonzero().flatten().tolist()
    assert changed == [0]  # the real rows rewrote the same values; padding went to slot 0


@pytest.mark.parametrize("window", [None, 3])
def test_padded_chain_batch_gives_the_ragged_rows_on_both_backends(window):
    """A verify batch of mixed lengths (1 to 4 rows) padded to width 5, as the verify graphs replay
    it: its real rows equal the ragged batch's on the torch-native reference and on the kernel, and
    its padding rows write K/V only to the pad slot."""
    from specdecode_worker.engine.batch import PAD_SLOT, padded_chain_batch

    req_pool, kv, g = _pools(kv_heads=2, seed=7)
    starts, lengths, reqs, width = [9, 70, 33, 50], [1, 4, 2, 3], [2, 4, 6, 1], 5
    ragged = paged_batch(req_pool, [s + n for s, n in zip(starts, lengths)], lengths, reqs)
    n = sum(lengths)
    q, k, v = _randn(n, 8, D, g=g), _randn(n, 2, D, g=g), _randn(n, 2, D, g=g)
    want = _run(TorchNativeAttnBackend, req_pool, kv, window, q, k, v, ragged)
    chains = torch.zeros(len(reqs), width, dtype=torch.int64, device=DEVICE)
    fb, _ = padded_chain_batch(req_pool, reqs, starts, chains, lengths, width)
    real = torch.tensor([i * width + j for i, m in enumerate(lengths) for j in range(m)], device=DEVICE)

    before = kv.k_buffer[0].clone()
    q_p, k_p, v_p = (_spread(x, real, len(reqs) * width, g) for x in (q, k, v))
    for backend in (TorchNativeAttnBackend, tb.TritonAttnBackend):
        got = _run(backend, req_pool, kv, window, q_p, k_p, v_p, fb)
        torch.testing.assert_close(got[real], want, atol=2e-5, rtol=2e-5)
    changed = (kv.k_buffer[0] != before).any(dim=(1, 2)).nonzero().flatten().tolist()
    assert changed == [PAD_SLOT]  # the real rows rewrote the same values


@pytest.mark.parametrize("window", [None, 3])
def test_left_padded_batch_gives_the_ragged_rows_on_both_backends(window):
    """An extend of 1 to 4 new tokens per request left-padded to width 4, as the extend graphs
    replay it: each request's last row is at (i + 1) x 4 - 1, its real rows equal the ragged
    batch's on the torch-native reference and on the kernel, and padding writes only the pad slot."""
    from specdecode_worker.engine.batch import PAD_SLOT, Segment, left_padded_batch

    req_pool, kv, g = _pools(kv_heads=2, seed=9)
    starts, lengths, reqs, width = [9, 70, 33], [1, 4, 2], [2, 4, 6], 4
    ragged = paged_batch(req_pool, [s + n for s, n in zip(starts, lengths)], lengths, reqs)
    n = sum(lengths)
    q, k, v = _randn(n, 8, D, g=g), _randn(n, 2, D, g=g), _randn(n, 2, D, g=g)
    want = _run(TorchNativeAttnBackend, req_pool, kv, window, q, k, v, ragged)
    segments = [Segment(r, [5] * m, s) for r, m, s in zip(reqs, lengths, starts)]
    fb, real = left_padded_batch(req_pool, segments, width, DEVICE)
    assert real.tolist() == [3, 4, 5, 6, 7, 10, 11]
    assert fb.extend_lens == [4, 4, 4] and fb.seq_lens.tolist() == [10, 74, 35]
    assert fb.input_ids.tolist() == [0, 0, 0, 5, 5, 5, 5, 5, 0, 0, 5, 5]

    before = kv.k_buffer[0].clone()
    q_p, k_p, v_p = (_spread(x, real, len(reqs) * width, g) for x in (q, k, v))
    for backend in (TorchNativeAttnBackend, tb.TritonAttnBackend):
        got = _run(backend, req_pool, kv, window, q_p, k_p, v_p, fb)
        torch.testing.assert_close(got[real], want, atol=2e-5, rtol=2e-5)
    changed = (kv.k_buffer[0] != before).any(dim=(1, 2)).nonzero().flatten().tolist()
    assert changed == [PAD_SLOT]  # the real rows rewrote the same values


def test_verify_batches_replay_verify_graphs_and_nothing_else(tmp_path):
    """ModelRunner.forward hands uniform k + 1 verify batches (all rows wanted) to the verify
    graphs; prefill and last-row-only batches run eagerly. A recorder stands in for the graphs."""
    from specdecode_worker.engine.cuda_graph import GraphInputs
    from specdecode_worker.engine.request import Request, SamplingParams

    from tests.engine_helpers import engine, run_all
    from devtools.tiny_models import write_tiny_pair

    target, draft = write_tiny_pair(tmp_path)
    prompts = [[3, 4, 5, 6, 7, 8], [5, 6, 7, 8]]  # two 4-token prompts would also be uniform, as 3 + 1 is

    def outputs(eng):
        reqs = run_all(eng, [Request(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in prompts])
        return [r.output_ids for r in reqs]

    plain = outputs(engine(target, "STANDALONE", draft, num_draft_tokens=3))
    eng = engine(target, "STANDALONE", draft, num_draft_tokens=3)
    runner, seen = eng.target_runner, []

    class Recorder:
        inputs = GraphInputs(8, 4, "cpu")
        max_bs, tokens_per_req = 8, 4

        def can_run(self, fb):
            return self.inputs.accepts(fb)

        def replay(self, fb):
            seen.append(list(fb.extend_lens))
            return runner.model(fb, runner.backend, fb.logit_rows(False))

    runner.verify_graphs = Recorder()
    assert outputs(eng) == plain
    assert seen and all(lens == [4] * len(lens) for lens in seen)
    assert eng.stats.verify_rounds >= len(seen)


@pytest.mark.parametrize("kernel, tokens", [("verify_attention", 4), ("extend_attention", 40)])
def test_a_graph_capture_makes_its_own_extend_metadata(monkeypatch, kernel, tokens):
    """A graph captured after its warm-up computes the batch's extend metadata itself rather
    than reading the warm-up's tensors (argument 6: the per-request query lengths)."""
    req_pool, kv, g = _pools(2)
    fb = paged_batch(req_pool, [42, 50, 61], [tokens] * 3, [1, 2, 3])
    n = 3 * tokens
    q, k, v = _randn(n, 4, D, g=g), _randn(n, 2, D, g=g), _randn(n, 2, D, g=g)
    assert_capture_makes_its_own_metadata(monkeypatch, tb, kernel, 6,
                                          tb.TritonAttnBackend(req_pool, kv, None), q, k, v, fb, SCALE)
