"""API keys with limits (`--api-keys-file`: JSON or JSON lines, one {"id", "sha256" or "key", "rpm", "tpm"} per
key), each limit a token bucket; `python -m tinyvllm.api.keys ID` makes a key. The file format and the buckets are
taught in docs/phases/09-appendix-limits-and-keys.md.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import re
import secrets
import sys
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from tinyvllm.api.audit import current_record
from tinyvllm.api.errors import OpenAIError, bad_request, invalid_api_key
from tinyvllm.outputs import RequestOutput

KEY_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")  # safe as it is in a log line and a Prometheus label
FIELDS = {"id", "sha256", "key", "rpm", "tpm"}
EPSILON = 1e-9  # a bucket refilled for exactly Retry-After seconds holds enough, float rounding or not


@dataclass(frozen=True)
class ApiKey:
    id: str
    digest: bytes  # SHA-256: the key itself is never kept
    rpm: int | None = None
    tpm: int | None = None

    @property
    def has_limits(self) -> bool:
        return self.rpm is not None or self.tpm is not None


def sha256(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def parse_key(entry: object, where: str) -> ApiKey:
    """One object of the keys file -> ApiKey; ValueError naming the entry and the field at fault."""
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: each key must be a JSON object, got {entry!r}")
    unknown = set(entry) - FIELDS
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; a key has {sorted(FIELDS)}")
    key_id = entry.get("id")
    if not isinstance(key_id, str) or KEY_ID.fullmatch(key_id) is None:
        raise ValueError(f"{where}: id must be 1-64 letters, digits, '.', '_' or '-', got {key_id!r}")
    if ("sha256" in entry) == ("key" in entry):
        raise ValueError(f"{where} ({key_id}): give exactly one of sha256 (preferred) or key")
    if "key" in entry:
        if not isinstance(entry["key"], str) or not entry["key"]:
            raise ValueError(f"{where} ({key_id}): key must be a non-empty string")
        digest = sha256(entry["key"])
    else:
        if not isinstance(entry["sha256"], str) or re.fullmatch(r"[0-9a-fA-F]{64}", entry["sha256"]) is None:
            raise ValueError(f"{where} ({key_id}): sha256 must be 64 hex digits")
        digest = bytes.fromhex(entry["sha256"])
    limits = {}
    for name in ("rpm", "tpm"):
        value = entry.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{where} ({key_id}): {name} must be an integer >= 1 (or absent: no limit), got {value!r}")
        limits[name] = value
    return ApiKey(key_id, digest, **limits)


def load_api_keys(path: str | Path) -> list[ApiKey]:
    """The keys of a JSON or JSON-lines file."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        document = json.loads(text)
        entries = document.get("keys", [document]) if isinstance(document, dict) else document
        where = [f"{path}: key {i}" for i in range(len(entries))] if isinstance(entries, list) else []
    except json.JSONDecodeError:  # JSON lines
        numbered = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
        entries, where = [], []
        for n, line in numbered:
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON object: {e}") from e
            where.append(f"{path}:{n}")
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"{path}: expected a list of keys, {{\"keys\": [...]}} or JSON lines, with at least one key")
    return [parse_key(entry, w) for entry, w in zip(entries, where)]


class TokenBucket:
    """Up to `per_minute` units, refilled continuously at `per_minute` / 60 per second; never below zero."""

    def __init__(self, per_minute: int, now: float):
        self.capacity, self.rate = per_minute, per_minute / 60.0
        self.level, self.updated = float(per_minute), now

    def refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def seconds_until(self, amount: float, now: float) -> float:
        """How long until the bucket holds `amount` (0: it does now)."""
        self.refill(now)
        return 0.0 if self.level + EPSILON >= amount else (amount - self.level) / self.rate

    def take(self, amount: float, now: float) -> None:
        """Take `amount` (a negative amount gives back: never above the capacity)."""
        self.refill(now)
        self.level = min(self.capacity, self.level - amount)

    def headers(self, kind: str, now: float) -> dict[str, str]:
        """OpenAI's x-ratelimit-* headers for this bucket; reset: until the bucket is full again."""
        self.refill(now)
        return {f"x-ratelimit-limit-{kind}": str(self.capacity),
                f"x-ratelimit-remaining-{kind}": str(max(0, math.floor(self.level + EPSILON))),
                f"x-ratelimit-reset-{kind}": duration((self.capacity - self.level) / self.rate)}


