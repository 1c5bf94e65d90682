"""The LLM API flavor's engine (tritonllm/engine/llmapi.py) over the stand-in of each TensorRT-LLM release's LLM API
it runs on (tests/standins/tensorrt_llm), which checks every name the engine passes against that release's and runs
the requests on the built model through llama.cpp."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import pickle
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import BUILD, ROOT
from tests.polling import eventually
from tests.unit.engine.conftest import emissions_of
from tritonllm.engine.api import Emission, GenerationRequest, Guide, Penalties, SamplingParams
from tritonllm.engine.llmapi_config import LlmApiConfig
from tritonllm.engine.llmapi_params import (
    SAMPLER_RULES,
    TokenRules,
    check_sampler,
    guided_decoding_kwargs,
    sampling_kwargs,
    token_rules,
)
from tritonllm.errors import ConfigError, EngineFailure, InputError
from tritonllm.protocol import FINISH_CANCELLED, FINISH_EOS, FINISH_ERROR, FINISH_LENGTH, FINISH_STOP
from tritonllm.versions import LLM_API_RELEASES

CPP_SAMPLER = SAMPLER_RULES["1.2.1", "TRTLLMSampler"]
TORCH_1_2 = SAMPLER_RULES["1.2.1", "TorchSampler"]
TORCH_1_4 = SAMPLER_RULES["1.4", "TorchSampler"]

STANDINS = ROOT / "tests" / "standins"
ENGINE_FOLDER = BUILD / "model_repository" / "tensorrt_llm_decoupled" / "1"  # the default build's engine.json


def forget_standin() -> None:
    for name in [n for n in sys.modules if n == "tensorrt_llm" or n.startswith("tensorrt_llm.")]:
        del sys.modules[name]


@pytest.fixture(scope="module", params=list(LLM_API_RELEASES))
def release(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def standin(release):
    """`import tensorrt_llm` finds the stand-in of `release` for this module's tests, and nothing after them."""
    if not (ENGINE_FOLDER / "engine.json").is_file():
        pytest.fail(f"needs the default build's {ENGINE_FOLDER}/engine.json (run `make build`)")
    forget_standin()
    with pytest.MonkeyPatch.context() as patch:
        patch.syspath_prepend(str(STANDINS))
        patch.setenv("TRITONLLM_STANDIN_ENGINE", str(ENGINE_FOLDER))
        patch.setenv("TRITONLLM_STANDIN_RELEASE", release)
        import tensorrt_llm

        yield tensorrt_llm
    forget_standin()


@pytest.fixture(scope="module")
def engine(standin, manifest, release):
    from tritonllm.engine.llmapi import LlmApiEngine

    eng = LlmApiEngine(LlmApiConfig(manifest["model_dir"], max_batch_size=8, llm_api_release=release).engine_settings())
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    messages = [{"role": "user", "content": "Tell me about the city of Paris."}]
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))


# ------------------------------------------------------------------ the stand-in is the recorded release surface


def test_the_standin_has_the_recorded_names(standin, release):
    from tensorrt_llm import surface
    from tensorrt_llm.llm import LLM, CompletionOutput, Logprob
    from tensorrt_llm.sampling_params import GuidedDecodingParams, LogitsProcessor

    assert release == surface.RELEASE and standin.__version__ == LLM_API_RELEASES[release].trtllm

    assert tuple(f.name for f in dataclasses.fields(standin.SamplingParams)) == surface.SAMPLING_PARAMS_FIELDS
    assert tuple(f.name for f in dataclasses.fields(GuidedDecodingParams)) == surface.GUIDED_DECODING_FIELDS
    assert tuple(inspect.signature(LogitsProcessor.__call__).parameters)[1:] == surface.LOGITS_PROCESSOR_CALL
    assert tuple(inspect.signature(LLM.generate_async).parameters)[1:] == surface.GENERATE_ASYNC_PARAMETERS
    public = tuple(f.name for f in dataclasses.fields(CompletionOutput) if not f.name.startswith("_"))
    assert public == surface.COMPLETION_OUTPUT_FIELDS
    assert all(isinstance(getattr(CompletionOutput, p), property) for p in surface.COMPLETION_OUTPUT_PROPERTIES)
    assert tuple(f.name for f in dataclasses.fields(Logprob)) == surface.LOGPROB_FIELDS
    with pytest.raises(TypeError):
        standin.SamplingParams(max_new_tokens=4)  # keyword-only, and only its own names


