"""What the portable engine takes and gives: its configuration, requests and emissions, without torch.

The engine model's stub imports only this when the engine runs in a process of its own
(tritonllm/engine/process.py): that process loads torch, transformers and the model.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import numbers
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tritonllm.engine.adapters import Adapter, AdapterTable
from tritonllm.engine.cpu_threads import YIELDING_NICENESS
from tritonllm.errors import ConfigError, EngineFailure, ErrorKind, InputError, TritonLLMError, error_of_kind
from tritonllm.options import flag_of, option
from tritonllm.protocol import MAX_WORD_SEQUENCES

AUTO_DEVICES = ("auto", "cpu", "cuda")
TRANSFORMERS = "transformers"
LLAMACPP = "llamacpp"
LLAMA_MAX_SEQUENCES = 256  # llama.cpp's sequences per context (LLAMA_MAX_SEQ)
GGUF_AS_IS = "gguf"  # the dtype of a llama.cpp engine that loads the GGUF file's own (quantized) types


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
class Penalties:
    """TensorRT-LLM's per-request penalties; the defaults leave the logits as they are.

    repetition: transformers' RepetitionPenaltyLogitsProcessor over the prompt and the generated tokens (a
    seen token's logit is divided by it when positive, multiplied when negative). presence / frequency:
    logit -= presence * [count > 0] + frequency * count, before the temperature, where count is over the generated
    tokens (OpenAI's rule), or with count_prompt over the prompt's too (TensorRT-LLM's, which applies them after
    the temperature: tritonllm/link/engine_io.py scales them for that). min_tokens: the end id is banned until
    this many tokens are generated (MinNewTokensLengthLogitsProcessor).
    """

    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0
    min_tokens: int = 0
    count_prompt: bool = False

    @property
    def neutral(self) -> bool:
        """No change to the logits. min_tokens is left out: it bans one token at a request's first steps, which
        every engine's greedy path does itself (it is 1 by default on NVIDIA's interface, as in TensorRT-LLM)."""
        return dataclasses.replace(self, min_tokens=0, count_prompt=False) == Penalties()


@dataclass(frozen=True)
class Guide:
    """Guided decoding, as TensorRT-LLM's `guided_decoding_guide_type` / `guided_decoding_guide` say it: `type`
    is one of protocol.GUIDE_TYPES; `text` is the JSON schema, regular expression or EBNF grammar ("" for any JSON)."""

    type: str
    text: str = ""


@dataclass(frozen=True)
class GenerationRequest:
    input_ids: list[int]
    max_new_tokens: int
    end_id: int = -1  # -1: never stop on a token
    sampling: SamplingParams = SamplingParams()
    stop_words: tuple[tuple[int, ...], ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    streaming: bool = False
    penalties: Penalties = Penalties()
    # (token id, value added to its logit), -inf allowed: TensorRT-LLM's embedding_bias, sparse.
    embedding_bias: tuple[tuple[int, float], ...] = ()
    # -1: no log probabilities; 0: the chosen token's; k > 0: also the k most likely tokens'. Of the model's own
    # distribution (log_softmax of its logits, before penalties, bias, temperature or a grammar), as vLLM's default.
    log_probs: int = -1
    guide: Guide | None = None
    adapter: str = ""  # the LoRA adapter's name (tritonllm/engine/adapters.py); "" for the base model

    @property
    def uses_controls(self) -> bool:
        """Whether its tokens are anything but the argmax of the model's logits."""
        return bool(
            self.sampling.sample
            or not self.penalties.neutral
            or self.embedding_bias
            or self.log_probs >= 0
            or self.guide is not None
            or self.bad_words
        )


@dataclass(frozen=True)
class TokenLogProbs:
    """The log probability of a generated token and, when asked for, the most likely tokens' (most likely first)."""

    log_prob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(slots=True)
