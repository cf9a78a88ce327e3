"""Chat templates that take tools, in the two call formats the server parses, for a model whose own
template takes none (SmolLM2-135M-Instruct). Each keeps the structure of the published template
it is named after (Qwen2.5's hermes blocks, Llama 3.1's JSON calls after a tool list), cut to
what tests need."""

from __future__ import annotations

import os
from pathlib import Path

# Qwen2.5-Instruct's format: tools listed in the system turn, calls in <tool_call> blocks,
# results in <tool_response> blocks of a user turn.
HERMES = """{%- if tools %}<|im_start|>system
{{ messages[0]['content'] if messages[0]['role'] == 'system' else 'You are a helpful assistant.' }}

# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and tools %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

# Llama 3.1-Instruct's format: the tools in the first user turn, a call as one JSON object
# {"name", "parameters"}, results in ipython turns.
LLAMA3_JSON = """{%- for message in messages %}
{%- if loop.first and tools %}<|im_start|>user
Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.

{% for tool in tools %}{{ tool | tojson }}

{% endfor %}{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>ipython
{{ message.content }}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def with_chat_template(model_dir: Path, dest: Path, template: str) -> Path:
    """``model_dir`` with ``template`` as its chat template: every other file linked, not copied."""
    dest.mkdir(parents=True, exist_ok=True)
    for item in Path(model_dir).iterdir():
        if item.name != "chat_template.jinja" and not (dest / item.name).exists():
            os.symlink(item.resolve(), dest / item.name)
    (dest / "chat_template.jinja").write_text(template)
    return dest
