"""OpenAI-compatible HTTP API over the engine.

The HTTP server starts before the engine: ``/health`` answers 503 while the three phases run
and 200 only once phase 3 has finished, so a startup probe can wait on it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from .engine.request import Request, SamplingParams
from .errors import InputError

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    engine: Any
    model_name: str
    plan: dict | None = None
    tokenizer: Any = None
    init_error: str | None = None
    started_at: float = field(default_factory=time.time)


def _error(status: int, message: str) -> JSONResponse:
    kind = "invalid_request_error" if status == 400 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status)


def _number(body: dict, key: str, default, kind=(int, float)):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, kind):
        raise InputError(f"'{key}' must be a {'integer' if kind is int else 'number'}, got {value!r}")
    return value


def sampling_params(body: dict) -> SamplingParams:
    n = body.get("n", 1)
    if n != 1:
        raise InputError(f"'n' must be 1 (one choice per request), got {n!r}")
    params = SamplingParams(
        max_tokens=_number(body, "max_tokens", _number(body, "max_completion_tokens", 16, int), int),
        temperature=_number(body, "temperature", 1.0),
        top_p=_number(body, "top_p", 1.0),
        top_k=_number(body, "top_k", 0, int),
        seed=_number(body, "seed", None, int),
        ignore_eos=bool(body.get("ignore_eos", False)),
    )
    params.validate()
    return params


def _stop_strings(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > 4:
        raise InputError("'stop' must be a non-empty string or a list of up to 4 of them")
    return stop


class _Stream:
    """Collects a request's tokens from the engine thread into the event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def __call__(self, req: Request, tokens: list[int] | None) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, tokens)


