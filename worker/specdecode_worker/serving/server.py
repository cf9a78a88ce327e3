"""OpenAI-compatible HTTP API over the engine.

The HTTP server starts before the engine: ``/health`` answers 503 while the three phases run
and 200 only once phase 3 has finished, so a startup probe can wait on it. Generation requests
go through one dependency (ready, else 503; a JSON object naming the served model, else 400) and
a pydantic model of their fields; every ``InputError`` becomes a 400 that says what is wrong.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Annotated, Any, Union

from fastapi import APIRouter, Depends, FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from ..contract import MemoryPlan
from ..engine.phases import PhaseError
from ..engine.request import SamplingParams
from ..engine.service import EngineService
from ..errors import InputError
from .generation import MAX_CHOICES, Answer, generate
from .metrics import RequestLatency
from .openai_shapes import error_response
from .structured import grammar_source
from .tools import call_grammar, template_format, tool_request

log = logging.getLogger(__name__)

Number = Union[StrictInt, StrictFloat]


@dataclass
class ServerState:
    engine: EngineService
    model_name: str
    plan: MemoryPlan | None = None
    tokenizer: Any = None
    init_error: str | None = None
    started_at: float = field(default_factory=time.time)
    latency: RequestLatency = field(default_factory=RequestLatency)


class NotReady(Exception):
    """The engine cannot take requests yet (initialising) or ever (initialisation failed)."""


# ---- request bodies ----------------------------------------------------------------------------
# What a field must be, for the 400 message when it is not.
EXPECTED = {
    "max_tokens": "an integer", "max_completion_tokens": "an integer", "temperature": "a number",
    "top_p": "a number", "top_k": "an integer", "seed": "an integer", "stream": "true or false",
    "stop": "a non-empty string or a list of up to 4 of them",
    "prompt": "a non-empty string or a list of token ids",
    "messages": "a non-empty list of {role, content} objects, content a string or a list of text parts",
    "speculative": "true or false", "cache_prompt": "true or false",
    "max_draft_tokens": "a non-negative integer (0 turns drafting off)",
    "logprobs": "an integer in [0, 20] on /v1/completions, true or false on /v1/chat/completions",
    "top_logprobs": "an integer in [0, 20]",
    "presence_penalty": "a number in [-2, 2]", "frequency_penalty": "a number in [-2, 2]",
    "repetition_penalty": "a number in (0, 10] (1 turns it off)",
    "logit_bias": "an object mapping token ids (as strings) to numbers in [-100, 100]",
    "min_tokens": "an integer in [0, max_tokens]",
    "n": f"an integer in [1, {MAX_CHOICES}]",
}


# OpenAI parameters this server does not implement. Each is accepted at the value that asks for
# nothing (what a client sends when it leaves the feature off) and refused with a 400 naming it
# otherwise: a client that asks for JSON or tools must not get plain text back silently.
UNSUPPORTED: dict[str, tuple] = {
    "echo": (False,), "best_of": (1,), "suffix": ("",),
    "tools": ([],), "tool_choice": ("none",), "functions": ([],),  # tools: chat only (ChatBody takes them)
    "function_call": ("none",),
}
# Accepted and ignored, with the reason (the docs' parameter table says the same).
IGNORED = {
    "user": "a caller's identifier for its own records; the output does not depend on it",
    "stream_options": "usage always comes with a stream's last chunk",
    "parallel_tool_calls": "only chat calls tools",
    "metadata": "kept by OpenAI for stored completions; nothing is stored here",
    "store": "nothing is stored here",
}


def check_parameters(body: dict, known: set[str]) -> None:
    """A 400 for a parameter this server does not know, or one it does not implement set to a
    value that asks for the feature; what it accepts and ignores passes."""
    for name, value in body.items():
        if name in known or name in IGNORED:
            continue
        if name in UNSUPPORTED:
            neutral = UNSUPPORTED[name]
            if value is None or value in neutral:  # 0.0 == 0 and False == 0; "0" is not 0
                continue
            raise InputError(f"'{name}' is not supported by this server (got {value!r}); leave it out or send "
                             f"{neutral[0]!r}")
        raise InputError(f"unknown parameter '{name}'")


class GenerationBody(BaseModel):
    """Fields both endpoints read (``check_parameters`` has refused the rest)."""

    model_config = ConfigDict(extra="ignore")
    model: Any = None
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    seed: StrictInt | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    repetition_penalty: Number | None = None
    logit_bias: dict[StrictStr, Number] | None = None
    min_tokens: StrictInt | None = None
    n: StrictInt | None = None
    ignore_eos: Any = False
    stop: StrictStr | list[StrictStr] | None = None
    stream: StrictBool = False
    speculative: StrictBool = True  # false: this request is decoded without drafting
    max_draft_tokens: StrictInt | None = None  # a cap on its draft length per round
    response_format: Any = None  # structured outputs (``structured.grammar_source`` checks it)
    cache_prompt: StrictBool = True  # false: neither reuse cached KV nor leave this request's in the cache

    def engine_options(self) -> dict:
        """This server's own per-request controls, as ``Request`` fields."""
        if self.max_draft_tokens is not None and self.max_draft_tokens < 0:
            raise InputError(f"'max_draft_tokens' must be {EXPECTED['max_draft_tokens']}, got {self.max_draft_tokens}")
        return {"speculative": self.speculative, "max_draft_tokens": self.max_draft_tokens,
                "cache_prompt": self.cache_prompt}

    def top_logprobs_wanted(self) -> int | None:
        """How many of the likeliest tokens to report at each position (None: no logprobs)."""
        return None

    def prompt_logprobs_wanted(self) -> int | None:
        """The same for the prompt's tokens (an echoed completion)."""
        return None

    def choices(self) -> int:
        """How many samples of the prompt to return."""
        n = 1 if self.n is None else self.n
        if not 1 <= n <= MAX_CHOICES:
            raise InputError(f"'n' must be {EXPECTED['n']}, got {n}")
        return n

    def sampling_params(self) -> SamplingParams:
        max_tokens = self.max_tokens if self.max_tokens is not None else self.max_completion_tokens
        params = SamplingParams(
            max_tokens=16 if max_tokens is None else max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            ignore_eos=bool(self.ignore_eos),
            logprobs=self.top_logprobs_wanted(),
            prompt_logprobs=self.prompt_logprobs_wanted(),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self.token_bias(),
            min_tokens=self.min_tokens or 0,
        )
        params.validate()
        return params

    def token_bias(self) -> tuple[tuple[int, float], ...]:
        bias = []
        for key, value in (self.logit_bias or {}).items():
            if not key.isdigit():
                raise InputError(f"'logit_bias' keys must be token ids, got {key!r}")
            bias.append((int(key), value))
        return tuple(bias)

    def stop_strings(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if not all(stops) or len(stops) > 4:
            raise InputError(f"'stop' must be {EXPECTED['stop']}")
        return stops


class CompletionBody(GenerationBody):
    prompt: StrictStr | list[StrictInt] | list[StrictStr] | None = None
    logprobs: StrictInt | None = None
    echo: StrictBool = False

    def top_logprobs_wanted(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_wanted(self) -> int | None:
        return self.logprobs if self.echo else None


ROLES = ("system", "developer", "user", "assistant", "tool")


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: StrictStr
    text: StrictStr


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: StrictStr
    arguments: StrictStr  # JSON, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: StrictStr
    type: StrictStr = "function"
    function: ToolCallFunction


class Message(BaseModel):
    """A chat turn: a role this server serves, and text (a string, or text parts, joined); an
    assistant turn may hold tool calls instead, and a tool turn answers one."""

    model_config = ConfigDict(extra="forbid")
    role: StrictStr
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None

    @property
    def uses_tools(self) -> bool:
        return self.role == "tool" or bool(self.tool_calls)

    def as_template_input(self) -> dict:
        if self.role not in ROLES:
            raise InputError(f"message role '{self.role}' is not served here; use one of {', '.join(ROLES)}")
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise InputError("message content parts must be of type 'text' (no images or audio here)")
            content = "".join(part.text for part in content)
        if content is None and not (self.role == "assistant" and self.tool_calls):
            raise InputError(f"'messages': a {self.role} message needs 'content' (only an assistant's tool calls "
                             "may stand alone)")
        if self.tool_calls and self.role != "assistant":
            raise InputError("only an assistant message holds 'tool_calls'")
        if self.role == "tool" and not self.tool_call_id:
            raise InputError("a tool message needs the 'tool_call_id' of the call it answers")
        turn: dict = {"role": self.role, "content": content}
        if self.name:
            turn["name"] = self.name
        if self.tool_call_id:
            turn["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            turn["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        return turn


def _arguments(text: str) -> Any:
    """A call's arguments as chat templates take them: the JSON parsed."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise InputError(f"a tool call's 'arguments' must be JSON, got {text[:80]!r}") from None


class ChatBody(GenerationBody):
    messages: list[Message]
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: Any = None  # ``tools.tool_request`` checks these three
    tool_choice: Any = None
    parallel_tool_calls: Any = None

    def top_logprobs_wanted(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InputError("'top_logprobs' needs 'logprobs': true")
        return (self.top_logprobs or 0) if self.logprobs else None


def parse_body(model: type[BaseModel], body: dict) -> Any:
    """``body`` as ``model``, or an InputError naming the first field that is wrong."""
    check_parameters(body, set(model.model_fields))
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        name = str(error["loc"][0]) if error["loc"] else "body"
        value = body.get(name)
        if name in EXPECTED:
            raise InputError(f"'{name}' must be {EXPECTED[name]}, got {value!r}") from None
        raise InputError(f"'{name}': {error['msg']}") from None


async def generation_request(http: HttpRequest) -> dict:
    """The shared dependency of the generation endpoints: ready, a JSON object, the served model."""
    state: ServerState = http.app.state.server
    if state.init_error:
        raise NotReady(f"initialisation failed: {state.init_error}")
    if not state.engine.ready:  # every request asks: the cheap flag, not the whole report
        raise NotReady("the worker is still initialising")
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


GenerationRequest = Annotated[dict, Depends(generation_request)]

# ---- endpoints -----------------------------------------------------------------------------------
router = APIRouter()


@router.get("/health")
async def health(http: HttpRequest):
    state: ServerState = http.app.state.server
    if state.init_error:
        return JSONResponse({"status": "failed", "error": state.init_error}, status_code=503)
    if not state.engine.ready:  # probed every few seconds: the report only while starting up
        return JSONResponse({"status": "initialising", "phase": state.engine.report().phase}, status_code=503)
    return {"status": "ok"}


@router.get("/v1/models")
async def models(http: HttpRequest):
    state: ServerState = http.app.state.server
    return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": int(state.started_at),
                                         "owned_by": "specdecode"}]}


@router.get("/plan")
async def plan(http: HttpRequest):
    state: ServerState = http.app.state.server
    report = state.engine.report()
    plan = state.plan
    dynamic = {"planned": plan.reserve.dynamic_bytes if plan else None, "measured": None, **report.dynamic}
    return {"plan": plan.document if plan else None, "actual": report.memory,
            "plannedMaxTotalNumTokens": plan.kv_cache.max_total_num_tokens if plan else None,
            "actualMaxTotalNumTokens": report.kv_tokens_actual, "dynamicBytes": dynamic,
            "prefixCache": report.prefix_cache, "speculationPolicy": report.policy}


@router.get("/metrics")
async def metrics(http: HttpRequest):
    from .metrics import render

    return PlainTextResponse(render(http.app.state.server), media_type="text/plain; version=0.0.4")


@router.post("/v1/completions")
async def completions(http: HttpRequest, body: GenerationRequest):
    state: ServerState = http.app.state.server
    request = parse_body(CompletionBody, body)
    prompt = request.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = _encode(state, prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        ids = list(prompt)
    else:
        raise InputError(f"'prompt' must be {EXPECTED['prompt']}")
    answer = Answer(grammar=grammar_source(request.response_format), echo=request.echo)
    return await generate(state, request, ids, chat=False, n=request.choices(), answer=answer)


@router.post("/v1/chat/completions")
async def chat_completions(http: HttpRequest, body: GenerationRequest):
    state: ServerState = http.app.state.server
    request = parse_body(ChatBody, body)
    if not request.messages:
        raise InputError(f"'messages' must be {EXPECTED['messages']}")
    tokenizer = state.tokenizer
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise InputError("this model has no chat template; use /v1/completions")
    tools = tool_request(request.tools, request.tool_choice, request.parallel_tool_calls)
    tool_format = template_format(tokenizer.chat_template)
    if (tools.tools or any(m.uses_tools for m in request.messages)) and tool_format is None:
        raise InputError("this model's chat template takes no tools (it teaches neither the hermes nor the "
                         "llama3_json call format); leave out 'tools' and tool messages")
    messages = [m.as_template_input() for m in request.messages]
    text = tokenizer.apply_chat_template(messages, tools=tools.tools or None, add_generation_prompt=True,
                                         tokenize=False)
    grammar = grammar_source(request.response_format)
    if tools.forced:
        if grammar:
            raise InputError("'response_format' and a required tool call both shape the answer; send one of them")
        grammar = call_grammar(tool_format, tools)
    answer = Answer(grammar=grammar, tool_format=tool_format if tools.active else None)
    return await generate(state, request, _encode(state, text, special=False), chat=True, n=request.choices(),
                          answer=answer)


def _encode(state: ServerState, text: str, special: bool = True) -> list[int]:
    if state.tokenizer is None:
        raise InputError("this model has no tokenizer; send 'prompt' as a list of token ids")
    if not text:
        raise InputError("the prompt is empty")
    return state.tokenizer.encode(text, add_special_tokens=special)


# ---- the app -------------------------------------------------------------------------------------
def build_app(state: ServerState, on_startup=None, on_shutdown=None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_app):
        if on_startup:
            on_startup()
        yield
        if on_shutdown:
            on_shutdown()

    app = FastAPI(title="specdecode worker", lifespan=lifespan)
    app.state.server = state
    app.include_router(router)
    app.add_exception_handler(InputError, _bad_request)
    app.add_exception_handler(NotReady, _unavailable)
    app.add_exception_handler(PhaseError, _unavailable)  # the engine stopped taking requests
    return app


async def _bad_request(_http: HttpRequest, exc: Exception) -> JSONResponse:
    return error_response(400, str(exc))


async def _unavailable(_http: HttpRequest, exc: Exception) -> JSONResponse:
    return error_response(503, str(exc))


def start_engine_in_background(state: ServerState, on_failure) -> threading.Thread:
    """Run the three phases off the event loop, then start the engine loop."""

    def run():
        try:
            state.engine.start_up()
            phases = state.engine.report().stats.phase_seconds
            log.info("ready: phases took %s", {k: round(v, 3) for k, v in phases.items()})
        except Exception as exc:  # reported on /health and by the CLI's exit code
            state.init_error = " ".join(str(exc).split()) or type(exc).__name__
            log.error("initialisation failed: %s", state.init_error)
            on_failure(exc)

    thread = threading.Thread(target=run, name="engine-init", daemon=True)
    thread.start()
    return thread
