"""Convert a GGUF checkpoint into an HF model directory.

    python -m tinyvllm.convert SRC.gguf OUT_DIR [--dtype float32|float16|bfloat16] [--max-shard-size 2GB]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from tinyvllm.model.gguf import GGUFFile
from tinyvllm.model.weights_gguf import load_gguf
from tinyvllm.model.weights_hf import INDEX_FILE, SINGLE_FILE, save_hf_weights

DTYPES = ("float32", "float16", "bfloat16")

# GGUF token types (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED = 1, 2, 3, 4

# tokenizer.ggml.pre preset -> HF pre_tokenizer (llama.cpp's regexes)
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
# Llama 3: split with its own regex first, then ByteLevel maps bytes only (use_regex off)
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_LLAMA3 = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": _LLAMA3_REGEX}, "behavior": "Isolated", "invert": False},
    {**_BYTE_LEVEL, "use_regex": False}]}
# SmolLM2 / StarCoder: every digit is its own pre-token, then GPT-2's regex
_DIGITS_THEN_GPT2 = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, _BYTE_LEVEL]}
PRE_TOKENIZERS = {
    "default": _BYTE_LEVEL, "gpt2": _BYTE_LEVEL,
    "smollm": _DIGITS_THEN_GPT2, "starcoder": _DIGITS_THEN_GPT2, "refact": _DIGITS_THEN_GPT2,
    "llama-bpe": _LLAMA3, "llama3": _LLAMA3, "llama-v3": _LLAMA3, "smaug-bpe": _LLAMA3,
}


def _token(md: dict, key: str) -> str | None:
    token_id = md.get(f"tokenizer.ggml.{key}_token_id")
    return None if token_id is None else md["tokenizer.ggml.tokens"][token_id]


def added_token(token_id: int, content: str, special: bool = True) -> dict:
    """tokenizer.json's entry for a token matched whole before the BPE model runs."""
    return {"id": token_id, "content": content, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": special}


def tokenizer_json(md: dict) -> dict:
    """HF tokenizers' tokenizer.json for a GGUF byte-level BPE ('gpt2') tokenizer."""
    kind = md.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"the GGUF tokenizer is {kind!r}: only byte-level BPE ('gpt2') tokenizers can be "
                         "written as tokenizer.json (sentencepiece 'llama' ones are not supported yet)")
    pre = md.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(f"unknown pre-tokenizer preset tokenizer.ggml.pre={pre!r}; known: {', '.join(PRE_TOKENIZERS)}")
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    types: list[int] = md.get("tokenizer.ggml.token_type") or [TOKEN_NORMAL] * len(tokens)
    added = [added_token(i, tok, special=types[i] != TOKEN_USER_DEFINED)
             for i, tok in enumerate(tokens) if types[i] in (TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED)]

    bos, eos = _token(md, "bos"), _token(md, "eos")
    add_bos = bos is not None and md.get("tokenizer.ggml.add_bos_token", False)
    add_eos = eos is not None and md.get("tokenizer.ggml.add_eos_token", False)
    if add_bos or add_eos:
        # BOS/EOS around each sequence: $A is the text's own tokens
        def template(seq: str) -> list[dict]:
            return ([{"SpecialToken": {"id": bos, "type_id": 0}}] if add_bos else []) + \
                [{"Sequence": {"id": seq, "type_id": 0}}] + \
                ([{"SpecialToken": {"id": eos, "type_id": 0}}] if add_eos else [])
        specials = [t for t, on in ((bos, add_bos), (eos, add_eos)) if on]
        post_processor = {"type": "TemplateProcessing", "single": template("A"), "pair": template("A") + template("B"),
                          "special_tokens": {t: {"id": t, "ids": [tokens.index(t)], "tokens": [t]} for t in specials}}
    else:
        post_processor = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True}

    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": PRE_TOKENIZERS[pre],
        "post_processor": post_processor,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
            # Llama 3's tokenizer takes a pre-token found whole in the vocab as is, before any merge
            "ignore_merges": PRE_TOKENIZERS[pre] is _LLAMA3,
            "vocab": {tok: i for i, tok in enumerate(tokens)},
            # merges are stored as "left right"; byte-level tokens never contain a real space
            "merges": [merge.split(" ", 1) for merge in md.get("tokenizer.ggml.merges", [])],
        },
    }


