"""Structured outputs: llguidance's per-request bitmask of the tokens a grammar allows next
(docs/phases/09-api-server.md, section 6)."""

from __future__ import annotations

import json
import re

import numpy as np

from tinyvllm.model.tokenizer import Tokenizer
from tinyvllm.sampling_params import StructuredOutputsParams


# JSON as json.dumps writes it
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


# below llguidance's 250,000: a lexer state takes 1-2 kB
MAX_LEXER_STATES = 20_000
MAX_GRAMMAR_SIZE = 100_000
GBNF_RULE = re.compile(r"(?m)^\s*[A-Za-z_][A-Za-z0-9_-]*\s*::=")  # `name ::= ...`


def grammar_limits():
    """The LLParserLimits every matcher, and every check of a grammar, runs under."""
    from llguidance import LLParserLimits

    return LLParserLimits(max_lexer_states=MAX_LEXER_STATES, max_grammar_size=MAX_GRAMMAR_SIZE,
                          verbose_errors=False)


def lark_of(grammar: str) -> str:
    """A Lark grammar as it is; a GBNF one (llama.cpp's, `root ::= ...`) converted by llguidance."""
    if GBNF_RULE.search(grammar) is None:
        return grammar
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(grammar)
    except Exception as e:  # GbnfToLarkError, or a construct the converter does not know
        raise ValueError(f"the GBNF grammar does not convert: {e}") from e


def grammar_of(params: StructuredOutputsParams) -> str:
    """The llguidance grammar for one request's constraint (exactly one of its fields is set)."""
    from llguidance import LLMatcher

    if params.json is not None:
        schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
        try:
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except ValueError as e:
            raise ValueError(f"structured_outputs.json is not a valid JSON schema: {e}") from e
    if params.json_object:
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=JSON_OPTIONS)
    if params.regex is not None:
        return LLMatcher.grammar_from_regex(params.regex)
    if params.choice is not None:
        return LLMatcher.grammar_from_regex("|".join(re.escape(choice) for choice in params.choice))
    return LLMatcher.grammar_from_lark(lark_of(params.grammar))


class _VocabularyView:
    """What llguidance's TokenizerWrapper reads of a tokenizer: every token's bytes and how text encodes."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [tokenizer.token_bytes(t) for t in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(tokenizer.special_token_ids)

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return self.tokenizer.encode(text, add_special_tokens=False)


class StructuredOutputManager:
    """One per engine: the tokenizer's trie (built on first use) and a matcher per request."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        self._ll_tokenizer = None

    @property
    def ll_tokenizer(self):
        if self._ll_tokenizer is None:
            from llguidance import LLTokenizer, TokenizerWrapper

            stops = sorted(self.tokenizer.stop_token_ids)  # a finished grammar allows these
            self._ll_tokenizer = LLTokenizer(TokenizerWrapper(_VocabularyView(self.tokenizer)), eos_token=stops)
        return self._ll_tokenizer

    def matcher(self, params: StructuredOutputsParams):
        """A fresh matcher for a request; a grammar that does not compile is a ValueError naming why."""
        from llguidance import LLMatcher

        matcher = LLMatcher(self.ll_tokenizer, grammar_of(params), log_level=0, limits=grammar_limits())
        if matcher.is_error():
            raise ValueError(f"structured_outputs: {matcher.get_error()}")
        return matcher

    def allocate_bitmask(self, rows: int) -> np.ndarray:
        """(rows, ceil(V / 32)) int32, all tokens allowed."""
        return np.full((rows, -(-self.vocab_size // 32)), -1, dtype=np.int32)

    @staticmethod
    def fill_bitmask(matcher, bitmask: np.ndarray, row: int) -> None:
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(matcher, bitmask, row)
        if matcher.is_error():
            raise RuntimeError(f"structured output matcher failed: {matcher.get_error()}")

    @staticmethod
    def accept(matcher, token_id: int) -> None:
        if not matcher.consume_token(token_id):
            raise RuntimeError(f"token {token_id} does not fit the grammar: {matcher.get_error()}")


class _ByteVocabulary:
    """A vocabulary of the 256 bytes and an end token: llguidance then matches text byte by byte, with no model."""

    tokens = [bytes([b]) for b in range(256)] + [b"<end>"]
    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)


_byte_tokenizer = None


def schema_validator(schema: dict):
    """A function value -> "" if `value` fits the JSON `schema`, else why not (the grammar run over its JSON)."""
    global _byte_tokenizer
    from llguidance import LLMatcher, LLTokenizer, TokenizerWrapper

    if _byte_tokenizer is None:
        _byte_tokenizer = LLTokenizer(TokenizerWrapper(_ByteVocabulary()))
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
    error = LLMatcher.validate_grammar(grammar, limits=grammar_limits())
    if error:
        raise ValueError(error)

    def validate(value: object) -> str:
        matcher = LLMatcher(_byte_tokenizer, grammar, log_level=0, limits=grammar_limits())
        text = json.dumps(in_schema_order(value, schema), ensure_ascii=False)
        if matcher.consume_tokens(list(text.encode("utf-8"))) and matcher.is_accepting():
            return ""
        return matcher.get_error() or f"{text} is incomplete for the schema"

    return validate


def in_schema_order(value: object, schema: object) -> object:
    """`value` with each object's keys in its schema's "properties" order (the others after)."""
    if not isinstance(schema, dict):
        return value
    if isinstance(value, dict):
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        keys = [k for k in properties if k in value] + [k for k in value if k not in properties]
        return {k: in_schema_order(value[k], properties.get(k)) for k in keys}
    if isinstance(value, list):
        return [in_schema_order(item, schema.get("items")) for item in value]
    return value


def apply_bitmask_numpy(logits: np.ndarray, bitmask_row: np.ndarray) -> np.ndarray:
    """The host twin of the device mask: logits (V,), tokens whose bit is clear at -inf."""
    vocab = logits.shape[0]
    bits = (bitmask_row.reshape(-1, 1) >> np.arange(32, dtype=np.int32)) & 1  # (W, 32)
    allowed = bits.reshape(-1)[:vocab].astype(bool)
    return np.where(allowed, logits, -np.inf)