# ------------------------------------------------------------------ what the engine asks of the LLM API


def test_the_build_arguments_are_llm_arguments(standin, manifest, release):
    kwargs = LlmApiConfig(
        manifest["model_dir"], llm_api_cuda_graphs=False, kv_cache_reuse=False, llm_api_release=release
    ).llm_kwargs()
    assert kwargs["cuda_graph_config"] is None and kwargs["kv_cache_config"]["enable_block_reuse"] is False
    llm = standin.LLM(**kwargs)  # refuses any name TorchLlmArgs, KvCacheConfig or CudaGraphConfig lacks
    llm.shutdown()
    with pytest.raises(ValueError, match="LLM got invalid argument: max_tokens_in_paged_kv_cache"):
        standin.LLM(**kwargs, max_tokens_in_paged_kv_cache=1)
    graphs = LlmApiConfig(manifest["model_dir"], max_batch_size=24).llm_kwargs()["cuda_graph_config"]
    assert graphs == {"max_batch_size": 24, "enable_padding": True}


def test_each_release_runs_its_own_sampler_and_refuses_another(standin, manifest, release):
    """1.2.1 is sent TRTLLMSampler by default; 1.4, which refuses it, is sent no sampler_type (TorchSampler only)."""
    config = LlmApiConfig(manifest["model_dir"], llm_api_release=release)
    assert config.llm_kwargs().get("sampler_type") == {"1.2.1": "TRTLLMSampler", "1.4": None}[release]
    settings = config.engine_settings()
    assert (settings["release"], settings["sampler"]) == (
        release,
        {"1.2.1": "TRTLLMSampler", "1.4": "TorchSampler"}[release],
    )
    refused = "TorchSampler" if release == "1.2.1" else "TRTLLMSampler"
    if release == "1.4":
        with pytest.raises(
            ConfigError, match=r"--llm-api-sampler TRTLLMSampler: TensorRT-LLM 1\.4 has TorchSampler only"
        ):
            LlmApiConfig(manifest["model_dir"], llm_api_release=release, llm_api_sampler=refused).check(100)
        with pytest.raises(ValueError, match="sampler_type 'TRTLLMSampler'"):  # the release itself refuses it
            standin.LLM(**{**config.llm_kwargs(), "sampler_type": "TRTLLMSampler"})
    else:
        LlmApiConfig(manifest["model_dir"], llm_api_release=release, llm_api_sampler=refused).check(100)


def test_a_build_for_another_release_is_refused_when_the_engine_loads(standin, manifest, release):
    from tritonllm.engine.llmapi import LlmApiEngine

    other = next(r for r in LLM_API_RELEASES if r != release)
    settings = LlmApiConfig(manifest["model_dir"], llm_api_release=other).engine_settings()
    with pytest.raises(ConfigError, match=rf"runs TensorRT-LLM {standin.__version__}, but the build is for {other}"):
        LlmApiEngine(settings)


def every_control(**changes) -> GenerationRequest:
    request = GenerationRequest(
        [1, 2, 3, 4],
        9,
        end_id=2,
        sampling=SamplingParams(sample=True, temperature=0.5, top_k=40, top_p=0.9, seed=7),
        stop_words=((5, 6),),
        bad_words=((8,), (9, 10)),
        streaming=True,
        penalties=Penalties(1.2, 0.5, 0.25, 3, count_prompt=True),
        embedding_bias=((11, -2.0),),
        log_probs=3,
        guide=Guide("regex", "(yes|no)"),
    )
    return dataclasses.replace(request, **changes)


