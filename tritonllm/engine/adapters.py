"""LoRA adapters by name: the ones a server has, and the rule by which a request chooses one.

Every front reaches the engine model with the same two inputs (NVIDIA's `lora_task_id`, and the addition
`lora_name`); the OpenAI layer sends its `model` as `lora_name`. `choose` is the one reading of them: an adapter
neither names is the base model, an unknown one is the client's mistake, named. Each adapter gets the task id
the build gives it, so NVIDIA's clients, which send task ids, reach the same adapters.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from tritonllm.errors import InputError

BASE = ""  # GenerationRequest.adapter of a request for the base model
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # what `model` may be: no path, no separator


@dataclass(frozen=True)
class Adapter:
    name: str
    task_id: int  # NVIDIA's lora_task_id for it
    path: str  # the GGUF LoRA file the llama.cpp engine loads
    source: str = ""  # the PEFT folder it was converted from

    def as_json(self) -> dict:
        return asdict(self)


def check_name(name: str, field: str) -> str:
    """`name` if it can name an adapter (letters, digits, `.`, `_`, `-`; 64 at most); InputError naming `field`."""
    if not NAME.fullmatch(name):
        raise InputError(
            field, f"`{name}` is not an adapter name: 1 to 64 letters, digits, '.', '_' or '-', not starting with '.'"
        )
    return name


def confined(path: str, folder: str) -> Path:
    """`path` (relative to `folder`, or absolute) resolved, links followed, if it lies inside `folder`: the one
    place adapters may be loaded from while serving (the build's --lora-dir). InputError naming lora_path else."""
    root = Path(folder).resolve()
    target = (root / path).resolve()
    if not path or not target.is_relative_to(root) or target == root:
        raise InputError("lora_path", f"`{path}` is not inside the adapter folder {root} (--lora-dir)")
    if not target.exists():
        raise InputError("lora_path", f"`{path}` does not exist in the adapter folder {root}")
    return target


class AdapterTable:
    """The adapters a server has, by name and by task id."""

    def __init__(self, adapters: Iterable[Adapter] = ()) -> None:
        self.by_name: dict[str, Adapter] = {}
        self.by_task: dict[int, Adapter] = {}
        for adapter in adapters:
            self.add(adapter)

    def add(self, adapter: Adapter) -> None:
        check_name(adapter.name, "lora_name")
        if adapter.name in self.by_name:
            raise InputError("lora_name", f"an adapter named `{adapter.name}` is loaded already")
        if adapter.task_id in self.by_task:
            raise InputError("lora_task_id", f"task id {adapter.task_id} is `{self.by_task[adapter.task_id].name}`'s")
        self.by_name[adapter.name] = self.by_task[adapter.task_id] = adapter

    def remove(self, name: str) -> Adapter:
        """Takes `name` out: requests can no longer choose it. InputError naming lora_name if there is none."""
        adapter = self.by_name.pop(name, None)
        if adapter is None:
            raise InputError("lora_name", f"no adapter named `{name}` is loaded{self._listing()}")
        del self.by_task[adapter.task_id]
        return adapter

    def loaded(self) -> list[Adapter]:
        """The adapters, copied at once: the engine's table changes while serving (a load or an unload on another
        thread), and a dict must not change while it is iterated."""
        return list(self.by_name.values())

    def next_task_id(self) -> int:
        """The task id an adapter loaded without one gets: one more than the largest there is."""
        return max(list(self.by_task), default=0) + 1

    def cards(self) -> list[dict]:
        """The adapters as `lora_adapters` lists them: name and task id, in the order they were loaded."""
        return [{"name": a.name, "task_id": a.task_id} for a in self.loaded()]

    def choose(self, name: str | None, task_id: int | None) -> str:
        """The adapter a request's `lora_name` and `lora_task_id` choose (BASE when neither is given, or the name is
        empty); InputError naming the input for an unknown one, or for two that disagree."""
        chosen = BASE
        if name:
            adapter = self.by_name.get(name)
            if adapter is None:
                raise InputError("lora_name", f"no adapter named `{name}` is loaded{self._listing()}")
            chosen = adapter.name
        if task_id is not None:
            adapter = self.by_task.get(int(task_id))
            if adapter is None:
                raise InputError(
                    "lora_task_id",
                    f"no adapter has task id {task_id}{self._listing()}; this engine takes no lora_weights: "
                    "adapters are loaded by name (--lora, or lora_action load)",
                )
            if chosen not in (BASE, adapter.name):
                raise InputError(
                    "lora_task_id", f"task id {task_id} is `{adapter.name}`, but lora_name says `{chosen}`"
                )
            chosen = adapter.name
        return chosen

    def _listing(self) -> str:
        if not self.by_name:
            return " (this server has none)"
        return " (this server has " + ", ".join(f"`{a.name}` = task {a.task_id}" for a in self.loaded()) + ")"
