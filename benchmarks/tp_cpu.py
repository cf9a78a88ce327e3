"""Tensor parallelism on CPU (gloo): time to first token and decode tokens/s, t=1 against t=2.

A random Llama-shaped model (no trained weights are needed for speed) is written once into a
cache folder, then served with the engine's tensor-parallel path: one process per rank, rank 0
schedules, followers replay its forward passes, all-reduce and all-gather over gloo.

What 2 CPU cores can show: each rank gets its own core and one intra-op thread, so t=2 splits
every matmul over two cores at the price of two all-reduces per layer plus a logits all-gather
through loopback TCP. The fair single-rank comparisons are t=1 with 1 thread (same per-rank
compute) and t=1 with 2 threads (the same cores, shared by intra-op threads instead of ranks).
Greedy outputs of every configuration are checked identical. On a shared or busy machine the
numbers move; the medians of ``--repeats`` runs are reported.

Run:  python benchmarks/tp_cpu.py [--hidden 1024 --layers 8 --prompt-tokens 256 --new-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdecode_worker.engine.parallel.distributed import launch  # noqa: E402
from specdecode_worker.engine.request import Request, SamplingParams  # noqa: E402
from specdecode_worker.engine.engine import EngineArgs  # noqa: E402


def model_dir(cache: Path, hidden: int, layers: int, heads: int, kv_heads: int, vocab: int) -> Path:
    from devtools.tiny_models import write_tiny_model

    out = cache / f"llama-h{hidden}-l{layers}-a{heads}-kv{kv_heads}-v{vocab}"
    if not (out / "model.safetensors").exists():
        write_tiny_model(out, "llama", seed=0, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         vocab_size=vocab, max_position_embeddings=4096)
    return out


def _timed(eng, prompt: list[int], new_tokens: int) -> tuple[list[int], float, float]:
    """(output, seconds to the first token, decode tokens per second after it)."""
    stamps: list[float] = []
    req = Request(prompt, SamplingParams(max_tokens=new_tokens, ignore_eos=True),
                  on_update=lambda r, toks: toks and stamps.extend([time.perf_counter()] * len(toks)))
    start = time.perf_counter()
    eng.submit(req)
    while not req.done.is_set():
        eng.step()
    ttft = stamps[0] - start
    decode = (len(stamps) - 1) / (stamps[-1] - stamps[0]) if len(stamps) > 1 else float("nan")
    return req.output_ids, ttft, decode


def _bench_rank(kw: dict, threads: int, prompt: list[int], new_tokens: int, repeats: int):
    from specdecode_worker.engine.parallel.tp_engine import run_rank

    torch.set_num_threads(threads)

    def lead(eng):
        _timed(eng, prompt[:16], 4)  # warm-up
        runs = [_timed(eng, prompt, new_tokens) for _ in range(repeats)]
        return {"output": runs[0][0], "ttft_s": statistics.median(r[1] for r in runs),
                "decode_tok_s": statistics.median(r[2] for r in runs)}

    return run_rank(EngineArgs(**kw), lead)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cache", default=str(Path.home() / ".cache" / "specdecode" / "bench"))
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)

    mdir = model_dir(Path(args.cache), args.hidden, args.layers, args.heads, args.kv_heads, args.vocab)
    kw = dict(target=str(mdir), algorithm="NONE", device_memory_bytes=8 << 30, runtime_bytes=0,
              context_len=args.prompt_tokens + args.new_tokens + 8, max_total_tokens=4096, max_running_requests=2)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(10, args.vocab, (args.prompt_tokens,), generator=gen).tolist()
    size_mb = (mdir / "model.safetensors").stat().st_size / 1e6
    print(f"model: {mdir.name} ({size_mb:.0f} MB float32), prompt {args.prompt_tokens} tokens, "
          f"{args.new_tokens} new tokens, median of {args.repeats}")
    rows = []
    for tp, threads in ((1, 1), (1, 2), (2, 1)):
        start = time.perf_counter()
        res = launch(tp, _bench_rank, (kw, threads, prompt, args.new_tokens, args.repeats), wall_timeout_s=1800)[0]
        res.update(tp=tp, threads_per_rank=threads, wall_s=time.perf_counter() - start)
        rows.append(res)
        print(f"t={tp} threads/rank={threads}: TTFT {res['ttft_s'] * 1000:.0f} ms, "
              f"decode {res['decode_tok_s']:.1f} tok/s "
              f"(run incl. start-up {res['wall_s']:.0f} s)", flush=True)
    same = all(r["output"] == rows[0]["output"] for r in rows)
    print(f"greedy outputs identical across configurations: {same}")
    if args.json:
        Path(args.json).write_text(json.dumps([{k: v for k, v in r.items() if k != "output"} for r in rows], indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