def test_every_control_maps_to_a_sampling_params_field(standin):
    request = every_control()
    kwargs = sampling_kwargs(request, CPP_SAMPLER)
    assert kwargs == {
        "max_tokens": 9,
        "detokenize": False,
        "exclude_input_from_output": True,
        "end_id": 2,
        "temperature": 0.5,
        "seed": 7,
        "top_k": 40,
        "top_p": 0.9,
        "min_tokens": 3,
        "repetition_penalty": 1.2,
        # TensorRT-LLM's rule, as the client sent it: the engine model's scaling by the temperature divided out.
        "presence_penalty": 1.0,
        "frequency_penalty": 0.5,
        "logprobs": 3,
    }
    # 1.4's TorchSampler subtracts them before the temperature, as the engine request holds them.
    assert sampling_kwargs(request, TORCH_1_4) == kwargs | {"presence_penalty": 0.5, "frequency_penalty": 0.25}
    if "logprobs_mode" in standin.surface.SAMPLING_PARAMS_FIELDS:
        kwargs["logprobs_mode"] = standin.sampling_params.LogprobMode.PROCESSED
    rules = token_rules(request)
    params = standin.SamplingParams(
        **kwargs,
        guided_decoding=standin.sampling_params.GuidedDecodingParams(**guided_decoding_kwargs(request.guide)),
    )
    assert params.pad_id == 2 and rules.bad_words == ((8,), (9, 10)) and rules.bias_ids == [11]
    assert token_rules(every_control(bad_words=(), embedding_bias=())) is None


def test_greedy_requests_leave_the_draw_unset_and_no_end_id_ignores_eos(standin):
    kwargs = sampling_kwargs(GenerationRequest([1, 2], 4), CPP_SAMPLER)
    assert not {"temperature", "top_k", "top_p", "seed", "end_id", "min_tokens"} & set(kwargs)
    assert kwargs["ignore_eos"] is True
    standin.SamplingParams(**kwargs)


def test_openai_penalties_count_the_generated_tokens_before_the_temperature():
    penalties = Penalties(presence=0.6, frequency=0.3, count_prompt=False)
    kwargs = sampling_kwargs(every_control(penalties=penalties), CPP_SAMPLER)
    assert kwargs["prompt_ignore_length"] == 4  # the prompt's tokens left out of the counts
    assert kwargs["presence_penalty"] == pytest.approx(1.2) and kwargs["frequency_penalty"] == pytest.approx(0.6)
    kwargs = sampling_kwargs(every_control(penalties=penalties), TORCH_1_4)
    assert kwargs["prompt_ignore_length"] == 4 and (kwargs["presence_penalty"], kwargs["frequency_penalty"]) == (
        0.6,
        0.3,
    )


def test_only_the_chosen_tokens_log_probability_asks_for_none_beyond_it_where_the_release_can():
    """logprobs=0 asks 1.2.1 for no log probabilities at all: 1 is asked, and the chosen token's read from it."""
    request = GenerationRequest([1, 2], 4, log_probs=0)
    assert sampling_kwargs(request, CPP_SAMPLER)["logprobs"] == 1
    assert sampling_kwargs(request, TORCH_1_4)["logprobs"] == 0
    assert sampling_kwargs(dataclasses.replace(request, log_probs=5), TORCH_1_4)["logprobs"] == 5


def test_penalties_a_sampler_would_ignore_are_refused_by_name():
    check_sampler(every_control(), CPP_SAMPLER)
    check_sampler(every_control(), TORCH_1_4)
    check_sampler(every_control(penalties=Penalties(min_tokens=3)), TORCH_1_2)
    for penalties, name in (
        (Penalties(repetition=1.1), "repetition_penalty"),
        (Penalties(presence=0.2), "presence_penalty"),
        (Penalties(frequency=-0.2), "frequency_penalty"),
    ):
        with pytest.raises(InputError, match=r"1\.2\.1's TorchSampler ignores penalties") as refused:
            check_sampler(every_control(penalties=penalties), TORCH_1_2)
        assert refused.value.field == name


@pytest.mark.parametrize(
    ("guide", "expected"),
    [
        (Guide("json"), {"json_object": True}),
        (Guide("json_schema", '{"type": "object"}'), {"json": '{"type": "object"}'}),
        (Guide("regex", "a+"), {"regex": "a+"}),
        (Guide("ebnf_grammar", 'root ::= "a"'), {"grammar": 'root ::= "a"'}),
    ],
)
def test_guides_map_to_guided_decoding_params(standin, guide, expected):
    assert guided_decoding_kwargs(guide) == expected
    standin.sampling_params.GuidedDecodingParams(**expected)


