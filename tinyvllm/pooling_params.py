"""What a pooling request asks for: one vector for a whole prompt from the final hidden states (vLLM's
`PoolingParams`).

Taught in docs/phases/09-appendix-endpoints.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

POOLING_TYPES = ("LAST", "MEAN")


@dataclass(frozen=True)
class PoolingParams:
    pooling_type: str = "LAST"
    normalize: bool = True

    def __post_init__(self):
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {self.pooling_type!r}")
        if not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be True or False, got {self.normalize!r}")

    @property
    def n(self) -> int:
        """Outputs returned: one vector (as `SamplingParams.n`)."""
        return 1

    @property
    def max_tokens(self) -> int:
        """Tokens it may generate: none (as `SamplingParams.max_tokens`)."""
        return 0

    @classmethod
    def from_json(cls, text: str | None) -> PoolingParams:
        """vLLM's --pooler-config JSON, e.g."""
        if text is None:
            return cls()
        try:
            config = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON: {e}") from e
        if not isinstance(config, dict) or set(config) - {"pooling_type", "normalize"}:
            raise ValueError(f'expected an object with "pooling_type" and/or "normalize", got {text}')
        return cls(**config)
