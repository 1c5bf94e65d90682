"""The engine the tests of a module share: the built model on the CPU, warmed up."""

import threading

import pytest

from tritonllm.engine.api import Emission, EngineConfig, GenerationRequest
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


def submitted(engine, request: GenerationRequest) -> tuple[threading.Event, list[Emission]]:
    """Submits `request`: its emissions as they come, and an event set at its final one."""
    done, emissions = threading.Event(), []

    def emit(emission: Emission) -> None:
        emissions.append(emission)
        if emission.final:
            done.set()

    engine.submit(request, emit)
    return done, emissions


def emissions_of(engine, request: GenerationRequest, timeout: float) -> list[Emission]:
    """Every emission of `request`, once its final one came within `timeout` seconds."""
    done, emissions = submitted(engine, request)
    assert done.wait(timeout), "no final emission"
    return emissions
