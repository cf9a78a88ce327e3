"""``response_format`` through the ``openai`` client against the real server, with SmolLM2-135M-Instruct
drafting for itself (STANDALONE): outputs parse and validate against the schema, and greedy output
is the same with speculation on and off, streamed or not."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from devtools import smollm2  # noqa: E402
from tests.server_helpers import free_port, serving  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "languages": {"type": "array", "items": {"type": "string", "enum": ["en", "fr", "de"]}}},
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Describe a French programmer as JSON with a name, an age and languages."}]
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def client():
    model = smollm2.smollm2_dir_or_skip()
    argv = ["--target", str(model), "--draft", str(model), "--algorithm", "STANDALONE", "--num-draft-tokens", "3",
            "--spec-policy", "fixed", "--device", "cpu", "--device-memory-gib", "2.5",
            "--mem-fraction-static", "0.9", "--context-length", "512", "--host", "127.0.0.1",
            "--port", str(free_port()), "--log-level", "warning", "--served-model-name", "smollm2"]
    with serving(argv) as (base, state):
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="none"), state


def _chat(client, **kw):
    return client.chat.completions.create(model="smollm2", messages=MESSAGES, max_tokens=80, **kw)


def test_json_schema_output_validates_and_speculation_does_not_change_it(client):
    c, state = client
    drafted_before = state.engine.report().stats.proposed_tokens
    spec = _chat(c, temperature=0, response_format=SCHEMA_FORMAT).choices[0]
    assert state.engine.report().stats.proposed_tokens > drafted_before, "the constrained request was speculated"
    plain = _chat(c, temperature=0, response_format=SCHEMA_FORMAT, extra_body={"speculative": False}).choices[0]
    assert spec.message.content == plain.message.content
    assert spec.finish_reason == "stop"  # the grammar ended it, not max_tokens
    jsonschema.validate(json.loads(spec.message.content), PERSON)
    free = _chat(c, temperature=0).choices[0].message.content
    assert free != spec.message.content, "the schema changed the output: the comparison is not the free one"


def test_streamed_json_equals_the_whole_answer(client):
    c, _ = client
    whole = _chat(c, temperature=0, response_format=SCHEMA_FORMAT).choices[0].message.content
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                       _chat(c, temperature=0, response_format=SCHEMA_FORMAT, stream=True) if chunk.choices)
    assert streamed == whole


def test_sampled_outputs_validate(client):
    c, _ = client
    out = _chat(c, temperature=0.9, seed=4, n=3, response_format=SCHEMA_FORMAT)
    assert len({choice.message.content for choice in out.choices}) > 1, "three samples, not one three times"
    for choice in out.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_output_parses(client):
    c, _ = client
    ask = [{"role": "user", "content": "Give a JSON object with the keys city and country for Paris."}]
    out = c.chat.completions.create(model="smollm2", messages=ask, max_tokens=80, temperature=0,
                                    response_format={"type": "json_object"}).choices[0]
    assert out.finish_reason == "stop"
    assert json.loads(out.message.content) == {"city": "Paris", "country": "France"}


def test_completions_take_a_schema_too(client):
    c, _ = client
    out = c.completions.create(model="smollm2", prompt="A person: ", max_tokens=80, temperature=0,
                               extra_body={"response_format": SCHEMA_FORMAT})
    jsonschema.validate(json.loads(out.choices[0].text), PERSON)
