"""What both kinds of speculator run alike around their drafting: the prompt's logprobs and first
token after a prefill, a round's slots and rows reserved in one copy, and a chain's verify pass
laid out, sampled and accepted, with the emitted tokens' log-probabilities.
"""

from __future__ import annotations

import torch

from ..batch import PaddedChains, Segment
from ..sampler import (chain_rows, choose_tokens, ruled_chain, ruled_next, to_host, token_logprobs, uniforms,
                      verify_chains)
from ..cuda_graph import chain_graph_width
from ..forward_batch import to_device
from ..request import Request, TokenLogprob
from .rounds import RoundResult, RoundRows


def wants_prompt_rows(reqs: list[Request]) -> bool:
    """Whether a prefill must keep every row: a request asked for its prompt's logprobs and has
    prompt positions left to score (a recompute after a retraction has none)."""
    return any(r.params.prompt_logprobs is not None and len(r.prompt_token_logprobs) < len(r.prompt_ids) - 1
               and r.kv_len < len(r.prompt_ids) - 1 for r in reqs)


def record_prompt_logprobs(reqs: list[Request], segments: list[Segment], logits: torch.Tensor) -> torch.Tensor:
    """``logits``: every row of a prefill chunk. Records the prompt tokens' logprobs each request
    asked for (the row at position p scores prompt token p + 1) and returns each segment's last row."""
    starts = [sum(len(s.tokens) for s in segments[:i]) for i in range(len(segments))]
    asking, rows, tokens = [], [], []
    for r, s, first in zip(reqs, segments, starts):
        if r.params.prompt_logprobs is None:
            continue
        begin, end = max(s.start, len(r.prompt_token_logprobs)), min(s.start + len(s.tokens), len(r.prompt_ids) - 1)
        if begin < end:
            asking.append(r)
            rows.append([first + p - s.start for p in range(begin, end)])
            tokens.append(r.prompt_ids[begin + 1 : end + 1])
    for r, found in zip(asking, token_logprobs(logits, rows, tokens, [r.params.prompt_logprobs for r in asking])):
        r.prompt_token_logprobs.extend(found)
    last = [first + len(s.tokens) - 1 for s, first in zip(segments, starts)]
    return logits.index_select(0, to_device(last, logits.device))


def first_tokens(reqs: list[Request], ends: list[int], logits: torch.Tensor) -> list[RoundResult | None]:
    """Sample, in one batch and one transfer, the first token of each request whose chunk (up to
    ``ends[i]``; ``logits``: its last row) ends a fresh prompt (the scheduler then moves every
    request's ``kv_len`` to its chunk's end)."""
    # chunks that end a prompt (a recompute samples nothing)
    fresh = [i for i, (r, end) in enumerate(zip(reqs, ends)) if end >= len(r.prefill_ids) and not r.output_ids]
    out: list[RoundResult | None] = [None] * len(reqs)
    if fresh:
        picked = [reqs[i] for i in fresh]
        for i, result in zip(fresh, sample_next(picked, logits, fresh, [ends[i] for i in fresh])):
            out[i] = result
    return out


def sample_next(reqs: list[Request], logits: torch.Tensor, rows: list[int], kv_lens: list[int]
                ) -> list[RoundResult]:
    """One token per request from its row ``rows[i]`` of ``logits``, under its output rules and
    sampler, with its log-probability where asked for, read back once: a prompt's first token, or
    a step where nobody drafts (what a verify pass draws after no proposal). ``kv_lens``: each
    request's target cache length after the pass (its result's ``kv_len``)."""
    every = rows == list(range(logits.shape[0]))
    picked = logits if every else logits.index_select(0, to_device(rows, logits.device))
    tokens, _ = choose_tokens(ruled_next(reqs, picked), [r.params for r in reqs],
                              first_uniforms(reqs, 1, logits.device))
    tokens = to_host(tokens)[0]
    logprobs = emitted_logprobs(reqs, logits, [[i] for i in rows], [[t] for t in tokens])
    return [RoundResult([t], proposed=0, accepted=0, kv_len=n, logprobs=lp)
            for t, lp, n in zip(tokens, logprobs, kv_lens)]


def first_uniforms(reqs: list[Request], counts, device) -> torch.Tensor | None:
    """Uniforms for a sampling pass over ``reqs``, ``[B]`` for one draw each."""
    u = uniforms([r.params for r in reqs], [r.generator for r in reqs], counts, device)
    return None if u is None else u[:, 0]


