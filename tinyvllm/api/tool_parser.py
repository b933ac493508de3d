"""Tool calling (OpenAI's `tools` / `tool_choice`) in the Hermes format that Qwen and many others use.

A model calls a tool by writing it as text; the server finds the calls in the output and returns them as
`message.tool_calls`. Three parts:

1. The prompt. A chat template with tool support reads a `tools` variable and writes the tools the way
   its model was trained on (tokenizer.apply_chat_template(..., tools=...)). A template without one, as
   SmolLM2's, gets `TOOLS_PROMPT`: a system-message block that lists the tools as JSON and asks for

       <tool_call>
       {"name": "get_weather", "arguments": {"city": "Paris"}}
       </tool_call>

   Past turns are rewritten the same way: an assistant's `tool_calls` become those blocks, a `tool`
   message a user turn holding `<tool_response>...</tool_response>`.

2. The constraint. tool_choice "required" or a named function may not be left to the model: the output
   follows `forced_tool_grammar`, a Lark grammar whose JSON part is a schema built from the functions'
   `parameters`, so a call is always there and its arguments always parse and validate. "auto" leaves the
   model free; "none" parses nothing.

3. The parser. `HermesToolParser` reads the output as it streams, sends the text around the calls as
   content, and each call once its closing tag is read. The non-streamed response runs the same parser
   over the whole text, so the two agree.

vLLM: `entrypoints/openai/tool_parsers/hermes_tool_parser.py`; the prompt is Qwen2.5's.
"""

from __future__ import annotations

import json
import uuid

from tinyvllm.api.protocol import FunctionCall, ToolCall
from tinyvllm.api.reasoning_parser import partial_tag_length
from tinyvllm.sample.structured_output import JSON_OPTIONS

START, END = "<tool_call>", "</tool_call>"

TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> \
XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def tool_call_text(name: str, arguments: dict | str) -> str:
    """One call as the model writes it."""
    return f"{START}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{END}"


def _arguments(tool_call: dict) -> dict | str:
    """A history tool call's arguments, as a dict where they parse (templates read them as one, as in vLLM)."""
    arguments = tool_call.get("function", {}).get("arguments", {})
    if isinstance(arguments, str):
        try:
            return json.loads(arguments)
        except json.JSONDecodeError:
            return arguments
    return arguments


def with_parsed_arguments(messages: list[dict]) -> list[dict]:
    """For a template with tool support: the messages, each assistant tool call's arguments as a dict."""
    out = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [{**call, "function": {**call.get("function", {}), "arguments": _arguments(call)}}
                     for call in message["tool_calls"]]
            message = {**message, "tool_calls": calls}
        out.append(message)
    return out


def with_default_tool_prompt(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """For a template without tool support: the tools in a system block, tool turns as plain text."""
    out = []
    for message in messages:
        if message["role"] == "tool":
            message = {"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"}
        elif message.get("tool_calls"):
            calls = [tool_call_text(call.get("function", {}).get("name", ""), _arguments(call))
                     for call in message["tool_calls"]]
            text = "\n".join([message["content"], *calls] if message["content"] else calls)
            message = {"role": message["role"], "content": text}
        out.append(message)
    if tools:
        block = TOOLS_PROMPT.format(tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def forced_tool_grammar(functions: list[dict]) -> str:
    """A Lark grammar (llguidance's dialect) for exactly one call to one of `functions` (OpenAI function
    definitions): the tags, then a JSON object whose "name" is one of theirs and whose "arguments" follow
    that function's parameters schema.

        start: "<tool_call>\\n" call "\\n</tool_call>"
        call: %json {"anyOf": [{"properties": {"name": {"const": "get_weather"}, "arguments": {...}}, ...}]}
    """
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or NO_PARAMETERS}}
             for f in functions]
    schema = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": JSON_OPTIONS}
    return f'start: "{START}\\n" call "\\n{END}"\ncall: %json {json.dumps(schema)}'


def parse_tool_call(body: str) -> ToolCall | None:
    """The call inside one pair of tags, or None when it is not {"name": str, "arguments": {...}}."""
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=value["name"], arguments=arguments))


class HermesToolParser:
    """Split an output into content and tool calls as it arrives.

    Text outside the tags is content, sent at once but for what could still be the start of `<tool_call>`
    and for trailing whitespace (held until more content follows: whitespace around the calls is dropped,
    so a reply of only calls has no content). A block that does not parse stays in the content as written.
    """

    def __init__(self):
        self.inside = False
        self.held = ""  # text not yet sent: a partial tag, or the body of an unfinished call
        self.whitespace = ""  # trailing whitespace of the content, held
        self.strip_leading = False  # just after a call: its following whitespace goes too
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """The content and the complete calls that `text` adds."""
        self.held += text
        content, calls = "", []
        while True:
            if not self.inside:
                start = self.held.find(START)
                if start < 0:
                    keep = partial_tag_length(self.held, START)
                    content += self._content(self.held[:len(self.held) - keep])
                    self.held = self.held[len(self.held) - keep:]
                    return content, calls
                content += self._content(self.held[:start])
                self.held, self.inside = self.held[start + len(START):], True
            else:
                end = self.held.find(END)
                if end < 0:
                    return content, calls
                body, self.held, self.inside = self.held[:end], self.held[end + len(END):], False
                call = parse_tool_call(body)
                if call is None:
                    content += self._content(START + body + END)
                else:
                    calls.append(call)
                    self.num_calls += 1
                    self.whitespace, self.strip_leading = "", True

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The output ended: an unclosed call that parses is a call (some models stop before the tag)."""
        held, self.held = self.held, ""
        content, calls = "", []
        if self.inside:
            call = parse_tool_call(held)
            if call is None:
                content += self._content(START + held)
            else:
                calls.append(call)
                self.num_calls += 1
        else:
            content += self._content(held)
        if not self.num_calls:
            content, self.whitespace = content + self.whitespace, ""
        return content, calls

    def _content(self, text: str) -> str:
        if self.strip_leading:
            text = text.lstrip()
            self.strip_leading = not text
        text = self.whitespace + text
        sent = text.rstrip()
        self.whitespace = text[len(sent):]
        return sent