def test_token_rules_bias_tokens_and_ban_a_words_last_token_after_its_beginning():
    rules = TokenRules(((7,), (3, 4, 5)), ((1, 2.5), (2, float("-inf"))))
    logits = torch.zeros(1, 8)
    rules(0, logits, [[9, 3, 4]], None, None)
    assert logits[0].tolist() == [0.0, 2.5, float("-inf"), 0.0, 0.0, float("-inf"), 0.0, float("-inf")]
    logits = torch.zeros(1, 8)
    rules(0, logits, [[9, 3, 3]], None, None)  # (3, 4, 5) has not begun: 5 stays
    assert logits[0, 5] == 0.0 and logits[0, 7] == float("-inf")


# ------------------------------------------------------------------ the engine over the stand-in


def collect(engine, request: GenerationRequest, timeout: float = 120) -> list[Emission]:
    return emissions_of(engine, request, timeout)


def test_streamed_and_whole_answers_carry_the_same_tokens(engine, prompt, tokenizer):
    whole = collect(engine, GenerationRequest(prompt, 24, end_id=tokenizer.eos_token_id))
    streamed = collect(engine, GenerationRequest(prompt, 24, end_id=tokenizer.eos_token_id, streaming=True))
    assert len(whole) == 1 and len(streamed) > 2
    assert [t for e in streamed for t in e.token_ids] == whole[0].token_ids
    assert whole[0].finish_reason == streamed[-1].finish_reason == FINISH_LENGTH
    assert whole[0].time_to_first_token is not None
    assert whole[0].time_to_schedule is not None  # from the request's perf metrics (timing_metrics)


def test_a_stop_word_ends_the_request_and_aborts_it_in_the_llm(engine, prompt, tokenizer):
    (whole,) = collect(engine, GenerationRequest(prompt, 24, end_id=tokenizer.eos_token_id))
    word = tuple(whole.token_ids[5:7])
    request = GenerationRequest(prompt, 24, end_id=tokenizer.eos_token_id, stop_words=(word,))
    (stopped,) = collect(engine, request)
    assert stopped.finish_reason == FINISH_STOP and stopped.token_ids == whole.token_ids[:7]
    assert eventually(lambda: engine.llm._engine.running() == 0)  # the LLM's request is aborted
    assert eventually(lambda: engine.running() == 0)


def test_the_end_id_ends_a_request_with_eos(engine, tokenizer):
    messages = [{"role": "user", "content": "Say yes."}]
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    emissions = collect(engine, GenerationRequest(ids, 200, end_id=tokenizer.eos_token_id, streaming=True))
    assert emissions[-1].finish_reason == FINISH_EOS
    assert tokenizer.eos_token_id not in [t for e in emissions for t in e.token_ids]


def test_cancel_ends_a_request_as_cancelled(engine, prompt):
    first, done, emissions = threading.Event(), threading.Event(), []

    def emit(emission: Emission) -> None:
        emissions.append(emission)
        first.set()
        if emission.final:
            done.set()

    engine_id = engine.submit(GenerationRequest(prompt, 400, streaming=True), emit)
    assert first.wait(60)
    engine.cancel(engine_id)
    assert done.wait(60)
    assert emissions[-1].finish_reason == FINISH_CANCELLED and sum(len(e.token_ids) for e in emissions) < 400


def test_log_probs_come_with_every_token(engine, prompt, tokenizer):
    emissions = collect(engine, GenerationRequest(prompt, 8, end_id=tokenizer.eos_token_id, log_probs=2))
    (whole,) = emissions
    assert len(whole.log_probs) == len(whole.token_ids) == 8
    for token, chosen in zip(whole.token_ids, whole.log_probs, strict=True):
        assert len(chosen.top) == 2 and chosen.top[0] == (token, chosen.log_prob)  # greedy: the most likely
    (only,) = collect(engine, GenerationRequest(prompt, 4, log_probs=0))
    assert all(p.top == () for p in only.log_probs) and len(only.log_probs) == 4


