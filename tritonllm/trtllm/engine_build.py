"""Hugging Face checkpoint -> TensorRT-LLM engine, with TensorRT-LLM 1.2.1's own Python API.

No `convert_checkpoint.py` from the TensorRT-LLM repository is needed: the model classes convert
the Hugging Face weights themselves (`from_hugging_face`, or `quantize` for the formats that need
calibration), and `tensorrt_llm.build` compiles each rank. Names and signatures are those of
release 1.2.1 (`tensorrt_llm/builder.py`, `models/modeling_utils.py`, `models/__init__.py`,
`quantization/mode.py`, `plugin/plugin.py`); `BuildConfig` is built by keyword arguments and
attribute assignment only, which both its dataclass and its pydantic form accept.

This runs inside the TensorRT-LLM image, on a GPU. Everything it asks of `tensorrt_llm` goes
through `TrtllmApi`, so the CPU tests can check every call it makes without pretending to build.
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tritonllm.errors import ConfigError
from tritonllm.options import option

# --quant choice -> (QuantAlgo member name, needs calibration data). tensorrt_llm/quantization/mode.py, 1.2.1.
QUANT_ALGOS: dict[str, tuple[str | None, bool]] = {
    "none": (None, False),
    "int8_wo": ("W8A16", False),  # weight-only INT8, per channel
    "int4_wo": ("W4A16", False),  # weight-only INT4, per channel
    "int4_awq": ("W4A16_AWQ", True),  # weight-only INT4, per group (AWQ), ModelOpt calibration
    "w4a8_awq": ("W4A8_AWQ", True),
    "fp8": ("FP8", True),  # Hopper and newer
    "int8_sq": ("W8A8_SQ_PER_CHANNEL", True),  # SmoothQuant
}
KV_CACHE_QUANT_ALGOS: dict[str, str | None] = {"none": None, "fp8": "FP8", "int8": "INT8"}
DTYPES = ("float16", "bfloat16")


class TrtllmBuildError(ConfigError):
    """An option or model this build cannot handle; says what to do."""


@dataclass(frozen=True)
class TrtllmBuildOptions:
    """The engine build's settings; fields made with `option` are build flags too (tritonllm/options.py)."""

    dtype: str = "bfloat16"
    quant: str = option("none", "weight (and activation) quantization", choices=tuple(QUANT_ALGOS))
    kv_cache_quant: str = option("none", "KV cache quantization", choices=tuple(KV_CACHE_QUANT_ALGOS))
    group_size: int = 128  # per-group quantization (AWQ)
    tp_size: int = option(1, "tensor-parallel size (GPUs per pipeline stage)", limits=(1, None), flag="--tp")
    pp_size: int = option(1, "pipeline-parallel size", limits=(1, None), flag="--pp")
    max_batch_size: int = 64
    max_input_len: int = 2048
    max_seq_len: int = 4096
    max_num_tokens: int = option(8192, "tokens per engine step", limits=(1, None))
    tokens_per_block: int = 32
    calib_dataset: str = option("cnn_dailymail", "for calibrated quantization: a dataset name or a local folder")
    calib_batches: int = 512

    def check(self) -> None:
        if self.dtype not in DTYPES:
            raise TrtllmBuildError(f"--dtype {self.dtype}: the TensorRT-LLM flavor builds {' or '.join(DTYPES)}")
        if self.quant not in QUANT_ALGOS:
            raise TrtllmBuildError(f"--quant {self.quant}: choose one of {', '.join(QUANT_ALGOS)}")
        if self.kv_cache_quant not in KV_CACHE_QUANT_ALGOS:
            raise TrtllmBuildError(
                f"--kv-cache-quant {self.kv_cache_quant}: choose one of {', '.join(KV_CACHE_QUANT_ALGOS)}"
            )
        if self.kv_cache_quant != "none" and not self.takes_modelopt:
            calibrated = ", ".join(q for q, (_, calibrates) in QUANT_ALGOS.items() if calibrates)
            raise TrtllmBuildError(
                f"--quant {self.quant} with --kv-cache-quant {self.kv_cache_quant} is not supported: TensorRT-LLM "
                f"quantizes a KV cache through ModelOpt only with --quant {calibrated} (FP8 or INT8 KV cache), or "
                "with --quant none and --kv-cache-quant fp8. Use one of those, or --kv-cache-quant none."
            )
        if self.tp_size < 1 or self.pp_size < 1:
            raise TrtllmBuildError(f"--tp {self.tp_size} --pp {self.pp_size}: both must be at least 1")
        if not 1 <= self.max_input_len < self.max_seq_len:
            raise TrtllmBuildError(
                f"--max-input-len {self.max_input_len} must be below --max-seq-len {self.max_seq_len}"
            )

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def takes_modelopt(self) -> bool:
        """Mirrors QuantConfig._requires_modelopt_quantization (models/modeling_utils.py, 1.2.1): any other
        calibrated combination falls to a model class's legacy `quantize`, which asserts or raises ValueError."""
        return QUANT_ALGOS[self.quant][1] or (self.quant == "none" and self.kv_cache_quant == "fp8")

    @property
    def needs_calibration(self) -> bool:
        return QUANT_ALGOS[self.quant][1] or self.kv_cache_quant != "none"


