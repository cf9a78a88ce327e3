"""Presence, frequency and repetition penalties on the target's rows, by vLLM's definitions.

- repetition: a token seen in the prompt or the output so far has its logit divided by the
  penalty where positive, multiplied where negative (transformers' and vLLM's rule);
- frequency: minus the penalty times the token's count in the output so far;
- presence: minus the penalty once for a token the output holds.

A verify row scores the token after some of the round's proposals, so they count as output for
it (``chain_extra``, ``tree_extra``); ``output_rules`` applies the penalties to the target's rows.
"""

from __future__ import annotations

import torch

from ..forward_batch import to_device
from ..request import Request, SamplingParams


def penalised(params: SamplingParams) -> bool:
    return params.repetition_penalty != 1 or params.presence_penalty != 0 or params.frequency_penalty != 0


def penalise(scores: torch.Tensor, r: Request, extra: torch.Tensor | None = None) -> torch.Tensor:
    """``scores``: ``[m, V]`` rows of one request; ``extra``: ``[m, V]`` counts of tokens each row
    sees beyond the request's committed output (the round's proposals before it), or None.
    Returns the penalised rows (a new tensor)."""
    p = r.params
    vocab, device = scores.shape[-1], scores.device
    scores = scores.float()
    counts = _counts(r.output_ids, vocab, device)[None].expand_as(scores)
    if extra is not None:
        counts = counts + extra
    if p.repetition_penalty != 1:
        seen = (counts > 0) | (_counts(r.prompt_ids, vocab, device) > 0)[None]
        scaled = torch.where(scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty)
        scores = torch.where(seen, scaled, scores)
    return scores - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()


def chain_extra(draft: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[K + 1, V]``: row j counts proposals 1..j of the chain ``draft`` (``[K]``)."""
    seen = torch.nn.functional.one_hot(draft.long(), vocab).float().cumsum(0)
    return torch.cat([torch.zeros(1, vocab, device=draft.device), seen])


def tree_extra(tokens: torch.Tensor, ancestors: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[n, V]``: node x counts the tokens on its path from the root, itself included and the root
    (the last committed token, already output) excluded. ``tokens``: ``[n]``; ``ancestors``:
    ``[n, n]``, x sees y iff y is x or an ancestor."""
    hot = torch.nn.functional.one_hot(tokens[1:].long(), vocab).float()
    return ancestors[:, 1:].float() @ hot


def _counts(ids: list[int], vocab: int, device) -> torch.Tensor:
    if not ids:
        return torch.zeros(vocab, device=device)
    return torch.bincount(to_device(ids, device, torch.int64), minlength=vocab)[:vocab].float()
