"""Byte-level BPE (GPT-2, Llama 3, SmolLM2, Qwen2), run by tiktoken.

Taught in docs/phases/01-appendix-tokens-and-sampling.md.
"""

from __future__ import annotations

import json
import unicodedata
from functools import lru_cache

import tiktoken

from tinyvllm.model.tokenizer import Tokenizer, token_id_of

# The pre-tokenizer regexes, by GGUF `tokenizer.ggml.pre` name (llama.cpp's llama-vocab.cpp keeps the same table).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Llama-3 (the regex Meta's own tiktoken tokenizer uses): contractions in any case, numbers of 1-3 digits
LLAMA3_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)
# SmolLM2 / StarCoder: HF's Digits(individual_digits) then GPT-2's regex, as one regex: every digit alone, and a
# whitespace run before a digit ends there whole (for GPT-2's `\s+(?!\S)` the digit ends its piece)
SMOLLM_PATTERN = r"""\p{N}|'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+(?![^\s\p{N}])|\s+"""

# Qwen2 / Qwen2.5 / Qwen3: Llama-3's regex with every digit alone (\p{N}, not \p{N}{1,3})
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+"""
)

PRETOKENIZER_PATTERNS = {
    "gpt2": GPT2_PATTERN,
    "gpt-2": GPT2_PATTERN,
    "llama-bpe": LLAMA3_PATTERN,
    "llama3": LLAMA3_PATTERN,
    "llama-v3": LLAMA3_PATTERN,
    "smollm": SMOLLM_PATTERN,
    "starcoder": SMOLLM_PATTERN,
    "qwen2": QWEN2_PATTERN,
}
# Text normalizations an HF tokenizer.json may ask for before the split (Qwen's: NFC, composed accents)
NORMALIZERS = ("NFC",)

# GGUF token types (llama.cpp `llama_token_type`)
GGUF_TOKEN_CONTROL = 3  # special: <|im_start|>, <|endoftext|>
GGUF_TOKEN_USER_DEFINED = 4  # added but not special: matched whole in text, kept by skip_special_tokens


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's spelling of each byte as a printable character: byte -> character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in printable}
    shifted = (b for b in range(256) if b not in spelling)
    for n, b in enumerate(shifted):
        spelling[b] = chr(256 + n)  # space (0x20) is the 33rd unprintable byte: chr(256 + 32) = "Ġ"
    return spelling


@lru_cache(maxsize=1)
def _unicode_to_bytes() -> dict[str, int]:
    return {char: b for b, char in bytes_to_unicode().items()}


@lru_cache(maxsize=1)
def _unspell_table() -> dict[int, str]:
    """`str.translate` table: each alphabet character -> its byte's; other code points < 256 -> one that latin-1
    cannot encode."""
    table = {ord(char): chr(b) for char, b in _unicode_to_bytes().items()}
    return {**{c: "\U00010000" for c in range(256) if c not in table}, **table}


def unspell(token: str) -> bytes | None:
    """The raw bytes of a token written in GPT-2's byte alphabet ("Ġthe" -> b" the"), None if it is not."""
    try:
        return token.translate(_unspell_table()).encode("latin-1")
    except UnicodeEncodeError:  # a character outside the alphabet
        return None