@dataclass
class TrtllmApi:
    """The parts of `tensorrt_llm` the build uses (1.2.1 module paths in comments)."""

    version: str
    Mapping: Any  # tensorrt_llm.mapping.Mapping, exported as tensorrt_llm.Mapping
    BuildConfig: Any  # tensorrt_llm.builder.BuildConfig, exported as tensorrt_llm.BuildConfig
    build: Any  # tensorrt_llm.builder.build, exported as tensorrt_llm.build
    QuantConfig: Any  # tensorrt_llm.models.modeling_utils.QuantConfig
    QuantAlgo: Any  # tensorrt_llm.quantization.mode.QuantAlgo, exported by tensorrt_llm.quantization
    MODEL_MAP: dict  # tensorrt_llm.models.MODEL_MAP: Hugging Face architecture -> model class

    @classmethod
    def load(cls) -> TrtllmApi:
        try:
            trt = importlib.import_module("tensorrt_llm")
        except ImportError as exc:
            raise TrtllmBuildError(
                "tensorrt_llm cannot be imported here: engines are built inside the TensorRT-LLM image "
                "(`make build ENGINE=trtllm` runs the build there)"
            ) from exc
        return cls(
            version=trt.__version__,
            Mapping=trt.Mapping,
            BuildConfig=trt.BuildConfig,
            build=trt.build,
            QuantConfig=importlib.import_module("tensorrt_llm.models.modeling_utils").QuantConfig,
            QuantAlgo=importlib.import_module("tensorrt_llm.quantization").QuantAlgo,
            MODEL_MAP=importlib.import_module("tensorrt_llm.models").MODEL_MAP,
        )


def model_class(api: TrtllmApi, hf_dir: Path):
    """The TensorRT-LLM class for the checkpoint's architecture (config.json `architectures[0]`)."""
    config = json.loads((hf_dir / "config.json").read_text())
    architecture = (config.get("architectures") or ["?"])[0]
    if architecture not in api.MODEL_MAP:
        supported = ", ".join(sorted(api.MODEL_MAP))
        raise TrtllmBuildError(
            f"{hf_dir}: architecture {architecture} has no TensorRT engine support in TensorRT-LLM {api.version} "
            f"(supported: {supported}). Serve it with ENGINE=portable."
        )
    return api.MODEL_MAP[architecture]


def quant_config(api: TrtllmApi, options: TrtllmBuildOptions):
    algo = QUANT_ALGOS[options.quant][0]
    kv_algo = KV_CACHE_QUANT_ALGOS[options.kv_cache_quant]
    return api.QuantConfig(
        quant_algo=getattr(api.QuantAlgo, algo) if algo else None,
        kv_cache_quant_algo=getattr(api.QuantAlgo, kv_algo) if kv_algo else None,
        group_size=options.group_size,
    )


def build_config(api: TrtllmApi, options: TrtllmBuildOptions, work_dir: Path):
    config = api.BuildConfig(
        max_batch_size=options.max_batch_size,
        max_input_len=options.max_input_len,
        max_seq_len=options.max_seq_len,
        max_num_tokens=options.max_num_tokens,
        max_beam_width=1,
        # build() writes its timing cache here (default "model.cache" in the working directory).
        output_timing_cache=str(work_dir / "model.cache"),
    )
    # kv_cache_type is left at its default, paged: in-flight batching needs it.
    plugins = config.plugin_config
    plugins.remove_input_padding = True
    plugins.context_fmha = True
    plugins.use_paged_context_fmha = True  # lets the runtime reuse KV blocks across requests
    plugins.tokens_per_block = options.tokens_per_block  # set: its default changed across releases
    if QUANT_ALGOS[options.quant][0] in (None, "W8A16", "W4A16"):
        plugins.gemm_plugin = "auto"  # the model dtype; quantized GEMMs choose their own kernels
    return config


def build_engine(options: TrtllmBuildOptions, hf_dir: Path, engine_dir: Path, work_dir: Path, api: TrtllmApi) -> None:
    """Build one engine per rank into `engine_dir` (config.json + rank{r}.engine)."""
    options.check()
    cls = model_class(api, hf_dir)
    qconfig = quant_config(api, options)
    engine_dir.mkdir(parents=True, exist_ok=True)
    work_dir.mkdir(parents=True, exist_ok=True)

    def mapping(rank: int):
        return api.Mapping(world_size=options.world_size, rank=rank, tp_size=options.tp_size, pp_size=options.pp_size)

    checkpoint = work_dir / "checkpoint"
    if options.needs_calibration:
        # check() let through only combinations that take ModelOpt: its calibration writes a quantized
        # TensorRT-LLM checkpoint for every rank at once.
        cls.quantize(
            str(hf_dir),
            str(checkpoint),
            dtype=options.dtype,
            mapping=mapping(0),
            quant_config=qconfig,
            calib_dataset=options.calib_dataset,
            calib_batches=options.calib_batches,
        )
    for rank in range(options.world_size):
        # build() mutates the model it compiles: load a fresh one per rank.
        if options.needs_calibration:
            model = cls.from_checkpoint(str(checkpoint), rank=rank)
        else:
            model = cls.from_hugging_face(str(hf_dir), dtype=options.dtype, mapping=mapping(rank), quant_config=qconfig)
        engine = api.build(model, build_config(api, options, work_dir))
        engine.save(str(engine_dir))
