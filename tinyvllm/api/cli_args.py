"""The server's flags (vLLM's `make_arg_parser`): the engine's from `EngineArgs.add_cli_args`, the server's
added here."""

from __future__ import annotations

import argparse
import os

from tinyvllm.api.reasoning_parser import REASONING_PARSERS
from tinyvllm.api.response_store import DEFAULT_MAX_STORED_RESPONSES
from tinyvllm.api.serving_engine import ServerLimits
from tinyvllm.engine.arg_utils import EngineArgs


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="tinyvllm: an OpenAI-compatible server")
    p.add_argument("--model", default=None, help="a .gguf file or an HF checkpoint directory (default: SmolLM2-135M)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("TINYVLLM_API_KEY") or os.environ.get("VLLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every path but /health "
                        "(default: $TINYVLLM_API_KEY, else vLLM's $VLLM_API_KEY, else none)")
    p.add_argument("--api-keys-file", default=None, metavar="PATH",
                   help="API keys with optional requests/tokens-per-minute limits, as JSON or JSON lines "
                        "(tinyvllm/api/keys.py has the format; `python -m tinyvllm.api.keys ID` makes a key). "
                        "With --api-key too, that key is one more, id 'default', without limits")
    p.add_argument("--audit-log", default=None, metavar="PATH",
                   help="append one JSON line per request (time, key id, route, status, tokens, latency) to PATH")
    p.add_argument("--allowed-hosts", nargs="+", default=[], metavar="NAME",
                   help="host names (the Host header) to answer to, besides localhost, IP addresses and the "
                        "--host value; '*' for any. Others get 421: a guard against DNS rebinding (default: none)")
    p.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN",
                   help="origins browsers may call this server from (CORS), e.g. https://app.example; '*' for any "
                        "(default: none: vLLM allows any, which lets any web page read a local server)")
    p.add_argument("--allowed-methods", nargs="+", default=["*"], metavar="METHOD",
                   help="HTTP methods allowed cross-origin (default '*')")
    p.add_argument("--allowed-headers", nargs="+", default=["*"], metavar="HEADER",
                   help="request headers allowed cross-origin (default '*')")
    p.add_argument("--allow-credentials", action="store_true",
                   help="let cross-origin requests carry cookies and Authorization (default off)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the name(s) clients ask for in 'model' (default: the model's own name)")
    EngineArgs.add_cli_args(p)  # the engine's flags, shared with `tinyvllm generate` (engine/arg_utils.py)
    p.add_argument("--max-waiting", type=int, default=256,
                   help="more requests than this waiting get 429 with Retry-After (default 256)")
    defaults = ServerLimits()
    p.add_argument("--max-request-body-bytes", type=int, default=defaults.max_request_body_bytes,
                   help=f"larger request bodies get 413 (default {defaults.max_request_body_bytes} = 4 MiB)")
    p.add_argument("--header-read-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="a request whose headers have not all arrived this long after their first byte gets 408 "
                        "and its connection closes (default 10)")
    p.add_argument("--body-read-timeout", type=float, default=defaults.body_read_timeout, metavar="SECONDS",
                   help=f"a request body not all arrived this long after the headers gets 408 "
                        f"(default {defaults.body_read_timeout:g})")
    p.add_argument("--max-n", type=int, default=defaults.max_n,
                   help=f"most choices (n) one request may ask for (default {defaults.max_n})")
    p.add_argument("--max-stop-sequences", type=int, default=defaults.max_stop_sequences,
                   help=f"most stop strings per request (default {defaults.max_stop_sequences})")
    p.add_argument("--max-stop-length", type=int, default=defaults.max_stop_length,
                   help=f"longest stop string, in characters (default {defaults.max_stop_length})")
    p.add_argument("--reasoning-parser", default="none", choices=REASONING_PARSERS,
                   help="think (or vLLM's qwen3, deepseek_r1): send the model's <think>...</think> as reasoning "
                        "(default none)")
    p.add_argument("--tool-call-parser", default="hermes", choices=["hermes", "llama3_json"],
                   help="the format the model writes tool calls in: hermes (<tool_call> JSON </tool_call>: Qwen, "
                        "Hermes, SmolLM2 with the default tool prompt) or llama3_json (Llama 3.1+; default hermes)")
    p.add_argument("--max-stored-responses", type=int, default=DEFAULT_MAX_STORED_RESPONSES, metavar="N",
                   help="the Responses API keeps the last N responses created with store=true (the default), for "
                        "previous_response_id, GET /v1/responses/{id} and background=true; the oldest finished one "
                        "is forgotten first. 0: keep none, as vLLM without VLLM_ENABLE_RESPONSES_API_STORE "
                        f"(default {DEFAULT_MAX_STORED_RESPONSES})")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="answers' usage says how many prompt tokens the prefix cache served "
                        "(usage.prompt_tokens_details.cached_tokens; default off, as vLLM's)")
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="every stream ends with a usage chunk, as if each client asked for "
                        "stream_options.include_usage (default off)")
    p.add_argument("--pooler-config", default=None, metavar="JSON",
                   help='how /v1/embeddings pools the final hidden states, vLLM\'s pooler config as JSON: '
                        '\'{"pooling_type": "MEAN"}\' (LAST or MEAN; default LAST) and "normalize" (default true)')
    p.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGTERM, requests in flight get this long to finish before they end with an error; "
                        "new ones get 503 meanwhile (default 10)")
    p.add_argument("--allow-remote-media", action="store_true",
                   help="fetch http(s) image URLs of chat image_url parts (default: data URLs only)")
    p.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="serve file:// image URLs from under this directory (default: none)")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="every response carries X-Request-Id: the client's, or one made for it (default: only "
                        "the client's, echoed)")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info: the tokenizer's configuration, chat template included "
                        "(default off, as vLLM's)")
    p.add_argument("--root-path", default="", metavar="PATH",
                   help="the path prefix a proxy serves this server under (FastAPI's root_path, vLLM's flag)")
    p.add_argument("--enable-per-request-metrics", action="store_true",
                   help="each answer (a stream's usage chunk) carries its request's timings as 'metrics' (vLLM's flag)")
    p.add_argument("--enable-server-load-tracking", action="store_true",
                   help="count the generating routes' requests in flight, served at GET /load (vLLM's flag)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines: tool_choice 'auto' is always served here, parsed by "
                        "--tool-call-parser")
    p.add_argument("--uds", default=None, metavar="PATH",
                   help="listen on this Unix domain socket instead of --host and --port")
    p.add_argument("--log-level", default="info")
    return p
