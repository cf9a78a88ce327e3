"""What the pipe between the front end and the engine process costs, and what the front end takes.

Two measurements:

- **per message**: the engine process's ``updates`` message (a step's new tokens, for 1 or 8
  requests, with and without top-5 logprobs), sent from a child process over the same
  ``multiprocessing`` pipe as ``serving/engine_process.py`` and received by a thread, as the front
  end's reader receives them. Microseconds per message, sender and receiver overlapping.
- **the front end's share**: a real ``serve`` of SmolLM2-135M-Instruct (bf16, no speculation) at 8
  concurrent requests of 64 tokens: tokens/s, and each process's CPU seconds per wall second
  from ``/proc``. The same with ``SPECDECODE_ENGINE_PROCESS=0`` (one process) for reference,
  alternating, 5 repeats of a fresh server each.

    .venv/bin/python benchmarks/engine_pipe.py
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "worker"), str(ROOT / "benchmarks")]

MESSAGES = 20_000
REPEATS = 5


def _send(conn, message, count: int) -> None:
    conn.send("ready")  # started and imported: the timing begins here
    for _ in range(count):
        conn.send(message)
    conn.send(None)


def per_message_us(message) -> float:
    """Microseconds per message from a child process to a reader thread here."""
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    child = context.Process(target=_send, args=(theirs, message, MESSAGES))
    received = []

    def read():
        while ours.recv() is not None:
            received.append(1)

    child.start()
    assert ours.recv() == "ready"
    reader = threading.Thread(target=read)
    begin = time.perf_counter()
    reader.start()
    reader.join()
    seconds = time.perf_counter() - begin
    child.join()
    assert len(received) == MESSAGES
    return seconds / MESSAGES * 1e6


def process_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def front_end_share(in_own_process: bool) -> tuple[float, dict[str, float]]:
    import vs_vllm_cpu as bench

    from devtools.smollm2 import smollm2_dir

    os.environ["SPECDECODE_ENGINE_PROCESS"] = "1" if in_own_process else "0"
    config = bench.configs(1)[0]  # no speculation
    port = bench.free_port()
    server = bench.start(bench.command("ours", config, Path(smollm2_dir()), port, ""), port,
                         Path("/tmp/engine_pipe_serve.log"))
    try:
        pid = server.proc.pid
        engines = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
                   if "resource_tracker" not in Path(f"/proc/{c}/cmdline").read_text()]
        named = {"front end": pid, **({"engine process": engines[0]} if engines else {})}
        bench.tokens_per_second(server.base, 8)  # warm
        before = {name: process_cpu(p) for name, p in named.items()}
        begin = time.perf_counter()
        rates = [bench.tokens_per_second(server.base, 8) for _ in range(3)]
        wall = time.perf_counter() - begin
        share = {name: (process_cpu(p) - before[name]) / wall for name, p in named.items()}
        return sorted(rates)[1], share
    finally:
        bench.stop(server)


def main() -> None:
    from specdecode_worker.engine.request import TokenLogprob

    def step(requests: int, tokens: int, logprobs=None) -> tuple:  # distinct objects: pickle memoizes repeats
        return "updates", [("tokens", rid, list(range(rid, rid + tokens)),
                            [logprobs(rid)] * tokens if logprobs else [], []) for rid in range(requests)]

    cases = {
        "a step's updates, 1 request, 1 token": step(1, 1),
        "a step's updates, 8 requests, 1 token each": step(8, 1),
        "a step's updates, 8 requests, 4 tokens each (speculative)": step(8, 4),
        "a step's updates, 8 requests, 1 token with top-5 logprobs each":
            step(8, 1, lambda rid: (rid, -0.5, tuple((t, -1.5 - t) for t in range(rid, rid + 5)))),
        "the same logprobs as TokenLogprob dataclasses (not sent so)":
            step(8, 1, lambda rid: TokenLogprob(rid, -0.5, tuple((t, -1.5 - t) for t in range(rid, rid + 5)))),
    }
    print("| message | us per message |\n|---|---|")
    for name, message in cases.items():
        print(f"| {name} | {per_message_us(message):.1f} |")
    rates: dict[bool, list[float]] = {True: [], False: []}
    shares: dict[bool, dict[str, float]] = {}
    for _ in range(REPEATS):  # alternating: this machine's speed drifts between minutes
        for own in (True, False):
            rate, shares[own] = front_end_share(own)
            rates[own].append(rate)
    print(f"\n| engine | tokens/s, 8 requests, median (range) of {REPEATS} | CPUs busy (last repeat): front end "
          "| engine process |\n|---|---|---|---|")
    for own in (True, False):
        r = sorted(rates[own])
        print(f"| {'own process' if own else 'one process (SPECDECODE_ENGINE_PROCESS=0)'} | "
              f"{r[len(r) // 2]:.1f} ({r[0]:.1f}-{r[-1]:.1f}) | {shares[own]['front end']:.2f} | "
              f"{shares[own].get('engine process', 0.0):.2f} |")

if __name__ == "__main__":
    main()
