"""The engine model's metrics: counters added up per flush, histograms per request."""

from __future__ import annotations

import pytest

from tests.unit.backend import fake_pb_utils
from tritonllm.engine.api import Emission


@pytest.fixture
def metrics(monkeypatch):
    fake_pb_utils.install(monkeypatch)
    from tritonllm.backend.metrics import EngineMetrics

    return EngineMetrics("tensorrt_llm", "1", "cuda:0")


def test_a_flush_increments_each_counter_once_and_observes_each_request(metrics):
    from tritonllm.link.engine_calls import Finished

    finished = [
        Finished(
            Emission([1, 2], "length", time_to_first_token=0.1, time_per_output_token=0.01, cached_tokens=4), 8, 2
        ),
        Finished(Emission([3], "stop", time_to_first_token=0.2, cached_tokens=0), 5, 1),
        Finished(Emission([], "error", "engine failed"), 3, 0),
    ]
    metrics.record([*finished, "invalid_input", "invalid_input", "server_busy"])

    assert metrics.input_tokens.value() == 16 and metrics.input_tokens.increments == 1
    assert metrics.output_tokens.value() == 3 and metrics.output_tokens.increments == 1
    assert metrics.cached_tokens.value() == 4 and metrics.cached_tokens.increments == 1
    assert {r: m.value() for r, m in metrics.finished.items() if m.value()} == {"length": 1, "stop": 1, "error": 1}
    assert {k: m.value() for k, m in metrics.errors.items()} == {
        "invalid_input": 2,
        "server_busy": 1,
        "generation_failed": 1,
    }
    assert all(m.increments <= 1 for m in [*metrics.finished.values(), *metrics.errors.values()])
    assert metrics.ttft.observed == [0.1, 0.2]
    assert metrics.tpot.observed == [0.01]


def test_a_flush_with_nothing_to_count_makes_no_round_trip(metrics):
    metrics.record([])
    counters = [metrics.input_tokens, metrics.output_tokens, metrics.cached_tokens, *metrics.finished.values()]
    assert sum(m.increments for m in counters) == 0


def test_every_metric_carries_the_instances_device(metrics):
    """One engine-model instance per GPU registers the metrics: its device tells them apart (in tritonserver 2.51
    two stubs registering a metric of the same name and labels get one, freed by either while the other updates
    it)."""
    made = [metric for family in fake_pb_utils.metric_families for metric in family.metrics]
    assert made and all(m.labels["device"] == "cuda:0" and m.labels["model"] == "tensorrt_llm" for m in made)


def test_each_adapter_counts_its_own_requests_and_tokens(monkeypatch):
    fake_pb_utils.install(monkeypatch)
    from tritonllm.backend.metrics import EngineMetrics
    from tritonllm.link.engine_calls import Finished

    metrics = EngineMetrics("tensorrt_llm", "1", "cpu", ["banana", "cherry"])
    metrics.record(
        [
            Finished(Emission([1], "eos"), 8, 2, "banana"),
            Finished(Emission([1], "eos"), 5, 3, "banana"),
            Finished(Emission([1], "eos"), 7, 4),  # the base model: counted only in the totals
        ]
    )
    banana, cherry = metrics.adapters["banana"], metrics.adapters["cherry"]
    assert (banana.requests.value(), banana.input_tokens.value(), banana.output_tokens.value()) == (2, 13, 5)
    assert banana.requests.labels["adapter"] == "banana" and banana.requests.increments == 1
    assert cherry.requests.value() == 0 and metrics.output_tokens.value() == 9
