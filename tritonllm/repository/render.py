"""Render the Triton model repository from `model_repository/` templates, and prove it sound.

Every `${name}` in a template is filled from values derived from the model; a placeholder left
unfilled, a value that no template uses, a config that does not parse into Triton's real
`ModelConfig` message, or an ensemble whose wiring does not hold is an error naming the model
and the field, and nothing is written. Folders of `model_repository/` starting with "_" are not
models: `_shared/<name>.pbtxt` fills `${<name>}` wherever it appears, and
`_flavors/<flavor>/<model>/` replaces `<model>/` for that engine flavor (e.g. trtllm), as
`_flavors/<flavor>/_shared/<name>.pbtxt` replaces a fragment (the portable engine's additions, which the
TensorRT-LLM flavor does not declare), and
`_modes/decoupled/<model>/` replaces it in NVIDIA's decoupled deployment (`model_names` says how the two
deployments name the engine's models).
"""

from __future__ import annotations

import hashlib
import re
import shutil
import tempfile
from pathlib import Path

from tritonclient.grpc import model_config_pb2 as mc

from tritonllm.errors import ConfigError
from tritonllm.protocol import DECOUPLED_ENGINE_MODEL, ENGINE_MODEL
from tritonllm.text.model_config import parse_config, read_config

__all__ = ["RepositoryError", "read_config", "render_configs", "write_repository"]

PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
TEMPLATES = Path(__file__).resolve().parent / "model_repository"  # the top-level model_repository/, packaged
DTYPE_NAMES = {v: k for k, v in mc.DataType.items()}


class RepositoryError(ConfigError):
    """The rendered repository would not load or would not work; says which model and field."""


def fill(text: str, values: dict[str, str], where: str, used: set[str]) -> str:
    def substitute(match: re.Match) -> str:
        name = match.group(1)
        if name not in values:
            raise RepositoryError(f"{where}: placeholder ${{{name}}} has no value")
        used.add(name)
        return str(values[name])

    return PLACEHOLDER.sub(substitute, text)


def model_names(decoupled_mode: bool) -> dict[str, str | None]:
    """Template folder -> model name where they differ (None: not rendered), in each of NVIDIA's deployments.

    Not decoupled (NVIDIA's decoupled_mode false, the default): the request/response face of the engine,
    `tensorrt_llm_bridge/`, is `tensorrt_llm`, which HTTP /infer and gRPC ModelInfer reach and the ensemble calls;
    the engine, `tensorrt_llm/`, is `tensorrt_llm_decoupled`, which tensorrt_llm_bls streams from. Decoupled: the
    engine is `tensorrt_llm` itself, and the ensemble, decoupled too, streams over gRPC."""
    if decoupled_mode:
        return {"tensorrt_llm_bridge": None}
    return {"tensorrt_llm": DECOUPLED_ENGINE_MODEL, "tensorrt_llm_bridge": ENGINE_MODEL}


def model_folders(templates: Path, flavor: str, decoupled_mode: bool = False) -> dict[str, Path]:
    """Model name -> template folder: `_flavors/<flavor>/<model>` replaces the default folder of that model, and
    `_modes/decoupled/<model>` replaces it in the decoupled deployment; folders are named as `model_names` says."""
    folders = {p.name: p for p in templates.iterdir() if p.is_dir() and not p.name.startswith("_")}
    overlays = [templates / "_flavors" / flavor] + ([templates / "_modes" / "decoupled"] if decoupled_mode else [])
    for overrides in (o for o in overlays if o.is_dir()):
        folders.update({p.name: p for p in overrides.iterdir() if p.is_dir() and not p.name.startswith("_")})
    names = model_names(decoupled_mode)
    named = {names.get(folder, folder): path for folder, path in folders.items()}
    return dict(sorted((name, path) for name, path in named.items() if name is not None))


def render_configs(
    values: dict[str, str], templates: Path = TEMPLATES, flavor: str = "portable", decoupled_mode: bool = False
) -> dict[str, tuple[str, mc.ModelConfig]]:
    """Model name -> (config text, parsed config), after all checks."""
    fragments = {}
    for shared in (templates / "_shared", templates / "_flavors" / flavor / "_shared"):
        fragments.update({p.stem: p.read_text() for p in sorted(shared.glob("*.pbtxt"))})
    overlap = fragments.keys() & values.keys()
    if overlap:
        raise RepositoryError(f"values {sorted(overlap)} clash with the shared fragments of the same name")
    used: set[str] = set()
    rendered = {}
    for name, folder in model_folders(templates, flavor, decoupled_mode).items():
        where = f"{folder.relative_to(templates)}/config.pbtxt"
        template = (folder / "config.pbtxt").read_text()
        text = fill(template, {**fragments, **values}, where, used)
        try:
            config = parse_config(text, where)
        except ConfigError as exc:
            raise RepositoryError(str(exc)) from None
        if config.name != name:
            raise RepositoryError(f"{where}: name is '{config.name}', expected '{name}'")
        rendered[name] = (text, config)
    unused = values.keys() - used
    if unused:
        raise RepositoryError(f"values {sorted(unused)} are used by no template in {templates}")
    check_ensembles({name: config for name, (_, config) in rendered.items()}, decoupled_mode)
    return rendered


