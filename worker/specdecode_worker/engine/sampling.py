"""Token distributions and speculative verification.

Greedy verification accepts the longest prefix of proposals that equals the target's argmax.
Sampling uses speculative rejection sampling (Leviathan et al., Chen et al.): proposal d drawn
from the draft's p is kept with probability min(1, q(d) / p(d)); on the first rejection the token
is drawn from norm(max(q - p, 0)); after k acceptances a bonus token is drawn from q. The output
then follows q exactly. A deterministic proposal (n-gram lookup) is the point mass p = onehot(d).
"""

from __future__ import annotations

import torch

from .request import SamplingParams


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution sampling draws from: temperature, then top-k, then top-p. Rows of [n, V]."""
    logits = logits.float() / max(params.temperature, 1e-5)
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p
        sorted_p = sorted_p.masked_fill(before >= params.top_p, 0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    # Per-request generators live on the CPU, so draws are reproducible on any device.
    return int(torch.multinomial(probs.float().cpu(), 1, generator=generator))


def choose(logits_row: torch.Tensor, params: SamplingParams, generator) -> tuple[int, torch.Tensor | None]:
    """One token from one logits row; also returns its distribution (None for greedy)."""
    if params.greedy:
        return int(torch.argmax(logits_row)), None
    probs = probs_from_logits(logits_row[None], params)[0]
    return sample(probs, generator), probs


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
    if params.greedy:
        best = torch.argmax(target_logits, dim=-1).tolist()
        n = 0
        while n < len(proposals) and proposals[n] == best[n]:
            n += 1
        return n, best[n]
    q = probs_from_logits(target_logits, params)
    for i, d in enumerate(proposals):
        p = draft_probs[i] if draft_probs is not None else None
        p_d = 1.0 if p is None else float(p[d])
        q_d = float(q[i, d])
        u = float(torch.rand((), generator=generator))
        if p_d > 0 and u < min(1.0, q_d / p_d):
            continue
        if p is None:
            residual = q[i].clone()
            residual[d] = 0
        else:
            residual = torch.clamp(q[i] - p, min=0)
        total = float(residual.sum())
        if total <= 0:  # q <= p everywhere means rejection had probability 0; keep q
            residual, total = q[i], 1.0
        return i, sample(residual / total, generator)
    return len(proposals), sample(q[len(proposals)], generator)
