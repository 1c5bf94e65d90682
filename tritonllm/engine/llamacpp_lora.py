"""The llama.cpp engine's LoRA adapters: the ones requests may name, the one set on the context, and the changes
asked for while serving, which the step thread makes between steps.

llama.cpp applies adapters to a whole context (`llama_set_adapters_lora`), so the engine sets one per decode
(tritonllm/engine/llamacpp.py). An adapter loaded while serving is read by the step thread, between two steps:
llama.cpp's loader is not known to be safe beside a decode of the same model. One unloaded is taken out of the
table at once, so no new request can choose it, and freed once no request uses it: requests already running with
it finish as they would have.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from concurrent.futures import Future

from tritonllm.engine.adapters import BASE, Adapter, AdapterTable
from tritonllm.errors import EngineFailure


class LlamaLoras:
    """The adapters of one llama.cpp model and context; `sweep` runs on the step thread."""

    def __init__(self, llama, model, ctx, lock: threading.RLock) -> None:
        self._llama, self._model, self._ctx = llama, model, ctx
        self._lock = lock  # the engine's: submit checks a request's adapter under it
        self.table = AdapterTable()
        self._pointers: dict[str, object] = {}  # name -> llama_adapter_lora pointer
        self._active = BASE  # the adapter set on the context
        self._loads: list[tuple[Adapter, Future]] = []
        self._retired: dict[str, Future] = {}  # out of the table, freed once no request uses them

    def load_now(self, adapter: Adapter) -> None:
        """Loads a GGUF LoRA (at start, or on the step thread); InputError when its name or task id is taken."""
        with self._lock:
            self.table.add(adapter)  # checked before the file is read
        pointer = self._llama.llama_adapter_lora_init(self._model, adapter.path.encode())
        if not pointer:
            with self._lock:
                self.table.remove(adapter.name)
            raise EngineFailure(f"llama.cpp could not load the LoRA adapter {adapter.path} for this model")
        self._pointers[adapter.name] = pointer

    def load(self, adapter: Adapter) -> Future:
        """Asks the step thread to load `adapter`; the future is done once requests may name it."""
        done: Future = Future()
        with self._lock:
            self._loads.append((adapter, done))
        return done

    def unload(self, name: str) -> Future:
        """Takes `name` out of the table now (new requests naming it are refused); the future is done once it is
        freed, after the last request using it finished. InputError naming lora_name for an unknown one."""
        with self._lock:
            self.table.remove(name)
            done = self._retired[name] = Future()
        return done

    def use(self, name: str) -> None:
        """Sets `name`'s adapter (BASE: none) on the context for the next decode."""
        if name == self._active:
            return
        llama = self._llama
        if name == BASE:
            code = llama.llama_set_adapters_lora(self._ctx, None, 0, None)
        else:
            adapters = (llama.llama_adapter_lora_p_ctypes * 1)(self._pointers[name])
            code = llama.llama_set_adapters_lora(self._ctx, adapters, 1, (ctypes.c_float * 1)(1.0))
        if code != 0:
            raise EngineFailure(f"llama_set_adapters_lora returned {code} for adapter `{name or 'base'}`")
        self._active = name

    @property
    def active(self) -> str:
        return self._active

    def pending(self) -> bool:
        return bool(self._loads or self._retired)

    def sweep(self, in_use: Callable[[], set[str]], forget_kept: Callable[[str], None]) -> None:
        """On the step thread, between steps: loads what was asked for, and frees each unloaded adapter no request
        uses any more (`in_use`, read under the engine's lock), its kept cells first (`forget_kept`)."""
        with self._lock:
            loads, self._loads = self._loads, []
        for adapter, done in loads:
            try:
                self.load_now(adapter)
            except Exception as exc:
                done.set_exception(exc)
            else:
                done.set_result(None)
        if not self._retired:
            return
        with self._lock:
            used = in_use()
            free = [name for name in self._retired if name not in used]
        for name in free:
            forget_kept(name)
            if self._active == name:
                self.use(BASE)
            self._llama.llama_adapter_lora_free(self._pointers.pop(name))
            self._retired.pop(name).set_result(None)

    def fail_pending(self, error: str) -> None:
        """The engine stopped: what was asked for and not done fails with `error`."""
        with self._lock:
            waiting = [done for _, done in self._loads] + list(self._retired.values())
            self._loads, self._retired = [], {}
        for done in waiting:
            if not done.done():
                done.set_exception(EngineFailure(error))
