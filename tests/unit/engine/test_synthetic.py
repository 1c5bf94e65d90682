"""The synthetic benchmark engine: the portable engine's interface and semantics, on a fixed passage."""

import json
import os

import pytest

from tests.polling import eventually
from tests.unit.engine.conftest import emissions_of, submitted
from tritonllm.engine.api import Emission, GenerationRequest, Guide, Penalties, SamplingParams
from tritonllm.engine.health import EngineHealth
from tritonllm.engine.process import EngineProcess
from tritonllm.engine.synthetic import SYNTHETIC_CONFIG_FILE, SyntheticConfig, SyntheticEngine
from tritonllm.errors import EngineFailure, InputError
from tritonllm.protocol import FINISH_CANCELLED, FINISH_EOS, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP
from tritonllm.repository.builder import main as build_main
from tritonllm.repository.plan import text_instances

TEXT = tuple(range(100, 140))


@pytest.fixture
def engine():
    built = SyntheticEngine(SyntheticConfig(TEXT, max_batch_size=2, step_ms=1))
    yield built
    built.shutdown()


def stream(engine, request: GenerationRequest) -> list[Emission]:
    return emissions_of(engine, request, 10)


def test_a_stream_gets_one_token_a_step_along_the_passage(engine):
    emissions = stream(engine, GenerationRequest([1, 2, 3], max_new_tokens=50, streaming=True))
    tokens = [t for e in emissions for t in e.token_ids]
    assert [len(e.token_ids) for e in emissions] == [1] * 50
    assert [e.finish_reason for e in emissions] == [None] * 49 + [FINISH_LENGTH]
    start = TEXT.index(tokens[0])
    assert tokens == [TEXT[(start + i) % len(TEXT)] for i in range(50)]
    assert emissions[-1].time_to_first_token > 0


def test_the_same_prompt_gets_the_same_text_streamed_or_not(engine):
    whole, reason = engine.generate(GenerationRequest([5, 6], max_new_tokens=30))
    streamed = stream(engine, GenerationRequest([5, 6], max_new_tokens=30, streaming=True))
    assert reason == FINISH_LENGTH
    assert whole == [t for e in streamed for t in e.token_ids]


def test_end_id_and_stop_words_end_a_request(engine):
    tokens, _ = engine.generate(GenerationRequest([7], max_new_tokens=30))
    ended, reason = engine.generate(GenerationRequest([7], max_new_tokens=30, end_id=tokens[5]))
    assert (ended, reason) == (tokens[:5], FINISH_EOS)
    stopped, reason = engine.generate(GenerationRequest([7], max_new_tokens=30, stop_words=((tokens[3], tokens[4]),)))
    assert (stopped, reason) == (tokens[:5], FINISH_STOP)


def test_requests_beyond_the_batch_wait_and_cancel_frees_a_place(engine):
    finals: dict[str, Emission] = {}
    ids = [
        engine.submit(GenerationRequest([i], max_new_tokens=10**6), lambda e, i=i: e.final and finals.update({i: e}))
        for i in range(3)
    ]
    assert engine.running() == 3
    assert eventually(lambda: engine.in_batch() == 2, 1)
    engine.cancel(ids[0])
    assert finals[0].finish_reason == FINISH_CANCELLED
    assert engine.running() == 2
    for request_id in ids[1:]:
        engine.cancel(request_id)
    assert engine.running() == 0


@pytest.mark.parametrize(
    "request_options, field",
    [
        ({"sampling": SamplingParams(sample=True, temperature=0.7)}, "temperature"),
        ({"penalties": Penalties(repetition=1.2)}, "repetition_penalty"),
        ({"embedding_bias": ((3, 1.0),)}, "embedding_bias"),
        ({"log_probs": 0}, "return_log_probs"),
        ({"guide": Guide("json")}, "guided_decoding_guide"),
        ({"bad_words": ((3,),)}, "bad_words_list"),
        # the rules every engine applies, before its own refusals
        ({"penalties": Penalties(min_tokens=-1)}, "min_tokens"),
        ({"log_probs": 21}, "num_top_log_probs"),
        ({"guide": Guide("xml")}, "guided_decoding_guide_type"),
    ],
)
def test_what_it_cannot_honour_is_refused_by_name(engine, request_options, field):
    with pytest.raises(InputError) as refused:
        engine.submit(GenerationRequest([1], max_new_tokens=4, **request_options), lambda e: None)
    assert refused.value.field == field
    assert engine.running() == 0