def reserve_round(slots, reqs: list[Request], widths: list[int], ks: list[int], *also: list[int]
                  ) -> tuple[RoundRows, list[torch.Tensor]]:
    """Slots for positions L .. L + widths[i] - 1 of each request (``KVSlots``), its ``RoundRows``
    for draft lengths ``ks``, and the host lists ``also``, all in one copy to the device."""
    last, req_idx, kv, lengths, *rest = slots.reserve(
        [(r.req_idx, r.kv_len, r.kv_len + w) for r, w in zip(reqs, widths)],
        also=([r.all_ids[-1] for r in reqs], [r.req_idx for r in reqs], [r.kv_len for r in reqs],
              [k + 1 for k in ks], *also))
    return RoundRows(last, req_idx, kv, lengths), rest


def verify_width(graphs, ks: list[int]) -> int:
    """Rows per request of a chain verify pass laid out on the device (``batch.chain_batch``): the
    verify graphs' width (``chain_graph_width``), else every chain's length when they are all one
    length (no padding), else 0: the ragged batch."""
    return chain_graph_width(graphs, len(ks), max(ks, default=0)) or (ks[0] + 1 if len(set(ks)) == 1 else 0)


def chain_segments(reqs: list[Request], ks: list[int]) -> list[Segment]:
    """A ragged verify batch: request i's last token and ``ks[i]`` proposals (ids set on the device)."""
    return [Segment(r.req_idx, [0] * (k + 1), r.kv_len) for r, k in zip(reqs, ks)]


def ragged_ids(chains: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """The first ``ks[i] + 1`` tokens of each row of ``chains``, concatenated."""
    width = chains.shape[1]
    flat = [i * width + j for i, k in enumerate(ks) for j in range(k + 1)]
    return chains.reshape(-1).index_select(0, to_device(flat, chains.device))


def accept_chains(reqs: list[Request], draft: torch.Tensor, draft_probs: torch.Tensor | None,
                  logits: torch.Tensor, ks: list[int], padded: PaddedChains | None = None
                  ) -> tuple[list[int], list[int], list[list[int]], list[list[TokenLogprob] | None]]:
    """Verify every request's chain on the device and read the results back once: accepted counts,
    next tokens, the proposals, and the emitted tokens' log-probabilities where asked for.
    ``logits``: the verify pass's rows, ``ks[i] + 1`` per request, or ``padded.width`` per request
    (its first ``ks[i] + 1`` real) for a padded batch."""
    width = max(ks, default=0)
    draft = draft[:, :width]
    draft_probs = None if draft_probs is None else draft_probs[:, :width]
    if padded is None:
        rows = to_device(chain_rows(ks), logits.device)
        target = logits.index_select(0, rows).view(len(reqs), width + 1, -1)
        lengths = ks
    else:  # rows already laid out per request; the lengths are on the device with the batch
        target = logits.view(len(reqs), padded.width, -1)[:, : width + 1]
        lengths = padded.lengths - 1
    target = ruled_chain(reqs, target, draft, ks)  # a ruled copy: logprobs read the raw rows
    params = [r.params for r in reqs]
    u = uniforms(params, [r.generator for r in reqs], [k + 1 for k in ks], logits.device)
    n, nxt = verify_chains(draft, draft_probs, target, lengths, params, u)
    n, nxt, drafted = to_host(n, nxt, draft)
    widths = [padded.width] * len(reqs) if padded else [k + 1 for k in ks]
    starts = [sum(widths[:i]) for i in range(len(reqs))]  # each request's first row in ``logits``
    logprobs = emitted_logprobs(reqs, logits, [range(s, s + a + 1) for s, a in zip(starts, n)],
                                [d[:a] + [t] for d, a, t in zip(drafted, n, nxt)])
    return n, nxt, drafted, logprobs


def emitted_logprobs(reqs: list[Request], logits: torch.Tensor, rows: list, tokens: list[list[int]]
                     ) -> list[list[TokenLogprob] | None]:
    """Per request, its emitted ``tokens``' log-probabilities under its verifying ``rows`` of
    ``logits``, or None where it did not ask (nothing is computed when none did)."""
    asking = [i for i, r in enumerate(reqs) if r.params.logprobs is not None]
    out: list[list[TokenLogprob] | None] = [None] * len(reqs)
    if asking:
        found = token_logprobs(logits, [list(rows[i]) for i in asking], [tokens[i] for i in asking],
                               [reqs[i].params.logprobs for i in asking])
        for i, lp in zip(asking, found):
            out[i] = lp
    return out