def test_a_guide_is_honoured_and_a_bad_one_refused_at_submission(engine, tokenizer):
    messages = [{"role": "user", "content": "Is Paris in France?"}]
    ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    request = GenerationRequest(ids, 8, end_id=tokenizer.eos_token_id, guide=Guide("regex", "(yes|no)"))
    (answer,) = collect(engine, request)
    assert tokenizer.decode(answer.token_ids) in ("yes", "no")
    with pytest.raises(InputError, match="guided_decoding_guide"):
        engine.submit(GenerationRequest(ids, 8, guide=Guide("regex", "(unclosed")), lambda e: None)


def test_every_controls_params_pickle_for_the_workers(engine, release):
    """TensorRT-LLM pickles a request to its worker processes, its logits processor too."""
    params = pickle.loads(pickle.dumps(engine._sampling_params(every_control())))
    assert isinstance(params.logits_processor, engine.api.LogitsProcessor)
    assert params.logits_processor.bad_words == ((8,), (9, 10)) and params.guided_decoding.regex == "(yes|no)"
    if release == "1.4":  # the distribution the token was drawn from, as the C++ sampler's are
        assert params.logprobs_mode == engine.api.LogprobMode.PROCESSED


def test_a_request_the_llm_fails_ends_alone_with_its_error(engine, prompt):
    # The stand-in's llama.cpp model takes no logits processor: the LLM refuses the request, the engine goes on.
    (failed,) = collect(engine, GenerationRequest(prompt, 4, bad_words=((5,),)))
    assert failed.finish_reason == FINISH_ERROR and "logits_processor" in failed.error
    (after,) = collect(engine, GenerationRequest(prompt, 4))
    assert after.finish_reason == FINISH_LENGTH and engine.alive()


# ------------------------------------------------------------------ failures, with a scripted LLM


class ScriptedResult:
    """A RequestOutput whose steps the test gives: token lists, then an exception or a finish reason; or none (it
    waits until aborted). Its abort can be made to raise."""

    def __init__(self, steps, abort_raises: bool):
        self.steps, self.abort_raises, self.finished, self.aborted = list(steps), abort_raises, False, asyncio.Event()
        self.request_id, self.tokens, self.outputs = 1, [], []

    def abort(self):
        self.aborted.set()
        if self.abort_raises:
            raise RuntimeError("the executor is gone")

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.finished:
            raise StopAsyncIteration
        if not self.steps:
            await self.aborted.wait()
            self.steps = [("cancelled", [])]
        reason, new = self.steps.pop(0)
        if isinstance(reason, Exception):
            raise reason
        before, self.tokens = len(self.tokens), self.tokens + new
        self.finished = reason is not None
        diff = self.tokens[before:]
        self.outputs = [SimpleNamespace(token_ids_diff=diff, finish_reason=reason, request_perf_metrics=None)]
        return self


class ScriptedLLM:
    def __init__(self, **kwargs):
        self.script, self.abort_raises, self.results = [], False, []

    def generate_async(self, inputs, sampling_params=None, streaming=False):
        result = ScriptedResult(self.script, self.abort_raises)
        self.results.append(result)
        return result

    def shutdown(self):
        self.shut = True


@pytest.fixture
def scripted(standin, release):
    from tritonllm.engine.llmapi import LlmApi, LlmApiEngine

    params = standin.sampling_params
    api = LlmApi(
        standin.__version__,
        ScriptedLLM,
        standin.SamplingParams,
        params.GuidedDecodingParams,
        params.LogitsProcessor,
        getattr(params, "LogprobMode", None),
    )
    sampler = {"1.2.1": "TRTLLMSampler", "1.4": "TorchSampler"}[release]
    eng = LlmApiEngine({"release": release, "sampler": sampler, "llm": {"model": "unused"}}, api)
    yield eng
    eng.shutdown()


