"""The engine model's LoRA administration: requests with `lora_action` (tritonllm.protocol.LORA_ACTIONS).

`list` is open to every client, as the adapters are to requests. `load` and `unload` change what the server
serves, so they need the build's --lora-dir (off by default), which confines every `lora_path` to that folder,
and the server's admin key where it has one (the key of Triton's administrative APIs: ADMIN_KEY_ENV). A PEFT
folder is converted as the build converts it (tritonllm/engine/lora_gguf.py); the engine loads it between two
steps and unloads one once the requests using it have finished, so no request in flight fails.
"""

from __future__ import annotations

import hmac
import json
import os
import threading
from pathlib import Path

import numpy as np

from tritonllm.engine.adapters import Adapter, check_name, confined
from tritonllm.engine.api import BlockingGenerate, EngineConfig
from tritonllm.engine.lora_gguf import convert_peft, converted_dir
from tritonllm.errors import ErrorKind, InputError, error_of_kind
from tritonllm.protocol import ADMIN_KEY_ENV, LORA_ACTIONS, LORA_ADAPTERS_OUTPUT
from tritonllm.text.wire import as_text, scalar

LOAD_SECONDS = 120.0  # for the step thread to read an adapter: it does so between two steps
UNLOAD_SECONDS = 600.0  # for the requests using an adapter to finish before it is freed


def lora_action(arrays: dict[str, np.ndarray]) -> str | None:
    """The request's `lora_action`, checked; None for a request that generates."""
    value = scalar(arrays, "lora_action", 0)
    if value is None:
        return None
    action = as_text(value, "lora_action")
    if action not in LORA_ACTIONS:
        raise InputError("lora_action", f"`{action}` is not one of {', '.join(LORA_ACTIONS)}")
    return action


class AdapterAdmin:
    """Answers `lora_action` requests for one engine (on a thread of the engine model's: they may wait)."""

    def __init__(self, engine: BlockingGenerate) -> None:
        self.engine = engine
        config = getattr(engine, "config", None)
        self.config = config if isinstance(config, EngineConfig) else None
        self._key = os.environ.get(ADMIN_KEY_ENV) or None
        self._loading = threading.Lock()  # one load at a time: task ids are given in order

    def answer(self, action: str, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if action != "list":
            folder = self._allowed(arrays)
            name = check_name(self._text(arrays, "lora_name"), "lora_name")
            if action == "load":
                self._load(name, folder, arrays)
            else:
                self.engine.remove_adapter(name, UNLOAD_SECONDS)
        listing = json.dumps(self.engine.adapters.cards())
        return {LORA_ADAPTERS_OUTPUT: np.array([[listing.encode()]], dtype=object)}

    def _allowed(self, arrays: dict[str, np.ndarray]) -> str:
        """The adapter folder, when this request may change the adapters."""
        if self.config is None or not self.config.lora_dir:
            raise InputError(
                "lora_action",
                "loading and unloading adapters while serving is off: build with --lora-dir DIR, the folder they "
                "are loaded from (docs/lora.md)",
            )
        if self._key is not None:
            given = scalar(arrays, "lora_admin_key", 0)
            given = b"" if given is None else given if isinstance(given, bytes) else str(given).encode()
            if not hmac.compare_digest(given, self._key.encode()):
                raise error_of_kind(
                    ErrorKind.UNAUTHORIZED, "lora_admin_key: loading and unloading adapters needs the admin key"
                )
        return self.config.lora_dir

    def _load(self, name: str, folder: str, arrays: dict[str, np.ndarray]) -> None:
        config = self.config
        if name == Path(config.model_dir).name:
            raise InputError("lora_name", f"`{name}` is the base model's name")
        path = confined(self._text(arrays, "lora_path"), folder)
        with self._loading:
            if name in self.engine.adapters.by_name:
                raise InputError("lora_name", f"an adapter named `{name}` is loaded already")
            task_id = scalar(arrays, "lora_task_id", 0)
            task_id = self.engine.adapters.next_task_id() if task_id is None else int(task_id)
            if path.is_dir():  # a PEFT folder; its conversion is kept, redone only when the source changes
                adapter = convert_peft(name, path, Path(config.gguf_file), converted_dir(config.model_dir))
            elif path.suffix == ".gguf":
                adapter = Adapter(name, 0, str(path), str(path))
            else:
                raise InputError("lora_path", f"`{path.name}` is neither a PEFT folder nor a GGUF LoRA file")
            self.engine.add_adapter(Adapter(name, task_id, adapter.path, adapter.source), LOAD_SECONDS)

    @staticmethod
    def _text(arrays: dict[str, np.ndarray], field: str) -> str:
        value = scalar(arrays, field, 0)
        if value is None:
            raise InputError(field, "is required with lora_action load or unload")
        return as_text(value, field)
