"""Rendering model_repository/ templates: a broken repository is refused, naming the model and field."""

import dataclasses
import json
import os
import re
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest

from tritonllm.engine.api import ENGINE_CONFIG_FILE, EngineConfig
from tritonllm.errors import ConfigError
from tritonllm.options import carrier_count
from tritonllm.protocol import PERF_OUTPUTS
from tritonllm.repository.builder import main, parse_args
from tritonllm.repository.plan import (
    MAX_BACKEND_THREADS,
    BuildError,
    BuildPlan,
    engine_options,
    plan_portable,
    text_instances,
)
from tritonllm.repository.render import (
    TEMPLATES,
    RepositoryError,
    render_configs,
    stale_build,
    templates_digest,
    write_repository,
)

PLAN = BuildPlan(
    engine="portable",
    model_dir="/models/m",
    dtype="float32",
    max_batch_size=8,
    max_input_len=96,
    max_seq_len=128,
    vocab_size=1000,
    engine_values={"engine_instance_kind": "KIND_CPU"},
)
VALUES = PLAN.template_values()
DECOUPLED_VALUES = dataclasses.replace(PLAN, decoupled_mode=True).template_values()


def engine_json(plan: BuildPlan) -> dict[str, str]:
    """The engine's configuration as the build writes it (engine.json), values as text."""
    return {name: str(value).lower() for name, value in asdict(plan.engine_config).items()}


@pytest.fixture
def templates(tmp_path) -> Path:
    copy = tmp_path / "templates"
    shutil.copytree(TEMPLATES, copy, ignore=shutil.ignore_patterns("__pycache__"))
    return copy


def edit(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, 1))


def test_renders_every_model_with_derived_values():
    configs = {name: config for name, (_, config) in render_configs(VALUES).items()}
    assert set(configs) == {
        "preprocessing",
        "tensorrt_llm",
        "tensorrt_llm_decoupled",
        "postprocessing",
        "ensemble",
        "tensorrt_llm_bls",
    }
    assert all(c.max_batch_size == 8 for c in configs.values())
    assert configs["tensorrt_llm_decoupled"].model_transaction_policy.decoupled
    assert not configs["tensorrt_llm"].model_transaction_policy.decoupled, "HTTP /infer and ModelInfer reach it"
    assert set(configs["tensorrt_llm_decoupled"].parameters) == {
        "max_input_len",
        "max_seq_len",
        "vocab_size",
        "max_queue_size",
        "exclude_input_in_output",
    }, "the engine's options live in engine.json only"
    assert configs["preprocessing"].parameters["max_input_len"].string_value == "96"
    for streaming in ("tensorrt_llm", "tensorrt_llm_bls"):
        assert configs[streaming].parameters["engine_model_name"].string_value == "tensorrt_llm_decoupled"


def test_the_engines_face_and_the_engine_share_their_tensors():
    configs = {name: config for name, (_, config) in render_configs(VALUES).items()}
    assert list(configs["tensorrt_llm"].input) == list(configs["tensorrt_llm_decoupled"].input)
    assert list(configs["tensorrt_llm"].output) == list(configs["tensorrt_llm_decoupled"].output)


def test_the_decoupled_deployment_is_nvidias():
    """NVIDIA's decoupled_mode true: tensorrt_llm is the engine; the ensemble, decoupled, maps `streaming` from
    `stream`, and its postprocessing step reads only the engine's outputs; tensorrt_llm_bls streams from it."""
    configs = {name: config for name, (_, config) in render_configs(DECOUPLED_VALUES, decoupled_mode=True).items()}
    assert set(configs) == {"preprocessing", "tensorrt_llm", "postprocessing", "ensemble", "tensorrt_llm_bls"}
    assert configs["tensorrt_llm"].model_transaction_policy.decoupled
    assert configs["tensorrt_llm_bls"].parameters["engine_model_name"].string_value == "tensorrt_llm"
    preprocess, engine, postprocess = configs["ensemble"].ensemble_scheduling.step
    assert engine.model_name == "tensorrt_llm" and engine.input_map["streaming"] == "stream"
    assert "STREAM" not in preprocess.input_map
    assert set(postprocess.input_map.values()) <= set(engine.output_map.values())
    assert list(configs["ensemble"].input) == list(configs["tensorrt_llm_bls"].input)
    default = {name: config for name, (_, config) in render_configs(VALUES).items()}
    assert [t.name for t in configs["ensemble"].output] == [
        t.name for t in default["ensemble"].output if t.name != "finish_reason"
    ], "no finish_reason: postprocessing cannot read max_tokens there"