class Emission:
    """What the engine reports for a request.

    `token_ids` are the tokens since the previous emission of a streaming request, or all the generated tokens in the
    single emission of a non-streaming one. A final emission has a `finish_reason`; only an "error" one has `error`,
    and `error_kind` when it is not the engine's failure (a client's mistake that only the generation could find:
    INVALID_INPUT, a 400, not a 500). Not frozen, though nothing changes one once made: a stream makes one per token,
    and a frozen dataclass takes four times as long to make.
    """

    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None
    log_probs: list[TokenLogProbs] | None = None  # one per token of `token_ids` when the request asked
    # On final emissions: seconds from submission to the first generated token, and the mean
    # seconds per token after it (None when unknown: no or one token).
    time_to_first_token: float | None = None
    time_per_output_token: float | None = None
    time_to_schedule: float | None = None  # on final emissions: seconds from submission to its first step
    cached_tokens: int = 0  # on final emissions: prompt tokens whose KV cache came from an earlier request
    error_kind: ErrorKind | None = None  # of `error`; None: the engine failed (INTERNAL)

    @property
    def final(self) -> bool:
        return self.finish_reason is not None

    def failure(self) -> TritonLLMError:
        """An "error" emission's error as the project's: the engine's failure, or the client's mistake by its kind."""
        if self.error_kind in (None, ErrorKind.INTERNAL):
            return EngineFailure(f"generation failed: {self.error}")
        return error_of_kind(self.error_kind, self.error or "")

    @staticmethod
    def joinable(earlier: Emission, later: Emission) -> bool:
        """Whether one emission can carry a streaming request's two consecutive ones: not past a final or an error."""
        return not (earlier.final or earlier.error or later.error)

    @staticmethod
    def join(run: list[Emission]) -> Emission:
        """One emission for consecutive joinable ones: all their tokens (and log probs), the last one's other fields.
        A run at once: joined a pair at a time, a busy stream's tokens were copied over and over."""
        token_ids = [token for emission in run for token in emission.token_ids]
        log_probs = None
        if any(emission.log_probs is not None for emission in run):
            log_probs = [p for emission in run for p in emission.log_probs or ()]
        return dataclasses.replace(run[-1], token_ids=token_ids, log_probs=log_probs)


# Beside the engine model, as the build writes it: tensorrt_llm_decoupled/1/ (tensorrt_llm/1/ when decoupled).
ENGINE_CONFIG_FILE = "engine.json"