def build_app(state: ServerState, on_startup=None, on_shutdown=None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app):
        if on_startup:
            on_startup()
        yield
        if on_shutdown:
            on_shutdown()

    app = FastAPI(title="specdecode worker", lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req, exc):  # noqa: ANN001
        return _error(400, str(exc))

    async def _body(http: HttpRequest) -> dict:
        raw = await http.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise InputError(f"the request body is not valid JSON ({exc})") from None
        if not isinstance(body, dict):
            raise InputError("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != state.model_name:
            raise InputError(f"model '{model}' is not served here; this worker serves '{state.model_name}'")
        return body

    def _ready() -> JSONResponse | None:
        if state.init_error:
            return _error(503, f"initialisation failed: {state.init_error}")
        if not state.engine.ready:
            return _error(503, "the worker is still initialising")
        return None

    @app.get("/health")
    async def health():
        if state.init_error:
            return JSONResponse({"status": "failed", "error": state.init_error}, status_code=503)
        if not state.engine.ready:
            return JSONResponse({"status": "initialising", "phase": state.engine.phase.name}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": int(state.started_at),
                                             "owned_by": "specdecode"}]}

    @app.get("/plan")
    async def plan():
        s = state.engine
        actual = None
        if s.memory_profile is not None:
            actual = {**s.memory_profile.as_dict(), "phaseSeconds": s.stats.phase_seconds,
                      "poolTokens": s.memory_pool_config.max_total_num_tokens if s.memory_pool_config else None}
        planned = (state.plan or {}).get("kvCache", {}).get("maxTotalNumTokens")
        return {"plan": state.plan, "actual": actual, "plannedMaxTotalNumTokens": planned,
                "actualMaxTotalNumTokens": actual and actual["max_total_num_tokens"]}

    @app.get("/metrics")
    async def metrics():
        from .metrics import render

        return PlainTextResponse(render(state), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions")
    async def completions(http: HttpRequest):
        if (busy := _ready()) is not None:
            return busy
        try:
            body = await _body(http)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, str):
                ids = _encode(prompt)
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                ids = list(prompt)
            else:
                raise InputError("'prompt' must be a non-empty string or a list of token ids")
            return await _generate(body, ids, chat=False)
        except InputError as exc:
            return _error(400, str(exc))

    @app.post("/v1/chat/completions")
    async def chat(http: HttpRequest):
        if (busy := _ready()) is not None:
            return busy
        try:
            body = await _body(http)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages
            ):
                raise InputError("'messages' must be a non-empty list of {role, content} objects with string values")
            tok = state.tokenizer
            if tok is None or not getattr(tok, "chat_template", None):
                raise InputError("this model has no chat template; use /v1/completions")
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return await _generate(body, _encode(text, special=False), chat=True)
        except InputError as exc:
            return _error(400, str(exc))

    def _encode(text: str, special: bool = True) -> list[int]:
        if state.tokenizer is None:
            raise InputError("this model has no tokenizer; send 'prompt' as a list of token ids")
        if not text:
            raise InputError("the prompt is empty")
        return state.tokenizer.encode(text, add_special_tokens=special)

    def _decode(ids: list[int]) -> str:
        if state.tokenizer is None:
            return ""
        return state.tokenizer.decode(ids, skip_special_tokens=True)

    async def _generate(body: dict, ids: list[int], chat: bool):
        params = sampling_params(body)
        stops = _stop_strings(body)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise InputError(f"'stream' must be true or false, got {stream!r}")
        sink = _Stream(asyncio.get_running_loop())
        req = Request(ids, params, on_update=sink)
        state.engine.submit(req)  # raises InputError for a request that can never fit
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        async def pieces():
            """Yields (text delta, finish_reason) as tokens arrive; applies stop strings."""
            out: list[int] = []
            sent = ""
            while True:
                tokens = await sink.queue.get()
                if tokens is None:
                    if req.error:
                        raise RuntimeError(req.error)
                    yield "", req.finish_reason
                    return
                out.extend(tokens)
                text = _decode(out)
                for s in stops:
                    cut = text.find(s)
                    if cut >= 0:
                        state.engine.abort(req)
                        if cut > len(sent):
                            yield text[len(sent):cut], None
                        yield "", "stop"
                        return
                if text.endswith("\ufffd"):
                    continue  # an incomplete multi-byte character: wait for the rest
                if len(text) > len(sent) and text.startswith(sent):
                    yield text[len(sent):], None
                    sent = text

        def usage():
            return {"prompt_tokens": len(ids), "completion_tokens": len(req.output_ids),
                    "total_tokens": len(ids) + len(req.output_ids)}

        first = [True]

        def choice(text: str, finish, delta: bool):
            if not chat:
                return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            if not delta:
                return {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            content = {"content": text} if text else {}
            if first[0]:  # the role goes in the first chunk only
                content, first[0] = {"role": "assistant", **content}, False
            return {"index": 0, "delta": content, "finish_reason": finish}

        if not stream:
            text, finish = "", None
            try:
                async for piece, fin in pieces():
                    text += piece
                    finish = fin or finish
            except RuntimeError as exc:
                return _error(500, str(exc))
            return {"id": rid, "object": obj, "created": created, "model": state.model_name,
                    "choices": [choice(text, finish, delta=False)], "usage": usage()}

        async def events():
            chunk_obj = "chat.completion.chunk" if chat else "text_completion"
            try:
                async for piece, fin in pieces():
                    if piece or fin:
                        data = {"id": rid, "object": chunk_obj, "created": created, "model": state.model_name,
                                "choices": [choice(piece, fin, delta=True)]}
                        if fin:
                            data["usage"] = usage()
                        yield f"data: {json.dumps(data)}\n\n"
            except RuntimeError as exc:
                yield f"data: {json.dumps({'error': {'message': str(exc), 'code': 500}})}\n\n"
            finally:
                if not req.done.is_set():
                    state.engine.abort(req)  # the client went away
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def start_engine_in_background(state: ServerState, on_failure) -> threading.Thread:
    """Run the three phases off the event loop, then start the engine loop."""

    def run():
        try:
            state.engine.init_model_worker()
            state.engine.start()
            log.info("ready: phases took %s", {k: round(v, 3) for k, v in state.engine.stats.phase_seconds.items()})
        except Exception as exc:  # reported on /health and by the CLI's exit code
            state.init_error = " ".join(str(exc).split()) or type(exc).__name__
            log.error("initialisation failed: %s", state.init_error)
            on_failure(exc)

    thread = threading.Thread(target=run, name="engine-init", daemon=True)
    thread.start()
    return thread