class ByteLevelBPETokenizer(Tokenizer):
    """Byte-level BPE from a vocabulary (token -> id, GPT-2 spelling) and its ranked merges."""

    def __init__(
        self,
        vocab: dict[str, int],
        merges: list[tuple[str, str]],
        pattern: str,
        added_tokens: dict[str, int],
        special_token_ids: set[int],
        normalizer: str | None = None,
        **kwargs,
    ):
        assert normalizer is None or normalizer in NORMALIZERS, f"unknown normalizer {normalizer!r}"
        self.normalizer = normalizer
        vocab_size = max([*vocab.values(), *added_tokens.values()]) + 1
        token_bytes = [b""] * vocab_size
        for token, token_id in vocab.items():
            raw = unspell(token)
            token_bytes[token_id] = raw if raw is not None else token.encode("utf-8")
        spellings = [""] * vocab_size  # GPT-2's spelling of each token
        for token, token_id in vocab.items():
            spellings[token_id] = token
        for content, token_id in added_tokens.items():
            token_bytes[token_id] = content.encode("utf-8")  # added tokens are stored as written, not spelled
        super().__init__(token_bytes=token_bytes, added_tokens=added_tokens, special_token_ids=special_token_ids,
                         token_strings=spellings, **kwargs)

        # bytes -> rank for tiktoken; rank -> token id (None: a byte the vocabulary lacks)
        added_ids = set(added_tokens.values())
        ranks = {bytes([b]): b for b in range(256)}
        self._rank_to_id: list[int | None] = [None] * (256 + len(merges))
        for token_id in vocab.values():
            raw = token_bytes[token_id]
            if len(raw) == 1 and token_id not in added_ids:
                self._rank_to_id[raw[0]] = token_id
        for i, (left, right) in enumerate(merges):
            merged = left + right
            if left not in vocab or right not in vocab or merged not in vocab:
                raise ValueError(f"merge #{i} {left!r} + {right!r} uses or makes a token that is not in the vocabulary")
            raw = token_bytes[vocab[merged]]
            if raw in ranks:  # a second merge making the same token: the first one decides its rank
                continue
            ranks[raw] = 256 + i
            self._rank_to_id[256 + i] = vocab[merged]
        self.pattern = pattern
        self._bpe = tiktoken.Encoding("tinyvllm-bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})

    def _encode_ordinary(self, text: str, at_start: bool) -> list[int]:
        rank_to_id = self._rank_to_id
        if self.normalizer is not None:
            text = unicodedata.normalize(self.normalizer, text)
        return [rank_to_id[r] for r in self._bpe.encode_ordinary(text) if rank_to_id[r] is not None]

    # --- readers ----

    @classmethod
    def from_gguf_metadata(cls, metadata: dict) -> ByteLevelBPETokenizer:
        """From a GGUF's `tokenizer.ggml.*` keys (`tokenizer.ggml.model == "gpt2"`)."""
        tokens: list[str] = metadata["tokenizer.ggml.tokens"]
        types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        pre = metadata.get("tokenizer.ggml.pre", "gpt2")
        if pre not in PRETOKENIZER_PATTERNS:
            raise ValueError(
                f"GGUF pre-tokenizer {pre!r} is not supported; supported: {', '.join(sorted(PRETOKENIZER_PATTERNS))}"
            )
        merges = [_split_merge(m) for m in metadata["tokenizer.ggml.merges"]]
        added = {tok: i for i, tok in enumerate(tokens) if types[i] in (GGUF_TOKEN_CONTROL, GGUF_TOKEN_USER_DEFINED)}
        special = {i for i, t in enumerate(types) if t == GGUF_TOKEN_CONTROL}
        vocab = {tok: i for i, tok in enumerate(tokens) if i not in special}
        end_of_turn = [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
        return cls(
            vocab,
            merges,
            PRETOKENIZER_PATTERNS[pre],
            added,
            special,
            normalizer="NFC" if pre == "qwen2" else None,  # what Qwen's own tokenizer.json asks for
            bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=metadata.get("tokenizer.ggml.eos_token_id"),
            add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=metadata.get("tokenizer.chat_template"),
            extra_stop_token_ids=[t for t in end_of_turn if t is not None],
        )

    @classmethod
    def from_tokenizer_json(
        cls, tokenizer_json: dict, config: dict, chat_template: str | None, extra_stop_token_ids: list[int]
    ) -> ByteLevelBPETokenizer:
        """From HF's `tokenizer.json` (a byte-level BPE model) and `tokenizer_config.json`."""
        model = tokenizer_json.get("model", {})
        if model.get("type") != "BPE" or model.get("byte_fallback") or model.get("continuing_subword_prefix"):
            settings = {k: v for k, v in model.items() if k not in ("vocab", "merges")}
            raise ValueError(
                f"tokenizer.json: only byte-level BPE models are supported, got model {_brief(settings)}; "
                "for a sentencepiece model (byte_fallback), put its tokenizer.model in the directory"
            )
        normalizer = tokenizer_json.get("normalizer")
        if normalizer is not None and normalizer.get("type") not in NORMALIZERS:
            raise ValueError(f"tokenizer.json: normalizer {_brief(normalizer)} is not supported; supported: "
                             f"{', '.join(NORMALIZERS)}")
        pattern = pattern_from_pre_tokenizer(tokenizer_json.get("pre_tokenizer"))
        merges = [_split_merge(m) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        added = {t["content"]: t["id"] for t in tokenizer_json.get("added_tokens", [])}
        special = {t["id"] for t in tokenizer_json.get("added_tokens", []) if t.get("special")}
        vocab = {tok: i for tok, i in model["vocab"].items() if i not in special}
        ids = {**model["vocab"], **added}
        bos = token_id_of(config.get("bos_token"), ids)
        add_bos = config.get("add_bos_token")
        if add_bos is None:  # not stated: does the post-processor put BOS in front?
            add_bos = bos is not None and bos in _post_processor_prefix_ids(tokenizer_json.get("post_processor"))
        return cls(
            vocab,
            merges,
            pattern,
            added,
            special,
            normalizer=None if normalizer is None else normalizer["type"],
            bos_token_id=bos,
            eos_token_id=token_id_of(config.get("eos_token"), ids),
            add_bos_token=bool(add_bos),
            chat_template=chat_template,
            extra_stop_token_ids=extra_stop_token_ids,
        )


def pattern_from_pre_tokenizer(pre: dict | None) -> str:
    """The split regex of an HF byte-level `pre_tokenizer`, in the three shapes real models use."""
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else [pre or {}]
    kinds = [step.get("type") for step in steps]
    if kinds and kinds[-1] == "ByteLevel" and not steps[-1].get("add_prefix_space", False):
        uses_regex = steps[-1].get("use_regex", True)
        if kinds == ["ByteLevel"] and uses_regex:  # GPT-2: the regex lives inside ByteLevel
            return GPT2_PATTERN
        if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and uses_regex:  # SmolLM2
            return SMOLLM_PATTERN
        split = steps[0]
        if (
            kinds == ["Split", "ByteLevel"]
            and not uses_regex
            and "Regex" in split.get("pattern", {})
            and split.get("behavior") == "Isolated"
            and not split.get("invert")
        ):  # Llama-3, Qwen2: an explicit Split, then ByteLevel only spells the bytes
            return split["pattern"]["Regex"]
    raise ValueError(f"tokenizer.json: pre_tokenizer {_brief(pre)} is not supported")


def _post_processor_prefix_ids(post: dict | None) -> set[int]:
    """Ids a TemplateProcessing post-processor puts before the text (searched inside a Sequence)."""
    if not post:
        return set()
    if post.get("type") == "Sequence":
        return set().union(*(_post_processor_prefix_ids(p) for p in post.get("processors", [])))
    if post.get("type") != "TemplateProcessing" or not post.get("single"):
        return set()
    first = post["single"][0].get("SpecialToken")
    if first is None:
        return set()
    return set(post.get("special_tokens", {}).get(first["id"], {}).get("ids", []))


def _split_merge(merge: str) -> tuple[str, str]:
    left, sep, right = merge.partition(" ")  # spelled tokens never hold a real space: it is written "Ġ"
    if not sep or not left or not right:
        raise ValueError(f"malformed merge {merge!r}: expected two tokens separated by a space")
    return left, right


def _brief(obj: object) -> str:
    text = json.dumps(obj)
    return text if len(text) <= 200 else text[:200] + "..."