@dataclass(frozen=True)
class EngineConfig:
    """The portable engine's configuration. The build resolves it and writes it as engine.json; the engine model
    loads it with `EngineConfig(**json)`. Fields made with `option` are build options too (tritonllm/options.py)."""

    model_dir: str  # the Hugging Face folder (weights for transformers; the tokenizer for every engine)
    impl: str = option(
        "auto",
        "what runs the model: llamacpp (the GGUF file through llama.cpp, CPU) or transformers (PyTorch, CPU or "
        "CUDA); auto: llamacpp for a GGUF model on the CPU when llama-cpp-python is installed",
        choices=("auto", TRANSFORMERS, LLAMACPP),
        flag="--engine-impl",
    )
    gguf_file: str = ""  # the GGUF file the model came from, when it did: what the llama.cpp engine loads
    device: str = option("auto", "where the engine runs; auto: cuda when PyTorch sees a GPU", choices=AUTO_DEVICES)
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on the CPU; GGUF_AS_IS: the llama.cpp engine's file as it is
    max_batch_size: int = 16
    max_seq_len: int = 4096
    kv_cache_tokens: int = 16384  # KV cache capacity, in tokens, across all requests
    max_batch_tokens: int = option(
        512, "tokens per engine step; longer prompts are prefilled in chunks", limits=(1, None)
    )
    cuda_graphs: bool | None = option(
        None,
        "capture engine steps in CUDA graphs (default: on); a new batch shape pays its capture when first met",
        cuda_only=True,
    )
    cudnn_attention: bool | None = option(
        None,
        "let torch use cuDNN's attention kernel (default: with --cuda-graphs); cuDNN builds a graph for each new "
        "batch shape, which served batches keep meeting unless steps are captured in CUDA graphs",
        cuda_only=True,
    )
    compile: bool = option(
        False,
        "compile the engine step's forward with torch.compile: fused kernels, but one to two minutes more at start",
        cuda_only=True,
    )
    async_batching: bool | None = option(
        None,
        "prepare each engine step on the host while the GPU runs the previous one (transformers' asynchronous "
        "batching; default: with --cuda-graphs)",
        cuda_only=True,
    )
    fused_norms: bool = option(
        True,
        "run the model's RMSNorm layers as torch's one-kernel rms_norm where they compute the same (checked)",
        engine_only=TRANSFORMERS,
    )
    fused_projections: bool = option(
        True,
        "run each layer's q/k/v projections as one matrix product, and its MLP's gate/up ones as another",
        engine_only=TRANSFORMERS,
    )
    cpu_niceness: int = option(
        YIELDING_NICENESS,
        "on the CPU, the nice value added to the generation thread and its OpenMP workers, so that the stream's "
        "other steps take a core when they wake; 0 keeps the server's priority (a host shared with busy processes)",
        limits=(0, 19),
    )
    engine_process: bool | None = option(
        None,
        "run the engine in a process of its own beside the engine model's (default: on CUDA), so that sending a "
        "response per token per stream does not take the generation loop's interpreter lock",
    )
    engine_instances: int = option(
        0,
        "with the engine in a process of its own, instances of the engine model, each sending its own requests' "
        "responses with its own interpreter lock from the one engine they share; 0: as many as the text models "
        "(one per four cores of the build host, 1 to 8) with the engine in a process of its own, else 1",
        limits=(0, 64),
    )
    prefix_cache: bool = option(
        False,
        "keep a finished request's KV cache and start a later prompt that begins with the same tokens (a system "
        "prompt, an earlier turn of the chat) from it, computing only the rest; kept cells lie in the range every "
        "step's attention scans in llama.cpp's shared cache, so they slow each step a little while they stay",
        engine_only=LLAMACPP,
    )
    kv_events: str = ""  # a ZeroMQ endpoint for the prefix cache's KV events: the server's KV_EVENTS_ENV, at load
    # The LoRA adapters (adapters.Adapter.as_json), converted at build time from --lora NAME=PATH.
    lora_adapters: list[dict] = dataclasses.field(default_factory=list)
    lora_dir: str | None = option(
        None,
        "a folder of LoRA adapters (PEFT folders, or GGUF LoRA files) that may be loaded and unloaded while serving "
        "(docs/lora.md), behind the admin key; none: adapters are only those of --lora",
        engine_only=LLAMACPP,
    )
    attention: str = option(
        "auto",
        "attention kernel: varlen (CUDA, 16-bit types: FlashAttention over each request's own tokens) or sdpa "
        "(a mask across the whole batch); auto: varlen where it runs",
        choices=("auto", "sdpa", "varlen"),
        engine_only=TRANSFORMERS,
    )

    def resolve(self) -> EngineConfig:
        """This configuration with every "auto" and None decided for the device it will run on, and the CUDA-only
        options off elsewhere. Raises ConfigError, naming the build option, for what cannot run there."""
        import torch

        from tritonllm.engine.attention import VARLEN, unavailable_reason

        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        elif device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"--device {device}: PyTorch sees no CUDA GPU here. Use --device cpu (or auto).")
        cuda = device.startswith("cuda")
        impl = self.impl
        llama_cpp = importlib.util.find_spec("llama_cpp") is not None
        if impl == "auto":
            impl = LLAMACPP if not cuda and self.gguf_file and llama_cpp else TRANSFORMERS
        elif impl == LLAMACPP:
            if cuda:
                raise ConfigError("--engine-impl llamacpp runs on the CPU (a CPU build of llama.cpp): use --device cpu")
            if not self.gguf_file:
                raise ConfigError("--engine-impl llamacpp needs a GGUF model: MODEL=<file>.gguf (the default is one)")
            if not llama_cpp:
                raise ConfigError(
                    "--engine-impl llamacpp: llama-cpp-python is not installed (`make build` installs it)"
                )
        if impl == LLAMACPP and self.max_batch_size > LLAMA_MAX_SEQUENCES:
            raise ConfigError(
                f"--max-batch-size {self.max_batch_size}: llama.cpp runs at most {LLAMA_MAX_SEQUENCES} requests at once"
            )
        if impl == LLAMACPP and self.engine_process:
            raise ConfigError("--engine-process is for --engine-impl transformers: llama.cpp steps without the GIL")
        for field in dataclasses.fields(self):  # given to another engine, they would be silently ignored
            only = field.metadata.get("engine_only")
            if only and only != impl and getattr(self, field.name) != field.default:
                raise ConfigError(
                    f"{flag_of(field)}: an option of --engine-impl {only}; this build runs {impl} "
                    f"(--engine-impl {only} to use it)"
                )
        if self.dtype == GGUF_AS_IS and impl != LLAMACPP:
            raise ConfigError(
                f"--dtype {GGUF_AS_IS} is for the llama.cpp engine (--engine-impl llamacpp, a GGUF model)"
            )
        dtype = self.dtype if self.dtype != "auto" else ("bfloat16" if cuda else "float32")
        graphs = cuda if self.cuda_graphs is None else self.cuda_graphs
        own_process = cuda if self.engine_process is None else self.engine_process
        check_engine_instances(self.engine_instances, own_process)
        decided = {
            "impl": impl,
            "device": device,
            "dtype": dtype,
            "cuda_graphs": graphs,
            "cudnn_attention": graphs if self.cudnn_attention is None else self.cudnn_attention,
            "async_batching": graphs if self.async_batching is None else self.async_batching,
            "engine_process": own_process,
        }
        if not cuda:
            decided.update({f.name: False for f in dataclasses.fields(self) if f.metadata.get("cuda_only")})
        if impl != LLAMACPP:  # llama.cpp's attention is its own: the option stays at its default
            reason = unavailable_reason(device, dtype)
            if self.attention == "auto":
                decided["attention"] = "sdpa" if reason else VARLEN
            elif self.attention == VARLEN and reason:
                raise ConfigError(f"--attention {VARLEN}: {reason}")
        return dataclasses.replace(self, **decided)