def duration(seconds: float) -> str:
    """OpenAI's (Go's) way of writing a duration: '0s', '250ms', '1.5s', '6m0s'."""
    if seconds <= 0:
        return "0s"
    if seconds < 1:
        return f"{math.ceil(seconds * 1000)}ms"
    minutes, seconds = divmod(seconds, 60)
    text = f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{text}" if minutes else text


def rate_limited(key: ApiKey, kind: str, limit: int, needed: int, wait: float) -> OpenAIError:
    retry_after = max(1, math.ceil(wait - EPSILON))  # whole seconds (RFC 9110), never early
    return OpenAIError(429, f"Rate limit reached for {kind} per minute on API key {key.id!r}: limit {limit}, this "
                       f"request needs {needed}. Please try again in {retry_after}s.", type=kind,
                       retry_after=retry_after)


class ApiKeys:
    """The server's keys and their buckets (event loop only: no lock)."""

    def __init__(self, keys: list[ApiKey], clock: Callable[[], float] = time.monotonic):
        assert keys, "at least one key"
        for attribute in ("id", "digest"):
            values = [getattr(key, attribute) for key in keys]
            if len(set(values)) != len(values):
                raise ValueError(f"two API keys have the same {'id' if attribute == 'id' else 'key'}")
        self.keys, self.clock = list(keys), clock
        now = clock()
        self.by_id = {key.id: key for key in keys}
        self.requests = {key.id: TokenBucket(key.rpm, now) for key in keys if key.rpm is not None}
        self.tokens = {key.id: TokenBucket(key.tpm, now) for key in keys if key.tpm is not None}

    @classmethod
    def build(cls, api_key: str | None = None, keys_file: str | Path | None = None) -> ApiKeys | None:
        """The keys of --api-keys-file plus --api-key (id "default", no limits); None if neither."""
        keys = load_api_keys(keys_file) if keys_file is not None else []
        if api_key is not None:
            keys.append(ApiKey("default", sha256(api_key)))
        return cls(keys) if keys else None

    def identify(self, authorization: str) -> ApiKey:
        """The key of an `Authorization: Bearer KEY` header, or a 401."""
        scheme, _, token = authorization.partition(" ")
        # Starlette decodes headers as latin-1: encoding back gives the bytes the client sent
        digest = hashlib.sha256(token.encode("latin-1")).digest()
        found = None
        for key in self.keys:  # every key, in constant time
            if hmac.compare_digest(digest, key.digest):
                found = key
        if scheme.lower() != "bearer" or found is None:
            raise invalid_api_key()
        return found

    def admit_request(self, key: ApiKey) -> None:
        """At arrival: one unit of RPM, and a token bucket not in debt (429 otherwise)."""
        now = self.clock()
        tokens = self.tokens.get(key.id)
        if tokens is not None and (wait := tokens.seconds_until(1, now)) > 0:
            raise rate_limited(key, "tokens", key.tpm, 1, wait)
        requests = self.requests.get(key.id)
        if requests is not None:
            if (wait := requests.seconds_until(1, now)) > 0:
                raise rate_limited(key, "requests", key.rpm, 1, wait)
            requests.take(1, now)

    def reserve_tokens(self, key: ApiKey, num_prompt_tokens: int, max_completion_tokens: int) -> int:
        """Take the request's reservation, prompt plus the most it may generate: 429 if the bucket does not hold it
        now, 400 if it never can."""
        bucket = self.tokens.get(key.id)
        if bucket is None:
            return 0
        needed = num_prompt_tokens + max_completion_tokens
        if needed > bucket.capacity:  # a 429 would never clear: say so instead
            raise bad_request(f"this request may use {needed} tokens (a prompt of {num_prompt_tokens} and up to "
                              f"{max_completion_tokens} generated: max_tokens x n), more than the {bucket.capacity} "
                              f"tokens per minute that API key {key.id!r} may use: it can never be served; lower "
                              "max_tokens (or n)", "max_tokens")
        now = self.clock()
        if (wait := bucket.seconds_until(needed, now)) > 0:
            raise rate_limited(key, "tokens", key.tpm, needed, wait)
        bucket.take(needed, now)
        return needed

    def settle_tokens(self, key: ApiKey, reserved: int, used: int) -> None:
        """A request ended having used `used` of the `reserved` tokens: the rest go back to the bucket."""
        if key.id in self.tokens and reserved != used:
            self.tokens[key.id].take(used - reserved, self.clock())

    def headers(self, key: ApiKey) -> dict[str, str]:
        """x-ratelimit-{limit,remaining,reset}-{requests,tokens} for the limits this key has."""
        now, headers = self.clock(), {}
        if key.id in self.requests:
            headers.update(self.requests[key.id].headers("requests", now))
        if key.id in self.tokens:
            headers.update(self.tokens[key.id].headers("tokens", now))
        return headers


