"""MTP drafting with DeepSeek-V3's NextN layer: exact greedy output, exact sampling, and the bytes
the planner prices (weights and the one-layer latent pool) equal to what the worker holds."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV3ForCausalLM"):
    pytest.skip("this transformers has no DeepseekV3ForCausalLM", allow_module_level=True)

from specdecode_worker.engine.memory.mla_pool import MLATokenToKVPool  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402
from specdecode_worker.errors import InputError  # noqa: E402
from specdecode_worker.planner.plan import PlanArgs  # noqa: E402
from specdecode_worker.planner.plan_cli import make_plan  # noqa: E402

from devtools.deepseek_models import hf_greedy, write_tiny_deepseek  # noqa: E402
from tests.engine_helpers import engine, run_all  # noqa: E402

PROMPTS = [[5, 17, 42, 8, 99, 23, 4, 61, 7], [20, 21, 22], list(range(30, 50))]
NEW = 16
GREEDY = SamplingParams(max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_deepseek(tmp_path_factory.mktemp("mtp") / "tiny-deepseek-v3-mtp", mtp=True)


@pytest.fixture(scope="module")
def reference(model_dir):
    """transformers' greedy continuation (it never reads the MTP layer)."""
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for p in PROMPTS:
        out.append(hf_greedy(hf, p, NEW))
    return out


@pytest.mark.parametrize("k", [1, 3])
def test_mtp_greedy_output_equals_the_target_greedy_output(model_dir, reference, k):
    eng = engine(model_dir, "MTP", num_draft_tokens=k, context_len=128)
    reqs = run_all(eng, [Request(list(p), GREEDY) for p in PROMPTS])
    assert [r.output_ids for r in reqs] == reference
    assert eng.stats.proposed_tokens > 0
    assert eng.kv_usage()[0] == 0  # every slot, rejected drafts included, went back


@pytest.mark.slow
def test_mtp_greedy_output_on_the_fused_layer_kernels_equals_the_target_greedy_output(model_dir, reference,
                                                                                     monkeypatch):
    """The GPU's layer kernels under Triton's interpreter: DeepSeek's routing kernel (grouped top-k)
    and MLA's rope on the rotary kernel, with the expert kernel over stacked weights (Triton
    attention), give transformers' greedy output, drafting with the NextN layer."""
    from specdecode_worker.engine.kernels.attention import ATTENTION_BACKEND_ENV
    from specdecode_worker.engine.kernels.layer_kernels import LAYER_KERNELS_ENV

    from devtools.deepseek_models import record_static_moe

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("needs Triton: a GPU, or the interpreter (tests/conftest.py)")
    monkeypatch.setenv(LAYER_KERNELS_ENV, "triton")
    monkeypatch.setenv(ATTENTION_BACKEND_ENV, "triton")
    routed = record_static_moe(monkeypatch)
    eng = engine(model_dir, "MTP", num_draft_tokens=3, context_len=128)
    reqs = run_all(eng, [Request(list(p), GREEDY) for p in PROMPTS])
    assert [r.output_ids for r in reqs] == reference
    assert eng.stats.proposed_tokens > 0 and "chosen_experts" in routed


def _reference_nextn_logits(model_dir, ids: list[int], hidden: torch.Tensor) -> torch.Tensor:
    """The NextN step written with transformers' own DeepSeek-V3 modules over the published tensors:
    eh_proj(concat(enorm(embed), hnorm(hidden))) -> decoder block (causal) -> shared_head.norm -> lm_head."""
    from safetensors.torch import load_file
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as ds

    w = load_file(model_dir / "model.safetensors")
    config = transformers.AutoConfig.from_pretrained(model_dir)
    L = config.num_hidden_layers
    p = f"model.layers.{L}."
    block = ds.DeepseekV3DecoderLayer(config, L).float().eval()
    state = {k[len(p):]: v for k, v in w.items() if k.startswith(p) and ".experts." not in k}
    experts = range(config.n_routed_experts)
    gate_up = [torch.cat([w[f"{p}mlp.experts.{j}.gate_proj.weight"], w[f"{p}mlp.experts.{j}.up_proj.weight"]])
               for j in experts]
    state["mlp.experts.gate_up_proj"] = torch.stack(gate_up)
    state["mlp.experts.down_proj"] = torch.stack([w[f"{p}mlp.experts.{j}.down_proj.weight"] for j in experts])
    missing, _ = block.load_state_dict(state, strict=False)
    assert not missing

    def rms(x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps))

    n = len(ids)
    embedded = w["model.embed_tokens.weight"][ids]
    x = torch.cat([rms(embedded, w[p + "enorm.weight"]), rms(hidden, w[p + "hnorm.weight"])], -1)
    x = (x @ w[p + "eh_proj.weight"].T)[None]
    rotary = ds.DeepseekV3RotaryEmbedding(config)
    positions = torch.arange(n)[None]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        out = block(x, attention_mask=mask, position_ids=positions, position_embeddings=rotary(x, positions))
    out = rms(out[0], w[p + "shared_head.norm.weight"])
    return out @ w[p + "shared_head.head.weight"].T


