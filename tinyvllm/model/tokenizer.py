"""The tokenizer: text <-> token ids, the only part of the engine that sees strings.

Taught in docs/phases/01-foundation.md, section 6.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path


# Tokens that end a turn, beside the EOS id (Llama-3-Instruct ends turns with <|eot_id|>): llama.cpp's special_eog_ids
END_OF_TURN_TOKENS = (
    "<|im_end|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "<|end|>",
    "<end_of_turn>",
    "<EOT>",
    "</s>",
)


class Tokenizer:
    """What the engine needs from a tokenizer; a subclass gives every token's bytes and `_encode_ordinary`."""

    def __init__(
        self,
        *,
        token_bytes: list[bytes],
        added_tokens: dict[str, int],
        special_token_ids: Iterable[int],
        bos_token_id: int | None,
        eos_token_id: int | None,
        add_bos_token: bool,
        chat_template: str | None,
        extra_stop_token_ids: Iterable[int] = (),
        add_dummy_prefix: bool = False,
        token_strings: list[str] | None = None,
    ):
        self._token_bytes = token_bytes  # id -> raw bytes of that token
        # id -> the vocabulary's own spelling ("Ġis", "▁the"), added tokens as written; None: the decoded bytes
        self._token_strings = token_strings
        self.vocab_size: int = len(token_bytes)
        self.added_tokens = dict(added_tokens)  # content -> id, matched whole in the text
        for content, token_id in self.added_tokens.items() if token_strings is not None else ():
            token_strings[token_id] = content
        self.special_token_ids = frozenset(special_token_ids)
        for token_id in [*self.added_tokens.values(), *self.special_token_ids, bos_token_id, eos_token_id]:
            if token_id is not None and not 0 <= token_id < self.vocab_size:
                raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        # sentencepiece writes a space ("▁") before the text; decode takes it off again (HF's `Strip` decoder)
        self.add_dummy_prefix = add_dummy_prefix

        named_stops = {self.added_tokens[name] for name in END_OF_TURN_TOKENS if name in self.added_tokens}
        stops = {eos_token_id, *extra_stop_token_ids} | (named_stops & self.special_token_ids)
        self.stop_token_ids: frozenset[int] = frozenset(t for t in stops if t is not None)

        # one regex for every added token, longest first: HF matches leftmost-longest
        contents = sorted(self.added_tokens, key=len, reverse=True)
        self._added_tokens_re = re.compile("|".join(map(re.escape, contents))) if contents else None

    # --- what a subclass provides ----

    def _encode_ordinary(self, text: str, at_start: bool) -> list[int]:
        """Ids for `text`, which holds no added token."""
        raise NotImplementedError

    # --- encode ----

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`, added tokens written in it as their own ids; BOS iff `add_special_tokens` and
        `add_bos_token`."""
        ids = [self.bos_token_id] if add_special_tokens and self.add_bos_token and self.bos_token_id is not None else []
        pos = 0
        if self._added_tokens_re is not None:
            for match in self._added_tokens_re.finditer(text):
                if match.start() > pos:
                    ids += self._encode_ordinary(text[pos : match.start()], at_start=pos == 0)
                ids.append(self.added_tokens[match.group()])
                pos = match.end()
        if pos < len(text):
            ids += self._encode_ordinary(text[pos:], at_start=pos == 0)
        return ids

    def special_token_id(self, text: str) -> int | None:
        """The id of `text` when it is one special token of this vocabulary (`<image>`, `<tool_call>`), else None."""
        ids = self.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 and ids[0] in self.special_token_ids else None

    # --- decode ----

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token: not always valid UTF-8 alone (see `IncrementalDetokenizer`)."""
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")
        return self._token_bytes[token_id]

    def token_string(self, token_id: int) -> str:
        """The tokenizer's own spelling of a token, as HF's convert_ids_to_tokens ("Ġis", "▁the", "<0x0A>")."""
        raw = self.token_bytes(token_id)  # the range check
        return raw.decode("utf-8", errors="replace") if self._token_strings is None else self._token_strings[token_id]

    def is_special(self, token_id: int) -> bool:
        return token_id in self.special_token_ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """The tokens' bytes joined and decoded as UTF-8 (an invalid sequence becomes U+FFFD, as in HF)."""
        ids = [t for t in token_ids if not (skip_special_tokens and t in self.special_token_ids)]
        text = b"".join(self.token_bytes(t) for t in ids).decode("utf-8", errors="replace")
        return self.strip_dummy_prefix(text)

    def strip_dummy_prefix(self, text: str) -> str:
        """Take off the one space sentencepiece put in front of the text when encoding it."""
        return text[1:] if self.add_dummy_prefix and text.startswith(" ") else text

    # --- chat ----

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """The prompt text for a conversation by the model's template; `kwargs` are template variables, as in HF."""
        if self.chat_template is None:
            raise ValueError("this model has no chat template: pass a plain prompt, or a model with one")
        # imported here: jinja2 is a tenth of the engine's imports
        from tinyvllm.model.chat_template import render_chat_template
        # for templates' "{{ bos_token }}"
        names = {}
        for name, token_id in [("bos_token", self.bos_token_id), ("eos_token", self.eos_token_id)]:
            if token_id is not None:
                names[name] = self.token_bytes(token_id).decode("utf-8", errors="replace")
        variables = {**names, **kwargs}
        return render_chat_template(self.chat_template, messages, add_generation_prompt, **variables)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(vocab_size={self.vocab_size}, bos={self.bos_token_id}, eos={self.eos_token_id}, "
            f"add_bos_token={self.add_bos_token}, stop_token_ids={sorted(self.stop_token_ids)})"
        )


def load_tokenizer(path: str | os.PathLike) -> Tokenizer:
    """The tokenizer at `path`: a `.gguf` file, or an HF directory with `tokenizer.json` or `tokenizer.model`."""
    # imported here: both modules subclass `Tokenizer` from this one
    from tinyvllm.model.bpe import ByteLevelBPETokenizer
    from tinyvllm.model.sentencepiece_tokenizer import SentencePieceTokenizer

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no tokenizer at {path}: expected a .gguf file or a directory with tokenizer.json")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; pass a .gguf file or an HF model directory")
        from tinyvllm.model.gguf import GGUFFile

        metadata = GGUFFile(path).metadata
        model = metadata.get("tokenizer.ggml.model")
        if model == "gpt2":  # byte-level BPE
            return ByteLevelBPETokenizer.from_gguf_metadata(metadata)
        if model == "llama":  # sentencepiece
            return SentencePieceTokenizer.from_gguf_metadata(metadata)
        raise ValueError(
            f"{path}: GGUF tokenizer model {model!r} is not supported; supported: 'gpt2' (byte-level BPE), "
            "'llama' (sentencepiece)"
        )

    config = _read_json(path / "tokenizer_config.json")
    has_sentencepiece = (path / "tokenizer.model").is_file()
    if (path / "tokenizer.json").is_file():
        tokenizer_json = _read_json(path / "tokenizer.json")
        # Llama-2 repos ship both files; their tokenizer.json is HF's sentencepiece look-alike, not byte-level
        byte_level = (tokenizer_json.get("decoder") or {}).get("type") == "ByteLevel"
        if byte_level or not has_sentencepiece:
            return ByteLevelBPETokenizer.from_tokenizer_json(
                tokenizer_json, config, _chat_template(path, config), _generation_eos_ids(path)
            )
    if has_sentencepiece:
        return SentencePieceTokenizer.from_model_file(
            path / "tokenizer.model", config, _chat_template(path, config), _generation_eos_ids(path)
        )
    raise FileNotFoundError(f"{path} holds neither tokenizer.json nor tokenizer.model")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _chat_template(model_dir: Path, config: dict) -> str | None:
    """The model's chat template: `chat_template.jinja`, or tokenizer_config.json's (a string or named templates)."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    return template


def _generation_eos_ids(model_dir: Path) -> list[int]:
    """EOS ids from generation_config.json, which may list several (vLLM stops on all of them)."""
    eos = _read_json(model_dir / "generation_config.json").get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


def token_id_of(token: str | dict | None, vocab: dict[str, int]) -> int | None:
    """The id of a special token as tokenizer_config.json names it ("<s>" or {"content": "<s>", ...})."""
    if isinstance(token, dict):
        token = token.get("content")
    return vocab.get(token) if token is not None else None
