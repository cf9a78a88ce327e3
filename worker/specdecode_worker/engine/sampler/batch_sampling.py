"""Sampling and chain acceptance for a whole batch, on the logits' device, one host transfer a pass.

Every decision is a torch op on the device that holds the logits: greedy argmax, temperature /
top-k / top-p, a draw by inverse CDF, and speculative rejection sampling for chains (proposal d
kept with probability min(1, q(d) / p(d)), the first rejection resampled from norm(max(q - p, 0)),
a bonus token from q after k acceptances). The random numbers are uniforms from each request's
own CPU generator, copied to the device with the batch, so a seed gives the same tokens on any
device and greedy requests draw nothing. ``to_host`` is the one place a pass's results are read
back; it counts its calls so tests can check that a step transfers once.

Memory stays bounded whatever the batch: greedy requests only take the argmax, and the requests
that sample run in blocks of whole requests (``sampled_blocks``) whose distributions, sorts and
cumulative sums fit the plan's per-block budget (``contract.sampling_block_rows``); requests without a
top-k or top-p cut form blocks of their own, so no row is sorted that needs no sort. Every op is
row by row, so a request's results do not depend on the block or the batch it runs in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ...contract import sampling_block_rows
from ..forward_batch import to_device
from ..request import SamplingParams


class HostTransfers:
    """The single device-to-host read of a pass's results: ints of several tensors, one copy."""

    def __init__(self):
        self.count = 0

    def __call__(self, *tensors: torch.Tensor) -> list[list]:
        self.count += 1
        flat = torch.cat([t.reshape(-1).to(torch.int64) for t in tensors]).cpu()  # the one sync
        out, start = [], 0
        for t in tensors:
            part = flat[start : start + t.numel()].reshape(t.shape)
            start += t.numel()
            out.append(part.tolist())
        return out


to_host = HostTransfers()


def uniforms(params: Sequence[SamplingParams], generators: Sequence, counts: int | Sequence[int],
             device) -> torch.Tensor | None:
    """``[B, max(counts)]`` uniforms in [0, 1): row i holds ``counts[i]`` draws from request i's
    generator, then zeros (greedy rows draw nothing), so what a request draws never depends on the
    batch it runs in. None when every row is greedy."""
    if all(p.greedy for p in params):
        return None
    counts = [counts] * len(params) if isinstance(counts, int) else list(counts)
    width = max(counts)
    rows = [torch.zeros(width) if p.greedy else torch.cat([torch.rand(c, generator=g), torch.zeros(width - c)])
            for p, g, c in zip(params, generators, counts)]
    stacked = torch.stack(rows)
    return stacked.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" \
        else stacked.to(device)


def batch_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Rows of ``[N, V]`` logits to the distributions row i samples from: its temperature, then its
    top-k, then its top-p (greedy rows come out at temperature 1e-5, never read)."""
    device, vocab = logits.device, logits.shape[-1]
    temps = to_device([max(p.temperature, 1e-5) for p in params], device)
    logits = logits.float() / temps[:, None]
    top_k = [p.top_k if p.top_k and p.top_k < vocab else 0 for p in params]
    if any(top_k):
        k = to_device([k or vocab for k in top_k], device)
        kth = torch.sort(logits, dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))  # ties with the k-th stay, as topk keeps them
    probs = torch.softmax(logits, dim=-1)
    if any(p.top_p < 1 for p in params):
        top_p = to_device([p.top_p for p in params], device)[:, None]
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p
        sorted_p = sorted_p.masked_fill((before >= top_p) & (top_p < 1), 0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        # only cut rows renormalise: an uncut row's result must not depend on its neighbours
        probs = probs / torch.where(top_p < 1, probs.sum(-1, keepdim=True), 1.0)
    return probs


def cuts(p: SamplingParams, vocab: int) -> bool:
    """Whether a request's distribution needs a sort: a top-k below the vocabulary, or a top-p."""
    return bool(p.top_k and p.top_k < vocab) or p.top_p < 1


def sampled_blocks(params: Sequence[SamplingParams], vocab: int, rows_per_request: int = 1) -> list[list[int]]:
    """The indices of the requests that sample, in blocks of whole requests each within the plan's
    sampling budget (``rows_per_request`` logit rows a request): first those without a top-k or
    top-p cut, then those with one. Greedy requests are in none."""
    per_block = sampling_block_rows(vocab, rows_per_request) // rows_per_request
    plain = [i for i, p in enumerate(params) if not p.greedy and not cuts(p, vocab)]
    cut = [i for i, p in enumerate(params) if not p.greedy and cuts(p, vocab)]
    return [group[s : s + per_block] for group in (plain, cut) for s in range(0, len(group), per_block)]


def block_index(block: list[int], device) -> slice | torch.Tensor:
    """Index of a block's rows: a slice (a view, nothing copied) when they are consecutive."""
    if block == list(range(block[0], block[-1] + 1)):
        return slice(block[0], block[-1] + 1)
    return to_device(block, device)


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """One token per row of (unnormalised) ``probs``: the first whose cumulative mass exceeds u x total."""
    cdf = probs.cumsum(-1)
    target = (u * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)


