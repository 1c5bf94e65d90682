"""Unit: a build's manifest read once into the OpenAI layer's settings, by the layer and by its launchers alike."""

from __future__ import annotations

import pytest

from tritonllm.launch.tritonserver import OpenAIFrontend
from tritonllm.openai.lora_admin import ServedAdapters
from tritonllm.openai.settings import Settings

PORTABLE = {
    "engine": "portable",
    "tokenizer_dir": "/models/SmolLM2-135M-Instruct",
    "max_input_len": 1536,
    "max_seq_len": 2048,
    "tokenizer_class": "GPT2TokenizerFast",
}


def test_a_portable_build_streams_from_its_repository_with_the_engines_additions():
    settings = Settings.from_manifest(PORTABLE, "127.0.0.1:8001", "/build/model_repository")
    assert (settings.tokenizer_dir, settings.max_input_len, settings.max_seq_len) == (
        "/models/SmolLM2-135M-Instruct",
        1536,
        2048,
    )
    assert settings.model_name == "SmolLM2-135M-Instruct" and settings.tokenizer_class == "GPT2TokenizerFast"
    assert settings.engine_additions and settings.repository == "/build/model_repository"
    assert settings.kv_cache_block_tokens == 1 and settings.api_key is None


def test_a_tensorrt_llm_build_goes_through_bls_without_the_additions():
    manifest = dict(PORTABLE, engine="trtllm", kv_cache_block_tokens=32)
    settings = Settings.from_manifest(manifest, "127.0.0.1:8001", "/build/model_repository", model_name="served")
    assert not settings.engine_additions and settings.repository == ""
    assert settings.kv_cache_block_tokens == 32 and settings.model_name == "served"


@pytest.mark.parametrize("engine", ["portable", "trtllm", "trtllm-llmapi"])
def test_the_launcher_starts_the_layer_with_the_settings_the_layer_would_read(engine):
    manifest = dict(PORTABLE, engine=engine)
    settings = Settings.from_manifest(manifest, "127.0.0.1:8001", "/build/model_repository")
    frontend = OpenAIFrontend.for_build("127.0.0.1:8001", manifest, 9000, repository="/build/model_repository")
    assert (frontend.tokenizer_dir, frontend.max_input_len, frontend.max_seq_len) == (
        settings.tokenizer_dir,
        settings.max_input_len,
        settings.max_seq_len,
    )
    assert (frontend.repository, frontend.trtllm, frontend.tokenizer_class, frontend.kv_cache_block_tokens) == (
        settings.repository,
        not settings.engine_additions,
        settings.tokenizer_class,
        settings.kv_cache_block_tokens,
    )


@pytest.mark.parametrize(
    ("engine_config", "adapters", "lora_admin"),
    [
        (None, (), False),
        ({}, (), False),
        ({"lora_adapters": [{"name": "sql", "task_id": 1, "path": "sql.gguf"}]}, ("sql",), False),
        ({"lora_adapters": [], "lora_dir": "/srv/adapters"}, (), True),
    ],
    ids=["trtllm-flavors", "no-adapters", "one-adapter", "adapter-folder"],
)
def test_the_build_s_adapters_are_models_of_their_own(engine_config, adapters, lora_admin):
    """A TensorRT-LLM build records no engine_config (None); a portable one lists its LoRA adapters in it, and
    whether adapters load while serving (--lora-dir)."""
    settings = Settings.from_manifest(dict(PORTABLE, engine_config=engine_config), "127.0.0.1:8001")
    assert (settings.adapters, settings.lora_admin) == (adapters, lora_admin)
    frontend = OpenAIFrontend.for_build("127.0.0.1:8001", dict(PORTABLE, engine_config=engine_config), 9000)
    assert (frontend.adapters, frontend.lora_admin) == (adapters, lora_admin)
    served = ServedAdapters(settings, "tensorrt_llm_decoupled")
    assert served.of(settings.model_name) == "" and served.of("unknown") is None
    assert all(served.of(name) == name for name in adapters)
