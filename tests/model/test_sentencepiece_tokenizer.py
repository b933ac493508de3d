"""sentencepiece tokenizer on a tiny Llama-2-style model trained here (a fraction of a second),
against the sentencepiece library itself and HF's LlamaTokenizer loading the same file."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import sentencepiece

from tinyvllm.model.detokenizer import IncrementalDetokenizer
from tinyvllm.model.sentencepiece_model import fields, without_dummy_prefix
from tinyvllm.model.tokenizer import load_tokenizer

# Llama-2's tokenizer.model settings: BPE, byte fallback, digits split, a dummy prefix, whitespace kept.
LLAMA2_SETTINGS = dict(
    model_type="bpe",
    byte_fallback=True,
    split_digits=True,
    add_dummy_prefix=True,
    normalization_rule_name="identity",
    remove_extra_whitespaces=False,
    allow_whitespace_only_pieces=True,
    unk_id=0,
    bos_id=1,
    eos_id=2,
    pad_id=-1,
    character_coverage=1.0,
    minloglevel=2,
)
WORDS = (
    "the quick brown fox jumps over a lazy dog while tokenizers merge pieces into words "
    "café naïve 東京 日本 😀 def return import class if else"
).split()

CORPUS = [
    "Hello world",
    "the quick brown fox",
    "a  b   c",
    "tabs\tand\nnewlines\r\n",
    "\n\nfoo",
    "12345 and 3.14159",
    "café 東京 😀",
    "Ωmega ß 🦙 한국어",
    "def f(x):\n    return x",
    "x",
    "  two leading",
    " one leading",
    "trailing  ",
    "<s>Hello</s> x",
    "x <s> y",
    "x<s>y",
    "[INST] hi [/INST]",
    "<s>[INST] hi [/INST]",
    "<unk> here",
    "<|im_end|>done",
    "",
    " ",
    "</s></s>",
]


def _train(directory: Path, **overrides) -> Path:
    rng = random.Random(0)
    lines = [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + f" {rng.randint(0, 99999)}"
        for _ in range(1500)
    ]
    settings = {**LLAMA2_SETTINGS, **overrides}
    prefix = directory / "tokenizer"
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=str(prefix), vocab_size=400, **settings
    )
    return prefix.with_suffix(".model")


@pytest.fixture(scope="module")
def model_file(tmp_path_factory) -> Path:
    return _train(tmp_path_factory.mktemp("spm"))


# An added token beyond the sentencepiece vocabulary, as fine-tunes add chat markers.
ADDED = {
    "400": {
        "content": "<|im_end|>",
        "special": True,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "single_word": False,
    }
}


def _model_dir(model_file: Path, directory: Path, **config) -> Path:
    """An HF model directory: tokenizer.model and a tokenizer_config.json like Llama-2's."""
    shutil.copy(model_file, directory / "tokenizer.model")
    config = {
        "tokenizer_class": "LlamaTokenizer",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "added_tokens_decoder": ADDED,
        **config,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def sp(model_file):
    return sentencepiece.SentencePieceProcessor(model_file=str(model_file))


@pytest.fixture(scope="module")
def tok(model_file, tmp_path_factory):
    return load_tokenizer(_model_dir(model_file, tmp_path_factory.mktemp("llama")))


def test_metadata(tok):
    assert tok.vocab_size == 401
    assert (tok.bos_token_id, tok.eos_token_id, tok.add_bos_token) == (1, 2, True)
    assert tok.stop_token_ids == {2, 400}
    assert all(tok.is_special(i) for i in (0, 1, 2, 400)) and not tok.is_special(3)
    assert tok.token_bytes(3 + 0xE6) == b"\xe6"  # byte-fallback piece <0xE6>


def test_matches_sentencepiece_library(tok, sp):
    """Where HF and sentencepiece agree (no added token written in the text, no leading space),
    we agree with both."""
    for text in CORPUS:
        if "<" in text or text.startswith(" "):
            continue
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text), repr(text)
        assert tok.decode(ids) == sp.decode(ids)
        assert tok.encode(text) == [1, *ids]


def test_leading_space_follows_hf_not_sentencepiece(tok, sp):
    # sentencepiece puts its "▁" before the text's own space ("▁▁one"); HF's Metaspace does not.
    assert tok.encode(" one", add_special_tokens=False) == sp.encode("one")
    assert sp.encode(" one") == [sp.piece_to_id("▁"), *sp.encode("one")]


