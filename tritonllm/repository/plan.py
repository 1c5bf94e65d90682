"""The build's plan: what the repository is rendered from, derived from the model (or engine) and the options, with
the limits each flavor checks before anything is written."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tritonllm.engine.adapters import Adapter, AdapterTable
from tritonllm.engine.api import GGUF_AS_IS, LLAMACPP, EngineConfig, check_engine_instances
from tritonllm.engine.llmapi_config import KV_CACHE_DTYPES, LLM_API_CONFIG_FILE, LlmApiConfig, llm_api_adapter
from tritonllm.engine.lora_gguf import convert_peft, converted_dir, parse_lora
from tritonllm.engine.synthetic import PASSAGE, SYNTHETIC_CONFIG_FILE, SyntheticConfig
from tritonllm.errors import ConfigError, InputError
from tritonllm.options import carrier_count, option_fields
from tritonllm.protocol import engine_model
from tritonllm.repository.model_source import retype_gguf
from tritonllm.text.tokenization import GUIDES_BY_ENGINE, GUIDES_COMPILED, GUIDES_OFF

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
ENGINE_FOLDER = "tensorrt_llm"  # the engine's template folder: `files` under it go to the engine model's folder
# Python-backend threads per model instance, at most: beyond it, the ensemble's requests wait for a thread in the
# bridge (tensorrt_llm_bls and the engine model are not bounded by it: their BLS calls stream).
MAX_BACKEND_THREADS = 512
LLM_API = "trtllm-llmapi"  # --engine: TensorRT-LLM's LLM API (PyTorch backend) in the portable engine's model
DEFAULT_ADMITTED = 128  # running + waiting requests admitted by default (TGI's default max_concurrent_requests)


class BuildError(ConfigError):
    """An option that cannot work; says which and what to do."""


def text_instances(cores: int) -> int:
    """Instances of preprocessing, postprocessing, tensorrt_llm_bls and the bridge: one per four cores of the build
    host, at least one and at most eight. Each is a process with its own GIL: preprocessing and postprocessing run one
    batch at a time, and one tensorrt_llm_bls process, GIL-bound, carried ~35,000 streamed tokens/s on the
    H200 host's cores (docs/performance.md). Each also holds the tokenizer (~130 MiB): a small host, whose engine
    makes a few hundred tokens a second, gets one of each."""
    return max(1, min(8, cores // 4))


@dataclass(frozen=True)
class BuildPlan:
    """Everything the repository is rendered from, derived from the model (or engine) and the options."""

    engine: str
    model_dir: str  # the Hugging Face folder: tokenizer (and, for the portable engine, weights)
    dtype: str
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    vocab_size: int
    max_queue_size: int = 0  # requests that may wait for a batch slot (0: the default, queue_size)
    max_beam_width: int = 1  # the portable engine generates one beam; a TensorRT-LLM engine's is built in
    kv_cache_block_tokens: int = 1  # kv_cache_reused_blocks' unit: one token in the portable engine
    tokenizer_class: str = ""  # the class AutoTokenizer picks for model_dir (tritonllm/text/tokenizer.py)
    decoupled_mode: bool = False  # NVIDIA's decoupled deployment (tritonllm.repository.render.model_names)
    engine_values: dict[str, str] = field(default_factory=dict)  # the flavor's own template values
    engine_config: EngineConfig | None = None  # the portable engine's, written beside it as engine.json
    details: dict = field(default_factory=dict)  # what else the manifest records (the TensorRT-LLM engine's)
    files: dict[str, str] = field(default_factory=dict)  # path in the repository -> text, written with it
    text_instances: int = field(default_factory=lambda: text_instances(os.cpu_count() or 2))
    bls_instances: int = field(default_factory=lambda: carrier_count(os.cpu_count() or 2))  # every streamed token

    @property
    def queue_size(self) -> int:
        """--max-queue-size, or by default as many as the batch, and at least enough that DEFAULT_ADMITTED requests
        are admitted. A queue only as long as the batch answered 429 to most of a load of 32 streams at once when
        some clients dropped theirs: a dropped stream keeps its seat until its cancellation reaches the engine (a
        few tenths of a second), and every request arriving meanwhile was refused at once."""
        return self.max_queue_size or max(self.max_batch_size, DEFAULT_ADMITTED - self.max_batch_size)

    @property
    def guided_decoding(self) -> str:
        """Who checks a guide before generation (preprocessing's parameter: tritonllm.text.tokenization): TensorRT-LLM
        compiles guides in its batch step, the engine flavor's and the LLM API's alike."""
        if self.engine == LLM_API:
            return GUIDES_COMPILED
        if self.engine != "trtllm":
            return GUIDES_BY_ENGINE
        return GUIDES_COMPILED if self.details.get("guided_decoding", True) else GUIDES_OFF

    @property
    def postprocessing_instances(self) -> int:
        """One in the decoupled deployment: there the ensemble's outputs come from two steps, the engine's
        (batch_index, log probs, counts) and postprocessing's (text_output), and Triton pairs them into responses
        in the order each step produces them; with two instances, one engine response's text can be finished after
        the next one's, and a row's text then comes with another row's batch_index (or a streamed token's text with
        the next token's log probs)."""
        return 1 if self.decoupled_mode else self.text_instances

    @property
    def engine_instances(self) -> int:
        """Instances of the engine model (--engine-instances, checked by check_engine_instances): more than one only
        with the engine in a process of its own, which they share (tritonllm/engine/process.py), each a response
        sender with its own interpreter lock; 0 asks for as many as of the text models there, else one."""
        config = self.engine_config
        if config is not None:
            asked, own_process = config.engine_instances, config.engine_process
        else:
            asked, own_process = self.details.get("engine_instances", 1), self.details.get("engine_process", False)
        return asked or (self.text_instances if own_process else 1)

    @property
    def engine_model(self) -> str:
        """The engine's model, which streams: tensorrt_llm_decoupled, or tensorrt_llm in the decoupled deployment."""
        return engine_model(self.decoupled_mode)

    def server_options(self) -> list[str]:
        """Server options this repository needs; the manifest records them and every launcher passes them.

        Triton's Python backend serves each model instance's BLS calls and response sends from a
        pool of threads (32 unless set), and a decoupled BLS call holds a thread until the callee's
        first response: for tensorrt_llm_bridge that is the whole answer, so 32 threads would cap
        the ensemble's requests in flight at 32. The pool gets one thread per request the engine
        admits (running and waiting) on top of the default 32, up to MAX_BACKEND_THREADS: every
        Python-backend instance gets such a pool in the server process, and at 1,024 admitted requests
        seven instances held 14,600 threads.
        """
        threads = min(self.max_batch_size + self.queue_size + 32, MAX_BACKEND_THREADS)
        return [f"--backend-config=python,thread-pool-size={threads}"]

    def template_values(self) -> dict[str, str]:
        counts = {} if self.decoupled_mode else {"bridge_instance_count": str(self.text_instances)}  # rendered?
        if self.engine != "trtllm":  # the Python engine model's template (NVIDIA's backend's has its own)
            counts["engine_instance_count"] = str(self.engine_instances)
        return counts | {
            "triton_max_batch_size": str(self.max_batch_size),
            "max_queue_delay_microseconds": "0",
            "preprocessing_instance_count": str(self.text_instances),
            "postprocessing_instance_count": str(self.postprocessing_instances),
            "bls_instance_count": str(self.bls_instances),
            "tokenizer_dir": self.model_dir,
            "tokenizer_class": self.tokenizer_class,
            "add_special_tokens": "true",
            "skip_special_tokens": "true",
            "max_input_len": str(self.max_input_len),
            "max_seq_len": str(self.max_seq_len),
            "vocab_size": str(self.vocab_size),
            "max_beam_width": str(self.max_beam_width),
            # A text model's requests at once, each on a thread, past which it answers busy (backend/admission.py):
            # enough that one instance can fill the engine's batch and queue, whose own limit then answers first.
            "max_inflight_requests": str(max(8 * self.max_batch_size, self.max_batch_size + self.queue_size)),
            "max_queue_size": str(self.queue_size),
            "engine_model": self.engine_model,
            "guided_decoding": self.guided_decoding,
            **self.engine_values,
        }


def engine_options() -> list[dataclasses.Field]:
    """EngineConfig's fields that are build options."""
    return option_fields(EngineConfig)


def kv_bytes_per_token(text_config, dtype: str) -> int:
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return 2 * text_config.num_hidden_layers * kv_heads * head_dim * DTYPE_BYTES[dtype]


def input_len(args: argparse.Namespace, max_seq_len: int, what: str) -> int:
    """--max-input-len, by default 3/4 of the sequence; BuildError unless it leaves room to generate."""
    max_input_len = args.max_input_len or max_seq_len * 3 // 4
    if not 1 <= max_input_len < max_seq_len:
        raise BuildError(f"--max-input-len {max_input_len} must be at least 1 and below {what}")
    return max_input_len


def model_lengths(model_dir: Path, args: argparse.Namespace):
    """The Hugging Face model's text config, and the sequence and input lengths: --max-seq-len capped by the model's
    positions, --max-input-len (input_len)."""
    from transformers import AutoConfig

    text_config = AutoConfig.from_pretrained(model_dir).get_text_config()
    model_max = getattr(text_config, "max_position_embeddings", None) or args.max_seq_len
    max_seq_len = min(args.max_seq_len, model_max)
    max_input_len = input_len(
        args,
        max_seq_len,
        f"the max sequence length {max_seq_len} (the smaller of --max-seq-len and the model's {model_max} positions)",
    )
    return text_config, max_seq_len, max_input_len


def plan_portable(model_dir: Path, gguf: Path | None, args: argparse.Namespace) -> BuildPlan:
    text_config, max_seq_len, max_input_len = model_lengths(model_dir, args)
    max_batch_size = args.max_batch_size or 16
    if max_batch_size < 1:
        raise BuildError(f"--max-batch-size must be at least 1, got {max_batch_size}")
    options = {f.name: getattr(args, f.name) for f in engine_options()}
    try:
        config = EngineConfig(
            str(model_dir),
            gguf_file=str(gguf or ""),
            dtype=args.dtype,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            **options,
        ).resolve()
    except ConfigError as exc:
        raise BuildError(str(exc)) from None
    if config.impl == LLAMACPP and config.dtype != GGUF_AS_IS:
        config = dataclasses.replace(config, gguf_file=str(retype_gguf(gguf, config.dtype, model_dir.parent)))
    if args.lora:
        config = dataclasses.replace(config, lora_adapters=lora_adapters(args.lora, config, model_dir))
    if config.lora_dir:
        folder = Path(config.lora_dir).expanduser().resolve()
        if not folder.is_dir():
            raise BuildError(f"--lora-dir {config.lora_dir}: no such folder (the adapters to load while serving)")
        config = dataclasses.replace(config, lora_dir=str(folder))
    # llama.cpp keeps its KV cache in float16.
    kv_dtype = "float16" if config.impl == LLAMACPP else config.dtype
    budget = int(args.kv_cache_gib * 2**30) // kv_bytes_per_token(text_config, kv_dtype)
    kv_cache_tokens = min(budget, max_batch_size * max_seq_len)
    if kv_cache_tokens < max_seq_len:
        raise BuildError(
            f"--kv-cache-gib {args.kv_cache_gib} holds {budget} tokens, fewer than one full sequence "
            f"({max_seq_len}); raise it or lower --max-seq-len"
        )
    return BuildPlan(
        engine="portable",
        model_dir=str(model_dir),
        dtype=config.dtype,
        max_batch_size=max_batch_size,
        max_input_len=max_input_len,
        max_seq_len=max_seq_len,
        vocab_size=text_config.vocab_size,
        max_queue_size=args.max_queue_size,
        engine_values={"engine_instance_kind": "KIND_GPU" if config.device == "cuda" else "KIND_CPU"},
        engine_config=dataclasses.replace(config, kv_cache_tokens=kv_cache_tokens),
    )


def lora_adapters(specs: list[str], config: EngineConfig, model_dir: Path) -> list[dict]:
    """--lora NAME=PATH, each PEFT folder converted for the llama.cpp engine, with task ids 1, 2, ... in order."""
    if config.impl != LLAMACPP:
        raise BuildError(
            f"--lora: adapters are served by the llama.cpp engine (a GGUF model); this build runs {config.impl}"
        )
    table = AdapterTable()
    for task_id, spec in enumerate(specs, start=1):
        name, folder = parse_lora(spec)
        if name == model_dir.name:
            raise BuildError(f"--lora {spec}: `{name}` is the base model's name")
        adapter = convert_peft(name, folder, Path(config.gguf_file), converted_dir(model_dir))
        try:
            table.add(dataclasses.replace(adapter, task_id=task_id))
        except InputError as exc:
            raise BuildError(f"--lora {spec}: {exc}") from None
    return [adapter.as_json() for adapter in table.by_name.values()]


def plan_synthetic(model_dir: Path, args: argparse.Namespace) -> BuildPlan:
    """The benchmark engine: the model's tokenizer and vocabulary, no weights (tritonllm/engine/synthetic.py)."""
    from transformers import AutoConfig, AutoTokenizer

    max_input_len = input_len(args, args.max_seq_len, f"--max-seq-len {args.max_seq_len}")
    # It stands for the portable engine on CUDA, and takes its defaults: the step loop in a process of its own.
    engine_process = args.engine_process is not False
    check_engine_instances(args.engine_instances, engine_process)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = SyntheticConfig(
        text_ids=tuple(tokenizer(PASSAGE, add_special_tokens=False)["input_ids"]),
        max_batch_size=args.max_batch_size or 16,
        engine_process=engine_process,  # the portable engine's option: where its step loop runs
        **{f.name: getattr(args, f.name) for f in option_fields(SyntheticConfig)},
    )
    return BuildPlan(
        engine="synthetic",
        model_dir=str(model_dir),
        dtype="none",
        max_batch_size=config.max_batch_size,
        max_input_len=max_input_len,
        max_seq_len=args.max_seq_len,
        vocab_size=AutoConfig.from_pretrained(model_dir).get_text_config().vocab_size,
        max_queue_size=args.max_queue_size,
        engine_values={"engine_instance_kind": "KIND_CPU"},
        details={
            "step_ms": config.step_ms,
            "engine_process": config.engine_process,
            "engine_instances": args.engine_instances,
        },
        files={f"{ENGINE_FOLDER}/1/{SYNTHETIC_CONFIG_FILE}": json.dumps(asdict(config)) + "\n"},
    )


def plan_trtllm(model_dir: Path, engine_dir: Path, args: argparse.Namespace) -> BuildPlan:
    """Triton values from the engine's own config.json (and the tokenizer folder)."""
    from tritonllm.trtllm.engine_dir import beam_width_warning, check_batch_size, decoding_mode, read_engine
    from tritonllm.trtllm.guided_decoding import (
        GUIDED_DECODING_OFF,
        TOKENIZER_INFO_IN_REPOSITORY,
        GuidedDecodingError,
        GuidedDecodingUnavailable,
        guided_decoding_values,
        tokenizer_info_json,
    )

    if not any(model_dir.glob("tokenizer*")):
        raise BuildError(
            f"tokenizer folder {model_dir} has no tokenizer files: the pre/postprocessing models need them"
        )
    info = read_engine(engine_dir)
    max_batch_size = args.max_batch_size or info.max_batch_size
    check_batch_size(info, max_batch_size)
    if not 0 < args.kv_cache_free_gpu_mem_fraction <= 1:
        raise BuildError(
            f"--kv-cache-free-gpu-mem-fraction must be in (0, 1], got {args.kv_cache_free_gpu_mem_fraction}"
        )
    if warning := beam_width_warning(info):
        print(f"build_engines.py: warning: {warning}", file=sys.stderr, flush=True)
    repository = Path(getattr(args, "build_dir", "build")) / "model_repository"
    try:  # the C++ backend's grammar engine reads the tokenizer from a file the build writes
        files = {TOKENIZER_INFO_IN_REPOSITORY: tokenizer_info_json(model_dir, info.vocab_size)}
        guides = guided_decoding_values(repository / engine_model(args.decoupled_mode))
    except GuidedDecodingUnavailable as exc:
        print(
            f"build_engines.py: warning: guided decoding is off for this model: {exc}; requests with "
            "guided_decoding_guide_type will be refused (the manifest records guided_decoding: false)",
            file=sys.stderr,
            flush=True,
        )
        files, guides = {}, GUIDED_DECODING_OFF
    except GuidedDecodingError as exc:
        raise BuildError(f"guided decoding: {exc}") from None
    return BuildPlan(
        engine="trtllm",
        model_dir=str(model_dir),
        dtype=info.dtype,
        max_batch_size=max_batch_size,
        max_input_len=info.max_input_len,
        max_seq_len=info.max_seq_len,
        vocab_size=info.vocab_size,
        max_queue_size=getattr(args, "max_queue_size", 0),
        max_beam_width=info.max_beam_width,
        kv_cache_block_tokens=info.tokens_per_block,
        engine_values={
            "engine_dir": str(engine_dir),
            "kv_cache_free_gpu_mem_fraction": str(args.kv_cache_free_gpu_mem_fraction),
            "enable_kv_cache_reuse": "true",
            "decoding_mode": decoding_mode(info.max_beam_width),
            **guides,
        },
        details={
            "engine_dir": str(engine_dir),
            "trtllm_version": info.version,
            "tp_size": info.tp_size,
            "pp_size": info.pp_size,
            "quant_algo": info.quant_algo,
            "kv_cache_quant_algo": info.kv_cache_quant_algo,
            "engine_max_batch_size": info.max_batch_size,
            "guided_decoding": bool(files),
        },
        files=files,
    )


def plan_llm_api(model_dir: Path, args: argparse.Namespace) -> BuildPlan:
    """TensorRT-LLM's LLM API (PyTorch backend): no engine build; the engine model loads the checkpoint itself, with
    the LLM arguments the build writes (tritonllm/engine/llmapi_config.py)."""
    if args.quant != "none":
        raise BuildError(
            f"--quant {args.quant}: the LLM API flavor quantizes nothing itself; serve a checkpoint quantized "
            "beforehand (ModelOpt's FP8/NVFP4 Hugging Face exports load as they are), with --quant none"
        )
    if args.kv_cache_quant not in KV_CACHE_DTYPES:
        raise BuildError(
            f"--kv-cache-quant {args.kv_cache_quant}: the LLM API flavor takes {', '.join(KV_CACHE_DTYPES)}"
        )
    text_config, max_seq_len, max_input_len = model_lengths(model_dir, args)
    config = LlmApiConfig(
        str(model_dir),
        tensor_parallel_size=args.tp_size,
        pipeline_parallel_size=args.pp_size,
        max_batch_size=args.max_batch_size or 64,
        max_num_tokens=args.max_num_tokens,
        max_seq_len=max_seq_len,
        dtype=args.dtype,
        free_gpu_memory_fraction=args.kv_cache_free_gpu_mem_fraction,
        kv_cache_dtype=KV_CACHE_DTYPES[args.kv_cache_quant],
        lora_adapters=llm_api_adapters(getattr(args, "lora", None) or [], model_dir),
        **{f.name: getattr(args, f.name) for f in option_fields(LlmApiConfig)},
    )
    try:
        config.check(max_input_len)
    except ConfigError as exc:
        raise BuildError(str(exc)) from None
    return BuildPlan(
        engine=LLM_API,
        model_dir=str(model_dir),
        dtype=config.dtype,
        max_batch_size=config.max_batch_size,
        max_input_len=max_input_len,
        max_seq_len=max_seq_len,
        vocab_size=text_config.vocab_size,
        max_queue_size=args.max_queue_size,
        # The engine model counts KV cache blocks in tokens (tritonllm/link/engine_io.py perf_outputs), the LLM
        # API's reused blocks turned into the tokens they hold: kv_cache_block_tokens stays 1.
        # One instance: the LLM places its ranks on the GPUs itself (NVIDIA's llmapi model is KIND_CPU, count 1).
        engine_values={"engine_instance_kind": "KIND_CPU"},
        details={
            "tp_size": config.tensor_parallel_size,
            "pp_size": config.pipeline_parallel_size,
            "llm_api_release": config.llm_api_release,
        },
        files={f"{ENGINE_FOLDER}/1/{LLM_API_CONFIG_FILE}": json.dumps(config.engine_settings(), indent=2) + "\n"},
    )


def llm_api_adapters(specs: list[str], model_dir: Path) -> tuple:
    """--lora NAME=PATH for the LLM API flavor: each PEFT folder as it is (TensorRT-LLM loads it), with task ids
    1, 2, ... in order."""
    table, adapters = AdapterTable(), []
    for task_id, spec in enumerate(specs, start=1):
        try:
            name, folder = parse_lora(spec)
            if name == model_dir.name:
                raise BuildError(f"--lora {spec}: `{name}` is the base model's name")
            adapter = llm_api_adapter(name, folder, task_id)
            table.add(Adapter(adapter.name, adapter.task_id, adapter.path, adapter.path))
        except InputError as exc:
            raise BuildError(f"--lora {spec}: {exc}") from None
        except ConfigError as exc:
            raise BuildError(str(exc)) from None
        adapters.append(adapter)
    return tuple(adapters)


def trtllm_options(args: argparse.Namespace):
    from tritonllm.trtllm.engine_build import TrtllmBuildOptions

    return TrtllmBuildOptions(
        dtype="bfloat16" if args.dtype == "auto" else args.dtype,
        max_batch_size=args.max_batch_size or 64,
        max_input_len=args.max_input_len or args.max_seq_len // 2,
        max_seq_len=args.max_seq_len,
        **{f.name: getattr(args, f.name) for f in option_fields(TrtllmBuildOptions)},
    )


def engine_name(plan: BuildPlan) -> str:
    """The engine, as the build's summary names it: the portable one says what runs the model, and on what."""
    config = plan.engine_config
    if config is None:
        return plan.engine
    if config.impl == LLAMACPP:
        return f"portable (llama.cpp, {Path(config.gguf_file).name})"
    return f"portable (transformers, {config.device})"