def test_a_decoupled_step_mixed_with_other_tensors_is_refused(templates):
    edit(
        templates / "_modes" / "decoupled" / "ensemble" / "config.pbtxt",
        'input_map { key: "SEQUENCE_LENGTH" value: "_SEQUENCE_LENGTH" }',
        'input_map { key: "SEQUENCE_LENGTH" value: "_SEQUENCE_LENGTH" }\n'
        '      input_map { key: "STOP_WORDS" value: "stop_words" }',
    )
    with pytest.raises(RepositoryError, match="reads tensors of a decoupled step and others"):
        render_configs(DECOUPLED_VALUES, templates, decoupled_mode=True)


def test_streaming_model_has_the_ensembles_tensors():
    configs = {name: config for name, (_, config) in render_configs(VALUES).items()}
    assert list(configs["ensemble"].input) == list(configs["tensorrt_llm_bls"].input)
    streamed = list(configs["tensorrt_llm_bls"].output)
    # Plus the tokens each streamed response's log probs belong to.
    assert list(configs["ensemble"].output) == streamed[:-1] and streamed[-1].name == "output_ids"
    assert configs["tensorrt_llm_bls"].model_transaction_policy.decoupled


def test_write_repository(tmp_path):
    out = tmp_path / "repo"
    models = write_repository(VALUES, out)
    for name in models:
        assert (out / name / "config.pbtxt").is_file() and (out / name / "1").is_dir()
        assert "${" not in (out / name / "config.pbtxt").read_text()
    assert (out / "preprocessing" / "1" / "model.py").is_file()


@pytest.mark.parametrize(
    ("model", "old", "new", "message"),
    [
        (
            "preprocessing",
            "${tokenizer_dir}",
            "${tokenizer_folder}",
            r"preprocessing/config.pbtxt: placeholder \$\{tokenizer_folder\}",
        ),
        (
            "postprocessing",
            "data_type: TYPE_STRING",
            "data_type: TYPE_TEXT",
            r"postprocessing/config.pbtxt: not a valid Triton model config",
        ),
        ("postprocessing", 'name: "postprocessing"', 'name: "postproc"', "expected 'postprocessing'"),
        (
            "ensemble",
            'value: "_TOKENS_BATCH"',
            'value: "_TOKENS"',
            "input 'TOKENS_BATCH' reads '_TOKENS_BATCH', which nothing before it produces",
        ),
        ("ensemble", 'key: "STOP_WORDS_DICT"', 'key: "STOP_WORDS"', "'STOP_WORDS' is not an input of preprocessing"),
        (
            "ensemble",
            'input_map { key: "REQUEST_OUTPUT_LEN" value: "max_tokens" }',
            "",
            r"required inputs \['REQUEST_OUTPUT_LEN'\]",
        ),
        ("ensemble", 'model_name: "tensorrt_llm"', 'model_name: "tensorrt_llm_decoupled"', "decoupled"),
        ("ensemble", 'model_name: "postprocessing"', 'model_name: "detokenizer"', "no model named 'detokenizer'"),
        (
            "_shared/text_inputs.pbtxt",
            '{ name: "top_k" data_type: TYPE_INT32',
            '{ name: "top_k" data_type: TYPE_FP32',
            "'TOP_K' is TYPE_INT32 but 'top_k' is TYPE_FP32",
        ),
        (
            "ensemble",
            'output_map { key: "OUTPUT" value: "text_output" }',
            'output_map { key: "OUTPUT" value: "text" }',
            "output 'text_output' is produced by no step",
        ),
    ],
)
def test_broken_templates_are_refused(templates, tmp_path, model, old, new, message):
    edit(templates / model if model.endswith(".pbtxt") else templates / model / "config.pbtxt", old, new)
    out = tmp_path / "out"
    out.mkdir()
    (out / "sentinel").write_text("previous build")
    with pytest.raises(RepositoryError, match=message):
        write_repository(VALUES, out, templates)
    assert (out / "sentinel").read_text() == "previous build", "a failed render must not touch the old repository"


def test_unused_value_is_refused():
    with pytest.raises(RepositoryError, match=re.escape("values ['typo_value'] are used by no template")):
        render_configs({**VALUES, "typo_value": "1"})


def test_batch_size_above_a_step_is_refused(templates):
    edit(templates / "postprocessing" / "config.pbtxt", "max_batch_size: ${triton_max_batch_size}", "max_batch_size: 2")
    with pytest.raises(RepositoryError, match="max_batch_size 2 is below the ensemble's 8"):
        render_configs(VALUES, templates)


