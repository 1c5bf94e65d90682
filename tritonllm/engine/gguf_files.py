"""A GGUF file the build derives from another (a retyped model, a converted LoRA adapter): written whole or not at
all, with a stamp of what it was made from, so that a later build reuses it only for the same source."""

from __future__ import annotations

import json
import os
from pathlib import Path


def partial(out: Path) -> Path:
    """Where `out` is written before it is complete."""
    return out.with_name(out.name + ".partial")


def is_current(out: Path, signature: dict) -> bool:
    """Whether `out` is there, made from the source `signature` describes."""
    stamp = out.with_suffix(".json")
    return out.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == signature


def finish(writer, out: Path, signature: dict) -> None:
    """Writes the file a gguf.GGUFWriter on partial(out) holds, then makes it `out`, stamped with `signature`."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial(out), out)
    out.with_suffix(".json").write_text(json.dumps(signature, indent=1))
