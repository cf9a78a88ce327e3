"""Tool calls for chat: the request's ``tools`` go to the model's chat template, and the model's
calls come back as ``tool_calls``, in the format its template teaches:

- ``hermes`` (Qwen2.5, Hermes): each call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
- ``llama3_json`` (Llama 3.1 to 3.3): the message is ``{"name": ..., "parameters": {...}}``, after
  an optional ``<|python_tag|>``; several calls are separated by ``;``.

``tool_choice`` ``"required"`` or a named function is a grammar (``structured``): the output can
only be calls to the allowed functions whose arguments validate against their parameters, so it
always parses. ``"auto"`` lets the model choose, and the output is parsed after it ends.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import llguidance

from ..errors import InputError

FORMATS = ("hermes", "llama3_json")
_HERMES_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


def template_format(chat_template: str | None) -> str | None:
    """The call format a chat template teaches, read from the template's own text; None when it
    takes no tools."""
    if not chat_template or "tools" not in chat_template:
        return None
    if "<tool_call>" in chat_template:
        return "hermes"
    if _PYTHON_TAG in chat_template or "ipython" in chat_template:
        return "llama3_json"
    return None


@dataclass(frozen=True)
class ToolRequest:
    """What a chat request asks of tools, checked."""

    tools: list[dict]  # as the chat template takes them: {"type": "function", "function": {...}}
    choice: str  # none, auto, required, or the name of the one function to call
    parallel: bool  # more than one call in an answer

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.active and self.choice != "auto"


def tool_request(tools: Any, tool_choice: Any, parallel_tool_calls: Any) -> ToolRequest:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` as OpenAI defines them, or an InputError
    that names what is wrong."""
    tools = tools or []
    if not isinstance(tools, list):
        raise InputError("'tools' must be a list of {type: function, function: {name, parameters}} objects")
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise InputError(f"'tools[{i}]' must be {{type: function, function: {{name, parameters}}}}")
        if not isinstance(fn.get("name"), str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", fn["name"]):
            raise InputError(f"'tools[{i}].function.name' must be 1 to 64 letters, digits, _ or -")
        if not isinstance(fn.get("parameters", {}), dict):
            raise InputError(f"'tools[{i}].function.parameters' must be a JSON schema object")
        names.append(fn["name"])
    if len(set(names)) != len(names):
        raise InputError("'tools' names a function twice")
    choice = "auto" if tool_choice is None and tools else tool_choice or "none"
    if isinstance(choice, dict):
        named = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if named not in names:
            raise InputError(f"'tool_choice' must be none, auto, required or {{type: function, function: {{name}}}} "
                             f"naming one of the tools ({', '.join(names) or 'none given'}), got {tool_choice!r}")
        choice = named
    elif choice not in ("none", "auto", "required"):
        raise InputError(f"'tool_choice' must be none, auto, required or a named function, got {tool_choice!r}")
    elif choice != "none" and not tools:
        raise InputError(f"'tool_choice' {choice!r} needs 'tools'")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InputError(f"'parallel_tool_calls' must be true or false, got {parallel_tool_calls!r}")
    return ToolRequest(list(tools), choice, parallel_tool_calls is not False)


def _call_schema(fmt: str, fn: dict) -> dict:
    args_key = "arguments" if fmt == "hermes" else "parameters"
    params = fn.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": fn["name"]}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False}


def call_grammar(fmt: str, request: ToolRequest) -> str:
    """An llguidance grammar whose every match is one call (several if parallel) to the allowed
    functions, arguments valid against their parameters."""
    functions = [t["function"] for t in request.tools if request.choice in ("required", t["function"]["name"])]
    schemas = [_call_schema(fmt, fn) for fn in functions]
    schema = {"anyOf": schemas} if len(schemas) > 1 else schemas[0]
    schema["x-guidance"] = {"whitespace_flexible": False}
    call = f"%json {json.dumps(schema)}"
    if fmt == "hermes":
        rules = ['block: "<tool_call>\\n" call "\\n</tool_call>"', f"call: {call}"]
        start = 'start: block ("\\n" block)*' if request.parallel else "start: block"
    else:
        rules = [f"call: {call}"]
        start = 'start: call (";" call)*' if request.parallel else "start: call"
    try:
        return llguidance.LLMatcher.grammar_from_lark("\n".join([start, *rules]) + "\n")
    except (ValueError, TypeError) as exc:
        raise InputError(f"'tools': a function's parameters are not a JSON schema this server can use: {exc}") from None


def parse_calls(fmt: str, text: str) -> tuple[str | None, list[dict]]:
    """The answer's text and its calls, as OpenAI's ``tool_calls``. Text that does not parse as
    calls stays text."""
    calls: list[dict] = []
    if fmt == "hermes":
        for block in _HERMES_BLOCK.findall(text):
            call = _call(block, "arguments")
            if call is None:
                return text or None, []
            calls.append(call)
        content = text[: text.index("<tool_call>")].strip() if calls else text
    else:
        body = text.strip().removeprefix(_PYTHON_TAG).strip()
        if body.startswith("{"):
            for part in _split_calls(body):
                call = _call(part, "parameters")
                if call is None:
                    return text or None, []
                calls.append(call)
        content = "" if calls else text
    return content or None, calls


def _split_calls(body: str) -> list[str]:
    """``{...};{...}``: each top-level JSON object (semicolons inside strings are not separators)."""
    decoder, parts, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            _obj, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return [body]  # not calls: _call refuses it
        parts.append(body[at:end])
        at = end
        while at < len(body) and body[at] in "; \n":
            at += 1
    return parts


def _call(text: str, args_key: str) -> dict | None:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args)}}
