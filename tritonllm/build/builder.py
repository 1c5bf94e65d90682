"""`build_engines.py`: model -> engine -> rendered, checked model repository + build/manifest.json.

--engine portable   the Hugging Face folder is the engine (PyTorch, CPU or CUDA)
--engine trtllm     a TensorRT-LLM engine, built inside NVIDIA's image (on a GPU host with Docker)
--engine synthetic  a benchmark instrument: fixed text at --step-ms per step, for measuring the pipeline
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tritonllm.build.model_source import ModelSourceError, gguf_source, resolve_model, retype_gguf
from tritonllm.build.repository import RepositoryError, templates_digest, write_repository
from tritonllm.engine.api import ENGINE_CONFIG_FILE, GGUF_AS_IS, LLAMACPP, EngineConfig
from tritonllm.engine.synthetic import PASSAGE, SYNTHETIC_CONFIG_FILE, SyntheticConfig
from tritonllm.errors import ConfigError
from tritonllm.options import add_options, option_fields
from tritonllm.protocol import engine_model
from tritonllm.text.tokenization import GUIDES_BY_ENGINE, GUIDES_COMPILED, GUIDES_OFF
from tritonllm.text.tokenizer import resolved_class

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
ENGINE_FOLDER = "tensorrt_llm"  # the engine's template folder: `files` under it go to the engine model's folder
# Python-backend threads per model instance, at most: beyond it, the ensemble's requests wait for a thread in the
# bridge (tensorrt_llm_bls and the engine model are not bounded by it: their BLS calls stream).
MAX_BACKEND_THREADS = 512
DEFAULT_ADMITTED = 128  # running + waiting requests admitted by default (TGI's default max_concurrent_requests)


class BuildError(ConfigError):
    """An option that cannot work; says which and what to do."""


def text_instances(cores: int) -> int:
    """Instances of preprocessing, postprocessing and tensorrt_llm_bls: one per four cores of the build host, at
    least two and at most eight. Each is a process with its own GIL: preprocessing and postprocessing run one
    batch at a time, and one tensorrt_llm_bls process, GIL-bound, carried ~35,000 streamed tokens/s on the
    H200 host's cores (docs/performance.md)."""
    return max(2, min(8, cores // 4))


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
    decoupled_mode: bool = False  # NVIDIA's decoupled deployment (tritonllm.build.repository.model_names)
    engine_values: dict[str, str] = field(default_factory=dict)  # the flavor's own template values
    engine_config: EngineConfig | None = None  # the portable engine's, written beside it as engine.json
    details: dict = field(default_factory=dict)  # what else the manifest records (the TensorRT-LLM engine's)
    files: dict[str, str] = field(default_factory=dict)  # path in the repository -> text, written with it
    text_instances: int = field(default_factory=lambda: text_instances(os.cpu_count() or 2))

    @property
    def queue_size(self) -> int:
        """--max-queue-size, or by default as many as the batch, and at least enough that DEFAULT_ADMITTED requests
        are admitted. A queue only as long as the batch answered 429 to most of a load of 32 streams at once when
        some clients dropped theirs: a dropped stream keeps its seat until its cancellation reaches the engine (a
        few tenths of a second), and every request arriving meanwhile was refused at once."""
        return self.max_queue_size or max(self.max_batch_size, DEFAULT_ADMITTED - self.max_batch_size)

    @property
    def guided_decoding(self) -> str:
        """Who checks a guide before generation (preprocessing's parameter: tritonllm.text.tokenization)."""
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
        return {
            "triton_max_batch_size": str(self.max_batch_size),
            "max_queue_delay_microseconds": "0",
            "preprocessing_instance_count": str(self.text_instances),
            "postprocessing_instance_count": str(self.postprocessing_instances),
            "bls_instance_count": str(self.text_instances),
            "tokenizer_dir": self.model_dir,
            "tokenizer_class": self.tokenizer_class,
            "add_special_tokens": "true",
            "skip_special_tokens": "true",
            "max_input_len": str(self.max_input_len),
            "max_seq_len": str(self.max_seq_len),
            "vocab_size": str(self.vocab_size),
            "max_beam_width": str(self.max_beam_width),
            "max_inflight_requests": str(8 * self.max_batch_size),
            "max_queue_size": str(self.queue_size),
            "engine_model": self.engine_model,
            "guided_decoding": self.guided_decoding,
            **self.engine_values,
        }


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


def plan_portable(model_dir: Path, gguf: Path | None, args: argparse.Namespace) -> BuildPlan:
    from transformers import AutoConfig

    text_config = AutoConfig.from_pretrained(model_dir).get_text_config()
    model_max = getattr(text_config, "max_position_embeddings", None) or args.max_seq_len
    max_seq_len = min(args.max_seq_len, model_max)
    max_input_len = input_len(
        args,
        max_seq_len,
        f"the max sequence length {max_seq_len} (the smaller of --max-seq-len and the model's {model_max} positions)",
    )
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


def plan_synthetic(model_dir: Path, args: argparse.Namespace) -> BuildPlan:
    """The benchmark engine: the model's tokenizer and vocabulary, no weights (tritonllm/engine/synthetic.py)."""
    from transformers import AutoConfig, AutoTokenizer

    max_input_len = input_len(args, args.max_seq_len, f"--max-seq-len {args.max_seq_len}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = SyntheticConfig(
        text_ids=tuple(tokenizer(PASSAGE, add_special_tokens=False)["input_ids"]),
        max_batch_size=args.max_batch_size or 16,
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
        details={"step_ms": config.step_ms},
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


def trtllm_options(args: argparse.Namespace):
    from tritonllm.trtllm.engine_build import TrtllmBuildOptions

    return TrtllmBuildOptions(
        dtype="bfloat16" if args.dtype == "auto" else args.dtype,
        max_batch_size=args.max_batch_size or 64,
        max_input_len=args.max_input_len or args.max_seq_len // 2,
        max_seq_len=args.max_seq_len,
        **{f.name: getattr(args, f.name) for f in option_fields(TrtllmBuildOptions)},
    )


def default_engine_dir(build_dir: Path, model_dir: Path, args: argparse.Namespace) -> Path:
    options = trtllm_options(args)
    parallel = f"tp{options.tp_size}pp{options.pp_size}"
    name = f"{model_dir.name}-{options.dtype}-{options.quant}-kv{options.kv_cache_quant}-{parallel}"
    return build_dir / "engines" / name


def build_trtllm_engine(model_dir: Path, engine_dir: Path, build_dir: Path, args: argparse.Namespace, argv) -> None:
    """Build the engine here when tensorrt_llm is importable (inside the image), else in the image."""
    from tritonllm.trtllm import docker
    from tritonllm.trtllm.engine_build import TrtllmApi, build_engine
    from tritonllm.versions import TRTLLM_VERSION

    options = trtllm_options(args)
    options.check()
    try:
        api = TrtllmApi.load()
    except Exception:
        api = None
    if api is not None:
        if api.version != TRTLLM_VERSION:
            raise BuildError(
                f"this image has TensorRT-LLM {api.version}; the project pins {TRTLLM_VERSION} "
                f"(tritonllm/versions.py): build in {docker.IMAGE_TAG} (`make build ENGINE=trtllm`)"
            )
        build_engine(options, model_dir, engine_dir, build_dir / "trtllm-work", api)
        return
    problems = docker.host_problems(gpus_needed=1)
    if problems:
        raise BuildError("\n  ".join(["the TensorRT-LLM engine cannot be built here:", *problems]))
    # The build, model and engine folders at their own paths: the engine built in the image must land where this
    # build (and the configs it renders) will look for it, also outside the project.
    folders = [build_dir.resolve(), model_dir.resolve(), engine_dir.resolve()]
    command = docker.docker_run(
        docker.IMAGE_TAG, Path.cwd(), ["python3", "build_engines.py", *argv, "--engine-only"], folders=folders
    )
    print("Building the engine inside", docker.IMAGE_TAG, "...", flush=True)
    if subprocess.run(command).returncode != 0:
        raise BuildError(f"the engine build in {docker.IMAGE_TAG} failed (its output is above)")


def engine_name(plan: BuildPlan) -> str:
    """The engine, as the build's summary names it: the portable one says what runs the model, and on what."""
    config = plan.engine_config
    if config is None:
        return plan.engine
    if config.impl == LLAMACPP:
        return f"portable (llama.cpp, {Path(config.gguf_file).name})"
    return f"portable (transformers, {config.device})"


def tokenizer_class(model_dir: str) -> str:
    """The tokenizer class AutoTokenizer picks for the model, recorded for the serving processes to load directly."""
    from transformers import AutoTokenizer

    return resolved_class(AutoTokenizer.from_pretrained(model_dir))


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("torch", "transformers", "nvidia-pytriton", "tritonclient", "tensorrt_llm"):
        with contextlib.suppress(PackageNotFoundError):
            found[package] = version(package)
    return found


def engine_options() -> list[dataclasses.Field]:
    """EngineConfig's fields that are build options."""
    return option_fields(EngineConfig)


def build_parser() -> argparse.ArgumentParser:
    from tritonllm.trtllm.engine_build import TrtllmBuildOptions

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--engine",
        choices=["portable", "trtllm", "synthetic"],
        default="portable",
        help="the engine flavor behind the ensemble; synthetic: a benchmark instrument (docs/performance.md)",
    )
    parser.add_argument(
        "--model",
        default="",
        help="Hugging Face folder or hub id, or a .gguf file (default: the packaged SmolLM2-135M-Instruct)",
    )
    parser.add_argument(
        "--build-dir", type=Path, default=Path("build"), help="where the repository, models and manifest go"
    )
    parser.add_argument(
        "--dtype",
        choices=["auto", *DTYPE_BYTES, GGUF_AS_IS],
        default="auto",
        help="weights and activations; auto: bfloat16 on GPUs, float32 on the CPU; gguf: the GGUF file's own "
        "(quantized) types, llama.cpp engine only",
    )
    parser.add_argument(
        "--max-batch-size",
        type=int,
        default=0,
        help="requests generating at once (default: portable 16; trtllm 64, or the engine's)",
    )
    parser.add_argument(
        "--max-queue-size",
        type=int,
        default=0,
        help="requests that may wait for a batch slot before new ones are refused as busy (default: as many as "
        f"--max-batch-size, and at least enough that {DEFAULT_ADMITTED} requests are admitted)",
    )
    parser.add_argument(
        "--decoupled-mode",
        action="store_true",
        help="NVIDIA's decoupled deployment: tensorrt_llm is the engine itself and streams, and the ensemble streams "
        "over gRPC (no HTTP /infer); default: tensorrt_llm and the ensemble answer request/response (HTTP /infer, "
        "gRPC ModelInfer) and tensorrt_llm_bls streams",
    )
    parser.add_argument("--max-seq-len", type=int, default=4096, help="prompt + generated tokens (capped by the model)")
    parser.add_argument(
        "--max-input-len", type=int, default=0, help="prompt tokens (default: portable 3/4, trtllm 1/2 of max-seq-len)"
    )
    portable = parser.add_argument_group("portable engine")
    add_options(portable, EngineConfig)
    portable.add_argument("--kv-cache-gib", type=float, default=1.0, help="memory for the KV cache")
    synthetic = parser.add_argument_group("synthetic benchmark engine (an instrument, not for serving)")
    add_options(synthetic, SyntheticConfig)
    trt = parser.add_argument_group("TensorRT-LLM engine")
    add_options(trt, TrtllmBuildOptions)
    trt.add_argument(
        "--kv-cache-free-gpu-mem-fraction",
        type=float,
        default=0.85,
        help="share of the GPU memory left after loading the engine that the KV cache may take",
    )
    trt.add_argument("--engine-dir", type=Path, help="serve this existing engine folder instead of building one")
    trt.add_argument("--engine-only", action="store_true", help=argparse.SUPPRESS)  # the in-image half of a build
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    build_dir = args.build_dir.resolve()
    try:
        model_dir = resolve_model(args.model or None, build_dir)
        if args.engine == "portable":
            plan = plan_portable(model_dir, gguf_source(args.model or None), args)
        elif args.engine == "synthetic":
            plan = plan_synthetic(model_dir, args)
        else:
            engine_dir = (args.engine_dir or default_engine_dir(build_dir, model_dir, args)).resolve()
            if args.engine_dir is None:
                build_trtllm_engine(model_dir, engine_dir, build_dir, args, argv)
            if args.engine_only:
                return 0
            plan = plan_trtllm(model_dir, engine_dir, args)
        plan = dataclasses.replace(
            plan, tokenizer_class=tokenizer_class(plan.model_dir), decoupled_mode=args.decoupled_mode
        )
        files = dict(plan.files)
        if plan.engine_config is not None:
            files[f"{ENGINE_FOLDER}/1/{ENGINE_CONFIG_FILE}"] = json.dumps(asdict(plan.engine_config), indent=2) + "\n"
        flavor = "portable" if plan.engine == "synthetic" else plan.engine  # the same models, another engine
        models = write_repository(
            plan.template_values(),
            build_dir / "model_repository",
            flavor=flavor,
            files={path.replace(ENGINE_FOLDER, plan.engine_model, 1): text for path, text in files.items()},
            decoupled_mode=plan.decoupled_mode,
        )
    except (ModelSourceError, RepositoryError, BuildError, ValueError) as exc:
        print(f"build_engines.py: {exc}", file=sys.stderr)
        return 2
    manifest = {
        **{k: v for k, v in asdict(plan).items() if k not in ("engine_values", "details", "files")},
        **plan.details,
        "tokenizer_dir": plan.model_dir,
        "engine_model": plan.engine_model,
        "server_options": plan.server_options(),
        "model_source": args.model or "default",
        "models": models,
        "templates": templates_digest(),
        "versions": versions(),
    }
    (build_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(
        f"Rendered {build_dir / 'model_repository'} ({', '.join(models)}) for the {engine_name(plan)} engine, "
        f"{plan.dtype}, max batch {plan.max_batch_size}, max input {plan.max_input_len}, "
        f"max sequence {plan.max_seq_len} tokens."
    )
    return 0
