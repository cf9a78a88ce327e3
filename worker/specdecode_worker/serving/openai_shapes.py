"""Pieces of the OpenAI response shapes: errors, usage, and log-probabilities (the legacy
completions object and chat's ``content`` list). Each token is shown as the tokenizer decodes it
alone (``token_id:N`` without a tokenizer), as vLLM shows it."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from ..engine.request import Request, TokenLogprob


def error_response(status: int, message: str) -> JSONResponse:
    kind = "invalid_request_error" if status == 400 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def usage(reqs: list[Request]) -> dict:
    """The n samples of one prompt count its tokens once, as OpenAI counts them."""
    prompt = len(reqs[0].prompt_ids)
    completion = sum(len(r.output_ids) for r in reqs)
    # The first sample's: the others wait for its prompt to be cached, then reuse it.
    cached = reqs[0].cached_tokens
    # Drafted tokens, as OpenAI counts a prediction's: those in the completion, and the rest.
    accepted = sum(r.kept_draft_tokens for r in reqs)
    rejected = sum(r.proposed_draft_tokens for r in reqs) - accepted
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": rejected}}


def token_text(tokenizer: Any, token: int) -> str:
    return tokenizer.decode([token]) if tokenizer is not None else f"token_id:{token}"


def completion_logprobs(tokenizer: Any, entries: list[TokenLogprob], offset: int = 0) -> dict:
    """``{tokens, token_logprobs, top_logprobs, text_offset}``; ``offset``: where the first token's
    text starts in the completion (a stream's later chunks continue the count)."""
    tokens = [token_text(tokenizer, e.token) for e in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{token_text(tokenizer, t): v for t, v in e.top} for e in entries],
        "text_offset": offsets,
    }


def prompt_logprobs(tokenizer: Any, prompt_ids: list[int], entries: list[TokenLogprob]) -> dict:
    """The echoed prompt's part of a completion's logprobs: its first token has none (nothing
    precedes it), each later one its log-probability under the row before it."""
    tokens = [token_text(tokenizer, t) for t in prompt_ids]
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {
        "tokens": tokens,
        "token_logprobs": [None, *(e.logprob for e in entries)],
        "top_logprobs": [None, *({token_text(tokenizer, t): v for t, v in e.top} for e in entries)],
        "text_offset": offsets,
    }


def joined(first: dict, then: dict) -> dict:
    """Two parts of a completion's logprobs as one (the prompt's, then the output's)."""
    return {key: first[key] + then[key] for key in first}


def chat_logprobs(tokenizer: Any, entries: list[TokenLogprob]) -> dict:
    """``{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}``."""
    def one(token: int, logprob: float) -> dict:
        text = token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]} for e in entries]}