def test_nextn_step_equals_transformers_modules_over_the_published_tensors(model_dir):
    eng = engine(model_dir, "MTP", num_draft_tokens=1, context_len=128)
    spec = eng.speculator
    seen = []
    original = spec.passes.run_draft

    def recording(fb, backend, hidden, from_target, rows):
        logits, feature = original(fb, backend, hidden, from_target, rows)
        seen.append((fb.input_ids.tolist(), hidden.clone(), logits.clone()))
        return logits, feature

    spec.passes.run_draft = recording
    prompt = PROMPTS[0]
    req = run_all(eng, [Request(list(prompt), SamplingParams(max_tokens=2, ignore_eos=True))])[0]
    ids, hidden, logits = seen[0]  # the first extend: tokens 1..L over the target's hiddens at 0..L-1
    assert ids == prompt[1:] + [req.output_ids[0]]
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # the hidden the layer reads: the target's final, normalised hidden state
        target_hidden = hf.model(torch.tensor([prompt])).last_hidden_state[0]
    assert torch.allclose(hidden, target_hidden, atol=1e-4)
    ref = _reference_nextn_logits(model_dir, ids, target_hidden)[-1]
    assert torch.allclose(logits[0], ref, atol=1e-4), float((logits[0] - ref).abs().max())
    assert int(logits[0].argmax()) == int(ref.argmax())


def test_mtp_sampling_keeps_the_target_distribution(tmp_path):
    """Second sampled token vs the exact marginal from transformers (chi-square, alpha 0.001)."""
    folder = write_tiny_deepseek(tmp_path / "v8", mtp=True, vocab_size=8, num_hidden_layers=2, weight_scale=6.0)
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = [1, 2, 3]
    with torch.no_grad():
        q1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1], -1)
        q2 = torch.softmax(hf(torch.tensor([prompt + [t] for t in range(8)])).logits[:, -1], -1)
    exact = (q1[:, None] * q2).sum(0).double()
    eng = engine(folder, "MTP", num_draft_tokens=2, max_running_requests=64, context_len=32)
    params = [SamplingParams(max_tokens=2, temperature=1.0, seed=i, ignore_eos=True) for i in range(1500)]
    reqs = [Request(prompt, p) for p in params]
    run_all(eng, reqs)
    counts = torch.zeros(8, dtype=torch.float64)
    for r in reqs:
        counts[r.output_ids[1]] += 1
    expected = exact * counts.sum()
    keep = expected > 0
    chi2 = float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())
    assert eng.stats.proposed_tokens > 0
    assert chi2 < 24.322  # 7 degrees of freedom


def test_planner_prices_what_the_mtp_worker_holds(model_dir):
    plan = make_plan(PlanArgs(target=str(model_dir), algorithm="MTP", tp=1, gpu_memory_gib=1.5,
                              mem_fraction_static=0.95, context_length=64))
    eng = engine(model_dir, "MTP", device_memory_bytes=int(1.5 * (1 << 30)), mem_fraction_static=0.95,
                 runtime_bytes=plan["reserve"]["runtimeBytes"], context_len=64)
    target, draft = eng.target_runner, eng.draft_runner
    assert plan["weights"]["targetBytes"] == target.weight_bytes
    assert plan["weights"]["draftBytes"] == draft.weight_bytes
    assert isinstance(draft.token_to_kv_pool, MLATokenToKVPool)
    assert plan["kvCache"]["draftBytesPerToken"] == draft.token_to_kv_pool.bytes_per_token() == 1 * (16 + 8) * 4
    assert plan["kvCache"]["targetBytesPerToken"] == target.token_to_kv_pool.bytes_per_token()
    assert plan["kvCache"]["maxTotalNumTokens"] == target.token_to_kv_pool_allocator.size
    # One slot space: the draft adopts the target's req_to_token pool and allocator.
    assert draft.req_to_token_pool is target.req_to_token_pool
    assert draft.token_to_kv_pool_allocator is target.token_to_kv_pool_allocator
    # The checkpoint's embed_tokens / shared_head.head copies are not resident in the draft.
    names = [n for n, _ in draft.model.named_parameters()]
    assert not any(n.endswith(("embed_tokens.weight", "shared_head.head.weight")) for n in names)


def test_a_model_without_a_nextn_layer_is_refused_before_weights_load(tmp_path):
    folder = write_tiny_deepseek(tmp_path / "no-mtp", num_nextn_predict_layers=0)
    with pytest.raises(InputError, match="num_nextn_predict_layers"):
        engine(folder, "MTP")


def test_served_with_algorithm_mtp_completions_return_the_target_greedy_text(model_dir):
    import httpx

    from tests.server_helpers import free_port, serving

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = ["hello world what is the", "one two three four five"]
    expected = {}
    for p in prompts:
        expected[p] = tok.decode(hf_greedy(hf, tok(p).input_ids, 10), skip_special_tokens=True)
    port = str(free_port())
    argv = ["--target", str(model_dir), "--algorithm", "MTP", "--num-draft-tokens", "2", "--spec-policy", "fixed",
            "--device", "cpu",
            "--device-memory-gib", "1.5", "--mem-fraction-static", "0.95", "--context-length", "64",
            "--host", "127.0.0.1", "--port", port, "--log-level", "warning", "--served-model-name", "ds"]
    with serving(argv) as (base, state):
        for p, text in expected.items():
            body = {"model": "ds", "prompt": p, "max_tokens": 10, "temperature": 0, "ignore_eos": True}
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == text
        assert state.engine.report().stats.proposed_tokens > 0