@dataclass(frozen=True)
class SubmitRules:
    """What an engine's `submit` refuses, as data (checks.check_submit applies them): checked by the engine itself,
    and before sending by a caller in another process (tritonllm/engine/process.py), which needs nothing else of it."""

    vocab_size: int | None = None  # bias token ids must be below it (None: not known)
    async_batching: bool = False  # the controls asynchronous batching cannot honour are refused (check_batching)
    fixed_text: bool = False  # the synthetic benchmark engine: every control that changes tokens is refused


class BlockingGenerate:
    """`generate` for an engine with `submit` (in this process, or in one of its own: tritonllm/engine/process.py)."""

    submit_rules = SubmitRules()

    @property
    def adapters(self) -> AdapterTable:
        """The LoRA adapters requests may name: none but the llama.cpp engine's."""
        return AdapterTable()

    def add_adapter(self, adapter: Adapter, timeout: float) -> None:
        """Loads a LoRA adapter while serving (the llama.cpp engine's)."""
        raise InputError("lora_action", "this engine serves no LoRA adapters (the llama.cpp engine does: docs/lora.md)")

    def remove_adapter(self, name: str, timeout: float) -> None:
        """Unloads a LoRA adapter once no request uses it (the llama.cpp engine's)."""
        raise InputError("lora_action", "this engine serves no LoRA adapters (the llama.cpp engine does: docs/lora.md)")

    def submit(self, request: GenerationRequest, emit: Callable[[Emission], None]) -> str:
        raise NotImplementedError

    def cancel(self, request_id: str) -> None:
        raise NotImplementedError

    def steps(self) -> int | None:
        """Steps the engine has finished, a count that rises while it generates (tritonllm/engine/health.py tells a
        stuck step by it); None for an engine that cannot tell."""
        return None

    def captured_graphs(self) -> int:
        """CUDA graphs the engine holds (the engine model's gauge); none but the transformers engine's on CUDA."""
        return 0

    def relay_stop(self, request_id: str) -> bool:
        """Hands TensorRT-LLM's `stop` request for a client request id to every engine-model instance the engine
        serves, each of which ends its calls that carry it (the caller's too); False for an engine in the caller's
        process, which serves no other: the caller ends its own."""
        return False

    def reports_metrics(self) -> bool:
        """Whether the caller's engine-model instance reports the engine's metrics: of the instances an engine
        serves, one does, and the others hand it their records (`forward_records`)."""
        return True

    def forward_records(self, records: list) -> None:
        """An instance's metrics records, to the instance that reports them."""
        raise NotImplementedError("an engine that serves one instance has it report its metrics")

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


def check_engine_instances(instances: int, engine_process: bool) -> None:
    """Several engine-model instances share an engine in a process of its own; in the model's process, each would
    load one."""
    if instances > 1 and not engine_process:
        raise ConfigError(
            f"--engine-instances {instances} needs the engine in a process of its own (--engine-process): in the "
            "model's process each instance would load the engine"
        )


def ends_with(tokens: Sequence[int], suffix: Sequence[int]) -> bool:
    return len(tokens) >= len(suffix) and tuple(tokens[len(tokens) - len(suffix) :]) == tuple(suffix)


def check_request(request: GenerationRequest) -> None:
    """What an engine's `submit` refuses (InputError) rather than queues. The prompt is checked for its type
    here, where an in-process caller's mistake (a tokenizer's whole output, say) would otherwise reach the step
    loop and fail every request in it."""
    ids = request.input_ids
    if not isinstance(ids, list) or not ids:  # a tuple too: the engines join the prompt to lists of tokens
        raise InputError("input_ids", f"must be a non-empty list of token ids, got {type(ids).__name__}")
    # `type(...) is int` first: the ABC check alone took 5% of the engine model's GIL at 512 streams.
    if not all(type(token) is int or isinstance(token, numbers.Integral) for token in ids):
        raise InputError("input_ids", "must be a list of integer token ids")
    if len(request.bad_words) > MAX_WORD_SEQUENCES:
        raise InputError(
            "bad_words", f"{len(request.bad_words)} sequences, more than the limit of {MAX_WORD_SEQUENCES}"
        )
