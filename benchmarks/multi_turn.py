"""A multi-turn chat workload for the prefix-cache benchmarks (CPU and GPU): conversations that run
concurrently, each sending its next turn as soon as its last answer is complete, the next prompt
being the last prompt, the answer and a new user message, token for token."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from specdecode_worker.engine.request import Request, SamplingParams


@dataclass
class Turn:
    conversation: int
    index: int
    request: Request
    submitted: float
    first_token: float | None = None


@dataclass
class Result:
    name: str
    outputs: dict[tuple[int, int], list[int]] = field(default_factory=dict)
    ttft: dict[tuple[int, int], float] = field(default_factory=dict)
    seconds: float = 0.0
    generated: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    proposed: int = 0
    accepted: int = 0

    def summary(self) -> dict:
        first = [t for (_, i), t in self.ttft.items() if i == 0]
        later = [t for (_, i), t in self.ttft.items() if i > 0]
        return {
            "config": self.name, "ttft_first_turn_s": statistics.mean(first),
            "ttft_later_turns_s": statistics.mean(later), "tokens_per_s": self.generated / self.seconds,
            "hit_rate": self.cached_tokens / self.prompt_tokens,
            "acceptance": self.accepted / self.proposed if self.proposed else None,
            "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens, "generated": self.generated,
            "seconds": self.seconds,
        }


def serve(eng, name: str, firsts: list[list[int]], follow_ups: list[list[list[int]]], max_tokens: int,
          eos: int | None, sync=lambda: None) -> Result:
    """Run every conversation to its end; a turn is submitted as soon as the conversation's last
    one ends, its prompt the last prompt, the answer (closed by ``eos``, when given) and the next
    follow-up."""
    result = Result(name)
    params = SamplingParams(max_tokens=max_tokens)
    ready: list[tuple[int, int, list[int]]] = [(c, 0, p) for c, p in enumerate(firsts)]
    live: list[Turn] = []
    start = time.perf_counter()
    while ready or live:
        for c, i, prompt in ready:
            turn = Turn(c, i, Request(prompt, params), time.perf_counter())
            turn.request.on_update = lambda r, new, t=turn: _first(t, new)
            eng.submit(turn.request)
            live.append(turn)
        ready = []
        eng.step()
        for turn in [t for t in live if t.request.done.is_set()]:
            live.remove(turn)
            r = turn.request
            assert r.error is None, r.error
            key = (turn.conversation, turn.index)
            result.outputs[key], result.ttft[key] = r.output_ids, turn.first_token - turn.submitted
            result.prompt_tokens += len(r.prompt_ids)
            result.cached_tokens += r.cached_tokens
            if turn.index + 1 <= len(follow_ups[turn.conversation]):
                answer = r.output_ids if eos is None or r.output_ids[-1:] == [eos] else r.output_ids + [eos]
                ready.append((turn.conversation, turn.index + 1,
                              r.prompt_ids + answer + follow_ups[turn.conversation][turn.index]))
    sync()
    result.seconds = time.perf_counter() - start
    result.generated = sum(len(o) for o in result.outputs.values())
    result.proposed, result.accepted = eng.stats.proposed_tokens, eng.stats.accepted_tokens
    return result


def _first(turn: Turn, new: list[int] | None) -> None:
    if new and turn.first_token is None:
        turn.first_token = time.perf_counter()


def random_workload(vocab: int, conversations: int, turns: int, system: int, user: int, seed: int = 0
                    ) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Random token ids (for random-weight models): one shared system prompt of ``system`` tokens,
    then per conversation a first user message and ``turns - 1`` follow-ups of ``user`` tokens."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(10, vocab - 10, (n,), generator=g).tolist()

    shared = ids(system)
    return ([shared + ids(user) for _ in range(conversations)],
            [[ids(user) for _ in range(turns - 1)] for _ in range(conversations)])
