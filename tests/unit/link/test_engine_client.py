"""Unit: the fronts as clients of the engine's own process (link.engine_client), against a real child process
running the synthetic engine, as the engine model's instance starts it."""

from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pytest

from tests.polling import eventually
from tritonllm.engine.process import EngineProcess, runtime_dir
from tritonllm.engine.synthetic import SYNTHETIC_CONFIG_FILE, SyntheticConfig
from tritonllm.errors import ErrorKind, InputError, ServerBusy
from tritonllm.link.engine_calls import EngineSettings, engine_scope
from tritonllm.link.engine_client import EngineClient
from tritonllm.protocol import FINISH_LENGTH
from tritonllm.text.wire import Limits

TEXT = tuple(range(100, 140))
SETTINGS = EngineSettings(Limits(max_input_len=64, max_seq_len=128, vocab_size=200), True, 4)


@pytest.fixture
def folder(tmp_path):
    """An engine model's version folder, as the build writes it for the synthetic engine in a process of its own."""
    folder = tmp_path / "tensorrt_llm_decoupled" / "1"
    folder.mkdir(parents=True)
    config = SyntheticConfig(TEXT, max_batch_size=2, step_ms=1, engine_process=True)
    (folder / SYNTHETIC_CONFIG_FILE).write_text(json.dumps(asdict(config)))
    return folder


@pytest.fixture
def instance(folder):
    """The engine model's instance: it starts the engine's process, as load_engine does."""
    config = SyntheticConfig(**json.loads((folder / SYNTHETIC_CONFIG_FILE).read_text()))
    stops: list[str] = []
    engine = EngineProcess(config, engine_scope(folder), on_stop=stops.append)
    engine.stops = stops
    yield engine
    engine.shutdown()


def arrays(ids: list[int], tokens: int, **extra) -> dict[str, np.ndarray]:
    return {
        "input_ids": np.array([ids], np.int32),
        "input_lengths": np.array([[len(ids)]], np.int32),
        "request_output_len": np.array([[tokens]], np.int32),
        **extra,
    }


def tokens_of(responses: list[dict]) -> list[int]:
    return [t for r in responses for t in r["output_ids"].reshape(-1)[: int(r["sequence_length"].reshape(-1)[0])]]


def test_a_client_gets_the_engine_models_outputs_streamed_and_whole(folder, instance):
    client = EngineClient(folder, SETTINGS)
    records: list = []
    instance._on_records = records.extend  # the instance that reports the engine's metrics gets the client's
    try:
        whole = list(client.open(arrays([1, 2], 12), wanted={"output_ids", "sequence_length"}))
        assert len(whole) == 1 and len(tokens_of(whole)) == 12
        streamed = list(client.open(arrays([1, 2], 12, streaming=np.array([[True]]))))
        assert tokens_of(streamed) == tokens_of(whole)
        expected, _ = instance.generate(instance_request([1, 2], 12), timeout=10)
        assert tokens_of(whole) == expected, "the same engine, reached by the instance or the client"
        assert eventually(lambda: len(records) == 2, 5), records  # the instance's own request is not forwarded
        assert [(r.emission.finish_reason, r.output_tokens) for r in records] == [(FINISH_LENGTH, 12)] * 2
        with pytest.raises(InputError):
            client.open(arrays([1], 0))
        assert eventually(lambda: len(records) == 3, 5) and records[2] == "invalid_input", "refusals counted too"
    finally:
        client.close()


def instance_request(ids, tokens):
    from tritonllm.engine.api import GenerationRequest

    return GenerationRequest(input_ids=ids, max_new_tokens=tokens)


def test_a_client_refuses_as_the_engine_model_does(folder, instance):
    client = EngineClient(folder, SETTINGS)
    try:
        with pytest.raises(InputError) as refused:
            client.open(arrays([1, 999], 4))
        assert refused.value.field == "input_ids"
        held = [client.open(arrays([1], 10_000 // 100, streaming=np.array([[True]]))) for _ in range(SETTINGS.capacity)]
        with pytest.raises(ServerBusy):
            client.open(arrays([1], 4))
        for stream in held:
            stream.stop()
            list(stream)
    finally:
        client.close()


def test_a_stop_relayed_through_the_engines_process_ends_a_clients_stream(folder, instance):
    client = EngineClient(folder, SETTINGS)
    try:
        long = client.open(arrays([1], 120, streaming=np.array([[True]])), request_id="long")
        assert eventually(lambda: not long.emissions.empty(), 5)
        instance.relay_stop("long")  # a stop request that reached the engine model's instance
        got = tokens_of(list(long))
        assert 0 < len(got) < 120
        assert eventually(lambda: instance.stops == ["long"], 5), "every caller of the engine hears it"
    finally:
        client.close()


def test_without_an_engine_process_a_client_answers_unavailable_and_leaves_nothing(folder):
    before = set(runtime_dir().iterdir())
    client = EngineClient(folder, SETTINGS)
    try:
        with pytest.raises(Exception) as failed:
            client.open(arrays([1], 4))
        assert getattr(failed.value, "kind", None) is ErrorKind.UNAVAILABLE and "not running" in str(failed.value)
        assert set(runtime_dir().iterdir()) == before, "no socket or lock file is made by looking"
    finally:
        client.close()
