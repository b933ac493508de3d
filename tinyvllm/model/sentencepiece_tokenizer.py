"""sentencepiece tokenizers (Llama 2, Mistral v0.1, TinyLlama), with HF `LlamaTokenizer`'s conventions around it.

    "Hello world"  ->  "▁Hello▁world"  ->  ["▁Hello", "▁world"]  ->  [15043, 3186]

Taught in docs/phases/01-appendix-tokens-and-sampling.md.
"""

from __future__ import annotations

from pathlib import Path

import sentencepiece

from tinyvllm.model.sentencepiece_model import PIECE_USER_DEFINED, model_proto_from_gguf, without_dummy_prefix
from tinyvllm.model.tokenizer import Tokenizer, token_id_of


class SentencePieceTokenizer(Tokenizer):
    """sentencepiece model + the HF conventions around it (added tokens, dummy prefix, BOS)."""

    def __init__(self, model_proto: bytes, config: dict, chat_template: str | None, extra_stop_token_ids: list[int]):
        proto, add_dummy_prefix, removes_whitespace = without_dummy_prefix(model_proto)
        if removes_whitespace:
            raise ValueError(
                "sentencepiece models that collapse whitespace (remove_extra_whitespaces=true) are not supported; "
                "Llama-family models keep it"
            )
        self._sp = sentencepiece.SentencePieceProcessor(model_proto=proto)
        sp = self._sp
        n = sp.get_piece_size()

        def piece_bytes(i: int) -> bytes:
            piece = sp.id_to_piece(i)
            if sp.is_byte(i):  # "<0xE6>"
                return bytes([int(piece[3:-1], 16)])
            if sp.is_control(i) or sp.is_unknown(i):  # "<s>", "</s>", "<unk>": written as themselves
                return piece.encode("utf-8")
            return piece.replace("▁", " ").encode("utf-8")

        # added tokens: control and unknown pieces, and tokenizer_config.json's
        added = {sp.id_to_piece(i): i for i in range(n) if sp.is_control(i) or sp.is_unknown(i)}
        special = set(added.values())
        for token_id, token in config.get("added_tokens_decoder", {}).items():
            added[token["content"]] = int(token_id)
            if token.get("special", True):
                special.add(int(token_id))
        token_bytes = [piece_bytes(i) for i in range(n)]
        token_bytes += [b""] * (max([n - 1, *added.values()]) + 1 - n)
        for content, token_id in added.items():
            token_bytes[token_id] = content.encode("utf-8")

        ids = {sp.id_to_piece(i): i for i in range(n)} | added
        bos = token_id_of(config.get("bos_token"), ids) if "bos_token" in config else _or_none(sp.bos_id())
        eos = token_id_of(config.get("eos_token"), ids) if "eos_token" in config else _or_none(sp.eos_id())
        add_bos = config.get("add_bos_token")  # not stated: True, Llama-2's models are trained with <s> first
        add_prefix = config.get("add_prefix_space")
        if add_prefix is None:
            add_prefix = add_dummy_prefix
        # HF `_get_prepend_scheme`: "always" (legacy), "first" (the default), or "never"
        self._prepend_scheme = ("always" if config.get("legacy", False) else "first") if add_prefix else "never"
        super().__init__(
            token_bytes=token_bytes,
            added_tokens=added,
            special_token_ids=special,
            bos_token_id=bos,
            eos_token_id=eos,
            add_bos_token=True if add_bos is None else bool(add_bos),
            chat_template=chat_template,
            extra_stop_token_ids=extra_stop_token_ids,
            add_dummy_prefix=bool(add_prefix),
            token_strings=[sp.id_to_piece(i) for i in range(n)] + [""] * (len(token_bytes) - n),
        )

    @classmethod
    def from_model_file(
        cls, path: str | Path, config: dict, chat_template: str | None, extra_stop_token_ids: list[int]
    ) -> SentencePieceTokenizer:
        return cls(Path(path).read_bytes(), config, chat_template, extra_stop_token_ids)

    @classmethod
    def from_gguf_metadata(cls, metadata: dict) -> SentencePieceTokenizer:
        """From a GGUF's `tokenizer.ggml.*` keys (`tokenizer.ggml.model == "llama"`, Llama-2 GGUFs)."""
        tokens: list[str] = metadata["tokenizer.ggml.tokens"]
        types: list[int] = metadata.get("tokenizer.ggml.token_type") or []

        def token(key: str) -> str | None:
            token_id = metadata.get(f"tokenizer.ggml.{key}_token_id")
            return None if token_id is None else tokens[token_id]

        # the settings tokenizer_config.json would hold, as the GGUF states them
        user_defined = {
            str(i): {"content": tokens[i], "special": False} for i, t in enumerate(types) if t == PIECE_USER_DEFINED
        }
        config = {
            "bos_token": token("bos"),
            "eos_token": token("eos"),
            "add_bos_token": metadata.get("tokenizer.ggml.add_bos_token", True),
            "added_tokens_decoder": user_defined,
        }
        end_of_turn = [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
        stops = [t for t in end_of_turn if t is not None]
        return cls(model_proto_from_gguf(metadata), config, metadata.get("tokenizer.chat_template"), stops)

    def _encode_ordinary(self, text: str, at_start: bool) -> list[int]:
        # the dummy prefix where HF's Metaspace puts it
        prepend = self._prepend_scheme == "always" or (self._prepend_scheme == "first" and at_start)
        if prepend and not text.startswith(" "):
            text = " " + text
        return self._sp.encode(text)


def _or_none(token_id: int) -> int | None:
    return token_id if token_id >= 0 else None  # sentencepiece says -1 for "this model has none"
