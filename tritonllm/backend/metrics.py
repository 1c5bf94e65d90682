"""The engine's Prometheus metrics, on tritonserver's metrics port beside Triton's own.

All carry the labels `model`, `version` and `device`: the engine-model instance's (cuda:N, one engine per GPU,
or cpu). Two stubs must not register a metric of the same name and labels: tritonserver 2.51 gives both one
metric, which either frees while the other still updates it.

Each update is a round trip to the server made with the GIL held
(the stub's `Metric.increment`, `set` and `observe`), which stops every other thread of the model's process
meanwhile; so the engine model makes them from its sender thread's periodic tick, never from the generation
loop, and `record` adds up each counter's requests into one increment per tick.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import triton_python_backend_utils as pb_utils

from tritonllm.link.engine_calls import Finished, error_label
from tritonllm.protocol import FINISH_REASONS

TTFT_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
TPOT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0]
ERROR_KINDS = ("invalid_input", "server_busy", "generation_failed")  # engine_calls.error_label's


@dataclass(frozen=True)
class AdapterCounters:
    """One LoRA adapter's finished requests and their tokens (label `adapter`)."""

    requests: object
    input_tokens: object
    output_tokens: object


class EngineMetrics:
    def __init__(self, model: str, version: str, device: str, adapters: Sequence[str] = ()) -> None:
        labels = {"model": model, "version": version, "device": device}
        family = pb_utils.MetricFamily
        self._families = []  # a family must outlive its metrics

        def make(name: str, description: str, kind):
            fam = family(name=name, description=description, kind=kind)
            self._families.append(fam)
            return fam

        requests = make("tritonllm_engine_requests", "Requests in the engine, by state", family.GAUGE)
        self.running = requests.Metric(labels={**labels, "state": "running"})
        self.waiting = requests.Metric(labels={**labels, "state": "waiting"})
        self.in_flight = make(
            "tritonllm_engine_requests_in_flight",
            "Requests submitted to the engine and not finished (running or waiting for a batch slot)",
            family.GAUGE,
        ).Metric(labels=labels)
        self.graphs = make(
            "tritonllm_cuda_graphs",
            "CUDA graphs the engine captured, one per step shape met (0 without CUDA graphs); each new one "
            "cost a capture in some step",
            family.GAUGE,
        ).Metric(labels=labels)
        self.input_tokens = make(
            "tritonllm_input_tokens_total", "Prompt tokens of finished requests", family.COUNTER
        ).Metric(labels=labels)
        self.output_tokens = make(
            "tritonllm_output_tokens_total", "Tokens generated for finished requests", family.COUNTER
        ).Metric(labels=labels)
        self.cached_tokens = make(
            "tritonllm_prefix_cache_tokens_total",
            "Prompt tokens of finished requests taken from the prefix cache (computed for an earlier request)",
            family.COUNTER,
        ).Metric(labels=labels)
        finished = make("tritonllm_requests_finished_total", "Finished requests, by finish reason", family.COUNTER)
        self.finished = {r: finished.Metric(labels={**labels, "finish_reason": r}) for r in FINISH_REASONS}
        errors = make("tritonllm_request_errors_total", "Refused or failed requests, by kind", family.COUNTER)
        self.errors = {k: errors.Metric(labels={**labels, "kind": k}) for k in ERROR_KINDS}
        self.ttft = make(
            "tritonllm_time_to_first_token_seconds", "From submission to the first generated token", family.HISTOGRAM
        ).Metric(labels=labels, buckets=TTFT_BUCKETS)
        lora = [
            make(f"tritonllm_lora_{what}_total", f"{description} of finished requests, by LoRA adapter", family.COUNTER)
            for what, description in (
                ("requests", "Count"),
                ("input_tokens", "Prompt tokens"),
                ("output_tokens", "Tokens generated"),
            )
        ]
        self._lora, self._labels = lora, labels
        self.adapters: dict[str, AdapterCounters] = {}
        for name in adapters:  # the build's, listed from the start; one loaded while serving, at its first request
            self._adapter(name)
        self.tpot = make(
            "tritonllm_time_per_output_token_seconds", "Mean time per generated token after the first", family.HISTOGRAM
        ).Metric(labels=labels, buckets=TPOT_BUCKETS)

    def _adapter(self, name: str) -> AdapterCounters:
        if name not in self.adapters:
            labels = {**self._labels, "adapter": name}
            self.adapters[name] = AdapterCounters(*(family.Metric(labels=labels) for family in self._lora))
        return self.adapters[name]

    def record(self, records: list[Finished | str]) -> None:
        """Requests finished, and requests refused or failed (their `error_label`), since the previous call: one
        increment per counter that moved, one observation per request and histogram."""
        counts: Counter = Counter()
        for request in records:
            if isinstance(request, str):
                counts[self.errors[request]] += 1
                continue
            emission = request.emission
            reason = emission.finish_reason if emission.finish_reason in self.finished else "error"
            counts[self.finished[reason]] += 1
            counts[self.input_tokens] += request.input_tokens
            counts[self.cached_tokens] += emission.cached_tokens
            counts[self.output_tokens] += request.output_tokens
            if request.adapter:
                adapter = self._adapter(request.adapter)
                counts[adapter.requests] += 1
                counts[adapter.input_tokens] += request.input_tokens
                counts[adapter.output_tokens] += request.output_tokens
            if emission.error:
                counts[self.errors[error_label(emission.error_kind)]] += 1
            if emission.time_to_first_token is not None:
                self.ttft.observe(emission.time_to_first_token)
            if emission.time_per_output_token is not None:
                self.tpot.observe(emission.time_per_output_token)
        for metric, amount in counts.items():
            if amount:
                metric.increment(amount)

    def load(self, in_flight: int, in_batch: int, graphs: int) -> None:
        self.graphs.set(graphs)
        self.in_flight.set(in_flight)
        self.running.set(in_batch)
        self.waiting.set(max(0, in_flight - in_batch))
