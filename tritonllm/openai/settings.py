"""The OpenAI layer's settings: what it serves and where, defined once, and read from a build's manifest once.

Light on purpose (no web framework): the launchers build them too.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tritonllm.protocol import STREAMING_MODEL


@dataclass(frozen=True)
class Settings:
    """Where the Triton server is, what the layer serves, and the build's limits and engine."""

    grpc_url: str
    tokenizer_dir: str
    model_name: str
    max_input_len: int
    max_seq_len: int
    api_key: str | None = None
    triton_model: str = STREAMING_MODEL
    kv_cache_block_tokens: int = 1  # the unit of the engine's kv_cache_reused_blocks
    # The engine takes the portable engine's additions (num_top_log_probs, openai_penalties); the TensorRT-LLM
    # flavor's returns no top log probabilities and applies its own rule to presence and frequency (docs/api.md).
    engine_additions: bool = True
    tokenizer_class: str = ""  # the build's record of it (tritonllm/text/tokenizer.py); empty: AutoTokenizer picks
    # The built repository, for the direct path to the engine model (openai/engine_stream.py); empty: every choice
    # goes through tensorrt_llm_bls (the TensorRT-LLM flavor's engine model does not stream in its default deployment).
    repository: str = ""
    adapters: tuple[str, ...] = ()  # the build's LoRA adapters' names, each a `model` of its own (vLLM's convention)
    lora_admin: bool = False  # adapters may be loaded and unloaded while serving (--lora-dir): lora_admin.py
    admin_key: str | None = None  # what loading and unloading them needs, in header ADMIN_HEADER (None: open)

    @classmethod
    def from_manifest(cls, manifest: dict, grpc_url: str, repository: str = "", **others) -> Settings:
        """The settings of a build (its manifest.json: the tokenizer, the limits, the engine), the one reading of it
        for the layer and its launchers; `repository`: the built one, unused by the TensorRT-LLM flavor."""
        trtllm = manifest.get("engine") == "trtllm"
        others["model_name"] = others.get("model_name") or Path(manifest["tokenizer_dir"]).name
        engine = manifest.get("engine_config") or {}
        return cls(
            grpc_url,
            manifest["tokenizer_dir"],
            max_input_len=manifest["max_input_len"],
            max_seq_len=manifest["max_seq_len"],
            kv_cache_block_tokens=manifest.get("kv_cache_block_tokens", 1),
            engine_additions=not trtllm,
            tokenizer_class=manifest.get("tokenizer_class", ""),
            repository="" if trtllm else repository,
            adapters=tuple(a["name"] for a in engine.get("lora_adapters", ())),
            lora_admin=bool(engine.get("lora_dir")),
            **others,
        )
