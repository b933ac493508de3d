"""`GET /metrics` in Prometheus' text format: each series under `tinyvllm:` (no labels) and under vLLM's `vllm:`
name with its labels `model_name` and `engine`, from one counter, so vLLM's Grafana dashboard reads it unchanged.
Taught in docs/phases/09-api-server.md and 09-appendix-endpoints.md.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

from tinyvllm.outputs import RequestOutput

PREFIX = "tinyvllm:"
VLLM_PREFIX = "vllm:"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))
FINISH_REASONS = ("stop", "length", "abort")  # vLLM's FinishReason: each series exists from the start, at 0


def label_text(labels: dict[str, str]) -> str:
    """`{a="x",b="y"}`, or nothing for no labels."""
    if not labels:
        return ""
    return "{" + ",".join(f'{key}="{value}"' for key, value in labels.items()) + "}"


class Metric:
    """One series family. `vllm`: vLLM has this name too, so it is also written as `vllm:<name>`."""

    kind = ""

    def __init__(self, name: str, help: str, vllm: bool = False):
        self.base_name, self.help, self.vllm = name, help, vllm
        self.name = PREFIX + name

    def render(self, prefix: str = PREFIX, labels: dict[str, str] | None = None) -> list[str]:
        name = prefix + self.base_name
        return [f"# HELP {name} {self.help}", f"# TYPE {name} {self.kind}", *self.samples(name, labels or {})]

    def samples(self, name: str, labels: dict[str, str]) -> list[str]:
        raise NotImplementedError


class Gauge(Metric):
    kind = "gauge"

    def __init__(self, name: str, help: str, vllm: bool = False):
        super().__init__(name, help, vllm)
        self.value = 0.0

    def samples(self, name: str, labels: dict[str, str]) -> list[str]:
        return [f"{name}{label_text(labels)} {self.value}"]


class Info(Metric):
    """A gauge of value 1 whose labels say how the engine is configured (vLLM's `cache_config_info`)."""

    kind = "gauge"

    def __init__(self, name: str, help: str, vllm: bool = False):
        super().__init__(name, help, vllm)
        self.labels: dict[str, str] = {}

    def samples(self, name: str, labels: dict[str, str]) -> list[str]:
        if not self.labels:
            return []
        return [f"{name}{label_text({**labels, **self.labels})} 1"]


class Counter(Metric):
    """Only goes up."""

    kind = "counter"

    def __init__(self, name: str, help: str, label: str | None = None, vllm: bool = False,
                 label_values: tuple[str, ...] = ()):
        super().__init__(name, help, vllm)
        self.label = label
        self.values: dict[str, float] = {value: 0.0 for value in label_values} if label else {"": 0.0}

    def inc(self, amount: float = 1.0, label_value: str = "") -> None:
        self.values[label_value] = self.values.get(label_value, 0.0) + amount

    def set_total(self, total: float) -> None:
        """For a count the engine keeps itself: its running total, copied."""
        self.values[""] = total

    def samples(self, name: str, labels: dict[str, str]) -> list[str]:
        if self.label is None:
            return [f"{name}{label_text(labels)} {self.values['']}"]
        return [f"{name}{label_text({**labels, self.label: value})} {count}"
                for value, count in sorted(self.values.items())]


class LabeledGauge(Counter):
    """A gauge per value of one label (vLLM's `num_requests_waiting_by_reason`)."""

    kind = "gauge"

    def set(self, value: float, label_value: str) -> None:
        self.values[label_value] = value


class Histogram(Metric):
    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: tuple[float, ...], vllm: bool = False):
        super().__init__(name, help, vllm)
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # per bucket, not cumulative; the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[next((i for i, upper in enumerate(self.buckets) if value <= upper), len(self.buckets))] += 1
        self.sum += value

    def samples(self, name: str, labels: dict[str, str]) -> list[str]:
        lines, cumulative = [], 0
        for upper, count in zip([*map(str, self.buckets), "+Inf"], self.counts):
            cumulative += count
            lines.append(f"{name}_bucket{label_text({**labels, 'le': upper})} {cumulative}")
        return [*lines, f"{name}_sum{label_text(labels)} {self.sum}", f"{name}_count{label_text(labels)} {cumulative}"]


