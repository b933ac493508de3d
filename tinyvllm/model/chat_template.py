"""Chat templates: a conversation -> the exact prompt text the model was trained on, rendered in an environment
like HF's (transformers' `utils/chat_template_utils.py`): a sandbox (templates are untrusted code), `trim_blocks`,
`lstrip_blocks`, `loopcontrols`, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII.
Taught in docs/phases/01-appendix-tokens-and-sampling.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False):
    # Jinja's own tojson escapes <, >, & for HTML, which would change the prompt
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    return _environment().from_string(template)


@lru_cache(maxsize=16)
def template_variables(template: str) -> frozenset[str]:
    """The variables a template reads from outside ("tools" when it renders tool definitions)."""
    return frozenset(jinja2.meta.find_undeclared_variables(_environment().parse(template)))


@lru_cache(maxsize=16)
def iterates_content(template: str) -> bool:
    """Whether the template loops over a message's content parts (vLLM's "openai" content format: SmolVLM's), so
    it is given parts, not a string."""
    for loop in _environment().parse(template).find_all(jinja2.nodes.For):
        it = loop.iter
        if (isinstance(it, jinja2.nodes.Getitem) and isinstance(it.arg, jinja2.nodes.Const)
                and it.arg.value == "content"
                or isinstance(it, jinja2.nodes.Getattr) and it.attr == "content"):
            return True
    return False


def content_text(content: list, where: str, read_image: Callable[[dict, str], str] | None = None,
                 image_kinds: tuple[str, ...] = ("image_url",)) -> str:
    """A message's content parts joined into its text: an image part (`image_kinds`) becomes what
    `read_image(part, where)` returns, its placeholder; read_image None: a model that takes no images."""
    kinds = ("text",) if read_image is None else ("text", *image_kinds)
    if any(not isinstance(part, dict) or part.get("type") not in kinds for part in content):
        raise ValueError(f"{where}: only {' and '.join(kinds)} content parts are supported"
                         + ("" if read_image is not None else " (this model takes no images)"))
    texts = []
    for j, part in enumerate(content):
        if part["type"] != "text":
            texts.append(read_image(part, f"{where}.content[{j}]"))
        elif isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            raise ValueError(f"{where}.content[{j}].text must be a string, got {part.get('text')!r}")
    return "".join(texts)


def content_parts(content: str, placeholder: str | None) -> list[dict]:
    """A message's text as content parts, each `placeholder` (an image's place) an image part."""
    pieces = content.split(placeholder) if placeholder else [content]
    parts = [{"type": "text", "text": pieces[0]}] if pieces[0] else []
    for piece in pieces[1:]:
        parts += [{"type": "image"}] + ([{"type": "text", "text": piece}] if piece else [])
    return parts


def template_messages(template: str, messages: list[dict], placeholder: str | None) -> list[dict]:
    """The messages as the template reads them: text content, or content parts for a template that loops over them."""
    if not iterates_content(template):
        return messages
    return [{**m, "content": content_parts(m["content"], placeholder)} for m in messages]


def validate_messages(messages: object) -> None:
    """A conversation is a list of {"role": str, "content": str | list of parts | None} dicts."""
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must hold at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] needs a string 'role' (e.g. 'system', 'user', 'assistant')")
        if "content" not in message and "tool_calls" not in message:
            raise ValueError(f"messages[{i}] (role {message['role']!r}) has no 'content'")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            kind = type(content).__name__
            raise ValueError(f"messages[{i}]['content'] must be a string or a list of parts, got {kind}")


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True, **variables) -> str:
    """The prompt text for `messages`."""
    validate_messages(messages)
    try:
        return _compile(template).render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.exceptions.TemplateError as e:  # raise_exception("Conversation roles must alternate ...")
        raise ValueError(f"chat template: {e}") from e