@pytest.mark.parametrize("flag", ["--cuda-graphs", "--cudnn-attention", "--compile", "--async-batching"])
@pytest.mark.parametrize(
    ("argv", "cuda", "expected"),
    [
        (["--device", "cuda", "FLAG"], True, "true"),
        (["--device", "cuda", "NO_FLAG"], True, "false"),
        (["--device", "cpu", "FLAG"], True, "false"),  # CUDA only
        (["FLAG"], False, "false"),  # auto picks the CPU here
    ],
)
def test_cuda_options_are_rendered_only_on_cuda(manifest, monkeypatch, flag, argv, cuda, expected):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    flags = {"FLAG": flag, "NO_FLAG": "--no-" + flag[2:]}
    plan = plan_portable(Path(manifest["model_dir"]), None, parse_args([flags.get(a, a) for a in argv]))
    assert engine_json(plan)[flag[2:].replace("-", "_")] == expected


# cuDNN attention: with CUDA graphs one cuDNN graph build per captured graph, without them one per new batch
# shape (every few steps). Async batching was measured with graphs only.
@pytest.mark.parametrize("option", ["cudnn_attention", "async_batching"])
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], "true"),  # CUDA graphs are the default on CUDA
        (["--no-cuda-graphs"], "false"),
        (["--no-OPTION"], "false"),
        (["--no-cuda-graphs", "--OPTION"], "true"),
    ],
)
def test_options_follow_cuda_graphs_unless_asked(manifest, monkeypatch, option, argv, expected):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    argv = [a.replace("OPTION", option.replace("_", "-")) for a in argv]
    plan = plan_portable(Path(manifest["model_dir"]), None, parse_args(["--device", "cuda", *argv]))
    assert engine_json(plan)[option] == expected


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--device", "cuda"], "true"),
        (["--device", "cuda", "--no-engine-process"], "false"),
        (["--device", "cpu"], "false"),
        (["--device", "cpu", "--engine-process"], "true"),  # runs on the CPU too (tests/unit/engine/test_process.py)
    ],
)
def test_engine_process_follows_the_device_unless_asked(manifest, monkeypatch, argv, expected):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plan = plan_portable(Path(manifest["model_dir"]), None, parse_args(argv))
    assert engine_json(plan)["engine_process"] == expected
    # Unless --engine-instances says: several instances send the responses of an engine in a process of its own.
    instances = str(plan.text_instances) if expected == "true" else "1"
    assert plan.template_values()["engine_instance_count"] == instances


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--engine-process", "--engine-instances", "3"], "3"),
        (["--engine-process", "--engine-instances", "0"], "text"),  # as many as the text models
        (["--engine-instances", "2"], "--engine-instances 2 needs the engine in a process of its own"),
    ],
)
def test_engine_instances_share_an_engine_in_its_own_process(manifest, argv, expected):
    args = parse_args(["--device", "cpu", *argv])
    if expected.startswith("--"):
        with pytest.raises(ConfigError, match=expected):
            plan_portable(Path(manifest["model_dir"]), None, args)
        return
    plan = plan_portable(Path(manifest["model_dir"]), None, args)
    wanted = str(plan.text_instances) if expected == "text" else expected
    assert plan.template_values()["engine_instance_count"] == wanted


@pytest.mark.parametrize(("argv", "process", "instances"), [([], True, "text"), (["--no-engine-process"], False, "1")])
def test_the_synthetic_engine_takes_the_cuda_engines_defaults(manifest, tmp_path, argv, process, instances):
    """It stands for the portable engine on CUDA: its step loop in a process of its own, several instances in front."""
    build = tmp_path / "build"
    assert main(["--engine", "synthetic", "--model", manifest["model_dir"], "--build-dir", str(build), *argv]) == 0
    engine = build / "model_repository" / "tensorrt_llm_decoupled"
    assert json.loads((engine / "1" / "synthetic_engine.json").read_text())["engine_process"] is process
    count = str(text_instances(os.cpu_count() or 2)) if instances == "text" else instances
    assert f"count: {count} kind: KIND_CPU" in (engine / "config.pbtxt").read_text()


@pytest.mark.parametrize(("argv", "expected"), [([], "false"), (["--compile"], "true")])
def test_compile_is_asked_for(manifest, monkeypatch, argv, expected):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plan = plan_portable(Path(manifest["model_dir"]), None, parse_args(["--device", "cuda", *argv]))
    assert engine_json(plan)["compile"] == expected


