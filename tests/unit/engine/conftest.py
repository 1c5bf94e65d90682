"""The engine the tests of a module share: the built model on the CPU, warmed up."""

import pytest

from tritonllm.engine.api import EngineConfig, GenerationRequest
from tritonllm.engine.portable import PortableEngine


@pytest.fixture(scope="module")
def engine(manifest):
    eng = PortableEngine(
        EngineConfig(
            manifest["model_dir"], dtype=manifest["dtype"], max_batch_size=8, max_seq_len=1024, kv_cache_tokens=8192
        )
    )
    eng.generate(GenerationRequest([0] * 8, 2), timeout=300)
    yield eng
    eng.shutdown()


def chat_ids(tokenizer, text: str) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )
