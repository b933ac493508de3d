"""The `tinyvllm` command (tinyvllm/cli.py): its verbs, their --help, and the errors it gives. The server verb
answering a real client is in tests/model/test_architectures.py; the installed command in tests/test_wheel.py."""

from __future__ import annotations

import pytest

from tinyvllm import cli


@pytest.mark.parametrize("verb, words", [
    ("serve", "--kv-cache-memory"), ("generate", "--prompt"), ("chat", "--prompt"), ("quantize", "--type"),
    ("perplexity", "--n-ctx"), ("bench latency", "--rate"), ("bench throughput", "--concurrency"),
    ("bench serve", "--base-url"),
])
def test_every_verb_has_help(capsys, verb, words):
    try:
        code = cli.main([*verb.split(), "--help"])
    except SystemExit as e:  # argparse's own --help exits
        code = e.code
    assert code in (0, None)
    assert words in capsys.readouterr().out


def test_top_level_help_and_unknown_verb(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(verb in out for verb in cli.VERBS)
    assert cli.main(["launch"]) == 2
    assert "unknown verb 'launch'" in capsys.readouterr().err
    assert cli.main(["bench", "sprint"]) == 2
    assert "unknown workload 'sprint'" in capsys.readouterr().err


def test_model_comes_first_as_in_vllm_serve():
    assert cli._model_first(["m.gguf", "--port", "9"]) == ["--model", "m.gguf", "--port", "9"]
    assert cli._model_first(["--port", "9"]) == ["--port", "9"]


def test_flags_with_underscores_read_as_vllms_parser_reads_them():
    from tinyvllm.api.cli_args import build_parser
    from tinyvllm.engine.arg_utils import dashed_flags

    argv = ["--max_model_len", "512", "--served-model-name", "a_b", "--kv_cache_dtype=int8", "x_y"]
    assert dashed_flags(argv) == ["--max-model-len", "512", "--served-model-name", "a_b", "--kv-cache-dtype=int8",
                                  "x_y"]  # flag names only: values keep their underscores
    args = build_parser().parse_args(dashed_flags(["--max_model_len", "512", "--enable_server_load_tracking"]))
    assert args.max_model_len == 512 and args.enable_server_load_tracking


def test_bench_outside_a_checkout_says_where_the_benchmarks_are(capsys, monkeypatch):
    monkeypatch.setattr(cli, "benchmarks_dir", lambda: None)
    assert cli.main(["bench", "latency"]) == 2
    assert "benchmarks/ of tinyvllm's source repository" in capsys.readouterr().err


def test_generate_bad_model_is_one_clear_line(capsys):
    assert cli.main(["generate", "no/such/model.gguf", "--prompt", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no checkpoint at no/such/model.gguf")


def test_chat_reads_turns_from_stdin(capsys, monkeypatch, tiny_model_dir):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO("Hello\nAnd again\n\n"))
    assert cli.main(["chat", str(tiny_model_dir), "--max-tokens", "3", "--temperature", "0",
                     "--max-model-len", "256", "--kv-cache-memory", "8MiB"]) == 0
    assert len(capsys.readouterr().out.strip("\n").split("\n")) == 2  # one reply line per turn
