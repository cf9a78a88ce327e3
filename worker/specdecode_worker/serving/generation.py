"""One generation call of the OpenAI endpoints: submit the ``n`` samples of a prompt, turn each
one's tokens into text deltas, and answer with one response or a stream of server-sent events.

Each sample is its own engine request (sample i draws from ``seed + i`` when a seed is given, and
holds its own grammar under ``response_format``), so the engine's admission, speculation and
retraction treat it like any other request. Text that could
begin a stop string is held back until the next tokens decide it, so no part of a stop string is
ever sent, in a stream or not.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi.responses import StreamingResponse

from ..engine.request import Request
from ..engine.service import EngineService
from .detokenize import IncrementalText
from .openai_shapes import chat_logprobs, completion_logprobs, error_response, joined, prompt_logprobs, usage
from .structured import token_grammar
from .tools import parse_calls

MAX_CHOICES = 16  # samples per request: more is a batch job, better sent as separate requests


class _Sink:
    """Carries a request's tokens from the engine thread into the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def __call__(self, _req: Request, tokens: list[int] | None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, tokens)


@dataclass
class Piece:
    """A text delta of one choice; ``received``: that choice's tokens so far, for its logprobs."""

    index: int
    text: str
    finish: str | None
    received: int


async def text_pieces(engine: EngineService, tokenizer: Any, index: int, req: Request, sink: _Sink,
                      stops: list[str]) -> AsyncIterator[Piece]:
    """One choice's text as its tokens arrive, cut at the first stop string. Each update decodes
    only its new tokens' window."""
    text = IncrementalText(tokenizer)
    held = ""  # decoded, not sent: its end may be the start of a stop string
    received = 0
    while True:
        tokens = await sink.queue.get()
        if tokens is None:
            if req.error:
                raise RuntimeError(req.error)
            if held:
                yield Piece(index, held, None, received)
            yield Piece(index, "", req.finish_reason, received)
            return
        received += len(tokens)
        held += text.push(tokens)
        cuts = [at for at in (held.find(stop) for stop in stops) if at >= 0]
        if cuts:
            engine.abort(req)
            if min(cuts):
                yield Piece(index, held[: min(cuts)], None, received)
            yield Piece(index, "", "stop", received)
            return
        keep = stop_prefix_length(held, stops)
        if len(held) > keep:
            yield Piece(index, held[: len(held) - keep], None, received)
            held = held[len(held) - keep :]


def stop_prefix_length(text: str, stops: list[str]) -> int:
    """The longest end of ``text`` that a stop string begins with (shorter than that stop)."""
    for n in range(min(len(text), max((len(s) for s in stops), default=1) - 1), 0, -1):
        if any(stop.startswith(text[-n:]) for stop in stops):
            return n
    return 0


async def merged(streams: list[AsyncIterator[Piece]]) -> AsyncIterator[Piece]:
    """The pieces of every choice in the order they arrive; the first error ends them all."""
    if len(streams) == 1:  # the common case needs no tasks
        async for piece in streams[0]:
            yield piece
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncIterator[Piece]) -> None:
        try:
            async for piece in stream:
                await queue.put(piece)
            await queue.put(done)
        except Exception as exc:  # handed to the consumer, which raises it
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()


@dataclass(frozen=True)
class Answer:
    """How a request's output is shaped: a grammar it must match (llguidance source), and the tool
    call format its text is parsed in (None: plain text)."""

    grammar: str | None = None
    tool_format: str | None = None
    echo: bool = False  # a completion that begins with its prompt


async def generate(state: Any, body: Any, ids: list[int], chat: bool, n: int, answer: Answer = Answer()):
    """The response to a generation request: ``n`` samples of the prompt ``ids``."""
    params = body.sampling_params()
    stops = body.stop_strings()
    vocab = state.engine.vocab_size
    loop = asyncio.get_running_loop()
    reqs, streams = [], []
    try:
        for i in range(n):
            seed = params.seed + i if params.seed is not None else None
            sink = _Sink(loop)
            grammar = token_grammar(state.tokenizer, vocab, answer.grammar) if answer.grammar else None
            req = Request(ids, dataclasses.replace(params, seed=seed), on_update=state.latency.timed(sink),
                          grammar=grammar, **body.engine_options())
            state.engine.submit(req)  # raises InputError for a request that can never fit
            reqs.append(req)
            streams.append(text_pieces(state.engine, state.tokenizer, i, req, sink, stops))
    except Exception:
        _abort(state, reqs)
        raise
    head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24], "created": int(time.time()),
            "model": state.model_name}
    pieces = merged(streams)
    if body.stream:
        return StreamingResponse(events(state, reqs, pieces, head, chat, answer.tool_format, answer.echo),
                                 media_type="text/event-stream")
    texts, finishes, received = [""] * n, [None] * n, [0] * n
    try:
        async for p in pieces:
            texts[p.index] += p.text
            finishes[p.index] = p.finish or finishes[p.index]
            received[p.index] = p.received
    except RuntimeError as exc:
        _abort(state, reqs)
        return error_response(503 if state.init_error else 500, str(exc))  # 503: the engine is gone
    choices = []
    for i, req in enumerate(reqs):
        logprobs = _logprobs(state, req, 0, received[i], chat)
        if chat:
            message, finish = _message(texts[i], finishes[i], answer.tool_format)
            choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
        else:
            text = texts[i]
            if answer.echo:
                prompt_text, prompt_part = _echo(state, req)
                text = prompt_text + text
                if logprobs is not None:
                    logprobs = joined(prompt_part, _logprobs(state, req, 0, received[i], chat, len(prompt_text)))
            choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": finishes[i]})
    return {**head, "object": "chat.completion" if chat else "text_completion", "choices": choices,
            "usage": usage(reqs)}


