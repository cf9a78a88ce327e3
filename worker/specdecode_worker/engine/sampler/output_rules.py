"""The rules a request sets on its output (logit bias, penalties, a minimum length, a grammar),
applied to the target's rows.

A row scores the token after the committed output and, in a verify pass, after the round's
proposals before it; each rule reads that prefix. Only the target's rows are ruled, so the tokens a
round emits are the ones the target alone would emit under the same rules; a draft proposes
unruled, which can lower acceptance but not change the output (rejection sampling reads the
distribution each proposal was drawn from). The raw rows stay untouched for logprobs.

A grammar needs the proposals on the host: a round that holds a request with a grammar reads its
proposals back once before verifying.
"""

from __future__ import annotations

import torch

from .penalties import chain_extra, penalise, penalised, tree_extra
from ..request import Request


def ruled(r: Request) -> bool:
    p = r.params
    return r.grammar is not None or penalised(p) or bool(p.logit_bias) or p.min_tokens > 0


def _bias_and_floor(scores: torch.Tensor, r: Request, lengths: torch.Tensor) -> torch.Tensor:
    """``scores``: ``[m, V]``; ``lengths``: ``[m]``, the output length each row extends. Adds the
    logit bias, and bars EOS from rows before ``min_tokens``."""
    p = r.params
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], device=scores.device)
        scores = scores.float().index_add(1, ids, torch.tensor([float(b) for _, b in p.logit_bias],
                                                                device=scores.device).expand(len(scores), -1))
    if p.min_tokens and r.eos_token_ids:
        early = (lengths.to(scores.device) < p.min_tokens)[:, None]
        eos = torch.zeros(scores.shape[-1], dtype=torch.bool, device=scores.device)
        eos[[t for t in r.eos_token_ids if t < scores.shape[-1]]] = True
        scores = scores.masked_fill(early & eos[None], float("-inf"))
    return scores


def ruled_next(reqs: list[Request], rows: torch.Tensor) -> torch.Tensor:
    """``rows``: ``[B, V]``, request i's row after its committed output."""
    if not any(ruled(r) for r in reqs):
        return rows
    out = rows.clone()
    for i, r in enumerate(reqs):
        out[i] = _bias_and_floor(rows[i: i + 1], r, torch.tensor([len(r.output_ids)]))[0]
        if penalised(r.params):
            out[i] = penalise(out[i: i + 1], r)[0]
        if r.grammar is not None:
            out[i] = _masked(out[i: i + 1], r.grammar.mask()[None])[0]
    return out


def ruled_chain(reqs: list[Request], target: torch.Tensor, draft: torch.Tensor, ks: list[int]) -> torch.Tensor:
    """``target``: ``[B, W + 1, V]``, request i's first ``ks[i] + 1`` rows verifying its chain
    ``draft[i, :ks[i]]``."""
    if not any(ruled(r) for r in reqs):
        return target
    out = target.clone()
    drafted = draft.tolist() if any(r.grammar is not None for r in reqs) else None
    for i, r in enumerate(reqs):
        out[i] = _bias_and_floor(target[i], r, len(r.output_ids) + torch.arange(target.shape[1]))
        if penalised(r.params):
            out[i] = penalise(out[i], r, chain_extra(draft[i], target.shape[-1]))
        if r.grammar is not None:
            rows = ks[i] + 1
            out[i, :rows] = _masked(out[i, :rows], r.grammar.masks_along(drafted[i][: ks[i]]))
    return out


def ruled_tree(reqs: list[Request], logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
              ancestors: torch.Tensor) -> torch.Tensor:
    """``logits``: ``[B x n, V]``, request i's rows for its tree's n nodes (``tokens``,
    ``parents``, ``ancestors``: ``[B, n]``, ``[B, n]``, ``[B, n, n]``); node x's row scores the
    token after the path from the root to x."""
    if not any(ruled(r) for r in reqs):
        return logits
    n = tokens.shape[1]
    out = logits.clone()
    host = (tokens.tolist(), parents.tolist()) if any(r.grammar is not None for r in reqs) else None
    for i, r in enumerate(reqs):
        rows = slice(i * n, (i + 1) * n)
        depths = ancestors[i].sum(-1) - 1  # a node sees itself and the root among its ancestors
        out[rows] = _bias_and_floor(logits[rows], r, len(r.output_ids) + depths)
        if penalised(r.params):
            out[rows] = penalise(out[rows], r, tree_extra(tokens[i], ancestors[i], logits.shape[-1]))
        if r.grammar is not None:
            out[rows] = _masked(out[rows], r.grammar.tree_masks(host[0][i], host[1][i]))
    return out


def _masked(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    return scores.masked_fill(~allowed.to(scores.device), float("-inf"))


class DraftGrammars:
    """A draft's logits masked to each request's grammar while its chain is drafted: a copy of the
    request's matcher follows the proposals, so a draft proposes only tokens that verification
    can accept (exactness needs none of this; acceptance does: an unmasked draft proposes what the
    grammar forbids wherever it binds). Rounds that hold a request with a grammar read each draft
    step's tokens back to the host."""

    def __init__(self, reqs: list[Request]):
        self.grammars = {i: r.grammar for i, r in enumerate(reqs) if r.grammar is not None}
        self.cursors = {i: g.matcher.deep_copy() for i, g in self.grammars.items()}

    def masked(self, logits: torch.Tensor, rows_of: list[int]) -> torch.Tensor:
        """``logits``: one row per request ``rows_of[j]``; rows of requests with a grammar masked."""
        if not self.cursors:
            return logits
        out = logits.clone()
        for j, i in enumerate(rows_of):
            if i in self.cursors:
                allowed = self.grammars[i].mask_after(self.cursors[i])
                width = min(allowed.numel(), out.shape[-1])
                keep = torch.zeros(out.shape[-1], dtype=torch.bool)
                keep[:width] = allowed[:width]
                out[j] = _masked(out[j: j + 1], keep[None])[0]
        return out

    def advance(self, tokens: torch.Tensor, rows_of: list[int]) -> None:
        """The tokens just drafted (one per row); a request whose grammar refuses its token (never,
        when its row was masked) is no longer followed."""
        if not self.cursors:
            return
        for t, i in zip(tokens.tolist(), rows_of):
            cursor = self.cursors.get(i)
            if cursor is not None and cursor.validate_tokens([t]) == 1:
                cursor.consume_tokens([t])
            elif cursor is not None:
                del self.cursors[i]