@dataclass
class _RequestTimes:
    arrival_time: float
    last_token_time: float = 0.0
    num_tokens: int = 0
    prefilled: bool = False  # its prompt tokens are counted (at its first output, as vLLM counts them)


def cache_config_labels(stats: dict) -> dict[str, str]:
    """vLLM's cache_config_info labels from the engine's stats (the size in tokens, and how many whole contexts)."""
    labels = {"cache_dtype": stats["kv_cache_dtype"]}
    if "block_size" in stats:
        tokens = stats["num_total_blocks"] * stats["block_size"]
        labels.update(block_size=str(stats["block_size"]), num_gpu_blocks=str(stats["num_total_blocks"]),
                      kv_cache_size_tokens=str(tokens),
                      kv_cache_max_concurrency=f"{tokens / stats['max_model_len']:.2f}",
                      enable_prefix_caching=str(stats["enable_prefix_caching"]))
    return labels


class ServerMetrics:
    """The async engine's stat logger: called on the engine thread, rendered on the event loop."""

    def __init__(self):
        self.lock = threading.Lock()
        self.running = Gauge("num_requests_running", "Requests in the running batch.", vllm=True)
        self.waiting = Gauge("num_requests_waiting", "Requests waiting to be scheduled, queued ones included.",
                             vllm=True)
        self.blocks_used = Gauge("num_kv_blocks_used", "KV cache blocks held by requests.")
        self.blocks_total = Gauge("num_kv_blocks_total", "KV cache blocks in the pool.")
        self.waiting_by_reason = LabeledGauge(
            "num_requests_waiting_by_reason", "Waiting requests by reason: capacity (for room in the batch or the KV "
            "cache; every one here) or deferred (vLLM's LoRA and KV-transfer waits, which this engine has not).",
            "reason", vllm=True, label_values=("capacity", "deferred"))
        self.admission_rejections = Counter(
            "admission_rejections_total", "Requests refused at admission (429) by a queue limit: --max-waiting is "
            "vLLM's max_num_queued_reqs.", "reason", vllm=True, label_values=("max_num_queued_reqs",))
        self.kv_usage = Gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).", vllm=True)
        self.cache_config = Info("cache_config_info", "KV cache configuration as labels (vLLM's): cache_dtype, "
                                 "block_size, num_gpu_blocks, kv_cache_size_tokens, kv_cache_max_concurrency "
                                 "(contexts of max_model_len it holds), enable_prefix_caching.", vllm=True)
        self.kv_bytes_per_token = Gauge("kv_cache_bytes_per_token", "KV cache bytes one token of context holds, "
                                        "over all layers (K and V, with their scales).")
        self.prompt_tokens = Counter("prompt_tokens_total", "Prompt tokens prefilled.", vllm=True)
        self.generation_tokens = Counter("generation_tokens_total", "Tokens generated.", vllm=True)
        self.success = Counter("request_success_total", "Requests finished, by reason (abort: the client left or "
                               "the request failed).", "finished_reason", vllm=True, label_values=FINISH_REASONS)
        # prefix caching, in tokens
        self.prefix_queries = Counter("prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.",
                                      vllm=True)
        self.prefix_hits = Counter("prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", vllm=True)
        self.ttft = Histogram("time_to_first_token_seconds", "Time from arrival to the first generated token.",
                              LATENCY_BUCKETS, vllm=True)
        self.itl = Histogram("inter_token_latency_seconds", "Time between two tokens of one request.",
                             LATENCY_BUCKETS, vllm=True)
        self.e2e = Histogram("e2e_request_latency_seconds", "Time from arrival to the last token.", LATENCY_BUCKETS,
                             vllm=True)
        self.tpot = Histogram("time_per_output_token_seconds", "Time between two tokens of one request "
                              "(the older name of inter_token_latency_seconds).", LATENCY_BUCKETS, vllm=True)
        self.queue_time = Histogram("request_queue_time_seconds", "Time from arrival to the first step that ran "
                                    "the request.", LATENCY_BUCKETS, vllm=True)
        self.prefill_time = Histogram("request_prefill_time_seconds", "Time from the first step that ran the "
                                      "request to its first token.", LATENCY_BUCKETS, vllm=True)
        self.decode_time = Histogram("request_decode_time_seconds", "Time from the first token to the last.",
                                     LATENCY_BUCKETS, vllm=True)
        self.inference_time = Histogram("request_inference_time_seconds", "Time from the first step that ran the "
                                        "request to its last token (prefill + decode).", LATENCY_BUCKETS, vllm=True)
        self.request_tpot = Histogram("request_time_per_output_token_seconds", "Per request: decode time / "
                                      "(generated tokens - 1).", LATENCY_BUCKETS, vllm=True)
        self.request_prompt_tokens = Histogram("request_prompt_tokens", "Prompt tokens of each finished request.",
                                               TOKEN_BUCKETS, vllm=True)
        self.request_generation_tokens = Histogram("request_generation_tokens", "Tokens generated by each finished "
                                                   "request (all its n completions).", TOKEN_BUCKETS, vllm=True)
        self.request_max_generation_tokens = Histogram(
            "request_max_num_generation_tokens", "Tokens generated by the longest of each finished request's n "
            "completions.", TOKEN_BUCKETS, vllm=True)
        self.params_n = Histogram("request_params_n", "The n of each request (choices, or beams).", (1, 2, 5, 10, 20),
                                  vllm=True)
        self.params_max_tokens = Histogram("request_params_max_tokens", "The max_tokens of each request that set it.",
                                           TOKEN_BUCKETS, vllm=True)
        self.iteration_tokens = Histogram("iteration_tokens_total", "Tokens of each engine step as vLLM counts them: "
                                          "the prompts of requests whose first output it made, plus the tokens it "
                                          "generated.", (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                                         16384), vllm=True)
        self.preemptions = Counter("num_preemptions_total", "Requests preempted (their KV blocks freed, to be "
                                   "recomputed) to make room for others.", vllm=True)
        self.request_preemptions = Histogram("request_num_preemptions", "Times each finished request was preempted.",
                                             (0, 1, 2, 5, 10, 20, 50), vllm=True)
        self.batch = Histogram("num_running_per_step", "Requests in the batch of each engine step.", BATCH_BUCKETS)
        # speculative decoding (Phase 7b), shown only when on: the engine's running totals
        self.spec_decode_on = False
        self.spec_draft = Counter("spec_decode_num_draft_tokens_total", "Draft tokens proposed and verified.",
                                  vllm=True)
        self.spec_accepted = Counter("spec_decode_num_accepted_tokens_total", "Draft tokens the target accepted.",
                                     vllm=True)
        self.spec_emitted = Counter("spec_decode_num_emitted_tokens_total",
                                    "Tokens the verifying requests got: the accepted drafts plus one of the target's.")
        self.spec_acceptance = Gauge("spec_decode_acceptance_rate", "Accepted / draft tokens, since the start.")
        self.spec_mean_length = Gauge("spec_decode_mean_accepted_length",
                                      "Tokens emitted per verify step: accepted drafts + 1, since the start.")
        self._requests: dict[str, _RequestTimes] = {}

    def record_added(self, request_id: str, arrival_time: float, params=None) -> None:
        """A request the engine took; `params` its SamplingParams (or BeamSearchParams, PoolingParams)."""
        with self.lock:
            self._requests[request_id] = _RequestTimes(arrival_time)
            if params is not None:
                self.params_n.observe(params.n)
                if params.max_tokens:
                    self.params_max_tokens.observe(params.max_tokens)

    def record_admission_rejection(self, reason: str = "max_num_queued_reqs") -> None:
        """A request refused before the engine took it (vLLM's name and reason)."""
        with self.lock:
            self.admission_rejections.inc(1, reason)

    def record_removed(self, request_id: str) -> None:
        """Aborted (the client left, or the request failed): no latency to report, but it finished."""
        with self.lock:
            if self._requests.pop(request_id, None) is not None:
                self.success.inc(1, "abort")

    def record(self, now: float, stats: dict, outputs: list[RequestOutput], stepped: bool) -> None:
        with self.lock:
            self.running.value = stats.get("num_running", 0)
            self.waiting.value = stats.get("num_waiting", 0)
            total = stats.get("num_total_blocks", 0)
            self.blocks_total.value = total
            self.blocks_used.value = total - stats.get("num_free_blocks", total)
            self.kv_usage.value = self.blocks_used.value / total if total else 0.0
            if "kv_cache_dtype" in stats:
                self.cache_config.labels = cache_config_labels(stats)
            self.kv_bytes_per_token.value = stats.get("kv_cache_bytes_per_token", 0)
            self.prefix_queries.set_total(stats.get("prefix_cache_queries", 0))
            self.prefix_hits.set_total(stats.get("prefix_cache_hits", 0))
            self.preemptions.set_total(stats.get("num_preemptions", 0))
            if "spec_decode_num_draft_tokens" in stats:
                self._record_spec_decode(stats)
            step_tokens = sum(self._record_output(now, output) for output in outputs)
            if stepped:  # the batch that ran: still running, or finished by this step
                self.batch.observe(self.running.value + sum(output.finished for output in outputs))
                self.iteration_tokens.observe(step_tokens)

    def _record_spec_decode(self, stats: dict) -> None:
        self.spec_decode_on = True
        self.spec_draft.set_total(stats["spec_decode_num_draft_tokens"])
        self.spec_accepted.set_total(stats["spec_decode_num_accepted_tokens"])
        self.spec_emitted.set_total(stats["spec_decode_num_emitted_tokens"])
        self.spec_acceptance.value = stats["spec_decode_acceptance_rate"]
        self.spec_mean_length.value = stats.get("spec_decode_mean_accepted_length", 0.0)

    def _record_output(self, now: float, output: RequestOutput) -> int:
        """One request's output of a step; returns its tokens as vLLM's IterationStats counts them: the whole prompt at
        its first output, plus the tokens generated."""
        times = self._requests.get(output.request_id)
        if times is None:
            return 0
        step_tokens = 0
        if not times.prefilled:
            times.prefilled = True
            self.prompt_tokens.inc(len(output.prompt_token_ids))
            step_tokens += len(output.prompt_token_ids)
        num_tokens = sum(len(completion.token_ids) for completion in output.outputs)
        new_tokens = num_tokens - times.num_tokens
        if new_tokens > 0:
            if times.num_tokens == 0:
                self.ttft.observe(now - times.arrival_time)
            else:
                for _ in range(new_tokens):
                    self.itl.observe((now - times.last_token_time) / new_tokens)
                    self.tpot.observe((now - times.last_token_time) / new_tokens)
            self.generation_tokens.inc(new_tokens)
            step_tokens += new_tokens
            times.num_tokens, times.last_token_time = num_tokens, now
        if output.finished:
            self.e2e.observe(now - times.arrival_time)
            for completion in output.outputs:
                self.success.inc(1, completion.finish_reason or "unknown")
            self._record_phases(now, times, output, num_tokens)
            del self._requests[output.request_id]
        return step_tokens

    def _record_phases(self, now: float, times: _RequestTimes, output: RequestOutput, num_tokens: int) -> None:
        """A finished request's queue, prefill, decode and inference times, and its token counts."""
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(num_tokens)
        self.request_max_generation_tokens.observe(max((len(c.token_ids) for c in output.outputs), default=0))
        metrics = output.metrics
        self.request_preemptions.observe(0 if metrics is None else metrics.num_preemptions)
        scheduled = None if metrics is None else metrics.first_scheduled_time
        if scheduled is None:
            return
        first_token = metrics.first_token_time if metrics.first_token_time is not None else now
        self.queue_time.observe(max(scheduled - times.arrival_time, 0.0))
        self.prefill_time.observe(max(first_token - scheduled, 0.0))
        self.decode_time.observe(max(now - first_token, 0.0))
        self.inference_time.observe(max(now - scheduled, 0.0))
        if num_tokens > 1:
            self.request_tpot.observe(max(now - first_token, 0.0) / (num_tokens - 1))

    def load_report(self, metrics_format: str, num_waiting: int) -> dict[str, str] | None:
        """vLLM's ORCA load report for a load balancer (Envoy): the `endpoint-load-metrics` header in
        `metrics_format` TEXT or JSON; None for any other."""
        named = {"kv_cache_usage_perc": float(self.kv_usage.value), "num_requests_waiting": float(num_waiting)}
        if metrics_format.lower() == "text":
            return {"endpoint-load-metrics": "TEXT " + ", ".join(f"named_metrics.{k}={v}" for k, v in named.items())}
        if metrics_format.lower() == "json":
            return {"endpoint-load-metrics": "JSON " + json.dumps({"named_metrics": named})}
        return None

    def render(self, num_waiting: int | None = None, model_name: str = "") -> str:
        """The text for a scrape: every series as `tinyvllm:`, and vLLM's again as `vllm:` with vLLM's labels
        (`engine`: the engine's index; one engine here, so "0")."""
        if num_waiting is not None:
            self.waiting.value = num_waiting
        self.waiting_by_reason.set(self.waiting.value, "capacity")
        metrics = [self.running, self.waiting, self.waiting_by_reason, self.admission_rejections, self.blocks_used,
                   self.blocks_total, self.kv_usage, self.cache_config, self.kv_bytes_per_token, self.prompt_tokens,
                   self.generation_tokens, self.success,
                   self.prefix_queries, self.prefix_hits, self.preemptions, self.ttft, self.itl, self.tpot, self.e2e,
                   self.queue_time, self.prefill_time, self.decode_time, self.inference_time, self.request_tpot,
                   self.request_prompt_tokens, self.request_generation_tokens, self.request_max_generation_tokens,
                   self.params_n, self.params_max_tokens, self.iteration_tokens, self.request_preemptions, self.batch]
        if self.spec_decode_on:
            metrics += [self.spec_draft, self.spec_accepted, self.spec_emitted, self.spec_acceptance,
                        self.spec_mean_length]
        vllm_labels = {"model_name": model_name, "engine": "0"}
        with self.lock:
            lines = [line for metric in metrics for line in metric.render()]
            lines += [line for metric in metrics if metric.vllm for line in metric.render(VLLM_PREFIX, vllm_labels)]
        return "\n".join(lines) + "\n"


