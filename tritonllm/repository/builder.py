"""`build_engines.py`: model -> engine -> rendered, checked model repository + build/manifest.json.

--engine portable   the Hugging Face folder is the engine (PyTorch, CPU or CUDA)
--engine trtllm     a TensorRT-LLM engine, built inside NVIDIA's image (on a GPU host with Docker)
--engine trtllm-llmapi  TensorRT-LLM's LLM API (PyTorch backend) on the Hugging Face folder, no engine build
--engine synthetic  a benchmark instrument: fixed text at --step-ms per step, for measuring the pipeline
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from tritonllm.engine.api import ENGINE_CONFIG_FILE, GGUF_AS_IS, EngineConfig
from tritonllm.engine.llmapi_config import LlmApiConfig
from tritonllm.engine.synthetic import SyntheticConfig
from tritonllm.options import add_options, option_fields
from tritonllm.repository.model_source import ModelSourceError, gguf_source, resolve_model
from tritonllm.repository.plan import (
    DEFAULT_ADMITTED,
    DTYPE_BYTES,
    ENGINE_FOLDER,
    LLM_API,
    BuildError,
    engine_name,
    plan_llm_api,
    plan_portable,
    plan_synthetic,
    plan_trtllm,
    trtllm_options,
)
from tritonllm.repository.render import RepositoryError, templates_digest, write_repository
from tritonllm.text.tokenizer import resolved_class


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


def build_parser() -> argparse.ArgumentParser:
    from tritonllm.trtllm.engine_build import TrtllmBuildOptions

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--engine",
        choices=["portable", "trtllm", LLM_API, "synthetic"],
        default="portable",
        help="the engine flavor behind the ensemble: portable, trtllm (TensorRT engines) or trtllm-llmapi "
        "(TensorRT-LLM's LLM API, PyTorch backend); synthetic: a benchmark instrument (docs/performance.md)",
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
    parser.add_argument(
        "--text-instances",
        type=int,
        default=0,
        help="instances of preprocessing, postprocessing, tensorrt_llm_bls and the bridge, each a process with its "
        "own interpreter lock and tokenizer (default: one per four cores of the build host, 1 to 8; tensorrt_llm_bls, "
        "which carries every streamed token, one per two cores)",
    )
    parser.add_argument("--max-seq-len", type=int, default=4096, help="prompt + generated tokens (capped by the model)")
    parser.add_argument(
        "--max-input-len", type=int, default=0, help="prompt tokens (default: portable 3/4, trtllm 1/2 of max-seq-len)"
    )
    portable = parser.add_argument_group("portable engine")
    add_options(portable, EngineConfig)
    portable.add_argument("--kv-cache-gib", type=float, default=1.0, help="memory for the KV cache")
    portable.add_argument(
        "--lora",
        action="append",
        metavar="NAME=PATH",
        help="a LoRA adapter (a PEFT folder) requests choose by NAME (OpenAI `model`, `lora_name`) or by its task id "
        "(`lora_task_id`: 1, 2, ... in the order given); repeat for more; llama.cpp engine, and --engine "
        "trtllm-llmapi (docs/lora.md)",
    )
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
    llm_api = parser.add_argument_group(
        "TensorRT-LLM LLM API (also takes --tp, --pp, --max-num-tokens, --kv-cache-quant and "
        "--kv-cache-free-gpu-mem-fraction)"
    )
    add_options(llm_api, LlmApiConfig)
    trt.add_argument("--engine-dir", type=Path, help="serve this existing engine folder instead of building one")
    trt.add_argument("--engine-only", action="store_true", help=argparse.SUPPRESS)  # the in-image half of a build
    return parser


def flavor_options() -> dict[str, set[str]]:
    """The options each --engine reads beyond those every one does (model, lengths, batch, queue, deployment)."""
    from tritonllm.trtllm.engine_build import TrtllmBuildOptions

    def names(cls) -> set[str]:
        return {f.name for f in option_fields(cls)}

    fraction = "kv_cache_free_gpu_mem_fraction"
    return {
        "portable": names(EngineConfig) | {"kv_cache_gib", "lora"},
        "synthetic": names(SyntheticConfig) | {"engine_process", "engine_instances"},
        "trtllm": names(TrtllmBuildOptions) | {fraction, "engine_dir", "engine_only"},
        LLM_API: names(LlmApiConfig)
        | {"tp_size", "pp_size", "max_num_tokens", "kv_cache_quant", "quant", fraction, "lora"},
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The build's arguments; another engine's option, given, is an error naming it (it would be ignored)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    by_flavor = flavor_options()
    own = by_flavor[args.engine]
    flags = {action.dest: action.option_strings[0] for action in parser._actions if action.option_strings}
    for dest in sorted(set().union(*by_flavor.values()) - own):
        if getattr(args, dest) != parser.get_default(dest):
            owners = ", ".join(flavor for flavor, dests in by_flavor.items() if dest in dests)
            parser.error(f"{flags[dest]} is an option of --engine {owners}; this build is --engine {args.engine}")
    return args


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
        elif args.engine == LLM_API:
            plan = plan_llm_api(model_dir, args)
        else:
            engine_dir = (args.engine_dir or default_engine_dir(build_dir, model_dir, args)).resolve()
            if args.engine_dir is None:
                build_trtllm_engine(model_dir, engine_dir, build_dir, args, argv)
            if args.engine_only:
                return 0
            plan = plan_trtllm(model_dir, engine_dir, args)
        if args.text_instances < 0:
            raise BuildError(f"--text-instances {args.text_instances}: at least 1 (0: one per four cores)")
        plan = dataclasses.replace(
            plan,
            tokenizer_class=tokenizer_class(plan.model_dir),
            decoupled_mode=args.decoupled_mode,
            text_instances=args.text_instances or plan.text_instances,
            bls_instances=args.text_instances or plan.bls_instances,
        )
        files = dict(plan.files)
        if plan.engine_config is not None:
            files[f"{ENGINE_FOLDER}/1/{ENGINE_CONFIG_FILE}"] = json.dumps(asdict(plan.engine_config), indent=2) + "\n"
        flavor = "trtllm" if plan.engine == "trtllm" else "portable"  # the same Python-backend models, another engine
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