def test_decode_round_trips(tok):
    for text in CORPUS:
        if text.startswith(" "):
            continue  # the leading space becomes the dummy prefix, which decode takes off
        assert tok.decode(tok.encode(text, add_special_tokens=False)) == text, repr(text)


def test_add_bos_token_from_config(model_file, tmp_path):
    (tmp_path / "unsaid").mkdir()
    (tmp_path / "no").mkdir()
    unsaid = load_tokenizer(_model_dir(model_file, tmp_path / "unsaid", add_bos_token=None))
    assert unsaid.add_bos_token is True  # not stated: Llama-2's sentencepiece models start with <s>
    no_bos = load_tokenizer(_model_dir(model_file, tmp_path / "no", add_bos_token=False))
    assert no_bos.encode("x") == no_bos.encode("x", add_special_tokens=False)
    assert no_bos.add_bos_token is False


@pytest.mark.parametrize("text", ["café 東京 😀", "Ωmega ß 🦙 한국어", "x 😀😀 y"])
def test_incremental_detokenizer_equals_decode(tok, text):
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    assert "".join(detok.add(t) for t in ids) == tok.decode(ids, skip_special_tokens=True) == text


def test_incremental_detokenizer_after_a_prompt(tok):
    """Generated text continues the prompt's: its first "▁" is a real space, not the dummy prefix."""
    prompt, generated = tok.encode("the quick brown"), tok.encode(" fox jumps 😀", add_special_tokens=False)
    continued = IncrementalDetokenizer(tok, prompt_token_ids=prompt)
    assert "".join(continued.add(t) for t in generated) == " fox jumps 😀"
    assert tok.decode(prompt + generated, skip_special_tokens=True) == "the quick brown fox jumps 😀"
    alone = IncrementalDetokenizer(tok)
    assert "".join(alone.add(t) for t in generated) == tok.decode(generated) == "fox jumps 😀"
    after_bos = IncrementalDetokenizer(tok, prompt_token_ids=[tok.bos_token_id])  # <s> is skipped: no text yet
    assert "".join(after_bos.add(t) for t in generated) == "fox jumps 😀"


def test_dummy_prefix_switch(model_file):
    proto, add_dummy_prefix, removes_whitespace = without_dummy_prefix(model_file.read_bytes())
    assert (add_dummy_prefix, removes_whitespace) == (True, False)
    again = without_dummy_prefix(proto)
    assert again[1] is False and again[0] == proto  # idempotent: the flag now reads false
    pieces = sentencepiece.SentencePieceProcessor(model_proto=proto).encode_as_pieces("the fox")
    assert "".join(pieces) == "the▁fox"  # sentencepiece itself would give "▁the▁fox"
    assert sum(1 for number, _, _ in fields(proto) if number == 1) == 400  # every piece kept


def test_model_that_collapses_whitespace_is_rejected(tmp_path):
    (tmp_path / "train").mkdir()
    model = _train(tmp_path / "train", remove_extra_whitespaces=True)
    with pytest.raises(ValueError, match="remove_extra_whitespaces"):
        load_tokenizer(_model_dir(model, tmp_path))


# --- against HF's LlamaTokenizer -----------------------------------------------------------------


@pytest.fixture(scope="module", params=[False, True], ids=["legacy=false", "legacy=true"])
def pair(request, model_file, tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("google.protobuf", reason="HF reads tokenizer.model with protobuf")
    directory = _model_dir(model_file, tmp_path_factory.mktemp("hf"), legacy=request.param)
    return load_tokenizer(directory), transformers.AutoTokenizer.from_pretrained(str(directory))


@pytest.mark.oracle
def test_ids_match_hf(pair):
    ours, hf = pair
    for text in CORPUS:
        assert ours.encode(text) == hf.encode(text), repr(text)
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False), repr(text)


@pytest.mark.oracle
def test_decode_matches_hf(pair):
    ours, hf = pair
    for text in CORPUS:
        ids = hf.encode(text)
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), repr(text)