def _dtype(dtype: int) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype))


def check_ensembles(configs: dict[str, mc.ModelConfig], decoupled_mode: bool = False) -> None:
    """Every ensemble step maps existing tensors of matching types; the ensemble can answer /infer, or in the
    decoupled deployment, a step after a decoupled one reads nothing but that step's outputs (Triton refuses
    inputs "originated from different decoupled models")."""
    for ensemble in (c for c in configs.values() if c.platform == "ensemble"):
        where = f"ensemble '{ensemble.name}'"
        produced = {t.name: t.data_type for t in ensemble.input}
        origin = dict.fromkeys(produced, "")  # tensor -> the decoupled step it came from ("" none)
        for index, step in enumerate(ensemble.ensemble_scheduling.step):
            model = configs.get(step.model_name)
            at = f"{where} step {index} ({step.model_name})"
            if model is None:
                raise RepositoryError(f"{at}: no model named '{step.model_name}' in the repository")
            decoupled = model.model_transaction_policy.decoupled
            if decoupled and not decoupled_mode:
                raise RepositoryError(
                    f"{at}: the model is decoupled, which would make the ensemble decoupled and refused by HTTP /infer"
                )
            sources = {origin.get(tensor, "") for tensor in step.input_map.values()}
            if len(sources) > 1 and sources - {""}:
                raise RepositoryError(f"{at}: reads tensors of a decoupled step and others, which Triton refuses")
            if ensemble.max_batch_size > model.max_batch_size:
                raise RepositoryError(
                    f"{at}: max_batch_size {model.max_batch_size} is below the ensemble's {ensemble.max_batch_size}"
                )
            inputs = {t.name: t for t in model.input}
            for key, tensor in step.input_map.items():
                if key not in inputs:
                    raise RepositoryError(f"{at}: input_map key '{key}' is not an input of {model.name}")
                if tensor not in produced:
                    raise RepositoryError(f"{at}: input '{key}' reads '{tensor}', which nothing before it produces")
                if produced[tensor] != inputs[key].data_type:
                    want, have = _dtype(inputs[key].data_type), _dtype(produced[tensor])
                    raise RepositoryError(f"{at}: input '{key}' is {want} but '{tensor}' is {have}")
            missing = [n for n, t in inputs.items() if not t.optional and n not in step.input_map]
            if missing:
                raise RepositoryError(f"{at}: required inputs {missing} are not mapped")
            outputs = {t.name: t.data_type for t in model.output}
            after = model.name if decoupled else next(iter(sources - {""}), "")
            for key, tensor in step.output_map.items():
                if key not in outputs:
                    raise RepositoryError(f"{at}: output_map key '{key}' is not an output of {model.name}")
                produced[tensor] = outputs[key]
                origin[tensor] = after
        for output in ensemble.output:
            if output.name not in produced:
                raise RepositoryError(f"{where}: output '{output.name}' is produced by no step")
            if produced[output.name] != output.data_type:
                want, have = _dtype(output.data_type), _dtype(produced[output.name])
                raise RepositoryError(f"{where}: output '{output.name}' is {want} but its step gives {have}")


def templates_digest(templates: Path = TEMPLATES) -> str:
    """A fingerprint of the model templates (configs and model.py shims) that repositories are rendered from; the
    manifest records it, so a server started from a build that an update of the templates left behind is refused."""
    digest = hashlib.sha256()
    for path in sorted(p for p in templates.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        digest.update(path.relative_to(templates).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def stale_build(manifest: dict, templates: Path = TEMPLATES) -> str | None:
    """Why a build's repository does not fit this checkout (None: it does). Its configs, rendered from older
    templates, would refuse inputs this code sends (a 500 on every OpenAI request, say)."""
    if manifest.get("templates") == templates_digest(templates):
        return None
    return "its model repository was rendered from other model templates than this checkout's (they changed since)"


def write_repository(
    values: dict[str, str],
    out_dir: Path,
    templates: Path = TEMPLATES,
    flavor: str = "portable",
    files: dict[str, str] | None = None,
    decoupled_mode: bool = False,
) -> list[str]:
    """Render, check, then replace `out_dir` in one step, with `files` (path in the repository -> text) added.
    Returns the model names."""
    rendered = render_configs(values, templates, flavor, decoupled_mode)
    folders = model_folders(templates, flavor, decoupled_mode)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out_dir.name + ".", dir=out_dir.parent))
    try:
        for name, (text, _) in rendered.items():
            target = staging / name
            shutil.copytree(
                folders[name], target, ignore=shutil.ignore_patterns("__pycache__", "config.pbtxt", ".keep")
            )
            (target / "1").mkdir(exist_ok=True)  # Triton needs a version folder, even an ensemble's
            (target / "config.pbtxt").write_text(text)
        for path, text in (files or {}).items():
            (staging / path).write_text(text)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return sorted(rendered)
