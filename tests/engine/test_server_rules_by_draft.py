"""Output rules (JSON schemas, tool calls, penalties) through the ``openai`` client under each kind of
draft that is not a separate model: NGRAM lookups, an EAGLE3 head as a chain and as a tree, on
SmolLM2-135M-Instruct with a Hermes chat template. (STANDALONE: test_server_structured.py and
test_server_tools.py. MTP's rules are checked on the engine, tests/engine/test_structured_outputs.py: no
DeepSeek model small enough here has a tokenizer.)

The grammar masks the drafts' proposals and the target's verification alike, and penalties count
the round's accepted tokens, so greedy output with speculation equals the same request without it,
and every answer parses and validates."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")
pytest.importorskip("torch")

from devtools import chat_templates, smollm2  # noqa: E402
from devtools.eagle_heads import write_eagle3_head  # noqa: E402
from tests.server_helpers import free_port, serving  # noqa: E402
from tests.engine.test_server_structured import PERSON, SCHEMA_FORMAT  # noqa: E402
from tests.engine.test_server_tools import ASK, SCHEMAS, TOOLS  # noqa: E402

DRAFTS = {
    "NGRAM": ("NGRAM", ("--num-draft-tokens", "3")),
    "EAGLE3": ("EAGLE3", ("--num-draft-tokens", "3")),
    "EAGLE3-tree": ("EAGLE3", ("--num-draft-tokens", "5", "--speculative-num-steps", "2",
                               "--speculative-eagle-topk", "2")),
}
# An example in the prompt gives n-gram lookups something to copy.
DESCRIBE = [{"role": "user", "content": 'Describe a French programmer as JSON with a name, an age and languages, '
                                        'like {"name": "Ana", "age": 31, "languages": ["en", "de"]}.'}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return chat_templates.with_chat_template(smollm2.smollm2_dir_or_skip(), tmp_path_factory.mktemp("hermes"),
                                             chat_templates.HERMES)


@pytest.fixture(scope="module")
def head(model, tmp_path_factory):
    return write_eagle3_head(tmp_path_factory.mktemp("eagle3") / "head", model, draft_vocab=4096, seed=3)


@pytest.fixture(scope="module", params=list(DRAFTS))
def client(request, model, head):
    algorithm, flags = DRAFTS[request.param]
    argv = ["--target", str(model), "--algorithm", algorithm, *flags, "--spec-policy", "fixed",
            "--device", "cpu", "--device-memory-gib", "2.5", "--mem-fraction-static", "0.9",
            "--context-length", "1024", "--host", "127.0.0.1", "--port", str(free_port()),
            "--log-level", "warning", "--served-model-name", "smollm2"]
    if algorithm.startswith("EAGLE"):
        argv += ["--draft", str(head)]
    with serving(argv) as (base, state):
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="none"), state


def _chat(c, messages, **kw):
    return c.chat.completions.create(model="smollm2", messages=messages, temperature=0, **kw).choices[0]


def _speculated_then_plain(c, state, messages, **kw):
    drafted = state.engine.report().stats.proposed_tokens
    spec = _chat(c, messages, **kw)
    assert state.engine.report().stats.proposed_tokens > drafted, "the request was speculated"
    plain = _chat(c, messages, extra_body={"speculative": False, **kw.pop("extra_body", {})}, **kw)
    return spec, plain


def test_a_json_schema_answer_validates_and_equals_the_unspeculated_one(client):
    c, state = client
    spec, plain = _speculated_then_plain(c, state, DESCRIBE, max_tokens=80, response_format=SCHEMA_FORMAT)
    assert spec.message.content == plain.message.content
    assert spec.finish_reason == "stop"  # the grammar ended it
    jsonschema.validate(json.loads(spec.message.content), PERSON)


def test_a_required_tool_call_validates_and_equals_the_unspeculated_one(client):
    c, state = client
    spec, plain = _speculated_then_plain(c, state, ASK, max_tokens=96, tools=TOOLS, tool_choice="required")
    assert spec.finish_reason == "tool_calls"
    calls = [(t.function.name, json.loads(t.function.arguments)) for t in spec.message.tool_calls]
    assert calls == [(t.function.name, json.loads(t.function.arguments)) for t in plain.message.tool_calls]
    for name, arguments in calls:
        jsonschema.validate(arguments, SCHEMAS[name])


def test_penalised_text_equals_the_unspeculated_text(client):
    c, state = client
    penalties = dict(frequency_penalty=0.6, presence_penalty=0.4, extra_body={"repetition_penalty": 1.3})
    spec, plain = _speculated_then_plain(c, state, DESCRIBE, max_tokens=48, **penalties)
    assert spec.message.content == plain.message.content
    assert spec.message.content != _chat(c, DESCRIBE, max_tokens=48).message.content, "the penalties changed nothing"