def tokenizer_config(md: dict) -> dict:
    """tokenizer_config.json: which tokens are special, whether BOS is prepended, the chat template."""
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast"}
    for key, gguf_key in (("bos", "bos"), ("eos", "eos"), ("unk", "unknown"), ("pad", "padding")):
        if _token(md, gguf_key) is not None:
            cfg[f"{key}_token"] = _token(md, gguf_key)
    cfg["add_bos_token"] = bool(md.get("tokenizer.ggml.add_bos_token", False))
    cfg["add_eos_token"] = bool(md.get("tokenizer.ggml.add_eos_token", False))
    cfg["clean_up_tokenization_spaces"] = False
    arch = md.get("general.architecture", "llama")
    if f"{arch}.context_length" in md:
        cfg["model_max_length"] = int(md[f"{arch}.context_length"])
    if "tokenizer.chat_template" in md:
        cfg["chat_template"] = md["tokenizer.chat_template"]
    return cfg


def generation_config(md: dict) -> dict:
    """generation_config.json: BOS and the token(s) that end generation (EOS, and end-of-turn if distinct)."""
    stop_ids = []
    for key in ("eos", "eot", "eom"):
        token_id = md.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None and token_id not in stop_ids:
            stop_ids.append(int(token_id))
    cfg: dict = {}
    if "tokenizer.ggml.bos_token_id" in md:
        cfg["bos_token_id"] = int(md["tokenizer.ggml.bos_token_id"])
    if stop_ids:
        cfg["eos_token_id"] = stop_ids[0] if len(stop_ids) == 1 else stop_ids
    if "tokenizer.ggml.padding_token_id" in md:
        cfg["pad_token_id"] = int(md["tokenizer.ggml.padding_token_id"])
    return cfg


def parse_size(text: str) -> int:
    """'500MB' -> 500_000_000, '2GiB' -> 2 * 2**30, '1000' -> 1000 bytes (HF's units: MB is 10**6)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"cannot read {text!r} as a size: use e.g. 500MB, 2GB, 1GiB or a byte count")
    number, prefix, binary = m.groups()
    base = 1024 if binary else 1000
    return int(float(number) * base ** " KMGT".index(prefix.upper() or " "))


def tokenizer_files(md: dict, special_tokens: dict[int, str] | None = None) -> dict[str, dict]:
    """tokenizer.json and tokenizer_config.json by file name; `special_tokens` (id -> text: a vision model's image
    tokens after the vocabulary) are added as special tokens."""
    tok = tokenizer_json(md)
    tok["added_tokens"] += [added_token(i, text) for i, text in (special_tokens or {}).items()]
    return {"tokenizer.json": tok, "tokenizer_config.json": tokenizer_config(md)}


def write_tokenizer(out_dir: str | os.PathLike, md: dict, special_tokens: dict[int, str] | None = None) -> None:
    for name, obj in tokenizer_files(md, special_tokens).items():
        _write_json(Path(out_dir) / name, obj)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert(src: str | os.PathLike, out_dir: str | os.PathLike, dtype: str = "float32",
            max_shard_size: int | None = None) -> Path:
    """Write the HF directory for GGUF file `src` into `out_dir` (created if missing) and return it."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    gguf = GGUFFile(src)
    md = gguf.metadata
    tok_files, gen_config = tokenizer_files(md), generation_config(md)  # fail early
    config, state_dict = load_gguf(gguf)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # an earlier conversion's weights would shadow or mix with these
    for old in [out / SINGLE_FILE, out / INDEX_FILE, *out.glob("model-*-of-*.safetensors")]:
        old.unlink(missing_ok=True)
    save_hf_weights(state_dict, out, dtype, max_shard_size)

    hf_config = config.to_hf_config()
    hf_config["torch_dtype"] = dtype
    hf_config.update({k: v for k, v in gen_config.items() if k in ("bos_token_id", "eos_token_id")})
    _write_json(out / "config.json", hf_config)
    _write_json(out / "generation_config.json", gen_config)
    for name, obj in tok_files.items():
        _write_json(out / name, obj)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tinyvllm.convert", description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="a LLaMA .gguf file")
    parser.add_argument("out_dir", help="the HF model directory to write")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the written weights")
    parser.add_argument("--max-shard-size", type=parse_size, default=None,
                        help="split the weights into safetensors shards of at most this size (e.g. 500MB, 2GB)")
    args = parser.parse_args(argv)
    try:
        out = convert(args.src, args.out_dir, args.dtype, args.max_shard_size)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    files = sorted(p.name for p in out.iterdir())
    print(f"wrote {out}: {', '.join(files)}", file=sys.stderr)


if __name__ == "__main__":
    main()
