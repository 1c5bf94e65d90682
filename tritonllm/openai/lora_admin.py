"""The OpenAI layer's LoRA adapters: the models it serves beside the base one (vLLM's convention: an adapter's name is
a `model`), and vLLM's routes that load and unload one while serving.

Where the build allows loading while serving (--lora-dir), the engine model is the one record of what is loaded:
each of the layer's workers asks it (`lora_action` list) when a request names a model it does not know, and at
most every FRESH_SECONDS otherwise, so an adapter one worker loaded is served by all. Elsewhere the build's
adapters are all there will be. Loading and unloading go to the engine model too, with the admin key: the layer
checks the client's header and the engine checks the key again (Triton's own clients reach it without the layer).
"""

from __future__ import annotations

import json
import secrets
import time

import tritonclient.grpc as grpcclient
import tritonclient.grpc.aio as grpcaio

from tritonllm.errors import ErrorKind
from tritonllm.openai.errors import triton_error
from tritonllm.openai.models import APIError
from tritonllm.openai.settings import Settings
from tritonllm.protocol import ADMIN_HEADER, LORA_ADAPTERS_OUTPUT, infer_inputs, lora_admin_tensors

FRESH_SECONDS = 2.0  # how old a worker's list may be before a request refreshes it


class ServedAdapters:
    """The adapters one worker serves, as last read from the engine model."""

    def __init__(self, settings: Settings, engine_model: str | None) -> None:
        self.settings = settings
        self.names: tuple[str, ...] = settings.adapters
        self._engine_model = engine_model if settings.lora_admin else None  # None: the build's list is all
        self._read_at = 0.0

    def of(self, model: str) -> str | None:
        """The adapter a request's `model` names: "" for the base model, None for a model not served."""
        if model == self.settings.model_name:
            return ""
        return model if model in self.names else None

    async def check(self, client: grpcaio.InferenceServerClient, model: str) -> str | None:
        """`of(model)`, with the list read again first when it is stale or does not know `model`."""
        stale = model not in self.names or time.monotonic() - self._read_at > FRESH_SECONDS
        if self._engine_model is not None and model != self.settings.model_name and stale:
            await self.refresh(client)
        return self.of(model)

    async def refresh(self, client: grpcaio.InferenceServerClient) -> None:
        if self._engine_model is not None:
            await self._ask(client, lora_admin_tensors("list"))

    async def change(
        self, client: grpcaio.InferenceServerClient, action: str, name: str, path: str, admin_key: str | None
    ) -> None:
        """vLLM's load (`lora_path`) or unload of an adapter, by a client that sent `admin_key` in ADMIN_HEADER."""
        if self._engine_model is None:
            raise APIError(
                ErrorKind.INVALID_INPUT,
                "loading and unloading adapters while serving is off: build with --lora-dir DIR (docs/lora.md)",
                param="lora_name",
            )
        key = self.settings.admin_key
        if key is not None and not secrets.compare_digest((admin_key or "").encode(), key.encode()):
            raise APIError(ErrorKind.UNAUTHORIZED, f"loading and unloading adapters needs header {ADMIN_HEADER}")
        if action == "load" and name == self.settings.model_name:
            raise APIError(ErrorKind.INVALID_INPUT, f"`{name}` is the base model's name", param="lora_name")
        await self._ask(client, lora_admin_tensors(action, name, path, admin_key=key))

    async def _ask(self, client: grpcaio.InferenceServerClient, tensors) -> None:
        """One lora_action request to the engine model (decoupled: a stream of its one response); the list it
        answers with becomes this worker's."""

        async def requests():
            yield {
                "model_name": self._engine_model,
                "inputs": infer_inputs(grpcclient, tensors),
                "outputs": [grpcclient.InferRequestedOutput(LORA_ADAPTERS_OUTPUT)],
            }

        listing = None
        async for result, error in client.stream_infer(requests()):  # to its end: the call completes itself
            if error is not None:
                raise triton_error(error)
            listing = result.as_numpy(LORA_ADAPTERS_OUTPUT)
        if listing is None:
            raise APIError(ErrorKind.INTERNAL, "the engine model answered a lora_action without the adapters")
        self.names = tuple(card["name"] for card in json.loads(listing.reshape(-1)[0]))
        self._read_at = time.monotonic()