@pytest.mark.parametrize(
    ("argv", "cuda", "expected"),
    [
        (["--device", "cuda"], True, "varlen"),  # auto: per-request attention where it runs
        (["--device", "cuda", "--attention", "sdpa"], True, "sdpa"),
        ([], False, "sdpa"),  # auto picks the CPU here, where the FlashAttention kernel does not run
        (["--device", "cuda", "--dtype", "float32"], True, "sdpa"),  # FlashAttention takes 16-bit types only
    ],
)
def test_attention_is_varlen_on_cuda_unless_asked(manifest, monkeypatch, argv, cuda, expected):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    plan = plan_portable(Path(manifest["model_dir"]), None, parse_args(argv))
    assert engine_json(plan)["attention"] == expected


def test_varlen_attention_on_cpu_is_refused_with_what_to_do(manifest):
    with pytest.raises(BuildError, match=r"--attention varlen: .*use --attention sdpa on CPU"):
        plan_portable(Path(manifest["model_dir"]), None, parse_args(["--device", "cpu", "--attention", "varlen"]))


def test_varlen_attention_in_float32_is_refused_with_what_to_do(manifest, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    argv = ["--device", "cuda", "--dtype", "float32", "--attention", "varlen"]
    with pytest.raises(BuildError, match=r"--attention varlen: .*bfloat16 or float16 only.*not float32"):
        plan_portable(Path(manifest["model_dir"]), None, parse_args(argv))


def test_the_default_queue_admits_at_least_128_requests_and_as_many_waiting_as_running():
    """32 streamed chats at once, some dropped by their clients, were mostly refused when the queue held only as
    many as the batch (16 + 16): a dropped stream's seat is freed a few tenths of a second late."""
    from dataclasses import replace

    from tritonllm.repository.plan import DEFAULT_ADMITTED

    assert [replace(PLAN, max_batch_size=b).queue_size for b in (8, 16, 64, 256)] == [120, 112, 64, 256]
    assert replace(PLAN, max_batch_size=16, max_queue_size=4).queue_size == 4, "--max-queue-size as given"
    assert DEFAULT_ADMITTED == 128


def test_python_backend_threads_cover_every_admitted_request(tmp_path):
    """A decoupled BLS call holds a Python-backend thread until its first response (the bridge's
    whole answer): the pool is sized for running + waiting requests, and the server is started with it."""
    from dataclasses import replace

    from tritonllm.launch.tritonserver import TritonServer

    assert PLAN.server_options() == ["--backend-config=python,thread-pool-size=160"]  # 8 running + 120 waiting + 32
    bigger = replace(PLAN, max_batch_size=128, max_queue_size=256)
    assert bigger.server_options() == ["--backend-config=python,thread-pool-size=416"]
    (tmp_path / "manifest.json").write_text(json.dumps({"server_options": bigger.server_options()}))
    command = TritonServer(tmp_path / "model_repository", tmp_path / "tritonserver").command()
    assert "--backend-config=python,thread-pool-size=416" in command
    # Each Python-backend instance gets the pool in the server process: bounded, or a large batch starts thousands.
    huge = replace(PLAN, max_batch_size=1024, max_queue_size=1024)
    assert huge.server_options() == [f"--backend-config=python,thread-pool-size={MAX_BACKEND_THREADS}"]


@pytest.mark.parametrize("fusion", ["fused_norms", "fused_projections"])
@pytest.mark.parametrize(("flag", "expected"), [("", "true"), ("--no-", "false")])
def test_fusions_are_on_unless_asked(manifest, fusion, flag, expected):
    argv = [flag + fusion.replace("_", "-")] if flag else []
    plan = plan_portable(Path(manifest["model_dir"]), None, parse_args(argv))
    assert engine_json(plan)[fusion] == expected


@pytest.mark.parametrize(("argv", "expected"), [([], "10"), (["--cpu-niceness", "0"], "0")])
def test_cpu_niceness_reaches_the_engine_config(manifest, argv, expected):
    plan = plan_portable(Path(manifest["model_dir"]), None, parse_args(argv))
    assert engine_json(plan)["cpu_niceness"] == expected


def test_cpu_niceness_out_of_range_is_refused_naming_the_limit(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--cpu-niceness", "25"])
    assert "--cpu-niceness: must be from 0 to 19, got 25" in capsys.readouterr().err


def test_each_option_is_a_flag_with_its_fields_default():
    from tritonllm.options import option_fields
    from tritonllm.trtllm.engine_build import TrtllmBuildOptions

    args = parse_args([])
    for option in [*engine_options(), *option_fields(TrtllmBuildOptions)]:
        assert getattr(args, option.name) == option.default, option.name
    assert parse_args(["--engine", "trtllm", "--tp", "2"]).tp_size == 2


def test_the_build_writes_the_engine_config_once_as_engine_json(manifest, tmp_path):
    """engine.json is what EngineConfig(**json) loads in the engine model; the manifest embeds the same."""
    argv = ["--model", manifest["model_dir"], "--build-dir", str(tmp_path), "--no-fused-norms", "--cpu-niceness", "3"]
    assert main(argv) == 0
    engine = tmp_path / "model_repository" / "tensorrt_llm_decoupled"
    written = json.loads((engine / "1" / ENGINE_CONFIG_FILE).read_text())
    config = EngineConfig(**written)
    assert config == config.resolve(), "written resolved: the engine model has nothing left to decide"
    assert (config.fused_norms, config.cpu_niceness, config.device) == (False, 3, "cpu")
    assert json.loads((tmp_path / "manifest.json").read_text())["engine_config"] == written


def test_tokenizer_instances_follow_the_build_hosts_cores():
    assert [text_instances(cores) for cores in (1, 2, 8, 12, 16, 64)] == [1, 1, 2, 3, 4, 8]
    assert VALUES["preprocessing_instance_count"] == VALUES["postprocessing_instance_count"] == str(PLAN.text_instances)
    assert DECOUPLED_VALUES["postprocessing_instance_count"] == "1", "responses keep their order (PLAN's docstring)"
    assert VALUES["bridge_instance_count"] == str(PLAN.text_instances)
    assert [carrier_count(cores) for cores in (1, 2, 3, 4, 8, 16, 64)] == [1, 1, 1, 2, 4, 8, 8]
    assert VALUES["bls_instance_count"] == str(PLAN.bls_instances)


def test_a_build_rendered_from_other_templates_is_stale(tmp_path):
    templates = tmp_path / "templates"
    shutil.copytree(TEMPLATES, templates, ignore=shutil.ignore_patterns("__pycache__"))
    manifest = {"templates": templates_digest(templates)}
    assert templates_digest(templates) == templates_digest(TEMPLATES) and stale_build(manifest, templates) is None
    config = templates / "_shared" / "text_inputs.pbtxt"
    config.write_text(config.read_text().replace("return_perf_metrics", "return_more_metrics"))
    assert "other model templates" in stale_build(manifest, templates)
    assert stale_build({}, TEMPLATES) is not None, "a build from before the manifest recorded them"


def test_serve_refuses_a_stale_build_before_starting_anything(tmp_path, capsys):
    from tritonllm.launch import serve

    (tmp_path / "model_repository").mkdir()
    (tmp_path / "manifest.json").write_text(json.dumps({"templates": "0" * 16}))
    assert serve.main(["--repository", str(tmp_path / "model_repository")]) == 2
    error = capsys.readouterr().err
    assert "rendered from other model templates" in error and "run `make build` again" in error


def test_only_the_tensorrt_llm_flavor_compiles_guides_in_preprocessing():
    configs = {name: config for name, (_, config) in render_configs(VALUES).items()}
    assert configs["preprocessing"].parameters["guided_decoding"].string_value == "engine"
    assert dataclasses.replace(PLAN, engine="trtllm").template_values()["guided_decoding"] == "compile"
    off = dataclasses.replace(PLAN, engine="trtllm", details={"guided_decoding": False})
    assert off.template_values()["guided_decoding"] == "off"


def test_every_perf_output_the_cpp_backend_writes_unasked_is_declared():
    """B1: with return_perf_metrics, TensorRT-LLM's fillTritonResponse writes all ten perf outputs without checking
    which were requested, and Triton refuses an output the config does not declare (the whole response fails).
    Both flavors' engines render the same fragment."""
    configs = {name: config for name, (_, config) in render_configs(VALUES).items()}
    for model in ("tensorrt_llm", "tensorrt_llm_decoupled", "ensemble", "tensorrt_llm_bls"):
        assert set(PERF_OUTPUTS) <= {t.name for t in configs[model].output}, model
    trtllm = (TEMPLATES / "_flavors" / "trtllm" / "tensorrt_llm" / "config.pbtxt").read_text()
    assert "${tensorrt_llm_io}" in trtllm