def test_in_a_process_of_its_own_it_answers_and_refuses_as_in_process(engine):
    """--engine-process: the step loop in a child (tritonllm/engine/process.py), as the portable engine's on CUDA."""
    child = EngineProcess(SyntheticConfig(TEXT, max_batch_size=2, step_ms=1, engine_process=True))
    try:
        request = GenerationRequest([1, 2, 3], max_new_tokens=12, streaming=True, stop_words=((TEXT[5],),))
        assert [e.token_ids for e in stream(child, request)] == [e.token_ids for e in stream(engine, request)]
        with pytest.raises(InputError) as refused:  # refused before it reaches the child: a 400 by name
            child.submit(GenerationRequest([1], 4, penalties=Penalties(repetition=1.2)), lambda e: None)
        assert refused.value.field == "repetition_penalty" and child.running() == 0
    finally:
        child.shutdown()


def test_the_build_writes_the_synthetic_engine_with_the_portable_models(manifest, tmp_path):
    argv = ["--engine", "synthetic", "--model", manifest["model_dir"], "--build-dir", str(tmp_path), "--step-ms", "2.5"]
    code = build_main([*argv, "--engine-process", "--engine-instances", "0"])
    assert code == 0
    repository = tmp_path / "model_repository"
    engine = repository / "tensorrt_llm_decoupled" / "1"  # the engine's model in the default deployment
    config = json.loads((engine / SYNTHETIC_CONFIG_FILE).read_text())
    assert config["step_ms"] == 2.5 and config["engine_process"] and len(config["text_ids"]) > 100
    assert (engine / "model.py").is_file()
    assert json.loads((tmp_path / "manifest.json").read_text())["engine"] == "synthetic"
    # --engine-instances 0: as many instances as the text models, sharing the engine's process.
    instances = f"count: {text_instances(os.cpu_count() or 2)} kind: KIND_CPU"
    assert instances in (engine.parent / "config.pbtxt").read_text()


def test_an_injected_fault_fires_once_its_file_exists_and_fails_requests_through_the_loops_guard(tmp_path):
    """The fault-injection instrument: armed by a file, from its step on; the step that fires removes the file."""
    armed = tmp_path / "fault"
    engine = SyntheticEngine(SyntheticConfig(TEXT, step_ms=1, fault_at_step=3, fault_file=str(armed)))
    try:
        assert engine.generate(GenerationRequest([1], max_new_tokens=5), timeout=10)[1] == FINISH_LENGTH  # unarmed
        armed.touch()
        runs = [submitted(engine, GenerationRequest([i], max_new_tokens=10**6, streaming=i)) for i in (0, 1)]
        for done, emissions in runs:
            assert done.wait(10), "a request in flight hung after the injected fault"
            assert emissions[-1].finish_reason == FINISH_ERROR
            assert emissions[-1].error == "the engine's step loop failed: injected fault at step 6"
        assert not armed.exists() and not engine.alive() and engine.running() == 0
        with pytest.raises(EngineFailure, match="injected fault at step 6"):
            engine.submit(GenerationRequest([2], max_new_tokens=4), lambda e: None)
    finally:
        engine.shutdown()


def test_a_step_fault_in_the_engines_own_process_ends_its_life_there_too():
    """The child outlives its engine's failed step: its reports say the loop stopped, so the health probe's first
    question is answered as with the engine in the caller's process."""
    child = EngineProcess(SyntheticConfig(TEXT, step_ms=1, fault_at_step=3, engine_process=True))
    try:
        assert child.alive()
        with pytest.raises(RuntimeError, match="injected fault at step 3"):
            child.generate(GenerationRequest([1], max_new_tokens=50), timeout=10)
        assert eventually(lambda: not child.alive(), timeout=5), "the child's reports say its loop stopped"
        assert EngineHealth(child).problem() == "the engine's generation loop has stopped"
    finally:
        child.shutdown()


def test_an_injected_fault_without_a_file_fires_at_its_step_on_every_start():
    for _ in range(2):
        engine = SyntheticEngine(SyntheticConfig(TEXT, step_ms=1, fault_at_step=2))
        try:
            with pytest.raises(RuntimeError, match="injected fault at step 2"):
                engine.generate(GenerationRequest([1], max_new_tokens=5), timeout=10)
        finally:
            engine.shutdown()


def test_text_instances_are_asked_for_apart_from_the_engine_models(manifest, tmp_path):
    argv = ["--engine", "synthetic", "--model", manifest["model_dir"], "--build-dir", str(tmp_path)]
    assert build_main([*argv, "--text-instances", "3", "--engine-process", "--engine-instances", "2"]) == 0
    repository = tmp_path / "model_repository"
    for model in ("preprocessing", "postprocessing", "tensorrt_llm_bls", "tensorrt_llm"):
        assert "count: 3 kind: KIND_CPU" in (repository / model / "config.pbtxt").read_text(), model
    assert "count: 2 kind: KIND_CPU" in (repository / "tensorrt_llm_decoupled" / "config.pbtxt").read_text()
    assert build_main([*argv, "--text-instances", "-1"]) == 2
