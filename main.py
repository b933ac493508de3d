"""Generate text from the command line: the text streams to stdout, the statistics go to stderr.

It runs on the same engine as `LLM.generate` and the server (`LLMEngine`, through `Generator`). The code lives in
the package (`tinyvllm.cli.generate_main`), so that an installed tinyvllm runs it too: `tinyvllm generate`.

    python main.py --prompt "The capital of France is" --max-tokens 32 --temperature 0
    python main.py --chat --prompt "Write a haiku about paged attention"
    python main.py --model path/to/model.gguf --prompt "..."       (or an HF checkpoint directory)
    python main.py --chat --prompt "Repeat: ..." --temperature 0 \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'     (speculative decoding)
"""

from __future__ import annotations

import sys

from tinyvllm.cli import build_generate_parser as build_parser  # noqa: F401  (the flags, for tests and docs)
from tinyvllm.cli import generate_main as main

if __name__ == "__main__":
    sys.exit(main())
