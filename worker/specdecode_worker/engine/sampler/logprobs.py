"""Log-probabilities of the emitted tokens, read from the target's own rows.

Every emitted token, a draft's accepted proposal or the target's own next token, was verified by
one target logit row: the row that predicts its position. Its log-probability is that row's
``log_softmax`` before temperature, top-k and top-p (vLLM's default, ``raw_logprobs``), so a
speculative round reports what the target alone would have reported for the same tokens.
"""

from __future__ import annotations

import torch

from ..forward_batch import to_device
from ..request import TokenLogprob


def token_logprobs(logits: torch.Tensor, rows: list[list[int]], tokens: list[list[int]], tops: list[int]
                   ) -> list[list[TokenLogprob]]:
    """Per request: ``tokens[i][j]``'s log-probability under ``logits[rows[i][j]]``, with the
    ``tops[i]`` most likely tokens of that row. One pass over the chosen rows, one host transfer."""
    flat_rows = [row for request in rows for row in request]
    if not flat_rows:
        return [[] for _ in rows]
    device = logits.device
    logp = torch.log_softmax(logits.index_select(0, to_device(flat_rows, device)).float(), dim=-1)
    chosen = logp.gather(1, to_device([t for request in tokens for t in request], device)[:, None]).squeeze(1)
    width = max(tops)
    top_values, top_ids = logp.topk(width, dim=-1) if width else (logp[:, :0], logp[:, :0].long())
    chosen, top_values, top_ids = _to_host(chosen, top_values, top_ids)
    out, at = [], 0
    for request_tokens, top in zip(tokens, tops):
        out.append([TokenLogprob(t, chosen[at + j], tuple(zip(top_ids[at + j][:top], top_values[at + j][:top])))
                    for j, t in enumerate(request_tokens)])
        at += len(request_tokens)
    return out


def _to_host(chosen: torch.Tensor, values: torch.Tensor, ids: torch.Tensor) -> tuple[list, list, list]:
    """One copy: float64 holds the log-probabilities and every token id exactly."""
    flat = torch.cat([chosen.double(), values.double().reshape(-1), ids.double().reshape(-1)]).cpu()
    rows, width = values.shape
    top_values = flat[rows: rows + rows * width].reshape(rows, width)
    top_ids = flat[rows + rows * width:].reshape(rows, width).long()
    return flat[:rows].tolist(), top_values.tolist(), top_ids.tolist()
