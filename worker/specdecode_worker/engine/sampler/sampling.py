"""Token distributions and speculative verification.

Greedy verification accepts the longest prefix of proposals that equals the target's argmax.
Sampling uses speculative rejection sampling (Leviathan et al., Chen et al.): proposal d drawn
from the draft's p is kept with probability min(1, q(d) / p(d)); on the first rejection the token
is drawn from norm(max(q - p, 0)); after k acceptances a bonus token is drawn from q. The output
then follows q exactly. A deterministic proposal (n-gram lookup) is the point mass p = onehot(d).

The engine samples whole batches on the device (``batch_sampling``); these per-request forms are
that code at batch 1, for tree acceptance and for tests.
"""

from __future__ import annotations

import torch

from .batch_sampling import batch_probs, to_host, uniforms, verify_chains
from ..request import SamplingParams


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from: temperature, then top-k, then top-p. Rows of [n, V]."""
    return batch_probs(logits, [params] * logits.shape[0])


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    # Per-request generators live on the CPU, so draws are reproducible on any device.
    return int(torch.multinomial(probs.float().cpu(), 1, generator=generator))


def verify(
    proposals: list[int],
    draft_probs: list[torch.Tensor | None] | None,
    target_logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Accept a prefix of ``proposals``; returns (accepted count, next token).

    ``target_logits`` has ``len(proposals) + 1`` rows: row i scores the token after proposal i-1.
    ``draft_probs[i]`` is the draft distribution proposal i was drawn from, None for a point mass.
    """
    device = target_logits.device
    draft = torch.tensor([proposals], dtype=torch.int64, device=device).reshape(1, len(proposals))
    probs = None
    if draft_probs is not None and proposals and all(p is not None for p in draft_probs):
        probs = torch.stack([p.to(device).float() for p in draft_probs])[None]
    u = uniforms([params], [generator], len(proposals) + 1, device)
    n, nxt = verify_chains(draft, probs, target_logits[None], [len(proposals)], [params], u)
    n, nxt = to_host(n, nxt)
    return n[0], nxt[0]
