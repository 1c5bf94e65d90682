"""Stand-in of `tensorrt_llm.lora_helper` (surface.LORA_CONFIG_FIELDS): `LoraConfig`, the LLM's lora_config."""

from __future__ import annotations

from dataclasses import dataclass, field

from tensorrt_llm.surface import LORA_CHECKPOINT_SOURCES


@dataclass
class LoraConfig:
    lora_dir: list[str] = field(default_factory=list)
    lora_ckpt_source: str = "hf"
    max_lora_rank: int = 64
    lora_target_modules: list[str] = field(default_factory=list)
    trtllm_modules_to_hf_modules: dict[str, str] = field(default_factory=dict)
    max_loras: int | None = None
    max_cpu_loras: int | None = None
    swap_gate_up_proj: bool = True

    def __post_init__(self) -> None:
        if self.lora_ckpt_source not in LORA_CHECKPOINT_SOURCES:
            raise ValueError(f"lora_ckpt_source must be one of {LORA_CHECKPOINT_SOURCES}, got {self.lora_ckpt_source}")
