"""A draft with a chosen acceptance rate that still pays for its own forward passes.

Random weights accept nothing, so a benchmark of random models cannot show what speculation gains.
``AcceptanceControl`` keeps every forward pass of the real draft (a 1B model, an EAGLE3 head) and
replaces only the token each draft step picks: the target's own greedy continuation (known from a
run without speculation on the same prompts), each token swapped for another with probability
``1 - rate``. The next draft step is fed the replaced token, as it would be fed its own pick, and
verification is untouched, so the output stays the target's greedy output whatever the rate.

With a per-token rate a and k proposals, a round accepts a + a^2 + ... + a^k tokens on average:
the rate is the chance that a draft token matches the target given the ones before it did.
"""

from __future__ import annotations

import random
import sys

from specdecode_worker.engine.forward_batch import to_device

# The method of each speculator that runs a round's draft steps (and picks one token per step
# through its module's ``choose_tokens``).
DRAFT_STEPS = {"StandaloneSpeculator": "_draft_propose", "HeadSpeculator": "_chain_round"}


class AcceptanceControl:
    """Installed on an engine's speculator: its draft steps propose ``continuations`` (the target's
    greedy output after each prompt), corrupted at rate ``1 - rate``; ``rate`` may change between runs."""

    def __init__(self, speculator, continuations: dict[tuple[int, ...], list[int]], vocab_size: int,
                 rate: float = 1.0, seed: int = 0):
        self.continuations, self.vocab_size, self.rate, self.seed = continuations, vocab_size, rate, seed
        method = DRAFT_STEPS[type(speculator).__name__]
        module = sys.modules[type(speculator).__module__]
        draft_steps, choose = getattr(speculator, method), module.choose_tokens

        def controlled(reqs, *args, **kwargs):
            by_params = {id(r.params): r for r in reqs}
            step = 0

            def pick(logits, params, u):
                nonlocal step
                tokens, probs = choose(logits, params, u)  # the draft's own pick, computed and dropped
                if probs is not None:
                    raise ValueError("a controlled draft proposes for greedy requests only")
                wanted = [self.token(by_params[id(p)], step) for p in params]
                step += 1
                return to_device(wanted, tokens.device, tokens.dtype), probs

            module.choose_tokens = pick
            try:
                return draft_steps(reqs, *args, **kwargs)
            finally:
                module.choose_tokens = choose

        setattr(speculator, method, controlled)

    def token(self, req, step: int) -> int:
        """Draft step ``step``'s proposal for ``req``: the target's token at that position, or,
        with probability ``1 - rate``, another one. The draw is the request's own (by its id, so
        every run draws anew, whatever its prompt), and the same each time the request's position
        is proposed again."""
        out = self.continuations.get(tuple(req.prompt_ids), [])
        at = len(req.output_ids) + step
        want = out[at] if at < len(out) else 0
        rng = random.Random(hash((self.seed, req.rid, at)))
        if rng.random() < self.rate:
            return want
        return (want + 1 + rng.randrange(self.vocab_size - 1)) % self.vocab_size