def test_a_failing_abort_still_ends_the_request_once(scripted):
    scripted.llm.script, scripted.llm.abort_raises = [(None, [5, 6, 7])], True  # max tokens reached mid-step
    emissions = collect(scripted, GenerationRequest([1], 2), timeout=10)
    assert [(e.token_ids, e.finish_reason) for e in emissions] == [([5, 6], FINISH_LENGTH)]
    assert scripted.llm.results[0].aborted.is_set()
    assert eventually(lambda: scripted.running() == 0)  # forgotten just after its final emission


def test_an_error_mid_stream_ends_the_request_with_it(scripted):
    scripted.llm.script = [(None, [5]), (RuntimeError("worker died"), [])]
    emissions = collect(scripted, GenerationRequest([1], 9, streaming=True), timeout=10)
    assert emissions[0].token_ids == [5] and emissions[-1].finish_reason == FINISH_ERROR
    assert "worker died" in emissions[-1].error and scripted.alive()


def test_cancel_before_and_after_the_llm_has_it(scripted):
    scripted._loop.call_soon_threadsafe(time.sleep, 0.3)  # the loop is busy: the cancel lands before the request
    done, emissions = threading.Event(), []
    engine_id = scripted.submit(GenerationRequest([1], 9), lambda e: (emissions.append(e), done.set()))
    scripted.cancel(engine_id)
    assert done.wait(10) and emissions[-1].finish_reason == FINISH_CANCELLED
    assert scripted.llm.results == []  # never reached the LLM
    scripted.llm.script = [("length", [5])]
    (finished,) = collect(scripted, GenerationRequest([1], 9), timeout=10)
    scripted.cancel("1")  # already finished: nothing to abort
    time.sleep(0.1)
    assert finished.finish_reason == FINISH_LENGTH
    assert not scripted.llm.results[0].aborted.is_set()


def test_shutdown_ends_the_requests_in_flight_and_refuses_new_ones(scripted):
    scripted.llm.script = []  # runs until aborted
    done, emissions = threading.Event(), []
    scripted.submit(GenerationRequest([1], 9, streaming=True), lambda e: (emissions.append(e), done.set()))
    assert eventually(lambda: scripted.llm.results)  # the LLM has it
    scripted.shutdown()
    assert done.wait(10) and emissions[-1].finish_reason == FINISH_ERROR and "shutting down" in emissions[-1].error
    assert scripted.llm.results[0].aborted.is_set() and not scripted.alive()
    with pytest.raises(EngineFailure, match="shutting down"):
        scripted.submit(GenerationRequest([1], 9), lambda e: None)


def test_a_submit_racing_shutdown_is_refused_not_dropped(scripted, monkeypatch):
    """submit checked that the engine was open, then shutdown ended every request and stopped the loop, then submit
    scheduled its request on the stopped loop: it never finished."""
    params = scripted._sampling_params

    def shut_down_meanwhile(request):
        stopping = threading.Thread(target=scripted.shutdown)
        stopping.start()
        stopping.join(10)
        return params(request)

    monkeypatch.setattr(scripted, "_sampling_params", shut_down_meanwhile)
    emissions: list[Emission] = []
    with pytest.raises(EngineFailure, match="it is shutting down"):
        scripted.submit(GenerationRequest([1], 9), emissions.append)
    assert emissions == [] and scripted.running() == 0


def test_every_finish_reason_of_the_release_is_mapped(standin):
    from tensorrt_llm.surface import FINISH_REASONS

    from tritonllm.engine.llmapi import LLM_FINISH

    assert set(LLM_FINISH) == set(FINISH_REASONS)


# ------------------------------------------------------------------ LoRA adapters by name (--lora NAME=PATH)


def peft_folder(folder, targets=("q_proj", "v_proj"), rank=8):
    """A PEFT folder as the build reads it (the stand-in's llama.cpp model applies no adapter: the weights are not
    read here)."""
    import json

    folder.mkdir(parents=True, exist_ok=True)
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": 16,
        "target_modules": targets if isinstance(targets, str) else list(targets),
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return folder


