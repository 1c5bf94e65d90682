"""`build_engines.py`: model -> served folder -> rendered, checked model repository + manifest."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from tritonllm.model_source import ModelSourceError, resolve_model
from tritonllm.repository import RepositoryError, write_repository

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class BuildPlan:
    """Everything the repository is rendered from, derived from the model and the options."""

    engine: str
    model_dir: str
    device: str
    dtype: str
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    vocab_size: int
    kv_cache_tokens: int
    max_batch_tokens: int

    def template_values(self) -> dict[str, str]:
        return {
            "triton_max_batch_size": str(self.max_batch_size),
            "max_queue_delay_microseconds": "0",
            "preprocessing_instance_count": "2",
            "postprocessing_instance_count": "2",
            "tokenizer_dir": self.model_dir,
            "add_special_tokens": "true",
            "skip_special_tokens": "true",
            "model_dir": self.model_dir,
            "dtype": self.dtype,
            "max_input_len": str(self.max_input_len),
            "max_seq_len": str(self.max_seq_len),
            "vocab_size": str(self.vocab_size),
            "kv_cache_tokens": str(self.kv_cache_tokens),
            "max_batch_tokens": str(self.max_batch_tokens),
            "engine_instance_kind": "KIND_GPU" if self.device == "cuda" else "KIND_CPU",
            "max_inflight_requests": str(8 * self.max_batch_size),
        }


def kv_bytes_per_token(text_config, dtype: str) -> int:
    heads = text_config.num_attention_heads
    kv_heads = getattr(text_config, "num_key_value_heads", None) or heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return 2 * text_config.num_hidden_layers * kv_heads * head_dim * DTYPE_BYTES[dtype]


def plan_build(model_dir: Path, args: argparse.Namespace) -> BuildPlan:
    import torch
    from transformers import AutoConfig

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: PyTorch sees no CUDA GPU here. Use --device cpu (or auto).")
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")

    text_config = AutoConfig.from_pretrained(model_dir).get_text_config()
    model_max = getattr(text_config, "max_position_embeddings", None) or args.max_seq_len
    max_seq_len = min(args.max_seq_len, model_max)
    max_input_len = args.max_input_len or max_seq_len * 3 // 4
    if not 1 <= max_input_len < max_seq_len:
        raise SystemExit(
            f"--max-input-len {max_input_len} must be at least 1 and below the max sequence length {max_seq_len} "
            f"(the smaller of --max-seq-len and the model's {model_max} positions)"
        )
    if args.max_batch_size < 1:
        raise SystemExit(f"--max-batch-size must be at least 1, got {args.max_batch_size}")
    budget = int(args.kv_cache_gib * 2**30) // kv_bytes_per_token(text_config, dtype)
    kv_cache_tokens = min(budget, args.max_batch_size * max_seq_len)
    if kv_cache_tokens < max_seq_len:
        raise SystemExit(
            f"--kv-cache-gib {args.kv_cache_gib} holds {budget} tokens, fewer than one full sequence "
            f"({max_seq_len}); raise it or lower --max-seq-len"
        )
    return BuildPlan(
        engine=args.engine,
        model_dir=str(model_dir),
        device=device,
        dtype=dtype,
        max_batch_size=args.max_batch_size,
        max_input_len=max_input_len,
        max_seq_len=max_seq_len,
        vocab_size=text_config.vocab_size,
        kv_cache_tokens=kv_cache_tokens,
        max_batch_tokens=args.max_batch_tokens,
    )


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("torch", "transformers", "nvidia-pytriton", "tritonclient"):
        with contextlib.suppress(PackageNotFoundError):
            found[package] = version(package)
    return found


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--engine",
        choices=["portable", "trtllm"],
        default="portable",
        help="portable: Hugging Face model on PyTorch (CPU or CUDA); trtllm: TensorRT-LLM engine",
    )
    parser.add_argument(
        "--model", default="", help="Hugging Face folder or .gguf file (default: packaged SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--build-dir", type=Path, default=Path("build"))
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--dtype", choices=["auto", *DTYPE_BYTES], default="auto")
    parser.add_argument("--max-batch-size", type=int, default=16, help="requests generating at once")
    parser.add_argument("--max-seq-len", type=int, default=4096, help="prompt + generated tokens (capped by the model)")
    parser.add_argument("--max-input-len", type=int, default=0, help="prompt tokens (default: 3/4 of max-seq-len)")
    parser.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per engine step (prefill chunk)")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0, help="memory for the KV cache")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.engine == "trtllm":
        print(
            "build_engines.py: --engine trtllm is not available yet; this version serves --engine portable.",
            file=sys.stderr,
        )
        return 2
    build_dir = args.build_dir.resolve()
    try:
        model_dir = resolve_model(args.model or None, build_dir)
        plan = plan_build(model_dir, args)
        models = write_repository(plan.template_values(), build_dir / "model_repository")
    except (ModelSourceError, RepositoryError) as exc:
        print(f"build_engines.py: {exc}", file=sys.stderr)
        return 2
    manifest = {
        **asdict(plan),
        "tokenizer_dir": plan.model_dir,
        "model_source": args.model or "default",
        "models": models,
        "versions": versions(),
    }
    (build_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(
        f"Rendered {build_dir / 'model_repository'} ({', '.join(models)}) for {plan.engine} on {plan.device}, "
        f"{plan.dtype}, max batch {plan.max_batch_size}, max input {plan.max_input_len}, "
        f"max sequence {plan.max_seq_len} tokens."
    )
    return 0