def choose_tokens(logits: torch.Tensor, params: Sequence[SamplingParams], u: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One token per row of ``[N, V]`` logits (device tensor), and the distributions sampled rows
    drew from (None when every row is greedy; greedy rows' are zeros). ``u``: one uniform per row,
    ``[N]``."""
    tokens = torch.argmax(logits, dim=-1)
    if u is None:
        return tokens, None
    probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    for block in sampled_blocks(params, logits.shape[-1]):
        at = block_index(block, logits.device)
        block_probs = batch_probs(logits[at], [params[i] for i in block])
        tokens[at] = draw(block_probs, u[at])
        probs[at] = block_probs
    return tokens, probs


def verify_chains(draft: torch.Tensor, draft_probs: torch.Tensor | None, target_logits: torch.Tensor,
                  lengths: Sequence[int] | torch.Tensor, params: Sequence[SamplingParams], u: torch.Tensor | None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept a prefix of each request's chain; returns (accepted counts ``[B]``, next tokens ``[B]``).

    ``draft``: ``[B, K]`` proposals, request i's first ``lengths[i]`` valid. ``target_logits``:
    ``[B, K + 1, V]``, row j scoring the token after proposal j - 1. ``draft_probs``: ``[B, K, V]``
    distributions the proposals were drawn from, None for point masses (n-gram lookup, greedy
    drafts). ``u``: ``[B, K + 1]`` uniforms, request i's ``lengths[i] + 1`` first (None when every
    request is greedy): one per proposal, then the one the next token is drawn with. ``lengths``
    may already be on the device (a padded verify batch's): nothing past a request's length is
    accepted or drawn from, whatever the rows beyond it hold.
    """
    batch, width = draft.shape
    device = draft.device
    lengths_t = lengths.to(device) if isinstance(lengths, torch.Tensor) else to_device(list(lengths), device)
    valid = torch.arange(width, device=device)[None] < lengths_t[:, None]
    best = torch.argmax(target_logits, dim=-1)  # [B, K + 1]
    n = ((draft == best[:, :width]) & valid).long().cumprod(1).sum(1)
    nxt = best.gather(1, n[:, None]).squeeze(1)
    if u is None:
        return n, nxt
    # a proposal's draft probability, for every request at once: [B, K], small
    p_d = None if draft_probs is None or not width else draft_probs.gather(2, draft[..., None]).squeeze(2)
    for block in sampled_blocks(params, target_logits.shape[-1], width + 1):
        at = block_index(block, device)
        requests = at if isinstance(at, torch.Tensor) else torch.arange(at.start, at.stop, device=device)
        n[at], nxt[at] = _accept_chains(draft[at], p_d if p_d is None else p_d[at], draft_probs, requests,
                                        target_logits[at], valid[at], lengths_t[at], [params[i] for i in block],
                                        u[at])
    return n, nxt


def _accept_chains(draft, p_d, draft_probs, requests, target_logits, valid, lengths, params, u):
    """``verify_chains``' rejection sampling for a block of sampling requests (``requests``: their
    rows in the batch's ``draft_probs``)."""
    batch, width = draft.shape
    vocab = target_logits.shape[-1]
    repeated = [p for p in params for _ in range(width + 1)]
    q = batch_probs(target_logits.reshape(batch * (width + 1), vocab), repeated).view(batch, width + 1, vocab)
    if width:
        q_d = q[:, :width].gather(2, draft[..., None]).squeeze(2)
        p_d = torch.ones_like(q_d) if p_d is None else p_d
        keep = (p_d > 0) & (u[:, :width] < torch.clamp(q_d / p_d, max=1.0)) & valid
        n = keep.long().cumprod(1).sum(1)
    else:
        n = torch.zeros(batch, dtype=torch.int64, device=draft.device)
    q_n = q.gather(1, n[:, None, None].expand(batch, 1, vocab)).squeeze(1)
    if width:
        at = n.clamp(max=width - 1)
        if draft_probs is None:  # a point mass at d: the residual is q without d
            residual = q_n.scatter(1, draft.gather(1, at[:, None]), 0.0)
        else:
            residual = torch.clamp(q_n - draft_probs[requests, at], min=0)
        rejected = n < lengths
        residual = torch.where(rejected[:, None], residual, q_n)
        # q <= p everywhere means rejection had probability 0; keep q
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, q_n)
    else:
        residual = q_n
    return n, draw(residual, u.gather(1, lengths[:, None]).squeeze(1))


def chain_rows(lengths: Sequence[int]) -> list[int]:
    """Flat row indices that lay out chains of ``lengths[i] + 1`` rows each as ``[B, K + 1]``
    (shorter chains repeat their last row; it is never read as a proposal's score)."""
    width, rows, start = max(lengths, default=0), [], 0
    for k in lengths:
        rows += [start + min(j, k) for j in range(width + 1)]
        start += k + 1
    return rows
