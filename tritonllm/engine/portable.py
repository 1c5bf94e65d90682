"""The portable engine: a Hugging Face causal LM behind transformers' continuous batching.

Requests join the running batch as they arrive (in-flight batching); the batching itself is
transformers' `ContinuousBatchingManager`. This module adds what a serving engine needs around
it, with TensorRT-LLM's semantics: per-request end id, stop and bad word sequences, seeded
sampling, penalties, embedding bias, log probabilities, guided decoding, streaming of new tokens,
cancellation, and a finish reason. Each control is processing a step runs only when a request in it
uses it (tritonllm/engine/sampling.py, controls.py, guided.py).
"""

from __future__ import annotations

import inspect
import itertools
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import transformers
from transformers import AutoModelForCausalLM, CompileConfig, GenerationConfig
from transformers.generation.configuration_utils import ContinuousBatchingConfig
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

from tritonllm.engine import attention
from tritonllm.engine.api import (
    BlockingGenerate,
    Emission,
    EngineConfig,
    GenerationRequest,
    SubmitRules,
)
from tritonllm.engine.checks import check_submit
from tritonllm.engine.controls import EmbeddingBias, LogProbs, PenaltyGroup, RequestSlots, attach_log_probs
from tritonllm.engine.cpu_threads import on_fresh_thread, start_yielding
from tritonllm.engine.guided import Follower, GuidedDecoding, Guides
from tritonllm.engine.lifecycle import Lifecycle
from tritonllm.engine.norms import fuse_rms_norms
from tritonllm.engine.projections import merge_projections
from tritonllm.engine.sampling import key_graphs_by_processors, request_processors
from tritonllm.engine.step_graphs import graph_steps_up_to
from tritonllm.errors import ConfigError, EngineFailure, TritonLLMError
from tritonllm.protocol import (
    FINISH_CANCELLED,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    MAX_WORD_SEQUENCES,
)
from tritonllm.versions import TRANSFORMERS_VERSION

log = logging.getLogger(__name__)

PAGE_SIZE = 128  # KV cache tokens per block
# CUDA graph shapes: steps are padded to multiples of these many query / KV tokens (the KV count is the step's
# cached tokens across its requests), and each new shape is captured once. transformers' defaults (64 / 16384)
# made batch-1 decode compute 64 query and 16k KV tokens a step under SDPA; under varlen attention padded KV
# tokens are only copied, and a coarse KV step keeps a growing batch from meeting a new shape every step.
GRAPH_Q_PADDING = 16
GRAPH_KV_PADDING = 4096


@dataclass(eq=False)
class _Active(Lifecycle):
    # The router's advance and a cancel from another thread both read and emit the tokens: they take turns, and
    # nothing is emitted after the final emission (done).
    lock: threading.RLock = field(default_factory=threading.RLock)
    follower: Follower | None = None  # its grammar matcher, for a guided request


