"""A long prompt prefilled in chunks: the EAGLE head's (and the NextN layer's) catch-up is chunked
too, no head pass exceeds chunkedPrefillSize tokens, and the output and the drafts are those of
an engine that never chunks."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from specdecode_worker.engine.speculation import head_passes  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402

from devtools.eagle_heads import write_eagle3_head  # noqa: E402
from tests.engine_helpers import engine, run_all  # noqa: E402
from devtools.tiny_models import write_tiny_model  # noqa: E402

VOCAB, CHUNK = 16, 16


def _head_passes(monkeypatch) -> list[int]:
    """Tokens of every head pass that reads target features (the catch-up and the round's extend)."""
    seen, real = [], head_passes.HeadPasses.run_draft

    def draft(self, fb, backend, hidden, from_target, rows):
        if from_target:
            seen.append(int(fb.input_ids.numel()))
        return real(self, fb, backend, hidden, from_target, rows)

    monkeypatch.setattr(head_passes.HeadPasses, "run_draft", draft)
    return seen


def _run(target, algorithm, draft, chunk, monkeypatch, prompts, **kw):
    with monkeypatch.context() as m:
        passes = _head_passes(m)
        eng = engine(target, algorithm, draft, chunked_prefill_size=chunk, context_len=256, **kw)
        reqs = run_all(eng, [Request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts])
    return [r.output_ids for r in reqs], eng.stats, passes


def _compare(target, algorithm, draft, monkeypatch, prompts, **kw):
    whole, whole_stats, whole_passes = _run(target, algorithm, draft, 0, monkeypatch, prompts, **kw)
    chunked, stats, passes = _run(target, algorithm, draft, CHUNK, monkeypatch, prompts, **kw)
    assert max(whole_passes) > CHUNK  # unchunked, the first extend reads the whole prompt at once
    assert max(passes) <= CHUNK
    assert chunked == whole
    # The head drafted the same tokens: same acceptance, round by round.
    assert stats.accept_lengths == whole_stats.accept_lengths and stats.proposed_tokens > 0


def test_eagle3_catch_up_is_chunked_and_changes_nothing(tmp_path, monkeypatch):
    target = write_tiny_model(tmp_path / "t", "llama", seed=0, weight_scale=3.0, vocab_size=VOCAB,
                              num_hidden_layers=4)
    head = write_eagle3_head(tmp_path / "h", target, draft_vocab=12, seed=3)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (70, 9, 41)]
    _compare(target, "EAGLE3", head, monkeypatch, prompts, num_draft_tokens=3)


def test_mtp_catch_up_is_chunked_and_changes_nothing(tmp_path, monkeypatch):
    if not hasattr(transformers, "DeepseekV3ForCausalLM"):
        pytest.skip("this transformers has no DeepseekV3ForCausalLM")
    from devtools.deepseek_models import write_tiny_deepseek

    model = write_tiny_deepseek(tmp_path / "ds", mtp=True)
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 100) for _ in range(n)] for n in (60, 7)]
    _compare(model, "MTP", None, monkeypatch, prompts, num_draft_tokens=2)
