"""Tool calls without a server: the request's checks, the call formats read from chat templates,
parsing model output by hand-written examples of each format, and the grammar a required call
compiles to, checked token by token with SmolLM2's tokenizer."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("llguidance")
transformers = pytest.importorskip("transformers")

from devtools import chat_templates, smollm2  # noqa: E402
from specdecode_worker.errors import InputError  # noqa: E402
from specdecode_worker.serving.structured import token_grammar  # noqa: E402
from specdecode_worker.serving.tools import call_grammar, parse_calls, template_format, tool_request  # noqa: E402

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                   "required": ["city"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def test_formats_are_read_from_the_templates():
    assert template_format(chat_templates.HERMES) == "hermes"
    assert template_format(chat_templates.LLAMA3_JSON) == "llama3_json"
    assert template_format("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert template_format(None) is None


@pytest.mark.parametrize("tools, choice, parallel, message", [
    ({"type": "function"}, None, None, "'tools' must be a list"),
    ([{"type": "retrieval"}], None, None, "'tools[0]' must be"),
    ([{"type": "function", "function": {"name": "has space"}}], None, None, "'tools[0].function.name'"),
    ([WEATHER, WEATHER], None, None, "names a function twice"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, None, "naming one of the tools (get_weather)"),
    ([WEATHER], "always", None, "'tool_choice' must be"),
    ([], "required", None, "'tool_choice' 'required' needs 'tools'"),
    ([WEATHER], "auto", "yes", "'parallel_tool_calls' must be true or false"),
])
def test_bad_tool_requests_name_the_field(tools, choice, parallel, message):
    with pytest.raises(InputError, match=re.escape(message)):
        tool_request(tools, choice, parallel)


def test_tool_choice_defaults_as_openai_defines_it():
    assert tool_request(None, None, None).choice == "none"
    assert tool_request([WEATHER], None, None).choice == "auto"
    named = tool_request([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, False)
    assert (named.choice, named.forced, named.parallel) == ("get_time", True, False)
    assert not tool_request([WEATHER], "none", None).active


def test_hermes_output_parses_into_calls():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    content, calls = parse_calls("hermes", text)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


def test_llama3_output_parses_into_calls():
    text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "a;b"}}; '
            '{"name": "get_time", "parameters": {}}')
    content, calls = parse_calls("llama3_json", text)
    assert content is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "a;b"}), ("get_time", {})]


@pytest.mark.parametrize("fmt, text", [
    ("hermes", "The weather is fine."),
    ("hermes", "<tool_call>\n{not json}\n</tool_call>"),
    ("llama3_json", "It is {sunny} today"),
    ("llama3_json", '{"city": "Paris"}'),  # JSON, but not a call
])
def test_text_that_is_not_calls_stays_text(fmt, text):
    assert parse_calls(fmt, text) == (text, [])


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(smollm2.smollm2_dir_or_skip())


@pytest.mark.parametrize("fmt, good, bad", [
    ("hermes", '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris","unit":"C"}}\n</tool_call>',
     '<tool_call>\n{"name":"get_weather","arguments":{"town":"Paris"}}\n</tool_call>'),
    ("llama3_json", '{"name":"get_weather","parameters":{"city":"Paris"}}',
     '{"name":"get_forecast","parameters":{"city":"Paris"}}'),
])
def test_a_required_call_is_a_grammar_of_valid_calls(tokenizer, fmt, good, bad):
    request = tool_request([WEATHER, TIME], "required", None)
    grammar = token_grammar(tokenizer, len(tokenizer), call_grammar(fmt, request))
    ids = tokenizer.encode(good)
    assert grammar.matcher.validate_tokens(ids) == len(ids)
    grammar.commit(ids)
    assert grammar.matcher.is_accepting()
    refused = token_grammar(tokenizer, len(tokenizer), call_grammar(fmt, request))
    bad_ids = tokenizer.encode(bad)
    assert refused.matcher.validate_tokens(bad_ids) < len(bad_ids)
    assert parse_calls(fmt, good)[1][0]["function"]["name"] == "get_weather"


def test_one_call_only_when_parallel_calls_are_off(tokenizer):
    request = tool_request([WEATHER], "required", False)
    grammar = token_grammar(tokenizer, len(tokenizer), call_grammar("hermes", request))
    one = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    grammar.commit(tokenizer.encode(one))
    assert grammar.complete, "nothing may follow the one call"
