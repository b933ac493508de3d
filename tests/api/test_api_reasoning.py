"""The reasoning split on /v1/chat/completions (vLLM's --reasoning-parser): `<think>...</think>` sent as
`reasoning`, its tokens counted in the usage, left out with include_reasoning false; the parsers read a stream
cut anywhere. The replies are fixed texts (`FakeLLMEngine(reply=...)`), the tools test_api_tools.py's.
"""

from __future__ import annotations

import pytest
from api_helpers import client, serve
from fake_engine import FakeLLMEngine, shared_tokenizer
from test_api_tools import ASK, CALL, REPLY, TOOLS, fake  # noqa: F401  (fake: a module fixture)

from tinyvllm.api.reasoning_parser import ThinkReasoningParser
from tinyvllm.api.tool_parser import HermesToolParser


def test_no_reasoning_parser_leaves_the_text_whole():
    with serve(lambda: FakeLLMEngine(reply=REPLY, max_model_len=1024, num_blocks=256)) as server:
        message = client(server).chat.completions.create(model="fake-smollm2", messages=ASK,
                                                         temperature=0).choices[0].message
    assert message.content == f"{REPLY}" and getattr(message, "reasoning", None) is None


def pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize("text", [REPLY, "<think>cut short", "  <thinking>no", "a <tool_call>{bad json}</tool_call> b",
                                  f"{CALL}\n{CALL}\n", '<tool_call>\n{"name": "add", "arguments": {"a": 1}}'])
def test_the_parsers_do_not_depend_on_how_the_text_is_cut(text):
    def run(chunks: list[str]):
        reasoning, tools, out = ThinkReasoningParser(), HermesToolParser(), ["", "", []]
        for i, chunk in enumerate(chunks):
            r, rest = reasoning.feed(chunk)
            if i == len(chunks) - 1:
                more = reasoning.finish()
                r, rest = r + more[0], rest + more[1]
            content, calls = tools.feed(rest)
            if i == len(chunks) - 1:
                more_content, more_calls = tools.finish()
                content, calls = content + more_content, calls + more_calls
            out = [out[0] + r, out[1] + content, out[2] + [(c.function.name, c.function.arguments) for c in calls]]
        return out

    whole = run([text])
    for size in (1, 2, 5):
        assert run(pieces(text, size)) == whole, size


# ---- reasoning tokens in the usage --------------------------------------------------------------------------

def test_reasoning_tokens_are_counted(fake):
    expected = len(shared_tokenizer().encode("The user wants the weather.", add_special_tokens=False))
    c = client(fake)
    response = c.chat.completions.create(model="fake-smollm2", messages=ASK, tools=TOOLS, temperature=0)
    assert response.usage.completion_tokens_details.reasoning_tokens == expected
    chunks = list(c.chat.completions.create(model="fake-smollm2", messages=ASK, tools=TOOLS, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == expected
    # before: the Responses API's output_tokens_details.reasoning_tokens stayed 0
    assert c.responses.create(model="fake-smollm2", input="Weather?",
                              temperature=0).usage.output_tokens_details.reasoning_tokens == expected
    events = list(c.responses.create(model="fake-smollm2", input="Weather?", temperature=0, stream=True))
    assert events[-1].response.usage.output_tokens_details.reasoning_tokens == expected


def test_include_reasoning_false_leaves_it_out_but_counts_it(fake):
    expected = len(shared_tokenizer().encode("The user wants the weather.", add_special_tokens=False))
    c = client(fake)
    request = dict(model="fake-smollm2", messages=ASK, tools=TOOLS, temperature=0,
                   extra_body={"include_reasoning": False})
    response = c.chat.completions.create(**request)
    message = response.choices[0].message
    assert getattr(message, "reasoning", None) is None and message.content == "I will check."
    assert response.usage.completion_tokens_details.reasoning_tokens == expected  # hidden, still billed (vLLM)
    chunks = list(c.chat.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    assert not any(getattr(ch.choices[0].delta, "reasoning", None) for ch in chunks if ch.choices)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == "I will check."