class KeyMetrics:
    """Requests and tokens per API key id (event loop only: no lock)."""

    def __init__(self):
        self.requests: dict[tuple[str, str], int] = {}  # (key_id, status) -> requests
        self.prompt_tokens = Counter("api_key_prompt_tokens_total", "Prompt tokens of requests, by API key.", "key_id")
        self.generation_tokens = Counter("api_key_generation_tokens_total", "Tokens generated, by API key.", "key_id")

    def record(self, key_id: str, status: int | None, prompt_tokens: int, generation_tokens: int) -> None:
        label = (key_id, str(status or 0))  # 0: no response was sent
        self.requests[label] = self.requests.get(label, 0) + 1
        self.prompt_tokens.inc(prompt_tokens, key_id)
        self.generation_tokens.inc(generation_tokens, key_id)

    def render(self) -> str:
        name = PREFIX + "api_key_requests_total"
        lines = [f"# HELP {name} Requests, by API key and HTTP status (429: over the key's limits).",
                 f"# TYPE {name} counter"]
        lines += [f'{name}{{key_id="{key_id}",status="{status}"}} {count}'
                  for (key_id, status), count in sorted(self.requests.items())]
        return "\n".join([*lines, *self.prompt_tokens.render(), *self.generation_tokens.render()]) + "\n"
