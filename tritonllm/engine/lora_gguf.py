"""A PEFT LoRA folder (adapter_config.json + adapter_model.safetensors, as PEFT writes them) as a GGUF LoRA adapter,
the file llama.cpp's `llama_adapter_lora_init` loads, written at build time with the `gguf` package.

No packaged converter exists for this: llama.cpp's convert_lora_to_gguf.py ships only in its source tree, beside the
whole of its Hugging Face converter. The format is small, and this writes what its loader checks
(llama-adapter.cpp): `general.type` "adapter", the base model's architecture, `adapter.type` "lora",
`adapter.lora.alpha`, and for each adapted weight `<base tensor>.lora_a` [rank, in] and `.lora_b` [out, rank] (numpy
order; ggml's is reversed), float32. llama.cpp scales B·A by alpha / rank, as PEFT does (rsLoRA's alpha / √rank is
written as the alpha that gives it). Its converter writes a llama model's q and k rows permuted for its rotary
kernel (convert_hf_to_gguf.py, LlamaModel.permute); the rows of B for those weights get the same permutation.
What it cannot carry is refused by name: DoRA, trained biases, fully trained modules, per-layer ranks.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from tritonllm.engine.adapters import Adapter, check_name
from tritonllm.engine.gguf_files import finish, is_current, partial
from tritonllm.errors import ConfigError, InputError

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<half>[AB])(?:\.default)?\.weight$")
_PERMUTED = {"llama"}  # architectures whose q/k rows llama.cpp's converter permutes (LlamaModel.permute)


class LoraError(ConfigError):
    """A --lora that cannot be served; the message names it and says why."""


def converted_dir(model_dir: str | Path) -> Path:
    """Where a model's converted adapters are written: beside the model's folder, by the build and the server."""
    return Path(model_dir).parent / "lora"


def parse_lora(spec: str) -> tuple[str, Path]:
    """`NAME=PATH` of --lora."""
    name, sep, path = spec.partition("=")
    if not sep or not path:
        raise LoraError(f"--lora {spec}: expected NAME=PATH (a PEFT adapter folder)")
    try:
        check_name(name, "--lora")
    except InputError as exc:
        raise LoraError(f"--lora {spec}: {exc}") from None
    return name, Path(path).expanduser()


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q/k permutation of rows (each head's halves interleaved)."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def peft_config(folder: Path) -> dict:
    """The adapter's config, refusing what a GGUF LoRA cannot carry."""
    path = folder / CONFIG
    if not path.is_file() or not (folder / WEIGHTS).is_file():
        raise LoraError(f"--lora {folder}: expected a PEFT adapter folder with {CONFIG} and {WEIGHTS}")
    config = json.loads(path.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"--lora {folder}: peft_type {config['peft_type']}; only LORA adapters convert")
    refused = {
        "use_dora": bool(config.get("use_dora")),
        "bias": config.get("bias", "none") != "none",
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
    }
    if given := [key for key, on in refused.items() if on]:
        raise LoraError(f"--lora {folder}: {', '.join(given)} in {CONFIG}: a GGUF LoRA holds plain A and B matrices")
    return config


def convert_peft(name: str, folder: Path, base_gguf: Path, out_dir: Path) -> Adapter:
    """`folder` as `out_dir/NAME.gguf` for the base model `base_gguf`; skipped when already done for the same
    source. The task id is set by the caller."""
    import gguf
    from safetensors.numpy import load_file

    folder = folder.resolve()
    config = peft_config(folder)
    out = out_dir / f"{name}.gguf"
    weights = folder / WEIGHTS
    signature = {"source": str(folder), "base": str(base_gguf), "mtime_ns": weights.stat().st_mtime_ns}
    if is_current(out, signature):
        return Adapter(name, 0, str(out), str(folder))
    base = gguf.GGUFReader(base_gguf)
    architecture = base.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    blocks = base.get_field(f"{architecture}.block_count").contents()
    heads = base.get_field(f"{architecture}.attention.head_count").contents()
    kv_field = base.get_field(f"{architecture}.attention.head_count_kv")
    kv_heads = kv_field.contents() if kv_field is not None else heads
    arch = {value: key for key, value in gguf.MODEL_ARCH_NAMES.items()}[architecture]
    names = gguf.get_tensor_name_map(arch, blocks)
    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in base.tensors}  # numpy order
    pairs: dict[str, dict[str, np.ndarray]] = {}
    for key, array in load_file(weights).items():
        match = _PEFT_KEY.match(key)
        if match is None:
            raise LoraError(f"--lora {name}: {WEIGHTS} holds {key}, not a LoRA A or B matrix")
        module = match["module"]
        target = names.get_name(module + ".weight", try_suffixes=(".weight",))
        if target is None or target not in shapes:
            raise LoraError(f"--lora {name}: {module} is no weight of the base model ({base_gguf.name})")
        pairs.setdefault(target, {})[match["half"]] = array.astype(np.float32)
    rank = int(config["r"])
    alpha = float(config.get("lora_alpha", rank))
    if config.get("use_rslora"):
        alpha *= math.sqrt(rank)  # llama.cpp's scale alpha / rank is then rsLoRA's alpha / sqrt(rank)
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(partial(out), architecture)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for target, pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"} or pair["A"].shape[0] != rank or pair["B"].shape[1] != rank:
            raise LoraError(f"--lora {name}: {target} needs A [{rank}, in] and B [out, {rank}] (r = {rank})")
        a, b = pair["A"], pair["B"]
        if (b.shape[0], a.shape[1]) != shapes[target]:
            product = (b.shape[0], a.shape[1])
            raise LoraError(f"--lora {name}: {target} is {shapes[target]} in the base model, B·A {product}")
        if architecture in _PERMUTED and target.endswith((".attn_q.weight", ".attn_k.weight")):
            b = _permute(b, heads if target.endswith(".attn_q.weight") else kv_heads)
        writer.add_tensor(target + ".lora_a", np.ascontiguousarray(a))
        writer.add_tensor(target + ".lora_b", np.ascontiguousarray(b))
    finish(writer, out, signature)
    return Adapter(name, 0, str(out), str(folder))
