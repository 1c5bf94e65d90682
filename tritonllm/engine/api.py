"""What the portable engine takes and gives: its configuration, requests and emissions, without torch.

The engine model's stub imports only this when the engine runs in a process of its own
(tritonllm/engine/process.py): that process loads torch, transformers and the model.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass

from tritonllm.engine.cpu_threads import YIELDING_NICENESS
from tritonllm.protocol import (
    FINISH_CANCELLED,
    FINISH_EOS,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    MAX_WORD_SEQUENCES,
)

__all__ = ["FINISH_CANCELLED", "FINISH_EOS", "FINISH_ERROR", "FINISH_LENGTH", "FINISH_STOP"]  # engine vocabulary


@dataclass(frozen=True)
class SamplingParams:
    """Greedy unless `sample`; then temperature > 0, top_k 0 = off, top_p 1.0 = off."""

    sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def as_kwargs(self) -> dict:
        if not self.sample:
            return {}
        return {
            "sample": True,
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "seed": self.seed,
        }


@dataclass(frozen=True)
class GenerationRequest:
    input_ids: list[int]
    max_new_tokens: int
    end_id: int = -1  # -1: never stop on a token
    sampling: SamplingParams = SamplingParams()
    stop_words: tuple[tuple[int, ...], ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    streaming: bool = False


@dataclass(frozen=True)
class Emission:
    """What the engine reports for a request.

    `token_ids` are the tokens since the previous emission of a streaming request, or all the
    generated tokens in the single emission of a non-streaming one. A final emission has a
    `finish_reason`; only an "error" one has `error`.
    """

    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    # On final emissions: seconds from submission to the first generated token, and the mean
    # seconds per token after it (None when unknown: no or one token).
    time_to_first_token: float | None = None
    time_per_output_token: float | None = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None

    @staticmethod
    def merge(earlier: Emission, later: Emission) -> Emission | None:
        """One emission for a streaming request's two consecutive ones; None when they cannot be one."""
        if earlier.final or earlier.error or later.error:
            return None
        return dataclasses.replace(later, token_ids=earlier.token_ids + later.token_ids)


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    device: str = "cpu"
    dtype: str = "float32"
    max_batch_size: int = 16
    max_seq_len: int = 4096
    kv_cache_tokens: int = 16384  # KV cache capacity, in tokens, across all requests
    max_batch_tokens: int = 512  # tokens per forward step; longer prompts are prefilled in chunks
    page_size: int = 128
    # Capture each step (forward, sampling, bad words) in CUDA graphs: batch-1 decode is bound by
    # kernel launches without them. CUDA devices only.
    cuda_graphs: bool = False
    # Graph shapes: steps are padded to multiples of these many query / KV tokens (the KV count is the step's
    # cached tokens across its requests), and each new shape is captured once. transformers' defaults
    # (64 / 16384) made batch-1 decode of a 7B model on an H200 compute 64 query and 16k KV tokens a step
    # under SDPA: 22 tokens/s; with 16 / 256, 89. Under varlen attention padded KV tokens are only copied,
    # not attended, and 256 requests add 256 KV tokens a step: 256 met a new shape, and paid a capture,
    # almost every step; 4096 captured 61 graphs where 256 captured 168, for 256 requests arriving over
    # 2 s: 3,788 against 3,433 tokens/s, batch 1 100 against 102 (docs/PERFORMANCE.md, run CC).
    graph_q_padding: int = 16
    graph_kv_padding: int = 4096
    # Steps of more query tokens than this run without a graph (engine/step_graphs.py); None: max_batch_size, so
    # every decode step replays one and only prefill-heavy steps run eagerly. On an H200, 7B, 256 requests: in-process
    # 7,639 -> 7,832 tokens/s, arriving over 2 s 5,343 -> 5,751, served streams 6,688 -> 7,423 with no capture in a
    # second load (docs/PERFORMANCE.md, run MMM).
    graph_max_q_tokens: int | None = None
    # "sdpa", or "varlen" (CUDA): torch's FlashAttention over each request's own tokens (tritonllm/engine/attention.py)
    attention: str = "sdpa"
    # Let torch's SDPA pick cuDNN's attention kernel (CUDA). It builds a cuDNN graph for every new batch
    # shape, and served batches are rarely the same twice: on an H200, 256 requests arriving over 2 s ran
    # at 1,393 tokens/s with it and 1,733 without, batch 1 at 19.6 and 31.6 (docs/PERFORMANCE.md). Under
    # CUDA graphs it is built once per captured graph.
    cudnn_attention: bool = False
    # Compile the step's forward (not the per-request sampling and bad words) with torch.compile: fewer, fused
    # kernels. On an H200 with CUDA graphs and async batching: batch-1 device time per step 8.2 -> 6.6 ms, served
    # single stream 113 -> 137-151 tokens/s, 256 streams -5 to +14 %, and 1-2.5 minutes more at start
    # (docs/PERFORMANCE.md).
    compile: bool = False
    # transformers' asynchronous batching: the host prepares step N+1 while the device runs step N. On an H200
    # at batch 1 it took the device's idle time between steps from ~3 ms to 0.1 ms per token; served, with
    # graphs: 256 streams 5,796 against 4,294 tokens/s (docs/PERFORMANCE.md runs AA, DD, EE).
    async_batching: bool = False
    # Run each RMSNorm layer as torch's one-kernel rms_norm instead of transformers' ~8 elementwise kernels
    # (tritonllm/engine/norms.py). On an H200, 7B with CUDA graphs and async batching: batch 1 114.7 -> 133.1
    # tokens/s, 256 requests +6 to +11 % (docs/PERFORMANCE.md, run DDD); on the CPU the same logits, and a
    # single stream +8 %.
    fused_norms: bool = True
    # Run each layer's q/k/v projections as one matrix product and its MLP's gate/up ones as another
    # (tritonllm/engine/projections.py). On an H200, 7B with CUDA graphs and async batching: batch 1 133.4 -> 144.0
    # tokens/s, 256 requests unchanged (docs/PERFORMANCE.md, run FFF); on the CPU the same logits, and a single
    # stream +11 %.
    fused_projections: bool = True
    # On the CPU, the nice value added to the generation thread and its OpenMP team (engine/cpu_threads.py): the
    # stream's other steps then take a core when they wake; 2 cores: the first streamed text 1-2 ms sooner (run in
    # docs/PERFORMANCE.md, thirteenth session). 0 keeps the caller's priority (a host with other busy processes).
    cpu_niceness: int = YIELDING_NICENESS


class BlockingGenerate:
    """`generate` for an engine with `submit` (in this process, or in one of its own: tritonllm/engine/process.py)."""

    def submit(self, request: GenerationRequest, emit: Callable[[Emission], None]) -> str:
        raise NotImplementedError

    def generate(self, request: GenerationRequest, timeout: float | None = None) -> tuple[list[int], str]:
        """Blocking helper: the generated tokens and finish reason of one non-streaming request."""
        done = threading.Event()
        result: list[Emission] = []

        def emit(emission: Emission) -> None:
            result.append(emission)
            if emission.final:
                done.set()

        self.submit(request, emit)
        if not done.wait(timeout):
            raise TimeoutError("generation did not finish in time")
        final = result[-1]
        if final.error:
            raise RuntimeError(final.error)
        return [t for e in result for t in e.token_ids], final.finish_reason or ""


def check_request(request: GenerationRequest) -> None:
    """What an engine's `submit` refuses (ValueError) rather than queues."""
    if len(request.bad_words) > MAX_WORD_SEQUENCES:
        raise ValueError(f"{len(request.bad_words)} bad words, more than the limit of {MAX_WORD_SEQUENCES}")