def _message(text: str, finish: str | None, tool_format: str | None) -> tuple[dict, str | None]:
    """A chat answer: its text, or its text and tool calls (finish reason ``tool_calls``)."""
    if tool_format is None:
        return {"role": "assistant", "content": text}, finish
    content, calls = parse_calls(tool_format, text)
    if not calls:
        return {"role": "assistant", "content": text}, finish
    return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls" if finish == "stop" else finish


async def events(state: Any, reqs: list[Request], pieces: AsyncIterator[Piece], head: dict, chat: bool,
                 tool_format: str | None = None, echo: bool = False):
    """Server-sent events: one chunk per text delta, naming its choice's ``index``; usage goes with
    the chunk that finishes the last choice. With tools, a choice's answer is held until it ends
    (whether it is calls is known only then) and goes out in one chunk: its text, then its calls
    as ``tool_calls`` deltas, each whole. An echoed prompt is a completion choice's first chunk (sent
    once its prefill, which scores the prompt, is done)."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    n = len(reqs)
    sent, offsets = [0] * n, [0] * n  # per choice: tokens whose logprobs went out, text length so far
    held = [""] * n
    role_sent, unfinished = [False] * n, n
    try:
        async for p in pieces:
            i = p.index
            if echo and not role_sent[i]:  # completions: the flag marks the echo sent
                prompt_text, prompt_part = _echo(state, reqs[i])
                role_sent[i], offsets[i] = True, len(prompt_text)
                choice = {"index": i, "text": prompt_text, "logprobs": prompt_part, "finish_reason": None}
                yield f"data: {json.dumps({**head, 'object': obj, 'choices': [choice]})}\n\n"
            if tool_format is not None:
                held[i] += p.text
                if not p.finish:
                    continue
            elif not (p.text or p.finish):
                continue
            logprobs = _logprobs(state, reqs[i], sent[i], p.received, chat, offsets[i])
            sent[i], offsets[i] = p.received, offsets[i] + len(p.text)
            finish = p.finish
            if not chat:
                choice = {"index": i, "text": p.text, "logprobs": logprobs, "finish_reason": finish}
            else:
                if tool_format is not None:
                    message, finish = _message(held[i], finish, tool_format)
                    delta = {k: v for k, v in message.items() if k != "role" and v is not None}
                    for j, call in enumerate(delta.get("tool_calls", [])):
                        delta["tool_calls"][j] = {"index": j, **call}
                else:
                    delta = {"content": p.text} if p.text else {}
                if not role_sent[i]:  # the role goes in a choice's first chunk only
                    delta, role_sent[i] = {"role": "assistant", **delta}, True
                choice = {"index": i, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            data = {**head, "object": obj, "choices": [choice]}
            if finish:
                unfinished -= 1
                if not unfinished:
                    data["usage"] = usage(reqs)
            yield f"data: {json.dumps(data)}\n\n"
    except RuntimeError as exc:
        yield f"data: {json.dumps({'error': {'message': str(exc), 'code': 500}})}\n\n"
    finally:
        _abort(state, reqs)  # the client went away, or one choice failed
    yield "data: [DONE]\n\n"


def _abort(state: Any, reqs: list[Request]) -> None:
    for req in reqs:
        if not req.done.is_set():
            state.engine.abort(req)


def _echo(state: Any, req: Request) -> tuple[str, dict | None]:
    """The prompt a completion echoes: its text and, when logprobs were asked, its part of them."""
    text = state.tokenizer.decode(req.prompt_ids) if state.tokenizer is not None else ""
    if req.params.logprobs is None:
        return text, None
    return text, prompt_logprobs(state.tokenizer, req.prompt_ids, req.prompt_token_logprobs)


def _logprobs(state: Any, req: Request, start: int, end: int, chat: bool, offset: int = 0) -> dict | None:
    """The log-probabilities of output tokens ``start .. end - 1`` (None: the request asked for none)."""
    if req.params.logprobs is None:
        return None
    entries = req.output_logprobs[start:end]
    if chat:
        return chat_logprobs(state.tokenizer, entries)
    return completion_logprobs(state.tokenizer, entries, offset)
