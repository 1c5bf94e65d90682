"""Stand-in of `tensorrt_llm.LLM` (tensorrt_llm/llmapi/llm.py) and its results (tensorrt_llm/executor/result.py).

It checks its arguments as the release does (surface.py: unknown names are refused) and runs the requests on the
project's llama.cpp engine, from the folder TRITONLLM_STANDIN_ENGINE names (one holding engine.json, as the default
build writes it), with SamplingParams translated by the release's rules: greedy when temperature, top_k and top_p
are unset; presence and frequency after the temperature (the C++ sampler), before it (1.4's TorchSampler) or not at
all (1.2.1's TorchSampler), over the prompt's tokens too unless prompt_ignore_length leaves them out; logprobs=0 as
none (1.2.1) or as the chosen token's alone (1.4). What the project never sends (stop and bad strings or ids, a dense
embedding bias, beams, 1.4's raw log probabilities) is refused, so a test fails if it starts to; logits processors
are refused too: llama.cpp's step takes none. LoRA: the LLM takes a `lora_helper.LoraConfig` (its folders must exist;
with more than one, lora_target_modules must name modules, as the PyTorch executor asserts), and a request an
`executor.request.LoRARequest`, passed by keyword, only then; both are recorded (`lora_config`, `lora_requests`) for
the tests to read, and the request runs on the base model: llama.cpp here has no adapter of the PEFT folder loaded.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import itertools
import json
import os
import pickle
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from tensorrt_llm import sampling_params as _params
from tensorrt_llm.executor.request import LoRARequest
from tensorrt_llm.lora_helper import LoraConfig
from tensorrt_llm.sampling_params import GuidedDecodingParams, SamplingParams, _implies_greedy
from tensorrt_llm.surface import (
    CUDA_GRAPH_CONFIG_FIELDS,
    DEFAULT_SAMPLER,
    GENERATE_ASYNC_PARAMETERS,
    GUIDED_DECODING_BACKENDS,
    KV_CACHE_CONFIG_FIELDS,
    LLM_ARGS,
    LOGPROBS_ZERO_IS_NONE,
    LORA_MODULES,
    RELEASE,
    SAMPLER_TYPES,
    TORCH_SAMPLER_PENALTIES,
)
from tritonllm.engine.api import ENGINE_CONFIG_FILE, Emission, EngineConfig, GenerationRequest, Guide, Penalties
from tritonllm.engine.api import SamplingParams as EngineSampling

ENGINE_ENV = "TRITONLLM_STANDIN_ENGINE"
TOKENS_PER_BLOCK = 32
_FINISH = {"eos": "stop", "length": "length", "cancelled": "cancelled"}
_GUIDES = {"json_object": "json", "json": "json_schema", "regex": "regex", "grammar": "ebnf_grammar"}
_NEVER_SENT = ("bad", "bad_token_ids", "stop", "stop_token_ids", "embedding_bias", "use_beam_search")


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None


@dataclass
class KvCacheMetrics:
    num_total_allocated_blocks: int = 0
    num_new_allocated_blocks: int = 0
    num_reused_blocks: int = 0
    num_missed_blocks: int = 0
    kv_cache_hit_rate: float = 0.0


@dataclass
class TimingMetrics:
    """Steady-clock times as timedeltas (the bindings' RequestPerfMetrics.timing_metrics); zero where unknown."""

    arrival_time: timedelta = timedelta(0)
    first_scheduled_time: timedelta = timedelta(0)
    first_token_time: timedelta = timedelta(0)
    last_token_time: timedelta = timedelta(0)


@dataclass
class RequestPerfMetrics:
    kv_cache_metrics: KvCacheMetrics
    timing_metrics: TimingMetrics


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    generation_logits: object = None
    additional_context_outputs: object = None
    additional_generation_outputs: object = None
    disaggregated_params: object = None
    request_perf_metrics: RequestPerfMetrics | None = None
    _last_token_ids_len: int = 0
    _last_logprobs_len: int = 0

    @property
    def length(self) -> int:
        return len(self.token_ids)

    @property
    def text_diff(self) -> str:
        return ""  # detokenize=False, and no tokenizer runs here

    @property
    def token_ids_diff(self) -> list[int]:
        return self.token_ids[self._last_token_ids_len :]

    @property
    def logprobs_diff(self) -> list[dict[int, Logprob]]:
        return self.logprobs[self._last_logprobs_len :]


class RequestOutput:
    """A request's result: an async iterator of itself, one step (streaming) or the whole answer per iteration."""

    def __init__(self, llm: LLM, request_id: int, streaming: bool, perf: bool) -> None:
        self.request_id = request_id
        self.outputs = [CompletionOutput(0)]
        self.finished = False
        self._llm, self._streaming, self._perf = llm, streaming, perf
        self._loop = asyncio.get_running_loop()  # the release makes its async queue only where a loop runs
        self._queue: asyncio.Queue[Emission] = asyncio.Queue()
        self._engine_id = ""
        self._aborted = False
        self._arrival = time.perf_counter()  # the steady clock, as the release stamps arrival_time

    def _emitted(self, emission: Emission) -> None:  # on the engine's thread
        self._loop.call_soon_threadsafe(self._queue.put_nowait, emission)

    def abort(self) -> None:
        self._aborted = True
        self._llm._engine.cancel(self._engine_id)

    def aborted(self) -> bool:
        return self._aborted

    def __aiter__(self) -> RequestOutput:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        output = self.outputs[0]
        output._last_token_ids_len, output._last_logprobs_len = len(output.token_ids), len(output.logprobs)
        while True:
            emission = await self._queue.get()
            if emission.error:
                raise RuntimeError(emission.error)
            output.token_ids.extend(emission.token_ids)
            if emission.log_probs is not None:
                output.logprobs.extend(map(_ranked, emission.token_ids, emission.log_probs))
            if emission.final:
                self.finished = True
                output.finish_reason = _FINISH[emission.finish_reason]
                if self._perf:
                    blocks = emission.cached_tokens // TOKENS_PER_BLOCK
                    timing = TimingMetrics(timedelta(seconds=self._arrival))
                    if emission.time_to_schedule is not None:
                        timing.first_scheduled_time = timedelta(seconds=self._arrival + emission.time_to_schedule)
                    output.request_perf_metrics = RequestPerfMetrics(KvCacheMetrics(num_reused_blocks=blocks), timing)
                return self
            if self._streaming:
                return self


def _ranked(token: int, position) -> dict[int, Logprob]:
    """The k most likely tokens by rank (1 first), and the chosen one when it is not among them (as the release's
    compute_logprobs adds it, with its true rank: here one past the k, which the engine does not say)."""
    ranked = {top: Logprob(value, rank) for rank, (top, value) in enumerate(position.top, start=1)}
    ranked.setdefault(token, Logprob(position.log_prob, len(position.top) + 1))
    return ranked


class LLM:
    def __init__(self, model: str, **kwargs) -> None:
        for key in kwargs:
            if key not in LLM_ARGS:
                raise ValueError(f"LLM got invalid argument: {key}")
        if kwargs.get("backend", "pytorch") != "pytorch":
            raise ValueError(f"backend {kwargs['backend']}: tensorrt_llm.LLM is the PyTorch backend's")
        _check_fields("KvCacheConfig", kwargs.get("kv_cache_config") or {}, KV_CACHE_CONFIG_FIELDS)
        fraction = (kwargs.get("kv_cache_config") or {}).get("free_gpu_memory_fraction", 0.9)
        if not 0 <= fraction <= 1:
            raise ValueError(f"free_gpu_memory_fraction must be in [0, 1], got {fraction}")
        if kwargs.get("cuda_graph_config") is not None:
            _check_fields("CudaGraphConfig", kwargs["cuda_graph_config"], CUDA_GRAPH_CONFIG_FIELDS)
        if kwargs.get("guided_decoding_backend") not in (None, *GUIDED_DECODING_BACKENDS):
            raise ValueError(f"guided_decoding_backend {kwargs['guided_decoding_backend']!r}")
        sampler = kwargs.get("sampler_type", "auto")
        if sampler not in SAMPLER_TYPES:
            raise ValueError(f"sampler_type {sampler!r}: TensorRT-LLM {RELEASE} takes {', '.join(SAMPLER_TYPES)}")
        self._sampler = DEFAULT_SAMPLER if sampler == "auto" or RELEASE == "1.4" else sampler
        if not Path(model).is_dir():
            raise ValueError(f"model {model} is not a folder")
        self.lora_config = kwargs.get("lora_config")
        if self.lora_config is not None:
            _check_lora(self.lora_config)
        self.lora_requests: list[tuple[LoRARequest, bool]] = []  # each with whether it came by keyword
        from tritonllm.engine.llamacpp import LlamaCppEngine

        self.model, self.args = model, kwargs
        config = json.loads((Path(os.environ[ENGINE_ENV]) / ENGINE_CONFIG_FILE).read_text())
        self._engine = LlamaCppEngine(EngineConfig(**config))
        self._ids = itertools.count(1)
        self._eos = None

    def generate_async(self, *args, **kwargs) -> RequestOutput:
        """The release's signature (surface.GENERATE_ASYNC_PARAMETERS, set below): another name is a TypeError."""
        given = inspect.signature(LLM.generate_async).bind(self, *args, **kwargs)
        given.apply_defaults()
        named = given.arguments
        lora_request = named["lora_request"]
        if lora_request is not None:
            if self.lora_config is None:
                raise ValueError("lora_request: no LoRA is configured")  # as the release: only with lora_config
            if not isinstance(lora_request, LoRARequest):
                raise TypeError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
            self.lora_requests.append((lora_request, "lora_request" in kwargs))
        return self._submit(named["inputs"], named["sampling_params"], named["streaming"])

    def _submit(self, inputs, sampling_params, streaming) -> RequestOutput:
        # The release pickles a request, logits processor included, to its worker processes.
        params = pickle.loads(pickle.dumps(sampling_params or SamplingParams()))
        ids = inputs["prompt_token_ids"] if isinstance(inputs, dict) else inputs
        perf = bool(params.return_perf_metrics or self.args.get("return_perf_metrics"))
        result = RequestOutput(self, next(self._ids), streaming, perf)
        result._engine_id = self._engine.submit(self._request(list(ids), params), result._emitted)
        return result

    def _request(self, ids: list[int], params: SamplingParams) -> GenerationRequest:
        for name in _NEVER_SENT:
            if getattr(params, name):
                raise ValueError(f"SamplingParams.{name}: the project never sends it")
        if params.logits_processor is not None:
            raise ValueError("logits_processor: this stand-in's llama.cpp model takes none")
        if params.n != 1 or params.best_of != 1:
            raise ValueError("n and best_of: the project sends each sequence as a request of its own")
        if params.prompt_ignore_length not in (None, len(ids)):
            raise ValueError("prompt_ignore_length: the project leaves out the whole prompt or none")
        if params.ignore_eos:
            end_id = -1
        elif params.end_id is not None:
            end_id = params.end_id
        else:  # as _prepare_sampling_params: the tokenizer's
            end_id = self._tokenizer_eos()
        sampling = EngineSampling()
        if not _implies_greedy(params):
            sampling = EngineSampling(
                sample=True,
                temperature=1.0 if params.temperature is None else params.temperature,
                top_k=params.top_k or 0,
                top_p=1.0 if params.top_p is None else params.top_p,
                seed=params.seed or 0,
            )
        # The C++ sampler subtracts presence and frequency after the temperature, the engine before it.
        rule = "after the temperature" if self._sampler == "TRTLLMSampler" else TORCH_SAMPLER_PENALTIES
        scale = sampling.temperature if sampling.sample and rule == "after the temperature" else 1.0
        penalties = Penalties(
            repetition=1.0 if params.repetition_penalty is None else params.repetition_penalty,
            presence=(params.presence_penalty or 0.0) * scale,
            frequency=(params.frequency_penalty or 0.0) * scale,
            min_tokens=1 if params.min_tokens is None else params.min_tokens,
            count_prompt=params.prompt_ignore_length is None,
        )
        if rule == "ignored":
            penalties = Penalties(min_tokens=penalties.min_tokens)
        log_probs = (
            -1 if params.logprobs is None or (LOGPROBS_ZERO_IS_NONE and not params.logprobs) else params.logprobs
        )
        if log_probs >= 0 and RELEASE == "1.4" and params.logprobs_mode != _params.LogprobMode.PROCESSED:
            raise ValueError("logprobs_mode: the project asks for the processed distribution's")
        guide = None
        if params.guided_decoding is not None:
            if self.args.get("guided_decoding_backend") is None:
                raise ValueError("guided_decoding needs LLM(guided_decoding_backend=...)")
            guide = _guide(params.guided_decoding)
        return GenerationRequest(
            ids,
            params.max_tokens,
            end_id,
            sampling,
            streaming=True,
            penalties=penalties,
            log_probs=log_probs,
            guide=guide,
        )

    def _tokenizer_eos(self) -> int:
        if self._eos is None:
            from transformers import AutoTokenizer

            self._eos = AutoTokenizer.from_pretrained(self.model).eos_token_id
        return self._eos

    def shutdown(self) -> None:
        self._engine.shutdown()


def _check_lora(config) -> None:
    """What the release's argument model and PyTorch executor check of lora_config (surface.py, H and X)."""
    if not isinstance(config, LoraConfig):
        raise ValueError(f"lora_config must be a LoraConfig, got {type(config).__name__}")
    for folder in config.lora_dir:
        if not Path(folder).is_dir():
            raise ValueError(f"lora_dir {folder} is not a folder")
    if len(config.lora_dir) != 1 and not config.lora_target_modules:
        raise AssertionError("Expecting at least one lora target module")
    unknown = [m for m in config.lora_target_modules if m not in LORA_MODULES]
    if unknown:
        raise ValueError(f"lora_target_modules: {unknown[0]} is no LoRA module")


def _check_fields(name: str, given: dict, fields: tuple[str, ...]) -> None:
    for key in given:
        if key not in fields:
            raise ValueError(f"{name}: extra fields not permitted: {key}")


def _guide(params: GuidedDecodingParams) -> Guide:
    (name,) = [f.name for f in dataclasses.fields(params) if getattr(params, f.name)]
    value = getattr(params, name)
    return Guide(_GUIDES[name], "" if value is True else value)


def _parameter(name: str) -> inspect.Parameter:
    """inputs is required; streaming defaults to False, priority to DEFAULT_REQUEST_PRIORITY (1.4), the rest to None."""
    required = inspect.Parameter.empty
    default = {"self": required, "inputs": required, "streaming": False, "priority": 0.5}.get(name)
    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=default)


LLM.generate_async.__signature__ = inspect.Signature([_parameter("self"), *map(_parameter, GENERATE_ASYNC_PARAMETERS)])
