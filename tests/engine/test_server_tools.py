"""Tools through the ``openai`` client against the real server: SmolLM2-135M-Instruct, drafting for
itself (STANDALONE), with a chat template of each call format. Required and named calls parse and
their arguments validate, the same with speculation on and off and streamed or not; a conversation
goes on after a tool's answer."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from devtools import chat_templates, smollm2  # noqa: E402
from tests.server_helpers import free_port, serving  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 32},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 32}},
                   "required": ["timezone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module", params=["HERMES", "LLAMA3_JSON"])
def client(request, tmp_path_factory):
    model = chat_templates.with_chat_template(smollm2.smollm2_dir_or_skip(), tmp_path_factory.mktemp(request.param),
                                              getattr(chat_templates, request.param))
    argv = ["--target", str(model), "--draft", str(model), "--algorithm", "STANDALONE", "--num-draft-tokens", "3",
            "--spec-policy", "fixed", "--device", "cpu", "--device-memory-gib", "2.5",
            "--mem-fraction-static", "0.9", "--context-length", "1024", "--host", "127.0.0.1",
            "--port", str(free_port()), "--log-level", "warning", "--served-model-name", "smollm2"]
    with serving(argv) as (base, state):
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="none"), state


def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _ask(c, **kw):
    return c.chat.completions.create(model="smollm2", messages=ASK, tools=TOOLS, max_tokens=96, temperature=0, **kw)


def test_a_required_call_parses_validates_and_speculation_does_not_change_it(client):
    c, state = client
    drafted = state.engine.report().stats.proposed_tokens
    spec = _ask(c, tool_choice="required").choices[0]
    assert state.engine.report().stats.proposed_tokens > drafted, "the call was speculated"
    plain = _ask(c, tool_choice="required", extra_body={"speculative": False}).choices[0]
    assert spec.finish_reason == "tool_calls"
    calls = _calls(spec.message)
    assert calls and calls == _calls(plain.message)
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])
    assert all(call.id.startswith("call_") and call.type == "function" for call in spec.message.tool_calls)


def test_a_named_call_calls_that_function(client):
    c, _ = client
    out = _ask(c, tool_choice={"type": "function", "function": {"name": "get_time"}}, parallel_tool_calls=False)
    [(name, arguments)] = _calls(out.choices[0].message)
    assert name == "get_time"
    jsonschema.validate(arguments, SCHEMAS["get_time"])


def test_streamed_calls_equal_the_whole_answer(client):
    c, _ = client
    whole = _calls(_ask(c, tool_choice="required").choices[0].message)
    parts: dict[int, dict] = {}
    finish = None
    for chunk in _ask(c, tool_choice="required", stream=True):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                part = parts.setdefault(delta.index, {"name": "", "arguments": ""})
                part["name"] += delta.function.name or ""
                part["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls"
    assert [(p["name"], json.loads(p["arguments"])) for _, p in sorted(parts.items())] == whole


def test_the_conversation_goes_on_after_a_tools_answer(client):
    c, _ = client
    first = _ask(c, tool_choice="required").choices[0].message
    call = first.tool_calls[0]
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "clear"})}]
    out = c.chat.completions.create(model="smollm2", messages=messages, tools=TOOLS, tool_choice="none",
                                    max_tokens=24, temperature=0).choices[0]
    assert out.message.tool_calls is None and out.message.content


def test_auto_answers_with_text_or_calls_that_parse(client):
    c, _ = client
    out = _ask(c, tool_choice="auto").choices[0]
    if out.message.tool_calls:
        assert out.finish_reason == "tool_calls"
        assert all(name in SCHEMAS for name, _ in _calls(out.message))
    else:
        assert out.message.content and out.finish_reason in ("stop", "length")


def test_a_tool_message_without_its_call_id_is_refused(client):
    c, _ = client
    with pytest.raises(openai.BadRequestError, match="tool_call_id"):
        c.chat.completions.create(model="smollm2", messages=[*ASK, {"role": "tool", "content": "21 C"}],
                                  tools=TOOLS, max_tokens=4)