def test_the_standin_has_the_recorded_lora_names(standin):
    from tensorrt_llm import surface
    from tensorrt_llm.executor import LoRARequest
    from tensorrt_llm.lora_helper import LoraConfig

    assert tuple(f.name for f in dataclasses.fields(LoraConfig)) == surface.LORA_CONFIG_FIELDS
    assert tuple(f.name for f in dataclasses.fields(LoRARequest)) == surface.LORA_REQUEST_FIELDS


@pytest.fixture(scope="module")
def lora_engine(standin, manifest, release, tmp_path_factory):
    from tritonllm.engine.llmapi import LlmApiEngine
    from tritonllm.engine.llmapi_config import llm_api_adapter

    root = tmp_path_factory.mktemp("adapters")
    adapters = (
        llm_api_adapter("sql", peft_folder(root / "sql"), 1),
        llm_api_adapter("chat", peft_folder(root / "chat", ("q_proj", "down_proj"), rank=16), 2),
    )
    config = LlmApiConfig(manifest["model_dir"], max_batch_size=8, llm_api_release=release, lora_adapters=adapters)
    eng = LlmApiEngine(config.engine_settings())
    yield eng
    eng.shutdown()


def test_the_llm_gets_a_lora_config_of_every_adapter(lora_engine, standin, release):
    from tensorrt_llm.lora_helper import LoraConfig

    config = lora_engine.llm.lora_config
    assert isinstance(config, LoraConfig)  # made by the engine: llm_api.json holds its arguments as JSON
    assert [Path(d).name for d in config.lora_dir] == ["sql", "chat"]
    assert config.lora_target_modules == ["attn_q", "attn_v", "mlp_4h_to_h"]
    assert (config.max_lora_rank, config.max_loras, config.max_cpu_loras) == (16, 2, 2)
    assert "enable_lora" not in lora_engine.llm.args
    assert lora_engine.adapters.cards() == [{"name": "sql", "task_id": 1}, {"name": "chat", "task_id": 2}]
    assert lora_engine.adapters.choose(None, 2) == "chat" and lora_engine.adapters.choose("sql", 1) == "sql"


def test_a_request_with_an_adapter_is_sent_its_lora_request_by_keyword(lora_engine, prompt):
    lora_engine.llm.lora_requests.clear()
    emissions = collect(lora_engine, GenerationRequest(prompt, 4, adapter="chat"))
    assert emissions[-1].finish_reason == FINISH_LENGTH and len(emissions[-1].token_ids) == 4
    ((lora, by_keyword),) = lora_engine.llm.lora_requests
    assert by_keyword
    assert (lora.lora_name, lora.lora_int_id, Path(lora.lora_path).name) == ("chat", 2, "chat")
    collect(lora_engine, GenerationRequest(prompt, 2))  # the base model: no lora_request
    assert len(lora_engine.llm.lora_requests) == 1


def test_an_unknown_adapter_is_refused_by_name_and_none_is_loaded_while_serving(lora_engine, engine, prompt):
    with pytest.raises(InputError, match="no adapter named `nope`") as refused:
        lora_engine.submit(GenerationRequest(prompt, 2, adapter="nope"), lambda e: None)
    assert refused.value.field == "lora_name"
    with pytest.raises(InputError, match=r"no adapter named `sql`.*has none"):
        engine.submit(GenerationRequest(prompt, 2, adapter="sql"), lambda e: None)  # a build without --lora
    with pytest.raises(InputError) as load:
        lora_engine.add_adapter(lora_engine.adapters.by_name["sql"], 1)
    assert load.value.field == "lora_action"


def test_the_adapters_a_build_cannot_pass_to_tensorrt_llm_are_refused(tmp_path):
    from tritonllm.engine.llmapi_config import llm_api_adapter

    with pytest.raises(ConfigError, match="no such folder"):
        llm_api_adapter("sql", tmp_path / "missing", 1)
    with pytest.raises(ConfigError, match="target module embed_tokens has no TensorRT-LLM LoRA module name"):
        llm_api_adapter("sql", peft_folder(tmp_path / "embed", ("q_proj", "embed_tokens")), 1)
    with pytest.raises(ConfigError, match="target_modules 'all-linear'"):
        llm_api_adapter("sql", peft_folder(tmp_path / "all", "all-linear"), 1)
