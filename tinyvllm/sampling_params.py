"""How one request wants its tokens chosen and when it wants them to stop.

    what to sample          temperature, top_p, top_k, min_p, seed        -> tinyvllm.sample.sampler
    what to discourage      presence/frequency/repetition_penalty, logit_bias
    how much                max_tokens, min_tokens, n
    when to stop            stop (strings), stop_token_ids, ignore_eos    -> tinyvllm.sample.stop
    what to report          logprobs, include_stop_str_in_output, skip_special_tokens
    what shape              structured_outputs (JSON schema, regex, choice, grammar) -> sample.structured_output
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import IntEnum

# below this temperature sampling is greedy (vLLM's `_SAMPLING_EPS`): a smaller divisor overflows float32
SAMPLING_EPS = 1e-5
# vLLM's default `max_logprobs`: how many alternatives a request may ask for at each position.
MAX_LOGPROBS = 20


class SamplingType(IntEnum):
    GREEDY = 0  # argmax, no randomness
    RANDOM = 1  # sampled with a fresh generator
    RANDOM_SEED = 2  # sampled with the request's own seeded generator: reproducible


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _require(ok: bool, field: str, value: object, valid: str) -> None:
    # Written as "ok" rather than "bad" so that NaN, which fails every comparison, is rejected.
    if not ok:
        raise ValueError(f"{field} must be {valid}, got {value!r}")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Constrain the output to a grammar; exactly one field is set (`grammar`: Lark)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self):
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        _require(len(given) == 1, "structured_outputs", given or None,
                 "exactly one of json, regex, choice, grammar or json_object")
        _require(self.json is None or isinstance(self.json, (str, dict)), "structured_outputs.json", self.json,
                 "a JSON schema (a dict or a JSON string)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _require(value is None or (isinstance(value, str) and value != ""), f"structured_outputs.{name}", value,
                     "a non-empty string")
        _require(self.choice is None or (isinstance(self.choice, list) and self.choice
                                         and all(isinstance(c, str) and c for c in self.choice)),
                 "structured_outputs.choice", self.choice, "a non-empty list of non-empty strings")
        _require(self.json_object in (None, True, False), "structured_outputs.json_object", self.json_object,
                 "True or None")


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1  # completions per prompt
    temperature: float = 1.0  # 0 (below SAMPLING_EPS) = greedy
    top_p: float = 1.0  # keep the most likely tokens whose mass reaches top_p; 1 = off
    top_k: int = -1  # keep the k most likely tokens; -1 or 0 = off
    min_p: float = 0.0  # keep tokens with prob >= min_p * (prob of the most likely); 0 = off
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    repetition_penalty: float = 1.0  # divides (or multiplies) logits of tokens in prompt or output; 1 = off
    seed: int | None = None
    max_tokens: int | None = 16  # None = until the context is full
    min_tokens: int = 0  # stop tokens (eos, stop_token_ids) are banned until this many are generated
    stop: str | list[str] | None = None  # normalised to a list
    stop_token_ids: list[int] | None = None  # normalised to a list
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # return this many top alternatives (plus the sampled token) per position; -1: all
    prompt_logprobs: int | None = None  # the same for each prompt token (the engine computes every position)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow

    def __post_init__(self):
        # Normalise first (frozen forbids plain assignment, hence object.__setattr__).
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "stop_token_ids", list(self.stop_token_ids or []))
        if self.logit_bias is not None:
            _require(isinstance(self.logit_bias, dict), "logit_bias", self.logit_bias, "a dict {token_id: bias}")
            object.__setattr__(self, "logit_bias", dict(self.logit_bias))
        self._validate()

    def _validate(self) -> None:
        _require(_is_int(self.n) and self.n >= 1, "n", self.n, "an integer >= 1")
        _require(_is_number(self.temperature) and self.temperature >= 0, "temperature", self.temperature,
                 "a number >= 0 (0 = greedy)")
        _require(_is_number(self.top_p) and 0 < self.top_p <= 1, "top_p", self.top_p, "in (0, 1]")
        _require(_is_int(self.top_k) and (self.top_k in (-1, 0) or self.top_k >= 1), "top_k", self.top_k,
                 "-1 or 0 (off) or an integer >= 1")
        _require(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_is_number(value) and -2 <= value <= 2, name, value, "in [-2, 2]")
        _require(_is_number(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
                 self.repetition_penalty, "> 0 (1 = off)")
        # Any 64-bit integer, as the OpenAI API allows; make_generator maps it onto numpy's unsigned seeds.
        _require(self.seed is None or (_is_int(self.seed) and -2**63 <= self.seed < 2**64), "seed", self.seed,
                 "None or a 64-bit integer")
        _require(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
                 self.max_tokens, "None or an integer >= 1")
        upper = "max_tokens" if self.max_tokens is None else f"max_tokens ({self.max_tokens})"
        _require(_is_int(self.min_tokens) and 0 <= self.min_tokens <= (self.max_tokens or self.min_tokens),
                 "min_tokens", self.min_tokens, f"an integer >= 0 and <= {upper}")
        for s in self.stop:
            _require(isinstance(s, str) and s != "", "stop", self.stop, "a string or a list of non-empty strings")
        for t in self.stop_token_ids:
            _require(_is_int(t) and t >= 0, "stop_token_ids", self.stop_token_ids, "a list of token ids >= 0")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _require(isinstance(getattr(self, name), bool), name, getattr(self, name), "True or False")
        for name in ("logprobs", "prompt_logprobs"):  # the engine's max_logprobs bounds them
            value = getattr(self, name)
            _require(value is None or (_is_int(value) and value >= -1), name, value,
                     "None, -1 (every token's) or an integer >= 0")
        _require(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputsParams),
                 "structured_outputs", self.structured_outputs, "None or a StructuredOutputsParams")
        for token_id, bias in (self.logit_bias or {}).items():
            _require(_is_int(token_id) and token_id >= 0, "logit_bias", token_id, "keyed by token ids >= 0")
            _require(_is_number(bias) and -100 <= bias <= 100, f"logit_bias[{token_id}]", bias, "in [-100, 100]")

    # ---- derived, never stored ----

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type == SamplingType.GREEDY

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def all_stop_token_ids(self, eos_token_ids: Iterable[int] = ()) -> set[int]:
        """The token ids that finish this request: `stop_token_ids`, plus the model's eos unless `ignore_eos` (the
        set `min_tokens` bans)."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(eos_token_ids)
        return ids
