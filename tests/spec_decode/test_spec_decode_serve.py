"""Speculative decoding from the outside (Phase 7b): `main.py --speculative-config`, the server's flag, /metrics.

The engine side (proposers, verification, rollback) is tested in tests/spec_decode/test_spec_decode.py; here the tiny
random model is enough: what matters is that the flags reach the engine, that a bad flag is one clear line before any
model loads, and that /metrics shows the engine's counters.
"""

from __future__ import annotations

import json

import httpx
import pytest
from api_helpers import parse_metrics, serve

import main as cli
from tinyvllm.api import server as api_server
from tinyvllm.api.cli_args import build_parser
from tinyvllm.api.metrics import ServerMetrics
from tinyvllm.engine.arg_utils import EngineArgs

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
# a prompt that repeats itself, so the ngram proposer finds its last tokens earlier and proposes what followed
REPEATING = "one two three four five six seven eight " * 6

SPEC_NAMES = ("spec_decode_num_draft_tokens_total", "spec_decode_num_accepted_tokens_total",
              "spec_decode_num_emitted_tokens_total", "spec_decode_acceptance_rate",
              "spec_decode_mean_accepted_length")


@pytest.mark.parametrize("flag, message", [
    ("{method: ngram}", "is not JSON"),
    ('["ngram", 4]', "must be a dict"),
    ('{"method": "medusa", "num_speculative_tokens": 4}', "['method'] must be one of"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 4, "k": 2}', "unknown keys ['k']"),
])
def test_main_bad_speculative_config_is_one_clear_line(capsys, flag, message):
    # --model names no checkpoint: the flag must be refused before the model would load
    assert cli.main(["--prompt", "hi", "--model", "no/such/model.gguf", "--speculative-config", flag]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --speculative-config") and message in err[0], err


@pytest.mark.parametrize("flag, message", [("{method: ngram}", "not JSON"),
                                           ('{"method": "ngram"}', "num_speculative_tokens")])
def test_server_bad_speculative_config_exits_before_loading(capsys, flag, message):
    with pytest.raises(SystemExit) as exit_info:
        api_server.main(["--model", "no/such/model.gguf", "--speculative-config", flag])
    assert exit_info.value.code == 2  # argparse's usage error
    err = capsys.readouterr().err
    assert "error: --speculative-config:" in err and message in err and "Traceback" not in err


def test_server_flag_parses():
    assert build_parser().parse_args([]).speculative_config is None
    args = build_parser().parse_args(["--speculative-config", json.dumps(NGRAM)])
    config = EngineArgs.from_cli_args(args).create_engine_config()  # what the server's engine gets
    assert config.speculative_config.method == "ngram"
    assert config.speculative_config.num_speculative_tokens == NGRAM["num_speculative_tokens"]


def test_main_speculates_and_prints_the_same_text(capsys, tiny_model_dir):
    common = ["--model", str(tiny_model_dir), "--prompt", REPEATING, "--max-tokens", "24", "--temperature", "0",
              "--max-model-len", "128", "--kv-cache-memory", "1MiB"]
    assert cli.main(common) == 0
    plain = capsys.readouterr()
    assert "[speculative decoding]" not in plain.err
    assert cli.main([*common, "--speculative-config", json.dumps(NGRAM)]) == 0
    speculated = capsys.readouterr()
    assert speculated.out == plain.out  # greedy: token for token the same text
    line = next(s for s in speculated.err.splitlines() if s.startswith("[speculative decoding]"))
    drafts = int(line.split()[2])
    assert drafts > 0, line  # the repeating prompt gave the proposer something to copy


def test_server_metrics_show_the_engines_spec_decode_counters(tiny_model_dir):
    from tinyvllm.engine.llm_engine import LLMEngine

    engine = LLMEngine(tiny_model_dir, max_model_len=128, kv_cache_memory="1MiB", speculative_config=NGRAM)
    with serve(lambda: engine) as server:
        for _ in range(2):
            response = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
                "prompt": REPEATING, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
            assert response.status_code == 200, response.text
        samples = parse_metrics(httpx.get(f"{server.url}/metrics").text)
        stats = engine.get_stats()
    values = {name: samples[f"tinyvllm:{name}"] for name in SPEC_NAMES}
    assert values["spec_decode_num_draft_tokens_total"] == stats["spec_decode_num_draft_tokens"] > 0
    assert values["spec_decode_num_accepted_tokens_total"] == stats["spec_decode_num_accepted_tokens"]
    assert values["spec_decode_num_emitted_tokens_total"] == stats["spec_decode_num_emitted_tokens"]
    assert values["spec_decode_acceptance_rate"] == pytest.approx(
        stats["spec_decode_num_accepted_tokens"] / stats["spec_decode_num_draft_tokens"])
    # accepted drafts + the target's one own token, per verify step (vLLM's mean acceptance length)
    assert values["spec_decode_mean_accepted_length"] == pytest.approx(
        (stats["spec_decode_num_accepted_tokens"] + stats["spec_decode_num_verify_steps"])
        / stats["spec_decode_num_verify_steps"]) == stats["spec_decode_mean_accepted_length"]


def test_metrics_render_spec_decode_only_when_it_is_on():
    metrics = ServerMetrics()
    metrics.record(0.0, {"num_running": 1}, [], stepped=False)
    assert "spec_decode" not in metrics.render()
    metrics.record(1.0, {"spec_decode_num_draft_tokens": 40, "spec_decode_num_accepted_tokens": 30,
                         "spec_decode_num_emitted_tokens": 40, "spec_decode_acceptance_rate": 0.75,
                         "spec_decode_mean_accepted_length": 4.0}, [], stepped=False)
    text = metrics.render()
    assert "# TYPE tinyvllm:spec_decode_num_draft_tokens_total counter" in text
    assert "# TYPE tinyvllm:spec_decode_acceptance_rate gauge" in text
    samples = parse_metrics(text)
    assert [samples[f"tinyvllm:{name}"] for name in SPEC_NAMES] == [40, 30, 40, 0.75, 4.0]
