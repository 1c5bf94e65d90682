"""Stand-in of `tensorrt_llm.executor.request` (surface.LORA_REQUEST_FIELDS): `LoRARequest`, generate_async's
lora_request, with the release's checks of its fields."""

from __future__ import annotations

import os
from dataclasses import dataclass

from tensorrt_llm.surface import LORA_CHECKPOINT_SOURCES, LORA_PATH_MUST_EXIST


@dataclass(slots=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    lora_ckpt_source: str = "hf"

    def __post_init__(self) -> None:
        if LORA_PATH_MUST_EXIST and self.lora_path is not None and not os.path.exists(self.lora_path):
            raise ValueError(f"lora_path ({self.lora_path}) does not exist.")
        if self.lora_ckpt_source not in LORA_CHECKPOINT_SOURCES:
            raise ValueError(f"lora_ckpt_source must be 'hf' or 'nemo', got '{self.lora_ckpt_source}'")
