"""A TensorRT-LLM engine folder: what its `config.json` says, and whether this server can run it.

The format is the one `Engine.save` writes in TensorRT-LLM 1.2.1 (`tensorrt_llm/builder.py`) and
`cpp/tensorrt_llm/runtime/gptJsonConfig.cpp` reads: `{"version", "pretrained_config",
"build_config"}`, plus one `rank{r}.engine` file per tensor/pipeline-parallel rank. The Triton
values of the `tensorrt_llm` model (batch size, lengths, beam width) are read from it, never typed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tritonllm.errors import ConfigError
from tritonllm.versions import TRTLLM_IMAGE


class EngineError(ConfigError):
    """The engine folder is missing, incomplete, or from another TensorRT-LLM release; says what to do."""


REBUILD = (
    "rebuild it with `make build ENGINE=trtllm` (engines are built inside the serving image, " + TRTLLM_IMAGE + ")"
)


@dataclass(frozen=True)
class EngineInfo:
    path: Path
    version: str
    architecture: str
    dtype: str
    tp_size: int
    pp_size: int
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_beam_width: int
    max_num_tokens: int
    vocab_size: int
    quant_algo: str | None
    kv_cache_quant_algo: str | None
    tokens_per_block: int = 32  # tokens per KV cache block: PluginConfig's default

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size


def _paged(build: dict) -> bool:
    # 1.2.1 writes build_config.kv_cache_type ("PAGED"; casing after the pydantic move is unconfirmed),
    # and older engines plugin_config.paged_kv_cache. The C++ runtime assumes "continuous" when absent.
    kv_type = build.get("kv_cache_type")
    if kv_type is not None:
        return str(kv_type).lower().endswith("paged")
    return bool(build.get("plugin_config", {}).get("paged_kv_cache"))


def read_engine(engine_dir: Path) -> EngineInfo:
    config_path = engine_dir / "config.json"
    if not engine_dir.is_dir():
        raise EngineError(f"engine folder {engine_dir} does not exist: build it with `make build ENGINE=trtllm`")
    if not config_path.is_file():
        raise EngineError(f"{engine_dir} has no config.json: it is not a TensorRT-LLM engine folder; {REBUILD}")
    config = json.loads(config_path.read_text())
    if "version" not in config:
        raise EngineError(f"{config_path} has no 'version': a pre-0.8 engine, which this server cannot run; {REBUILD}")
    pretrained, build = config.get("pretrained_config", {}), config.get("build_config", {})
    mapping = pretrained.get("mapping", {})
    quant = pretrained.get("quantization") or {}
    try:
        info = EngineInfo(
            path=engine_dir,
            version=str(config["version"]),
            architecture=pretrained["architecture"],
            dtype=pretrained["dtype"],
            tp_size=int(mapping.get("tp_size", 1)),
            pp_size=int(mapping.get("pp_size", 1)),
            max_batch_size=int(build["max_batch_size"]),
            max_input_len=int(build["max_input_len"]),
            max_seq_len=int(build["max_seq_len"]),
            max_beam_width=int(build.get("max_beam_width", 1)),
            max_num_tokens=int(build.get("max_num_tokens") or 0),
            vocab_size=int(pretrained["vocab_size"]),
            quant_algo=quant.get("quant_algo"),
            kv_cache_quant_algo=quant.get("kv_cache_quant_algo"),
            tokens_per_block=int(build.get("plugin_config", {}).get("tokens_per_block") or 32),
        )
    except KeyError as exc:
        raise EngineError(f"{config_path} lacks {exc.args[0]!r}; {REBUILD}") from None
    missing = [f"rank{r}.engine" for r in range(info.world_size) if not (engine_dir / f"rank{r}.engine").is_file()]
    if missing:
        raise EngineError(f"{engine_dir} lacks {', '.join(missing)} (tp {info.tp_size} x pp {info.pp_size}); {REBUILD}")
    if not _paged(build):
        raise EngineError(f"{engine_dir} was built without a paged KV cache, which in-flight batching needs; {REBUILD}")
    return info


def check_version(info: EngineInfo, running: str) -> None:
    """Refuse an engine from another release before the server tries (and fails obscurely) to load it."""
    if info.version != running:
        raise EngineError(
            f"engine {info.path} was built by TensorRT-LLM {info.version}, but this server runs TensorRT-LLM "
            f"{running}. An engine only loads under the release that built it: {REBUILD}."
        )


def check_batch_size(info: EngineInfo, triton_max_batch_size: int) -> None:
    if triton_max_batch_size > info.max_batch_size:
        raise EngineError(
            f"--max-batch-size {triton_max_batch_size} is larger than the engine's max_batch_size "
            f"{info.max_batch_size} ({info.path}/config.json): lower it, or rebuild the engine with a larger one"
        )


def decoding_mode(max_beam_width: int) -> str:
    """The tensorrtllm backend's `decoding_mode` for an engine: what the executor picks when it is unset, stated.

    Unset, ModelInstanceState::getExecutorConfigFromParams warns that it is "invalid or not specified" and leaves it
    to the executor (triton_backend/inflight_batcher_llm/src/model_instance_state.cc, NVIDIA/TensorRT-LLM 0c8de69,
    1.2.0rc8), which decides by its operating beam width, not the engine's: it runs requests of one beam width at a
    time (Executor::Impl::getLeaderNewReqWithIds dequeues only those of the operating width while any is active,
    cpp/tensorrt_llm/executor/executorImpl.cpp), switches the width when none is (verifyRequests -> changeBeamWidth
    -> createDecoder), and getDecodingMode turns beam_search into top_k_top_p at width 1
    (cpp/tensorrt_llm/batch_manager/trtGptModelInflightBatching.cpp; both read at b35ac1b, 1.2.0rc2). So
    `beam_search` samples for beam_width 1 and searches beams above it; `top_k_top_p` would set up a sampling
    decoder for beam_width > 1 requests.
    """
    return "top_k_top_p" if max_beam_width == 1 else "beam_search"


def beam_width_warning(info: EngineInfo) -> str | None:
    """What an engine built with max_beam_width > 1 (built elsewhere: this project builds 1) costs at serve time."""
    if info.max_beam_width == 1:
        return None
    return (
        f"engine {info.path} was built with max_beam_width {info.max_beam_width}: the executor runs requests of one "
        "beam width at a time (sampling for beam_width 1, beam search above), so a request whose beam_width differs "
        "from those running waits until they have all finished. Unless clients need beam search, serve an engine "
        "built with max_beam_width 1 (`make build ENGINE=trtllm` builds one)."
    )
