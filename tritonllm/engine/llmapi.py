"""TensorRT-LLM's LLM API (PyTorch backend) as an engine of the engine model: `tensorrt_llm.LLM` behind the interface
every engine has (submit, cancel, running, alive, shutdown), so that the same `tensorrt_llm` model, ensemble,
`tensorrt_llm_bls` and OpenAI layer serve it with every control they take.

The LLM is made from the arguments the build wrote (tritonllm/engine/llmapi_config.py). Its results are asyncio
iterators, so one event loop thread calls `generate_async` (the async queue of a result exists only when a loop runs
where it is made) and reads every request's steps. A request's tokens go through tritonllm/engine/lifecycle.py, as
in the other engines: stop words, max tokens and the end id end it there, and its emissions and timings are made
there. Names are those read in NVIDIA's sources nearest each release (tests/standins/tensorrt_llm/surface.py lists
them with the copies read: tensorrt_llm/llmapi/llm.py, executor/result.py, sampling_params.py), where they differ
mapped by the release's SamplerRules; only `LlmApi.load` imports tensorrt_llm, so the CPU tests drive this class with
a stand-in of each release (tests/standins/tensorrt_llm).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import itertools
import logging
import math
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from tritonllm.engine.adapters import BASE, Adapter, AdapterTable
from tritonllm.engine.api import BlockingGenerate, Emission, GenerationRequest, TokenLogProbs
from tritonllm.engine.checks import check_submit
from tritonllm.engine.grammar_check import check_guide
from tritonllm.engine.lifecycle import Lifecycle
from tritonllm.engine.llmapi_config import TOKENS_PER_BLOCK
from tritonllm.engine.llmapi_params import (
    SAMPLER_RULES,
    TokenRules,
    check_sampler,
    guided_decoding_kwargs,
    sampling_kwargs,
    token_rules,
)
from tritonllm.errors import ConfigError, EngineFailure
from tritonllm.protocol import FINISH_CANCELLED, FINISH_EOS, FINISH_ERROR, FINISH_LENGTH
from tritonllm.versions import LLM_API_RELEASES

# CompletionOutput.finish_reason (executor/result.py) -> ours. "stop" is the end id: stop words are never handed
# to the LLM API (tritonllm/engine/llmapi_params.py), so none of its stops is one.
LLM_FINISH = {"stop": FINISH_EOS, "length": FINISH_LENGTH, "cancelled": FINISH_CANCELLED, "timeout": FINISH_ERROR}
SHUTDOWN_SECONDS = 30  # for the requests in flight to get their final emission at shutdown

log = logging.getLogger(__name__)


@dataclass
class LlmApi:
    """The parts of `tensorrt_llm` the engine uses (module paths in comments, the same in 1.2.1 and 1.4.0rc4)."""

    version: str
    LLM: Any  # tensorrt_llm.LLM (tensorrt_llm/llmapi/llm.py), the PyTorch backend's
    SamplingParams: Any  # tensorrt_llm.SamplingParams (tensorrt_llm/sampling_params.py)
    GuidedDecodingParams: Any  # tensorrt_llm.sampling_params.GuidedDecodingParams
    LogitsProcessor: Any  # tensorrt_llm.sampling_params.LogitsProcessor, an abstract base with __call__
    LogprobMode: Any = None  # tensorrt_llm.sampling_params.LogprobMode, on 1.4 only
    LoraConfig: Any = None  # tensorrt_llm.lora_helper.LoraConfig, the LLM's lora_config
    LoRARequest: Any = None  # tensorrt_llm.executor.request.LoRARequest, generate_async's lora_request

    @classmethod
    def load(cls) -> LlmApi:
        try:
            trt = importlib.import_module("tensorrt_llm")
        except ImportError as exc:
            raise ConfigError(
                f"tensorrt_llm cannot be imported here ({type(exc).__name__}: {exc}): the trtllm-llmapi flavor runs "
                "in NVIDIA's TensorRT-LLM image (`make serve ENGINE=trtllm-llmapi`)"
            ) from exc
        params = importlib.import_module("tensorrt_llm.sampling_params")
        return cls(
            trt.__version__,
            trt.LLM,
            trt.SamplingParams,
            params.GuidedDecodingParams,
            params.LogitsProcessor,
            getattr(params, "LogprobMode", None),
            importlib.import_module("tensorrt_llm.lora_helper").LoraConfig,
            importlib.import_module("tensorrt_llm.executor.request").LoRARequest,
        )


@dataclass(eq=False)
class _Request:
    life: Lifecycle
    result: Any = None  # the LLM's RequestOutput, once submitted
    cancelled: bool = False


class LlmApiEngine(BlockingGenerate):
    def __init__(self, settings: dict, api: LlmApi | None = None) -> None:
        """`settings`: the build's llm_api.json (LlmApiConfig.engine_settings): the release, its sampler, the
        LoRA adapters (--lora), and the LLM's arguments."""
        release, llm_kwargs = settings["release"], settings["llm"]
        self.api = api or LlmApi.load()
        if self.api.version != LLM_API_RELEASES[release].trtllm:
            raise ConfigError(
                f"this image runs TensorRT-LLM {self.api.version}, but the build is for {release} "
                f"({LLM_API_RELEASES[release].trtllm}): serve it in {LLM_API_RELEASES[release].image}, or rebuild with "
                "--llm-api-release for this image's release"
            )
        self.rules = SAMPLER_RULES[release, settings["sampler"]]
        if self.rules.logprobs_mode and self.api.LogprobMode is None:
            raise ConfigError(
                f"tensorrt_llm {self.api.version} has no sampling_params.LogprobMode, which {self.rules.name} "
                "log probabilities are asked with"
            )
        # A virtual subclass of the release's abstract LogitsProcessor passes its isinstance checks and, a class at
        # module level, pickles: TensorRT-LLM pickles a request's logits processor to its worker processes.
        self.api.LogitsProcessor.register(TokenRules)
        self.max_batch_size = int(llm_kwargs.get("max_batch_size") or 1)
        # The adapters requests choose by lora_name or lora_task_id (the engine model's rule, AdapterTable.choose),
        # each a PEFT folder TensorRT-LLM loads itself; fixed at build time (no lora_action load or unload here).
        self._adapters = AdapterTable(
            Adapter(a["name"], int(a["task_id"]), a["path"], a["path"]) for a in settings.get("lora_adapters", ())
        )
        if llm_kwargs.get("lora_config") is not None:
            if self.api.LoraConfig is None:
                raise ConfigError(f"tensorrt_llm {self.api.version} has no lora_helper.LoraConfig")
            llm_kwargs = {**llm_kwargs, "lora_config": self.api.LoraConfig(**llm_kwargs["lora_config"])}
        self.llm = self.api.LLM(**llm_kwargs)  # loads the checkpoint; with tp/pp > 1, reaches every rank
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tensorrt_llm-llmapi", daemon=True)
        self._thread.start()
        # A submit registers and schedules its request under the lock shutdown closes under, so that shutdown's end
        # of every request meets it, or it is refused: a request scheduled on a stopped loop would never finish.
        self._lock = threading.Lock()
        self._closed = False
        self._dead: str | None = None  # why the LLM takes no more requests, once it says so

    # ---------------------------------------------------------------- the engine interface

    @property
    def adapters(self) -> AdapterTable:
        return self._adapters

    def submit(self, request: GenerationRequest, emit: Callable[[Emission], None]) -> str:
        check_submit(request, self.submit_rules)
        check_sampler(request, self.rules)
        if request.guide is not None:  # compiled in TensorRT-LLM's batch step, where a bad one fails late
            check_guide(request.guide.type, request.guide.text)
        params = self._sampling_params(request)
        lora = self._lora_request(request.adapter)
        entry = _Request(Lifecycle(request=request, emit=emit))
        with self._lock:
            if self._closed or self._dead:
                raise EngineFailure(f"the engine takes no requests: {self._dead or 'it is shutting down'}")
            engine_id = str(next(self._ids))
            self._requests[engine_id] = entry
            future = asyncio.run_coroutine_threadsafe(self._run(engine_id, entry, params, lora), self._loop)
        future.add_done_callback(_log_failure)
        return engine_id

    def cancel(self, engine_id: str) -> None:
        entry = self._requests.get(engine_id)
        if entry is not None:
            self._loop.call_soon_threadsafe(self._abort, entry)

    def running(self) -> int:
        return len(self._requests)

    def in_batch(self) -> int:
        """An estimate: the LLM API does not say which requests its scheduler holds; those beyond its batch wait."""
        return min(len(self._requests), self.max_batch_size)

    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed and self._dead is None

    def shutdown(self) -> None:
        """Every request in flight ends with an error first (and is aborted in the LLM), then the LLM stops."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        ended = asyncio.run_coroutine_threadsafe(self._end_all("the engine is shutting down"), self._loop)
        with contextlib.suppress(Exception):
            ended.result(SHUTDOWN_SECONDS)
        self.llm.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=SHUTDOWN_SECONDS)

    def _lora_request(self, name: str):
        """The release's LoRARequest for the adapter `name` (None for the base model); InputError naming lora_name
        for an adapter this engine does not have."""
        if name == BASE:
            return None
        adapter = self._adapters.by_name[self._adapters.choose(name, None)]
        return self.api.LoRARequest(lora_name=adapter.name, lora_int_id=adapter.task_id, lora_path=adapter.path)

    def _sampling_params(self, request: GenerationRequest):
        kwargs = sampling_kwargs(request, self.rules)
        if self.rules.logprobs_mode and "logprobs" in kwargs:
            kwargs["logprobs_mode"] = self.api.LogprobMode.PROCESSED
        if request.guide is not None:
            kwargs["guided_decoding"] = self.api.GuidedDecodingParams(**guided_decoding_kwargs(request.guide))
        rules = token_rules(request)
        if rules is not None:
            kwargs["logits_processor"] = rules
        return self.api.SamplingParams(**kwargs)

    # ---------------------------------------------------------------- on the event loop's thread

    def _abort(self, entry: _Request) -> None:
        entry.cancelled = True
        if entry.result is not None and not entry.life.done and not entry.result.finished:
            _abort_quietly(entry.result)

    async def _end_all(self, why: str) -> None:
        for entry in list(self._requests.values()):
            if entry.result is not None and not entry.result.finished:
                _abort_quietly(entry.result)
            entry.life.finish(FINISH_ERROR, error=why)

    async def _run(self, engine_id: str, entry: _Request, params, lora=None) -> None:
        life = entry.life
        try:
            if entry.cancelled:  # before it reached the LLM
                life.finish(FINISH_CANCELLED)
                return
            # Streamed from the LLM whenever tokens are checked as they come: stop words, or a streaming client.
            streaming = life.request.streaming or bool(life.request.stop_words)
            # By keyword: lora_request is generate_async's third positional parameter; base requests send none.
            adapter = {} if lora is None else {"lora_request": lora}
            try:
                entry.result = self.llm.generate_async(
                    {"prompt_token_ids": life.request.input_ids}, sampling_params=params, streaming=streaming, **adapter
                )
            except RuntimeError as exc:
                if "shutting down" in str(exc):  # the release's "LLM is shutting down": the health probe must see it
                    self._dead = str(exc)
                raise
            async for output in entry.result:
                if life.done or self._step(entry, output):
                    return
        except Exception as exc:  # this request fails alone
            if entry.result is not None and not entry.result.finished:
                _abort_quietly(entry.result)
            life.finish(FINISH_ERROR, error=f"{type(exc).__name__}: {exc}")
        finally:
            if not life.done:  # the LLM's results ended without a finished one
                life.finish(FINISH_ERROR, error="TensorRT-LLM ended the request without finishing it")
            self._requests.pop(engine_id, None)

    def _step(self, entry: _Request, output) -> bool:
        """One step's result: its new tokens through the lifecycle, and the end when there is one. True when done."""
        life = entry.life
        completion = output.outputs[0]
        new_tokens = completion.token_ids_diff
        wanted = life.request.log_probs >= 0
        log_probs = completion.logprobs_diff if wanted else None
        for position, token in enumerate(new_tokens):
            chosen = token_log_probs(token, log_probs[position], life.request.log_probs) if wanted else None
            reason = life.take(token, chosen)
            if reason is not None:
                self._finish(life, reason, completion)
                if not output.finished:  # a stop word or max tokens: the LLM API would go on
                    _abort_quietly(entry.result)
                return True
        if output.finished:
            reason = LLM_FINISH.get(completion.finish_reason, FINISH_ERROR)
            error = None if reason != FINISH_ERROR else f"TensorRT-LLM finished it: {completion.finish_reason}"
            self._finish(life, reason, completion, error)
            return True
        life.emit_new()
        return False

    def _finish(self, life: Lifecycle, reason: str, completion, error: str | None = None) -> None:
        """The final emission, with what the request's perf metrics say (on a finished step only): the KV cache
        blocks an earlier request left, and when the scheduler took it and its first and last tokens came (steady-
        clock timedeltas from the LLM's own arrival, more exact than this loop's: a whole answer comes in one step)."""
        metrics = completion.request_perf_metrics
        if metrics is not None:
            reused = metrics.kv_cache_metrics.num_reused_blocks * TOKENS_PER_BLOCK
            life.cached = min(reused, len(life.request.input_ids))  # a partly reused last block counts whole
            timing = metrics.timing_metrics
            if timing.arrival_time:
                for name, time in (
                    ("scheduled", timing.first_scheduled_time),
                    ("first_token", timing.first_token_time),
                    ("last_token", timing.last_token_time),
                ):
                    if time:
                        setattr(life, name, life.submitted + max((time - timing.arrival_time).total_seconds(), 0.0))
        life.finish(reason, error)


def _abort_quietly(result) -> None:
    """Ask the LLM to drop a request whose end is already decided here; its failure changes nothing for the client."""
    try:
        result.abort()
    except Exception:
        log.exception("tensorrt_llm: aborting request %s failed", getattr(result, "request_id", "?"))


def _log_failure(future: Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("tensorrt_llm: a request's coroutine failed", exc_info=future.exception())


def token_log_probs(token: int, position: dict, wanted: int) -> TokenLogProbs:
    """The chosen token's log probability and, when asked, the `wanted` most likely tokens', from the LLM API's
    {token: Logprob(logprob, rank)} of one position (the k most likely, and the chosen one beyond them). The chosen
    one's is required: a position without it fails the request, naming the token, rather than invent a value."""
    chosen = position.get(token)
    if chosen is None:
        raise RuntimeError(f"TensorRT-LLM returned no log probability for the chosen token {token}")
    ranked = sorted(
        position.items(), key=lambda item: (math.inf if item[1].rank is None else item[1].rank, -item[1].logprob)
    )
    top = tuple((t, p.logprob) for t, p in ranked[:wanted]) if wanted > 0 else ()
    return TokenLogProbs(chosen.logprob, top)
