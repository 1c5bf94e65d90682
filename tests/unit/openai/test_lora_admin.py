"""The OpenAI layer's adapters: read from the engine model where adapters load while serving (a request for a model
the worker does not know reads the list again first), the build's list elsewhere; changes need the admin key."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from tritonllm.errors import ErrorKind
from tritonllm.openai.lora_admin import ServedAdapters
from tritonllm.openai.models import APIError
from tritonllm.openai.settings import Settings
from tritonllm.protocol import LORA_ADAPTERS_OUTPUT


class Result:
    def __init__(self, cards: list[dict]) -> None:
        self.cards = cards

    def as_numpy(self, name: str):
        assert name == LORA_ADAPTERS_OUTPUT
        return np.array([[json.dumps(self.cards).encode()]], dtype=object)


class EngineModel:
    """A gRPC client whose engine model holds `cards`, recording each lora_action it is sent."""

    def __init__(self, cards: list[dict]) -> None:
        self.cards, self.actions = cards, []

    async def stream_infer(self, requests):
        async for request in requests:
            inputs = {tensor.name(): tensor for tensor in request["inputs"]}
            self.actions.append((request["model_name"], sorted(inputs)))
            yield Result(self.cards), None


def settings(**others) -> Settings:
    return Settings("127.0.0.1:8001", "/models/base", "base", 64, 128, **others)


def test_a_model_the_worker_does_not_know_is_read_again_from_the_engine():
    client = EngineModel([{"name": "sql", "task_id": 1}])
    served = ServedAdapters(settings(lora_admin=True), "tensorrt_llm_decoupled")
    assert asyncio.run(served.check(client, "base")) == "" and client.actions == []  # the base model: no question
    assert asyncio.run(served.check(client, "sql")) == "sql"
    assert client.actions[0][0] == "tensorrt_llm_decoupled" and "lora_action" in client.actions[0][1]
    asyncio.run(served.check(client, "sql"))  # known and fresh: not asked again
    assert len(client.actions) == 1
    client.cards = []  # unloaded through another worker
    assert asyncio.run(served.check(client, "chat")) is None and served.names == ()


def test_without_an_adapter_folder_the_build_s_list_is_all():
    client = EngineModel([{"name": "late", "task_id": 2}])
    served = ServedAdapters(settings(adapters=("sql",)), "tensorrt_llm_decoupled")
    assert asyncio.run(served.check(client, "late")) is None and asyncio.run(served.check(client, "sql")) == "sql"
    assert client.actions == []
    with pytest.raises(APIError, match="--lora-dir") as refused:
        asyncio.run(served.change(client, "load", "late", "late", None))
    assert refused.value.kind is ErrorKind.INVALID_INPUT


@pytest.mark.parametrize("given", [None, "", "wrong"])
def test_changes_need_the_admin_key(given):
    client = EngineModel([])
    served = ServedAdapters(settings(lora_admin=True, admin_key="key"), "tensorrt_llm_decoupled")
    with pytest.raises(APIError, match="tritonllm-admin-key") as refused:
        asyncio.run(served.change(client, "unload", "sql", "", given))
    assert refused.value.kind is ErrorKind.UNAUTHORIZED and client.actions == []
    asyncio.run(served.change(client, "unload", "sql", "", "key"))
    assert "lora_admin_key" in client.actions[0][1]


def test_the_base_model_s_name_is_not_an_adapter_s():
    served = ServedAdapters(settings(lora_admin=True), "tensorrt_llm_decoupled")
    with pytest.raises(APIError, match="base model"):
        asyncio.run(served.change(EngineModel([]), "load", "base", "x", None))
