"""Shared set-up for engine tests: tiny checkpoints and engines built in three phases."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from specdecode_worker.engine.engine import Engine, EngineArgs

from specdecode_worker.engine.request import Request, SamplingParams

from devtools.eagle_heads import write_eagle3_head, write_eagle_head
from devtools.smollm2 import noisy_copy  # noqa: F401  (tests take it from here)
from devtools.tiny_models import write_tiny_model, write_tiny_pair

# Tiny matrices gain nothing from intra-op threads, and on shared CI cores the thread hand-off
# costs more than the arithmetic.
torch.set_num_threads(1)


def tiny_models(root: Path) -> dict[str, Path]:
    """Target, a different random draft, and a byte-for-byte copy of the target."""
    target, draft = write_tiny_pair(root)
    copy = root / "target-copy"
    shutil.copytree(target, copy)
    return {"target": target, "draft": draft, "copy": copy}


def tiny_models_with_eagle_heads(root: Path, vocab: int, num_hidden_layers: int, draft_vocab: int) -> dict[str, Path]:
    """``tiny_models`` plus a llama target over a small vocabulary ("small") with a random EAGLE head
    ("eagle") and EAGLE3 head ("eagle3"): with few tokens random heads get some proposals accepted."""
    found = tiny_models(root / "pair")
    small = write_tiny_model(root / "small", "llama", seed=0, weight_scale=3.0, vocab_size=vocab,
                             num_hidden_layers=num_hidden_layers)
    found.update(small=small, eagle=write_eagle_head(root / "eagle", small, seed=1),
                 eagle3=write_eagle3_head(root / "eagle3", small, draft_vocab=draft_vocab, seed=3))
    return found


def every_algorithm_models(root: Path) -> dict[str, Path]:
    """``tiny_models`` plus what every algorithm drafts with: a llama over 8 tokens ("small") with
    an EAGLE ("eagle") and an EAGLE3 head ("eagle3"), and a tiny DeepSeek-V3 with its NextN layer ("mtp")."""
    from devtools.deepseek_models import write_tiny_deepseek

    found = tiny_models(root / "pair")
    small = write_tiny_model(root / "small", "llama", seed=0, weight_scale=3.0, vocab_size=8, num_hidden_layers=6)
    found.update(small=small, eagle=write_eagle_head(root / "eagle", small, seed=1),
                 eagle3=write_eagle3_head(root / "eagle3", small, draft_vocab=6, seed=3),
                 mtp=write_tiny_deepseek(root / "mtp", mtp=True))
    return found


def hf_greedy(model_dir: Path, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """The model's own greedy continuation of each prompt, from transformers' generate: the
    independent reference every speculative output must equal."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for p in prompts:
        ids = hf.generate(torch.tensor([p]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
        out.append(ids[0, len(p):].tolist())
    return out


def engine(target, algorithm="NONE", draft=None, **kw) -> Engine:
    args = dict(device_memory_bytes=64 << 20, mem_fraction_static=0.9, runtime_bytes=0, context_len=256,
                max_running_requests=8, num_draft_tokens=4)
    args.update(kw)
    eng = Engine(EngineArgs(str(target), str(draft) if draft else None, algorithm, **args))
    eng.init_model_worker()
    return eng


def run_all(eng: Engine, reqs):
    """Submit every request, then step the engine until all are done (no thread)."""
    for r in reqs:
        eng.submit(r)
    while not all(r.done.is_set() for r in reqs):
        eng.step()
    return reqs


def assert_every_slot_back(eng) -> None:
    """No slot leaked: every slot is free or in the prefix cache, and no finished request still
    holds a cached one."""
    slots = eng.target_runner.slots
    assert slots.allocator.available_size() + slots.cached() == slots.size
    assert slots.cache is None or slots.cache.evictable == slots.cache.size


def record_rounds(eng) -> list[list[int]]:
    """Each round's verified draft lengths, request by request."""
    rounds, real = [], eng.speculator.decode_round

    def decode_round(reqs, draft_lengths=None, lookup=None):
        results = real(reqs, draft_lengths, lookup)
        rounds.append([x.proposed for x in results])
        return results

    eng.speculator.decode_round = decode_round
    return rounds

# chi-square critical values at alpha = 0.001 by degrees of freedom
CHI2_CRIT = {3: 16.266, 7: 24.322}


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def second_token_case(root: Path) -> tuple[Path, Path, list[int], torch.Tensor, torch.Tensor]:
    """A tiny target and a different draft over 8 tokens, a prompt, and the exact marginal of the
    second sampled token under each, from transformers' full forward passes."""
    from transformers import AutoModelForCausalLM

    shape = dict(vocab_size=8, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1)
    target = write_tiny_model(root / "t", seed=0, weight_scale=4.0, num_hidden_layers=2, **shape)
    draft = write_tiny_model(root / "d", seed=5, weight_scale=4.0, num_hidden_layers=1, **shape)
    prompt = [1, 2, 3]

    def marginal(path: Path) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        with torch.no_grad():
            q1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
            seqs = torch.tensor([prompt + [t] for t in range(8)])
            q2 = torch.softmax(model(seqs).logits[:, -1], -1)  # [t1, t2]
        return (q1[:, None] * q2).sum(0).double()

    return target, draft, prompt, marginal(target), marginal(draft)


def second_token_counts(eng: Engine, prompt: list[int], n: int = 3000) -> torch.Tensor:
    """How often each token came second in ``n`` seeded samples of two tokens at temperature 1."""
    reqs = [Request(prompt, SamplingParams(max_tokens=2, temperature=1.0, seed=i, ignore_eos=True)) for i in range(n)]
    run_all(eng, reqs)
    assert [r.error for r in reqs if r.error] == [] and {len(r.output_ids) for r in reqs} == {2}
    counts = torch.zeros(8, dtype=torch.float64)
    for r in reqs:
        counts[r.output_ids[1]] += 1
    return counts