class PortableEngine(BlockingGenerate):
    """One model, one batching manager, one thread that routes the manager's outputs to requests."""

    def __init__(self, config: EngineConfig) -> None:
        check_transformers(transformers.__version__)
        config = self.config = config.resolve()
        varlen = config.attention == attention.VARLEN
        if varlen and (reason := attention.unavailable_reason(config.device, config.dtype)):
            raise ValueError(f"attention {attention.VARLEN!r}: {reason}")
        if config.device.startswith("cuda"):
            # A process-wide setting: the engine owns its process (one per Triton model instance).
            torch.backends.cuda.enable_cudnn_sdp(config.cudnn_attention)
        if config.device == "cpu":
            # Only the generation thread is to keep an OpenMP team: loading on the caller's thread would
            # leave a second one, and cut a small host's decode speed by a third (tritonllm/engine/cpu_threads.py).
            on_fresh_thread(self._start)
        else:
            self._start()

    def _start(self) -> None:
        """Loads the model, creates the batching manager and starts it and the output router."""
        config = self.config
        varlen = config.attention == attention.VARLEN
        self.model = AutoModelForCausalLM.from_pretrained(
            config.model_dir,
            dtype=getattr(torch, config.dtype),
            attn_implementation="sdpa" if varlen else config.attention,
        ).to(config.device)
        self.model.eval()
        if config.fused_norms:
            log.info("%d RMSNorm layers run as torch's rms_norm", fuse_rms_norms(self.model))
        if config.fused_projections:
            log.info("%d groups of projections run as one product each", merge_projections(self.model))
        generation_config = GenerationConfig(
            do_sample=False, max_new_tokens=config.max_seq_len, eos_token_id=-1, pad_token_id=0
        )
        self._manager = self.model.init_continuous_batching(
            generation_config=generation_config,
            continuous_batching_config=ContinuousBatchingConfig(
                page_size=PAGE_SIZE,
                num_blocks=max(1, config.kv_cache_tokens // PAGE_SIZE),
                max_batch_tokens=config.max_batch_tokens,
                max_requests_per_batch=config.max_batch_size,
                use_cuda_graph=config.cuda_graphs,
                q_padding_interval_size=GRAPH_Q_PADDING,
                kv_padding_interval_size=GRAPH_KV_PADDING,
                # The processors prepare from what the host knows before the previous step's token (sampling.py).
                use_async_batching=config.async_batching,
                auto_switch_to_flash=False,
                varlen_compile_config=compile_config(self.model.config) if config.compile else None,
            ),
        )
        if varlen:
            # After the manager checked the implementation, before it allocates its step buffers (attention.py).
            self.model.set_attn_implementation(attention.register())
        self.vocab_size = logits_width(self.model)
        self.submit_rules = SubmitRules(self.vocab_size, config.async_batching)
        device = self.model.device
        self._slots = RequestSlots(self.vocab_size, config.max_batch_size, device)
        self._log_probs = LogProbs(config.max_batch_size, device)
        self.guides = Guides(config.model_dir, self.vocab_size)
        self._guided = GuidedDecoding(self.guides, config.max_batch_size, device)
        processors = request_processors(
            MAX_WORD_SEQUENCES,
            before_bans=[self._log_probs, EmbeddingBias(self._slots), PenaltyGroup(self._slots)],
            before_sampling=[self._guided],
        )
        self._manager.logit_processor = processors
        create_batch_processor = self._manager._create_batch_processor

        def create_and_attach():  # the manager makes its step buffers when it starts (or warms up)
            processor = create_batch_processor()
            ios = processor.inputs_and_outputs
            self._slots.stream = self._guided.stream = ios.compute_stream
            if not processor.use_async_batching:
                attach_log_probs(ios, self._log_probs)
            return processor

        self._manager._create_batch_processor = create_and_attach
        self._graph_stores: list = []
        if config.cuda_graphs:
            # Capture the largest graphs now, which sizes their shared memory pool, rather than in the first
            # requests' latency; smaller shapes are captured when first met. Steps of more query tokens than the
            # batch's request limit (prefill-heavy ones) then run eagerly (graph_steps_up_to): the largest
            # capture is kept for the pool's size only.
            self._manager.warmup()
            processor = self._manager.batch_processor
            self._graph_stores = key_graphs_by_processors(processor.inputs_and_outputs, processors)
            graph_steps_up_to(
                processor.model_runner,
                processor.inputs_and_outputs,
                config.max_batch_size,
            )
        self._active: dict[str, _Active] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._stopping = threading.Event()
        self._router = threading.Thread(target=self._route_outputs, name="engine-output-router", daemon=True)
        if config.device == "cpu":
            # The generation loop and its OpenMP team yield the cores to the stream's other steps when they wake.
            start_yielding(self._manager.start, config.cpu_niceness)
        else:
            self._manager.start()
        self._router.start()

    # ------------------------------------------------------------------ requests

    def submit(self, request: GenerationRequest, emit: Callable[[Emission], None]) -> str:
        """Queue a request; `emit` is called from the engine's thread as tokens arrive. Raises InputError, naming
        the input, for controls out of range or a guide that does not compile."""
        check_submit(request, self.submit_rules)
        compiled = self.guides.compile(request.guide) if request.guide is not None else None
        request_id = f"r{next(self._ids)}"
        active = _Active(request=request, emit=emit)
        kwargs = request_kwargs(request)
        if compiled is not None:
            self.guides.start(request_id, compiled, request.end_id, request.penalties.min_tokens)
            active.follower = self.guides.follower(request_id)
        # Registered before the manager has it: the router may meet its first output before add_request returns.
        with self._lock:
            self._active[request_id] = active
        # The manager reports every token when we must look at each one (stop words, streaming).
        per_token = request.streaming or bool(request.stop_words)
        try:
            queued = self._manager.add_request(
                input_ids=request.input_ids,
                request_id=request_id,
                max_new_tokens=request.max_new_tokens,
                streaming=per_token,
                record_timestamps=True,
                eos_token_id=request.end_id,
                **kwargs,
            )
            if queued is None:  # transformers drops, with a warning only, what arrives while its loop stops
                raise EngineFailure("the engine's generation loop is stopping: the request was not queued")
        except Exception:
            with self._lock:
                self._active.pop(request_id, None)  # not taken: it must not hold an admission slot
            self._release(request_id)
            raise
        return request_id

    def _release(self, request_id: str) -> None:
        """Frees what a finished request held beside the manager: its device slot and its grammar matcher."""
        self._slots.release(request_id)
        self.guides.release(request_id)

    def cancel(self, request_id: str) -> None:
        """Stop a request and free its place in the batch; it gets a final "cancelled" emission."""
        with self._lock:
            active = self._active.pop(request_id, None)
        if active is not None:
            self._manager.cancel_request(request_id)  # before the release: the slot is freed once out of the batch
            self._release(request_id)
            _finish(active, FINISH_CANCELLED)

    def running(self) -> int:
        """Requests submitted and not finished."""
        with self._lock:
            return len(self._active)

    def in_batch(self) -> int:
        """Requests in the running batch (the others submitted wait for a slot)."""
        processor = self._manager.batch_processor
        return len(processor.scheduler.active_requests) if processor is not None else 0

    def alive(self) -> bool:
        """Whether the generation loop runs (when it stops, the router fails every request and ends)."""
        return self._router.is_alive()

    def steps(self) -> int | None:
        """The batching manager's count of the steps its loop has run (a public attribute of transformers')."""
        return getattr(self._manager, "current_batch", None)

    def captured_graphs(self) -> int:
        """CUDA graphs held: one per step shape and processing met so far, in each step buffer set (two under
        asynchronous batching). They are kept for the engine's life; a rising count means steps pay captures."""
        return sum(len(store) for store in self._graph_stores)

    def shutdown(self) -> None:
        self._stopping.set()
        with self._lock:
            pending = list(self._active.items())
            self._active.clear()
        for request_id, active in pending:
            self._manager.cancel_request(request_id)
            self._release(request_id)
            _finish(active, FINISH_ERROR, "the engine is shutting down")
        self._manager.stop(block=True, timeout=10)
        self._router.join(timeout=5)

    # ------------------------------------------------------------------ output routing

    def _route_outputs(self) -> None:
        while not self._stopping.is_set():
            output = self._manager.get_result(timeout=0.1)
            if output is None:
                if not self._manager.is_running() and not self._stopping.is_set():
                    self._fail_all("the generation loop stopped unexpectedly")
                    return
                continue
            with self._lock:
                active = self._active.get(output.request_id)
            if active is None:  # cancelled meanwhile
                continue
            try:
                self._advance(output.request_id, active, output)
            except Exception as exc:  # a bug here must not kill routing for every other request
                log.exception("routing output of %s failed", output.request_id)
                self._drop(output.request_id, active, FINISH_ERROR, f"internal error: {exc}")

    def _advance(self, request_id: str, active: _Active, output: GenerationOutput) -> None:
        with active.lock:
            if not active.done:
                self._advance_locked(request_id, active, output)

    def _advance_locked(self, request_id: str, active: _Active, output: GenerationOutput) -> None:
        if output.status == RequestStatus.FAILED:
            self._drop(request_id, active, FINISH_ERROR, output.error or "generation failed")
            return
        if active.follower is not None and _guide_lost(active.follower, output):
            self._manager.cancel_request(request_id)
            self._drop(request_id, active, FINISH_ERROR, active.follower.lost)
            return
        request = active.request
        reason = None
        log_probs = output.logprobs if request.log_probs >= 0 else None
        times = output.timestamps
        for index in range(active.taken, len(output.generated_tokens)):
            if log_probs is not None and index >= len(log_probs):
                raise RuntimeError(f"token {index} came without its log probabilities")
            reason = active.take(
                output.generated_tokens[index],
                None if log_probs is None else log_probs[index],
                times[index] if index < len(times) else None,
            )
            if reason == FINISH_STOP:
                self._manager.cancel_request(request_id)
            if reason is not None:
                break
        if reason is None and output.is_finished():
            reason = FINISH_LENGTH
        if reason is not None:
            self._drop(request_id, active, reason)
        else:
            active.emit_new()

    def _drop(self, request_id: str, active: _Active, reason: str, error: str | TritonLLMError | None = None) -> None:
        with self._lock:
            if self._active.pop(request_id, None) is None:
                return  # already finished (cancelled concurrently)
        self._release(request_id)
        _finish(active, reason, error)

    def _fail_all(self, error: str) -> None:
        with self._lock:
            pending = list(self._active.items())
            self._active.clear()
        for request_id, active in pending:
            self._release(request_id)
            _finish(active, FINISH_ERROR, error)


def logits_width(model) -> int:
    """The model's vocabulary as its logits have it (an output layer may be padded past the tokenizer's)."""
    output = model.get_output_embeddings()
    return output.weight.shape[0] if output is not None else model.config.get_text_config().vocab_size


def request_kwargs(request: GenerationRequest) -> dict:
    """The manager's per-request processor arguments (tritonllm/engine/sampling.py's groups) for `request`: only
    the controls it uses, so that a step of requests without them skips their processing."""
    kwargs = request.sampling.as_kwargs()
    if request.bad_words:
        kwargs["bad_words"] = request.bad_words
    penalties = request.penalties
    if penalties.repetition != 1.0:
        kwargs["repetition_penalty"] = float(penalties.repetition)
    if penalties.presence:
        kwargs["presence_penalty"] = float(penalties.presence)
    if penalties.frequency:
        kwargs["frequency_penalty"] = float(penalties.frequency)
    if penalties.count_prompt and (penalties.presence or penalties.frequency):
        kwargs["count_prompt"] = True
    if penalties.min_tokens > 0 and request.end_id >= 0:
        kwargs["min_tokens"] = int(penalties.min_tokens)
    if request.embedding_bias:
        kwargs["embedding_bias"] = tuple((int(t), float(v)) for t, v in request.embedding_bias)
    if request.log_probs >= 0:
        kwargs["log_probs"] = int(request.log_probs)
    if request.guide is not None:
        kwargs["guided"] = True
    return kwargs


def _guide_lost(follower: Follower, output: GenerationOutput) -> bool:
    """Whether the request's grammar refused one of its tokens. The step thread's matcher takes each token when it
    prepares the next step; a finished request has none, so its last tokens are given to the matcher here (the
    manager no longer steps it: the matcher is this thread's)."""
    if follower.lost is None and output.is_finished():
        for token in output.generated_tokens[follower.accepted :]:
            if not follower.accept(token, output.request_id):
                break
    return follower.lost is not None


def _finish(active: _Active, reason: str, error: str | TritonLLMError | None = None) -> None:
    """The request's final emission, once."""
    with active.lock:
        active.finish(reason, error)


def compile_config(model_config) -> CompileConfig:
    """torch.compile settings for the batching manager's step: the forward pass and the bad-word bans (the
    sampling draw stays eager, tritonllm/engine/sampling.py).

    transformers' paged cache update is a graph break inside each attention layer, and the code before it is
    specialised on the layer's index, so a model needs one compiled entry per layer: dynamo's default limit
    of 8 would leave the other layers uncompiled. Newer torch releases take the limit per compiled function
    (their global setting is thread-local, and the manager compiles in its own thread).
    """
    limit = 2 * getattr(model_config, "num_hidden_layers", 0) + 8
    settings = CompileConfig(mode="default", fullgraph=False, dynamic=True)
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        settings.recompile_limit = limit
    else:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    return settings


def check_transformers(installed: str) -> None:
    """The engine drives internals of one transformers release (tritonllm.versions): another fails in ways that
    do not name it (an image's own release dropped options, or failed at the attention), so it is refused here."""
    if installed != TRANSFORMERS_VERSION:
        raise ConfigError(
            f"the transformers engine needs transformers=={TRANSFORMERS_VERSION} (it drives that release's "
            f"continuous batching), and this Python has {installed}: install it (pip install "
            f"transformers=={TRANSFORMERS_VERSION}) or use the project's .venv"
        )
