"""The sentencepiece model file (`tokenizer.model`): a protobuf `ModelProto`, read and written by hand.

    ModelProto
      1 pieces            repeated SentencePiece {1 piece: "▁the", 2 score: -42.0, 3 type: NORMAL}
      2 trainer_spec      TrainerSpec {3 model_type: BPE, 35 byte_fallback: true, 40 unk_id: 0, ...}
      3 normalizer_spec   NormalizerSpec {1 name: "identity", 3 add_dummy_prefix: true,
                                          4 remove_extra_whitespaces: false, 5 escape_whitespaces: true}

Taught in docs/phases/01-appendix-tokens-and-sampling.md.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator

# field numbers in sentencepiece_model.proto
MODEL_PIECES, MODEL_TRAINER_SPEC, MODEL_NORMALIZER_SPEC = 1, 2, 3
PIECE_PIECE, PIECE_SCORE, PIECE_TYPE = 1, 2, 3
TRAINER_MODEL_TYPE, TRAINER_BYTE_FALLBACK = 3, 35
TRAINER_UNK_ID, TRAINER_BOS_ID, TRAINER_EOS_ID, TRAINER_PAD_ID = 40, 41, 42, 43
SPEC_NAME, SPEC_ADD_DUMMY_PREFIX, SPEC_REMOVE_EXTRA_WHITESPACES, SPEC_ESCAPE_WHITESPACES = 1, 3, 4, 5

MODEL_TYPE_BPE = 2
# SentencePiece.Type; GGUF's `tokenizer.ggml.token_type` uses the same numbers (llama.cpp copied them)
PIECE_NORMAL, PIECE_UNKNOWN, PIECE_CONTROL, PIECE_USER_DEFINED, PIECE_UNUSED, PIECE_BYTE = 1, 2, 3, 4, 5, 6

VARINT, FIXED64, LENGTH_DELIMITED, FIXED32 = 0, 1, 2, 5


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, pos


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # a negative int32 (pad_id = -1) is written as its 64-bit two's complement
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def fields(buf: bytes) -> Iterator[tuple[int, int | bytes, bytes]]:
    """Yield (field_number, value, raw bytes of the whole field) for each field of a message."""
    pos = 0
    while pos < len(buf):
        start = pos
        key, pos = _read_varint(buf, pos)
        wire_type = key & 7
        if wire_type == VARINT:
            value, pos = _read_varint(buf, pos)
        elif wire_type in (FIXED64, FIXED32):
            size = 8 if wire_type == FIXED64 else 4
            value, pos = buf[pos : pos + size], pos + size
        elif wire_type == LENGTH_DELIMITED:
            size, pos = _read_varint(buf, pos)
            value, pos = buf[pos : pos + size], pos + size
        else:
            raise ValueError(f"not a sentencepiece model: unexpected protobuf wire type {wire_type}")
        yield key >> 3, value, buf[start:pos]


def field(number: int, value: int | float | bytes | str) -> bytes:
    """One encoded field: an int as a varint, a float as fixed32, bytes or str length-prefixed."""
    if isinstance(value, bool | int):
        return _varint(number << 3 | VARINT) + _varint(int(value))
    if isinstance(value, float):
        return _varint(number << 3 | FIXED32) + struct.pack("<f", value)
    payload = value.encode("utf-8") if isinstance(value, str) else value
    return _varint(number << 3 | LENGTH_DELIMITED) + _varint(len(payload)) + payload


def without_dummy_prefix(model_proto: bytes) -> tuple[bytes, bool, bool]:
    """The model with `add_dummy_prefix` off, and its own add_dummy_prefix and remove_extra_whitespaces."""
    add_dummy_prefix = removes_whitespace = True  # the proto's defaults, when a field is absent
    top = list(fields(model_proto))
    spec = next((value for number, value, _ in top if number == MODEL_NORMALIZER_SPEC), b"")
    new_spec = bytearray()
    for number, value, raw in fields(spec):
        if number == SPEC_ADD_DUMMY_PREFIX:
            add_dummy_prefix = bool(value)
            continue
        if number == SPEC_REMOVE_EXTRA_WHITESPACES:
            removes_whitespace = bool(value)
        new_spec += raw
    new_spec += field(SPEC_ADD_DUMMY_PREFIX, False)
    out = bytearray()
    for number, _, raw in top:
        if number != MODEL_NORMALIZER_SPEC:
            out += raw
    out += field(MODEL_NORMALIZER_SPEC, bytes(new_spec))
    return bytes(out), add_dummy_prefix, removes_whitespace


def model_proto_from_gguf(metadata: dict) -> bytes:
    """A sentencepiece BPE model from a GGUF's `tokenizer.ggml.*` keys; it encodes exactly as the original."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    scores: list[float] = metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
    types: list[int] = metadata.get("tokenizer.ggml.token_type") or [PIECE_NORMAL] * len(tokens)
    pieces = b"".join(
        field(MODEL_PIECES, field(PIECE_PIECE, tok) + field(PIECE_SCORE, float(score)) + field(PIECE_TYPE, kind))
        for tok, score, kind in zip(tokens, scores, types, strict=True)
    )

    def token_id(key: str) -> int:
        value = metadata.get(f"tokenizer.ggml.{key}_token_id")
        return -1 if value is None else value

    trainer = (
        field(TRAINER_MODEL_TYPE, MODEL_TYPE_BPE)
        + field(TRAINER_BYTE_FALLBACK, PIECE_BYTE in types)
        + field(TRAINER_UNK_ID, token_id("unknown"))
        + field(TRAINER_BOS_ID, token_id("bos"))
        + field(TRAINER_EOS_ID, token_id("eos"))
        + field(TRAINER_PAD_ID, token_id("padding"))
    )
    normalizer = (
        field(SPEC_NAME, "identity")
        + field(SPEC_ADD_DUMMY_PREFIX, bool(metadata.get("tokenizer.ggml.add_space_prefix", True)))
        + field(SPEC_REMOVE_EXTRA_WHITESPACES, False)
        + field(SPEC_ESCAPE_WHITESPACES, True)
    )
    return pieces + field(MODEL_TRAINER_SPEC, trainer) + field(MODEL_NORMALIZER_SPEC, normalizer)