@pytest.mark.oracle
def test_directory_with_both_tokenizer_files(pair, model_file, tmp_path):
    """Llama-2 repos ship tokenizer.json (HF's sentencepiece look-alike) beside tokenizer.model."""
    ours, hf = pair
    hf.save_pretrained(tmp_path)  # writes that kind of tokenizer.json
    with pytest.raises(ValueError, match="byte_fallback.*tokenizer.model"):
        load_tokenizer(tmp_path)
    _model_dir(model_file, tmp_path, legacy=hf.legacy)  # tokenizer.model and its tokenizer_config.json beside it
    both = load_tokenizer(tmp_path)
    assert type(both) is type(ours)
    for text in CORPUS:
        assert both.encode(text) == ours.encode(text) == hf.encode(text), repr(text)


def test_chat_template_list_in_tokenizer_config(model_file, tmp_path):
    templates = [
        {"name": "tool_use", "template": "tools"},
        {"name": "default", "template": "{{ messages[0].content }}"},
    ]
    tok = load_tokenizer(_model_dir(model_file, tmp_path, chat_template=templates))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi"


LLAMA2_CHAT = (
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + message['content'] "
    "+ ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' ' + message['content'] + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)


@pytest.mark.oracle
def test_chat_template_from_tokenizer_config(model_file, tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("google.protobuf")
    directory = _model_dir(model_file, tmp_path, chat_template=LLAMA2_CHAT)
    ours, hf = load_tokenizer(directory), transformers.AutoTokenizer.from_pretrained(str(directory))
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "user", "content": "?"},
    ]
    prompt = ours.apply_chat_template(messages)
    assert (
        prompt == hf.apply_chat_template(messages, tokenize=False) == "<s>[INST] hi [/INST] yo </s><s>[INST] ? [/INST]"
    )
    assert ours.encode(prompt, add_special_tokens=False) == hf.encode(prompt, add_special_tokens=False)


# --- Llama-2 GGUFs: the same pieces, scores and types as GGUF metadata ---------------------------------


@pytest.fixture(scope="module")
def gguf_file(sp, tmp_path_factory) -> Path:
    """A GGUF holding the tiny model's tokenizer, written the way llama.cpp's converter writes Llama-2's."""
    gguf = pytest.importorskip("gguf")
    path = tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in {"block_count": 1, "context_length": 16, "embedding_length": 8, "head_count": 1}.items():
        getattr(writer, f"add_{key}")(value)
    n = sp.get_piece_size()
    writer.add_tokenizer_model("llama")
    writer.add_token_list([sp.id_to_piece(i) for i in range(n)])
    writer.add_token_scores([sp.get_score(i) for i in range(n)])
    kinds = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]
    writer.add_token_types(kinds)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template(LLAMA2_CHAT)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return path


def test_gguf_equals_tokenizer_model(gguf_file, tok):
    from_gguf = load_tokenizer(gguf_file)
    assert (from_gguf.vocab_size, from_gguf.bos_token_id, from_gguf.eos_token_id) == (400, 1, 2)
    assert from_gguf.add_bos_token and from_gguf.stop_token_ids == {2}
    assert all(from_gguf.token_bytes(i) == tok.token_bytes(i) for i in range(400))
    for text in CORPUS:
        if "<|im_end|>" not in text:  # an added token of the directory's config only
            assert from_gguf.encode(text) == tok.encode(text), repr(text)
    messages = [{"role": "user", "content": "hi"}]
    assert from_gguf.apply_chat_template(messages) == "<s>[INST] hi [/INST]"


@pytest.mark.oracle
def test_gguf_matches_hf(gguf_file):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    ours = load_tokenizer(gguf_file)
    for text in CORPUS:
        assert ours.encode(text) == hf.encode(text), repr(text)
        ids = hf.encode(text)
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), repr(text)


def test_a_directory_with_tokenizer_model_loads_as_sentencepiece(tok):
    """tinyvllm/model/sentencepiece_tokenizer.py is what load_tokenizer gives for a `tokenizer.model`: its text
    comes back whole through encode and decode."""
    from tinyvllm.model.sentencepiece_tokenizer import SentencePieceTokenizer

    assert isinstance(tok, SentencePieceTokenizer)
    text = "def f(x):\n    return x"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and tok.decode(ids, skip_special_tokens=True) == text


@pytest.mark.oracle
def test_token_strings_match_hf(pair):
    ours, hf = pair
    ids = list(range(min(ours.vocab_size, len(hf))))
    assert [ours.token_string(i) for i in ids] == hf.convert_ids_to_tokens(ids)