class KeyedEngine:
    """The AsyncLLMEngine as the serving code sees it, each request charged to the key in `current_record`."""

    def __init__(self, engine, keys: ApiKeys | None):
        self.async_engine, self.keys = engine, keys

    def __getattr__(self, name: str):
        return getattr(self.async_engine, name)

    def add_request(self, request_id: str, prompt: list[int], sampling_params, priority: int = 0):
        record = current_record.get(None)
        key = self.keys.by_id.get(record.key_id) if record is not None and self.keys is not None else None
        num_prompt_tokens = len(prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt)
        reserved = 0
        if key is not None:
            reserved = self.keys.reserve_tokens(key, num_prompt_tokens, self.max_completion_tokens(
                num_prompt_tokens, sampling_params))
        try:
            stream = self.async_engine.add_request(request_id, prompt, sampling_params, priority)
        except BaseException:
            if key is not None:
                self.keys.settle_tokens(key, reserved, 0)
            raise
        if record is None:
            return stream
        record.request_id, record.prompt_tokens = request_id, num_prompt_tokens  # once however many choices (n)
        return self.metered(stream, record, key, reserved, num_prompt_tokens)

    def max_completion_tokens(self, num_prompt_tokens: int, params) -> int:
        """The most tokens a request may generate, all its choices together: (max_tokens or the room left) x n."""
        room = self.async_engine.max_model_len - num_prompt_tokens
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        return max(0, max_tokens) * params.n

    async def metered(self, stream: AsyncIterator[RequestOutput], record, key: ApiKey | None, reserved: int,
                      num_prompt_tokens: int):
        """The stream, counting its completion tokens; the key's reservation settled however it ends."""
        generated = 0
        try:
            async for output in stream:
                generated = sum(len(completion.token_ids) for completion in output.outputs)
                record.completion_tokens = generated
                yield output
        finally:  # closing the engine's stream aborts the request
            if key is not None:
                self.keys.settle_tokens(key, reserved, num_prompt_tokens + generated)
            await stream.aclose()


def main(argv: list[str] | None = None) -> None:
    """Print a new random key (to give to its user) and its line for --api-keys-file (no secret in it)."""
    import argparse

    p = argparse.ArgumentParser(description="make a new API key for --api-keys-file")
    p.add_argument("id", help="the key's id: shown in the audit log and /metrics")
    p.add_argument("--rpm", type=int, default=None, help="requests per minute (default: no limit)")
    p.add_argument("--tpm", type=int, default=None, help="tokens per minute (default: no limit)")
    args = p.parse_args(argv)
    key = "sk-" + secrets.token_urlsafe(32)
    entry = {"id": args.id, "sha256": sha256(key).hex(), "rpm": args.rpm, "tpm": args.tpm}
    parse_key(entry, "the new key")
    print(f"key for {args.id} (give it to them; it is stored nowhere): {key}", file=sys.stderr)
    print(json.dumps({k: v for k, v in entry.items() if v is not None}))


if __name__ == "__main__":
    main()
