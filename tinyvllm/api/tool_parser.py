"""Tool calling (OpenAI's `tools` / `tool_choice`): the prompt (TOOLS_PROMPT where the template has no tool
support), the forced-call grammar, the parsers of `--tool-call-parser` (hermes, llama3_json: vLLM's
`tool_parsers/`), and the `ToolCallPolicy` that decides which calls a client gets.
Taught in docs/phases/09-appendix-tools-and-reasoning.md.
"""

from __future__ import annotations

import json
import logging
import uuid

from tinyvllm.api.protocol import FunctionCall, ToolCall
from tinyvllm.api.reasoning_parser import partial_tag_length
from tinyvllm.sample.structured_output import JSON_OPTIONS, schema_validator

logger = logging.getLogger("tinyvllm.api")

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
    """A history tool call's arguments, as a dict where they parse (as in vLLM)."""
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


def call_rules(functions: list[dict], arguments_key: str = "arguments") -> str:
    """Lark rules for one call, `call: call_0 | call_1 | ...`, one per function, its parameters a whole schema
    (`arguments_0: %json {...}`) so that their "#/$defs/..." `$ref`s resolve (docs: 09-appendix-tools-and-reasoning).
    """
    rules = ["call: " + " | ".join(f"call_{i}" for i in range(len(functions)))]
    for i, function in enumerate(functions):
        head = json.dumps(f'{{"name": {json.dumps(function["name"])}, "{arguments_key}": ')  # a Lark string literal
        schema = {**(function.get("parameters") or NO_PARAMETERS), "x-guidance": JSON_OPTIONS}
        rules += [f'call_{i}: {head} arguments_{i} "}}"', f"arguments_{i}: %json {json.dumps(schema)}"]
    return "\n".join(rules)


def forced_tool_grammar(functions: list[dict], parallel: bool = False) -> str:
    """A Lark grammar (llguidance's dialect) for a call to one of `functions`, or one or more when `parallel`.

        start: block ("\\n" block)*              (parallel; else start: block)
        block: "<tool_call>\\n" call "\\n</tool_call>"
        call: call_0 | call_1 | ...              (`call_rules`: one per function)
    """
    start = 'start: block ("\\n" block)*' if parallel else "start: block"
    return f'{start}\nblock: "{START}\\n" call "\\n{END}"\n{call_rules(functions)}'


class ToolCallPolicy:
    """Which calls a client gets: undeclared ones dropped, one without parallel calls, bad arguments left as text
    (`forced` calls: dropped, as only max_tokens can cut a call the grammar writes)."""

    def __init__(self, functions: list[dict], parallel: bool = True, forced: bool = False):
        self.functions = {f["name"]: f for f in functions}
        self.parallel = parallel
        self.forced = forced
        self._validators: dict[str, object] = {}

    def check(self, call: ToolCall, num_kept: int) -> str:
        """"keep", "drop" (undeclared, or a second call without parallel calls) or "invalid" (bad arguments)."""
        function = self.functions.get(call.function.name)
        if function is None:
            logger.info("dropped a call to %r, which is not among the declared tools", call.function.name)
            return "drop"
        if num_kept and not self.parallel:
            return "drop"
        if call.function.name not in self._validators:
            self._validators[call.function.name] = schema_validator(function.get("parameters") or NO_PARAMETERS)
        try:
            arguments = json.loads(call.function.arguments)
        except json.JSONDecodeError:
            return "invalid"
        error = self._validators[call.function.name](arguments)
        if error:
            logger.info("a call to %r has arguments that do not fit its schema: %s", call.function.name, error)
            return "invalid"
        return "keep"


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


class ToolParser:
    """A parser: `feed(text)` -> (content, calls) as the output arrives, `finish()` at its end; each call found goes
    through the `ToolCallPolicy` (None: every call kept)."""

    def __init__(self, policy: ToolCallPolicy | None = None):
        self.policy = policy
        self.num_calls = 0

    def admit(self, call: ToolCall | None, text: str) -> tuple[str, ToolCall | None]:
        """A call found in `text` (None: the text did not parse as one) -> (content, the call if kept)."""
        verdict = "invalid" if call is None else "keep" if self.policy is None else self.policy.check(
            call, self.num_calls)
        if verdict == "invalid" and self.policy is not None and self.policy.forced:
            verdict = "drop"
        if verdict == "keep":
            self.num_calls += 1
            return "", call
        return ("" if verdict == "drop" else text), None

    @staticmethod
    def forced_grammar(functions: list[dict], parallel: bool) -> str:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """Split an output into content and tool calls as it arrives."""

    def __init__(self, policy: ToolCallPolicy | None = None):
        super().__init__(policy)
        self.inside = False
        self.held = ""  # text not yet sent: a partial tag, or the body of an unfinished call
        self.whitespace = ""
        self.strip_leading = False

    forced_grammar = staticmethod(forced_tool_grammar)

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
                text, call = self.admit(parse_tool_call(body), START + body + END)
                content += self._content(text)
                if call is not None:
                    calls.append(call)
                if not text:
                    self.whitespace, self.strip_leading = "", True

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The output ended: an unclosed call that parses is a call (some models stop before the tag)."""
        held, self.held = self.held, ""
        content, calls = "", []
        if self.inside:
            text, call = self.admit(parse_tool_call(held), START + held)
            content += self._content(text)
            calls += [call] if call is not None else []
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


class Llama3JsonToolParser(ToolParser):
    """Llama 3.1+'s JSON tool calls (vLLM's `llama3_json`): `{"name": ..., "parameters": {...}}`, several separated
    by `;`, optionally after `<|python_tag|>`."""

    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, policy: ToolCallPolicy | None = None):
        super().__init__(policy)
        self.held = ""
        self.mode: str | None = None

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.held += text
        if self.mode is None:
            start = self.held.lstrip()
            if not start or (len(start) < len(self.PYTHON_TAG) and self.PYTHON_TAG.startswith(start)):
                return "", []  # not yet known
            self.mode = "calls" if start.startswith(("{", self.PYTHON_TAG)) else "content"
        if self.mode == "calls":
            return "", []
        content, self.held = self.held, ""
        return content, []

    def finish(self) -> tuple[str, list[ToolCall]]:
        held, self.held = self.held, ""
        if self.mode != "calls":
            return held, []
        body = held.strip().removeprefix(self.PYTHON_TAG)
        content, calls = [], []
        for part in split_json_objects(body):
            text, call = self.admit(parse_tool_call(part), part)
            content += [text] if text else []
            calls += [call] if call is not None else []
        return ("; ".join(content) if calls else held if content else ""), calls

    @staticmethod
    def forced_grammar(functions: list[dict], parallel: bool) -> str:
        """One call, or several separated by "; " when `parallel`: {"name": ..., "parameters": {...}}."""
        start = 'start: call ("; " call)*' if parallel else "start: call"
        return f"{start}\n{call_rules(functions, 'parameters')}"


def split_json_objects(text: str) -> list[str]:
    """'{...}; {...}' -> ['{...}', '{...}']: the top-level objects as written; other text is one more part."""
    parts, outside, depth, start, in_string, escaped = [], "", 0, 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"' and depth:
            in_string = True
        elif ch == "{":
            start = i if depth == 0 else start
            depth += 1
        elif ch == "}" and depth:
            depth -= 1
            if depth == 0:
                parts.append(text[start:i + 1])
        elif not depth:
            outside += ch
    if depth:
        parts.append(text[start:])
    if outside.strip(" ;\n\t"):
        parts.append(outside.strip(" ;\n\t"))
    return parts


TOOL_PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}
