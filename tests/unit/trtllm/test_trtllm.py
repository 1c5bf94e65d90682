"""The TensorRT-LLM flavor, checked on CPU against TensorRT-LLM 1.2.1's documented formats.

No engine is built or loaded here (that needs a GPU and NVIDIA's image): these tests check the
engine config.json reading, the rendered repository, the version lock, the exact calls the build
makes into tensorrt_llm's API (through a recording stand-in), and the docker/MPI command lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.conftest import ROOT
from tritonllm import versions
from tritonllm.launch import container, serve_trtllm
from tritonllm.launch.serve_trtllm import load_build
from tritonllm.launch.server_command import (
    CONTAINER_BINARY,
    RESTRICTED_APIS,
    server_command,
)
from tritonllm.protocol import ADMIN_HEADER, DECOUPLED_ENGINE_MODEL, ENGINE_MODEL, PORTS
from tritonllm.repository.builder import main as builder_main
from tritonllm.repository.plan import BuildError, plan_trtllm
from tritonllm.repository.render import TEMPLATES, read_config, render_configs, templates_digest, write_repository
from tritonllm.text.model_config import parse_config
from tritonllm.trtllm import docker
from tritonllm.trtllm.engine_build import TrtllmApi, TrtllmBuildError, TrtllmBuildOptions, build_engine
from tritonllm.trtllm.engine_dir import EngineError, check_version, read_engine


def engine_config(**build_overrides) -> dict:
    """An engine config.json as Engine.save writes it (layout of TensorRT-LLM 1.x, builder.py)."""
    build = {
        "max_input_len": 2048,
        "max_seq_len": 4096,
        "max_batch_size": 64,
        "max_beam_width": 1,
        "max_num_tokens": 8192,
        "kv_cache_type": "PAGED",
        "plugin_config": {"gpt_attention_plugin": "auto", "remove_input_padding": True, "tokens_per_block": 32},
    }
    build.update(build_overrides)
    return {
        "version": "1.2.1",
        "pretrained_config": {
            "architecture": "LlamaForCausalLM",
            "dtype": "bfloat16",
            "vocab_size": 49152,
            "hidden_size": 576,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "max_position_embeddings": 8192,
            "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1, "cp_size": 1, "gpus_per_node": 8},
            "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
        },
        "build_config": build,
    }


def write_engine(path: Path, config: dict | None = None, ranks: int = 1) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or engine_config()))
    for rank in range(ranks):
        (path / f"rank{rank}.engine").write_bytes(b"not a real engine")
    return path


@pytest.fixture
def engine_dir(tmp_path) -> Path:
    return write_engine(tmp_path / "engine")


@pytest.fixture
def tokenizer_dir(manifest) -> Path:
    return Path(manifest["tokenizer_dir"])


def args(**overrides) -> argparse.Namespace:
    base = {"max_batch_size": 0, "kv_cache_free_gpu_mem_fraction": 0.85, "decoupled_mode": False}
    base.update(overrides)
    return argparse.Namespace(**base)


# ---------------------------------------------------------------- engine folder and version lock


def test_engine_values_come_from_config_json(engine_dir):
    info = read_engine(engine_dir)
    assert (info.version, info.dtype, info.max_batch_size, info.max_input_len, info.max_seq_len) == (
        "1.2.1",
        "bfloat16",
        64,
        2048,
        4096,
    )
    assert info.world_size == 1 and info.vocab_size == 49152 and info.tokens_per_block == 32


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda p: (p / "config.json").unlink(), "has no config.json"),
        (lambda p: (p / "rank0.engine").unlink(), "lacks rank0.engine"),
        (lambda p: (p / "config.json").write_text(json.dumps({"pretrained_config": {}})), "pre-0.8 engine"),
        (lambda p: (p / "config.json").write_text(json.dumps(engine_config(kv_cache_type="CONTINUOUS"))), "paged KV"),
    ],
)
def test_broken_engine_folders_are_refused(engine_dir, change, message):
    change(engine_dir)
    with pytest.raises(EngineError, match=message):
        read_engine(engine_dir)


def test_missing_engine_folder(tmp_path):
    with pytest.raises(EngineError, match="does not exist: build it with `make build ENGINE=trtllm`"):
        read_engine(tmp_path / "nothing")


def test_parallel_engine_needs_every_rank(tmp_path):
    config = engine_config()
    config["pretrained_config"]["mapping"].update(world_size=4, tp_size=2, pp_size=2)
    path = write_engine(tmp_path / "tp2pp2", config, ranks=3)
    with pytest.raises(EngineError, match=r"lacks rank3.engine \(tp 2 x pp 2\)"):
        read_engine(path)
    (path / "rank3.engine").write_bytes(b"x")
    assert read_engine(path).world_size == 4


def test_version_mismatch_is_refused_with_both_versions(engine_dir):
    info = read_engine(engine_dir)
    check_version(info, "1.2.1")
    with pytest.raises(EngineError) as err:
        check_version(info, "1.1.0")
    message = str(err.value)
    assert "built by TensorRT-LLM 1.2.1" in message and "runs TensorRT-LLM 1.1.0" in message
    assert "make build ENGINE=trtllm" in message


def test_dockerfile_pins_the_same_release():
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(rf"^ARG TRITON_TAG={re.escape(versions.TRITON_TAG)}$", dockerfile, re.M)
    assert "FROM nvcr.io/nvidia/tritonserver:${TRITON_TAG}-trtllm-python-py3 AS trtllm" in dockerfile
    assert "FROM nvcr.io/nvidia/tritonserver:${TRITON_TAG}-py3 AS portable" in dockerfile
    assert versions.TRTLLM_VERSION == "1.2.1"  # what Triton 26.04-26.07 ship (NVIDIA's compatibility matrix)
    assert docker.IMAGE_TAG.endswith(versions.TRITON_TAG)
    # `make trtllm-image` builds the engine flavor's image on the same Triton release.
    assert docker.image_build_args(docker.ENGINE_RELEASE) == [
        "--target",
        "trtllm",
        "-t",
        docker.IMAGE_TAG,
        "--build-arg",
        f"TRITON_TAG={versions.TRITON_TAG}",
    ]


# ---------------------------------------------------------------- rendering


ENGINE = DECOUPLED_ENGINE_MODEL  # the engine's model in the default deployment


def trtllm_values(engine_dir: Path, tokenizer_dir: Path, **overrides) -> dict[str, str]:
    return plan_trtllm(tokenizer_dir, engine_dir, args(**overrides)).template_values()


def test_rendered_trtllm_repository(engine_dir, tokenizer_dir, tmp_path):
    configs = {n: c for n, (_, c) in render_configs(trtllm_values(engine_dir, tokenizer_dir), flavor="trtllm").items()}
    engine = configs[ENGINE]
    assert engine.backend == "tensorrtllm"
    assert engine.model_transaction_policy.decoupled
    params = {k: v.string_value for k, v in engine.parameters.items()}
    assert params["gpt_model_type"] == "inflight_fused_batching"
    assert params["gpt_model_path"] == str(engine_dir)
    assert params["max_beam_width"] == "1"
    assert params["exclude_input_in_output"] == "true"
    assert params["enable_kv_cache_reuse"] == "true"
    assert params["kv_cache_free_gpu_mem_fraction"] == "0.85"
    assert all(c.max_batch_size == 64 for c in configs.values())
    assert configs["preprocessing"].parameters["max_input_len"].string_value == "2048"
    assert configs["preprocessing"].parameters["max_seq_len"].string_value == "4096"
    out = tmp_path / "repo"
    write_repository(trtllm_values(engine_dir, tokenizer_dir), out, flavor="trtllm")
    assert not (out / ENGINE / "1" / "model.py").exists(), "the C++ backend needs no model.py"
    assert (out / ENGINE / "1").is_dir()


# Parameters NVIDIA's C++ tensorrtllm backend (TensorRT-LLM 1.2.1) reads with no fallback: ModelState::GetParameter
# (triton_backend/inflight_batcher_llm/src/model_state.cc) throws "Cannot find parameter with name" when a key is
# absent, and these calls are not guarded: the first two when ModelInstanceState is created (the path must be an
# existing engine folder), the last three in ModelInstanceState::getGuidedDecodingConfigFromParams
# (model_instance_state.cc). A missing one fails the model's load.
UNGUARDED_TRTLLM_PARAMETERS = (
    "gpt_model_type",
    "gpt_model_path",
    "tokenizer_dir",
    "xgrammar_tokenizer_info_path",
    "guided_decoding_backend",
)


def test_rendered_trtllm_config_has_every_parameter_the_backend_requires(engine_dir, tokenizer_dir):
    configs = render_configs(trtllm_values(engine_dir, tokenizer_dir), flavor="trtllm")
    params = configs[ENGINE][1].parameters
    assert [p for p in UNGUARDED_TRTLLM_PARAMETERS if p not in params] == []


def test_rendered_trtllm_config_turns_guided_decoding_on(engine_dir, tokenizer_dir, tmp_path):
    """What getGuidedDecodingConfigFromParams needs: backend "xgrammar" and an existing tokenizer-info file."""
    build_dir = tmp_path / "build"
    values = trtllm_values(engine_dir, tokenizer_dir, build_dir=build_dir)
    config = render_configs(values, flavor="trtllm")[ENGINE][1]
    params = {k: v.string_value for k, v in config.parameters.items()}
    assert params["guided_decoding_backend"] == "xgrammar"  # the only backend the C++ runtime takes
    path = Path(params["xgrammar_tokenizer_info_path"])
    assert path.is_absolute(), "the backend opens it relative to tritonserver's working folder otherwise"
    assert path == (build_dir / "model_repository" / ENGINE / "1" / "xgrammar_tokenizer_info.json").resolve()
    assert params["tokenizer_dir"] == "", "read but ignored by the C++ backend; set, it only logs that it is ignored"
    assert params["normalize_log_probs"] == "true"


def test_the_build_writes_the_tokenizer_info_where_the_config_points(engine_dir, tokenizer_dir, tmp_path):
    build_dir = tmp_path / "build"
    options = ["--engine-dir", str(engine_dir), "--model", str(tokenizer_dir), "--build-dir", str(build_dir)]
    assert builder_main(["--engine", "trtllm", *options]) == 0
    config = read_config(build_dir / "model_repository" / ENGINE / "config.pbtxt")
    path = Path(config.parameters["xgrammar_tokenizer_info_path"].string_value)
    assert path.is_file()
    info = json.loads(path.read_text())
    assert set(info) == {"encoded_vocab", "tokenizer_str", "stop_token_ids"}
    manifest = json.loads((build_dir / "manifest.json").read_text())
    assert "files" not in manifest and "encoded_vocab" not in json.dumps(manifest)
    assert manifest["kv_cache_block_tokens"] == 32  # the OpenAI layer's unit of kv_cache_reused_blocks


# lora_task_id is NVIDIA's name too: the C++ backend's model and its face declare it with NVIDIA's other LoRA inputs.
PORTABLE_ADDITIONS = {
    "num_top_log_probs",
    "openai_penalties",
    "top_log_probs",
    "top_log_prob_ids",
    "lora_task_id",
    "lora_name",
}
# NVIDIA's LoRA inputs of the tensorrtllm backend's template (triton_backend/all_models/inflight_batcher_llm/
# tensorrt_llm/config.pbtxt @ 0c8de69a1ca6213eebb20a51873890ff128666c2): name -> (type, dims, reshape, ragged).
NVIDIA_LORA_INPUTS = {
    "lora_task_id": ("TYPE_UINT64", [1], [], False),
    "lora_weights": ("TYPE_FP16", [-1, -1], None, True),
    "lora_config": ("TYPE_INT32", [-1, 3], None, True),
}


@pytest.mark.parametrize("decoupled_mode", [False, True])
def test_no_trtllm_model_declares_the_portable_engines_additions(engine_dir, tokenizer_dir, decoupled_mode):
    """The C++ backend computes none of them: every model refuses them by name, in both deployments (the decoupled
    ensemble maps its engine step to the C++ model itself)."""
    plan = dataclasses.replace(plan_trtllm(tokenizer_dir, engine_dir, args()), decoupled_mode=decoupled_mode)
    configs = render_configs(plan.template_values(), flavor="trtllm", decoupled_mode=decoupled_mode)
    for name, (_, config) in configs.items():
        tensors = {t.name for t in [*config.input, *config.output]}
        nvidia = {"lora_task_id"} if name in (ENGINE_MODEL, ENGINE) else set()
        assert tensors & PORTABLE_ADDITIONS == nvidia, name
    from tests.unit.repository.test_render import DECOUPLED_VALUES, VALUES

    portable = render_configs(DECOUPLED_VALUES if decoupled_mode else VALUES, decoupled_mode=decoupled_mode)
    for name in ("ensemble", "tensorrt_llm_bls", ENGINE_MODEL):
        tensors = {t.name for t in [*portable[name][1].input, *portable[name][1].output]}
        assert tensors >= PORTABLE_ADDITIONS, name


def test_client_facing_io_is_identical_in_both_flavors(engine_dir, tokenizer_dir):
    trt = {n: c for n, (_, c) in render_configs(trtllm_values(engine_dir, tokenizer_dir), flavor="trtllm").items()}
    from tests.unit.repository.test_render import VALUES

    portable = {n: c for n, (_, c) in render_configs(VALUES).items()}
    assert set(trt) == set(portable)

    def shared(tensors) -> list:
        return [t for t in tensors if t.name not in PORTABLE_ADDITIONS]

    for name in ("ensemble", "tensorrt_llm_bls"):
        assert list(trt[name].input) == shared(portable[name].input)
        assert list(trt[name].output) == shared(portable[name].output)
    for trt_step, portable_step in zip(
        trt["ensemble"].ensemble_scheduling.step, portable["ensemble"].ensemble_scheduling.step, strict=True
    ):
        assert trt_step.model_name == portable_step.model_name
        assert dict(trt_step.input_map) == {
            k: v for k, v in portable_step.input_map.items() if k not in PORTABLE_ADDITIONS
        }
        assert dict(trt_step.output_map) == {
            k: v for k, v in portable_step.output_map.items() if k not in PORTABLE_ADDITIONS
        }
    # tensorrt_llm: the shared tensors (_shared/tensorrt_llm_io.pbtxt); the portable engine's additions
    # (_shared/portable_engine_io.pbtxt, e.g. top log probs) are not declared by the C++ backend's model.
    additions = portable_only_tensors()
    trt_inputs = [t for t in trt[ENGINE].input if t.name not in NVIDIA_LORA_INPUTS]
    assert trt_inputs == [t for t in portable[ENGINE].input if t.name not in additions]
    assert list(trt[ENGINE].output) == [t for t in portable[ENGINE].output if t.name not in additions]
    assert additions & {t.name for t in [*trt[ENGINE].input, *trt[ENGINE].output]} == {"lora_task_id"}  # NVIDIA's


@pytest.mark.parametrize("decoupled_mode", [False, True])
def test_the_cpp_model_and_its_face_declare_nvidias_lora_inputs(engine_dir, tokenizer_dir, decoupled_mode):
    """lora_task_id, lora_weights and lora_config, optional, with the template's types and shapes, on the C++ model
    and on tensorrt_llm in both deployments (the default one's is the face that forwards every input); the ensemble
    and tensorrt_llm_bls declare none of them."""
    plan = dataclasses.replace(plan_trtllm(tokenizer_dir, engine_dir, args()), decoupled_mode=decoupled_mode)
    configs = {
        n: c
        for n, (_, c) in render_configs(plan.template_values(), flavor="trtllm", decoupled_mode=decoupled_mode).items()
    }
    from tritonclient.grpc import model_config_pb2 as mc

    for name in {ENGINE_MODEL, plan.engine_model}:
        inputs = {t.name: t for t in configs[name].input}
        for tensor, (dtype, dims, reshape, ragged) in NVIDIA_LORA_INPUTS.items():
            declared = inputs[tensor]
            assert mc.DataType.Name(declared.data_type) == dtype and list(declared.dims) == dims, (name, tensor)
            assert declared.optional and declared.allow_ragged_batch == ragged, (name, tensor)
            assert (list(declared.reshape.shape) if declared.HasField("reshape") else None) == reshape, (name, tensor)
    for name in ("ensemble", "tensorrt_llm_bls"):
        assert not {t.name for t in configs[name].input} & NVIDIA_LORA_INPUTS.keys(), name
    # The backend's LoRA cache parameters are left to its defaults (each read guarded).
    assert not [p for p in configs[plan.engine_model].parameters if p.startswith("lora_")]


def portable_only_tensors() -> set[str]:
    fragment = TEMPLATES / "_shared" / "portable_engine_io.pbtxt"
    if not fragment.is_file():
        return set()
    config = parse_config(f'name: "x"\n{fragment.read_text()}', str(fragment))
    return {t.name for t in [*config.input, *config.output]}


def test_triton_batch_size_cannot_exceed_the_engines(engine_dir, tokenizer_dir):
    assert trtllm_values(engine_dir, tokenizer_dir, max_batch_size=32)["triton_max_batch_size"] == "32"
    with pytest.raises(EngineError, match="larger than the engine's max_batch_size 64"):
        trtllm_values(engine_dir, tokenizer_dir, max_batch_size=128)


def test_tokenizer_folder_must_exist(engine_dir, tmp_path):
    with pytest.raises(BuildError, match="has no tokenizer files"):
        plan_trtllm(tmp_path, engine_dir, args())


# ---------------------------------------------------------------- the build: calls into tensorrt_llm


# QuantConfig._requires_modelopt_quantization (tensorrt_llm/models/modeling_utils.py, 1.2.1): the quant_algo values
# that PretrainedModel.quantize hands to ModelOpt; with no quant_algo, only an FP8 KV cache goes there.
MODELOPT_QUANT_ALGOS = frozenset(
    f"QuantAlgo.{n}" for n in ("NVFP4", "FP8", "W4A16_AWQ", "W4A8_AWQ", "W8A8_SQ_PER_CHANNEL", "MIXED_PRECISION")
)


def requires_modelopt_quantization(quant_config) -> bool:
    algo, kv_algo = quant_config.kwargs["quant_algo"], quant_config.kwargs["kv_cache_quant_algo"]
    return algo in MODELOPT_QUANT_ALGOS or (algo is None and kv_algo == "QuantAlgo.FP8")


class Recorder:
    """Stands in for tensorrt_llm's API and records every call made to it."""

    def __init__(self, architectures=("LlamaForCausalLM",)):
        self.calls: list[tuple] = []
        recorder = self

        class Mapping:
            def __init__(self, **kwargs):
                self.kwargs = kwargs
                recorder.calls.append(("Mapping", kwargs))

        class PluginConfig:
            def __setattr__(self, name, value):
                recorder.calls.append(("plugin", name, value))
                object.__setattr__(self, name, value)

        class BuildConfig:
            def __init__(self, **kwargs):
                self.kwargs = kwargs
                self.plugin_config = PluginConfig()
                recorder.calls.append(("BuildConfig", kwargs))

        class QuantConfig:
            def __init__(self, **kwargs):
                self.kwargs = kwargs
                recorder.calls.append(("QuantConfig", kwargs))

        class QuantAlgo:
            def __getattr__(self, name):
                return f"QuantAlgo.{name}"

        class Engine:
            def save(self, path):
                recorder.calls.append(("save", path))

        class Model:
            @classmethod
            def from_hugging_face(cls, hf_dir, **kwargs):
                recorder.calls.append(("from_hugging_face", hf_dir, kwargs["mapping"].kwargs, kwargs["dtype"]))
                return cls()

            @classmethod
            def quantize(cls, hf_dir, out_dir, **kwargs):
                # As strict as PretrainedModel.quantize: anything ModelOpt does not take is refused.
                if not requires_modelopt_quantization(kwargs["quant_config"]):
                    raise ValueError(f"The quant_config ({kwargs['quant_config'].kwargs}) should not call modelopt")
                recorder.calls.append(("quantize", hf_dir, out_dir, kwargs))

            @classmethod
            def from_checkpoint(cls, ckpt_dir, rank):
                recorder.calls.append(("from_checkpoint", ckpt_dir, rank))
                return cls()

        def build(model, config):
            recorder.calls.append(("build", config.kwargs["max_batch_size"]))
            return Engine()

        self.api = TrtllmApi(
            version="1.2.1",
            Mapping=Mapping,
            BuildConfig=BuildConfig,
            build=build,
            QuantConfig=QuantConfig,
            QuantAlgo=QuantAlgo(),
            MODEL_MAP={a: Model for a in architectures},
        )

    def named(self, name: str) -> list[tuple]:
        return [c for c in self.calls if c[0] == name]


def run_build(tmp_path: Path, tokenizer_dir: Path, **options) -> Recorder:
    recorder = Recorder()
    build_engine(TrtllmBuildOptions(**options), tokenizer_dir, tmp_path / "engine", tmp_path / "work", recorder.api)
    return recorder


def test_plain_build_converts_and_compiles_one_rank(tmp_path, tokenizer_dir):
    rec = run_build(tmp_path, tokenizer_dir, dtype="float16", max_batch_size=32, max_input_len=1024, max_seq_len=2048)
    assert rec.named("QuantConfig") == [
        ("QuantConfig", {"quant_algo": None, "kv_cache_quant_algo": None, "group_size": 128})
    ]
    assert rec.named("from_hugging_face") == [
        ("from_hugging_face", str(tokenizer_dir), {"world_size": 1, "rank": 0, "tp_size": 1, "pp_size": 1}, "float16")
    ]
    [(_, build_kwargs)] = rec.named("BuildConfig")
    assert build_kwargs == {
        "max_batch_size": 32,
        "max_input_len": 1024,
        "max_seq_len": 2048,
        "max_num_tokens": 8192,
        "max_beam_width": 1,
        "output_timing_cache": str(tmp_path / "work" / "model.cache"),
    }
    plugins = {c[1]: c[2] for c in rec.named("plugin")}
    assert plugins == {
        "remove_input_padding": True,
        "context_fmha": True,
        "use_paged_context_fmha": True,
        "tokens_per_block": 32,
        "gemm_plugin": "auto",
    }
    assert rec.named("build") == [("build", 32)]
    assert rec.named("save") == [("save", str(tmp_path / "engine"))]
    assert not rec.named("quantize")


def test_tensor_and_pipeline_parallel_build_every_rank(tmp_path, tokenizer_dir):
    rec = run_build(tmp_path, tokenizer_dir, tp_size=2, pp_size=2)
    mappings = [c[2] for c in rec.named("from_hugging_face")]
    assert mappings == [{"world_size": 4, "rank": r, "tp_size": 2, "pp_size": 2} for r in range(4)]
    assert len(rec.named("build")) == 4 and len(rec.named("save")) == 4
    assert len(rec.named("BuildConfig")) == 4, "one BuildConfig per rank, as upstream's build() deep-copies it"


@pytest.mark.parametrize(("quant", "algo"), [("int8_wo", "QuantAlgo.W8A16"), ("int4_wo", "QuantAlgo.W4A16")])
def test_weight_only_quantization_happens_in_conversion(tmp_path, tokenizer_dir, quant, algo):
    rec = run_build(tmp_path, tokenizer_dir, quant=quant)
    assert rec.named("QuantConfig")[0][1]["quant_algo"] == algo
    assert rec.named("from_hugging_face") and not rec.named("quantize")
    assert ("plugin", "gemm_plugin", "auto") in rec.calls


@pytest.mark.parametrize(
    ("options", "algo", "kv_algo"),
    [
        ({"quant": "fp8"}, "QuantAlgo.FP8", None),
        ({"quant": "int4_awq", "group_size": 64}, "QuantAlgo.W4A16_AWQ", None),
        ({"quant": "int8_sq"}, "QuantAlgo.W8A8_SQ_PER_CHANNEL", None),
        ({"quant": "none", "kv_cache_quant": "fp8"}, None, "QuantAlgo.FP8"),
        ({"quant": "int4_awq", "kv_cache_quant": "int8"}, "QuantAlgo.W4A16_AWQ", "QuantAlgo.INT8"),
        ({"quant": "fp8", "kv_cache_quant": "fp8"}, "QuantAlgo.FP8", "QuantAlgo.FP8"),
    ],
)
def test_calibrated_quantization_writes_a_checkpoint_first(tmp_path, tokenizer_dir, options, algo, kv_algo):
    rec = run_build(tmp_path, tokenizer_dir, tp_size=2, calib_dataset="/data/calib", **options)
    [(_, qc)] = rec.named("QuantConfig")
    assert (qc["quant_algo"], qc["kv_cache_quant_algo"]) == (algo, kv_algo)
    [(_, hf, out, kwargs)] = rec.named("quantize")
    assert hf == str(tokenizer_dir) and out == str(tmp_path / "work" / "checkpoint")
    assert kwargs["calib_dataset"] == "/data/calib" and kwargs["mapping"].kwargs["tp_size"] == 2
    assert rec.named("from_checkpoint") == [("from_checkpoint", out, 0), ("from_checkpoint", out, 1)]
    assert not rec.named("from_hugging_face")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"dtype": "float32"}, "float16 or bfloat16"),
        ({"quant": "int3"}, "--quant int3"),
        ({"tp_size": 0}, "at least 1"),
        ({"max_input_len": 4096, "max_seq_len": 4096}, "below --max-seq-len"),
        # Weight-only or no quantization with a quantized KV cache leaves ModelOpt's path in TensorRT-LLM, and fails.
        ({"quant": "int8_wo", "kv_cache_quant": "fp8"}, "--quant int8_wo with --kv-cache-quant fp8"),
        ({"quant": "int4_wo", "kv_cache_quant": "fp8"}, "--quant int4_wo with --kv-cache-quant fp8"),
        ({"quant": "int8_wo", "kv_cache_quant": "int8"}, "--quant int8_wo with --kv-cache-quant int8"),
        ({"quant": "int4_wo", "kv_cache_quant": "int8"}, "--quant int4_wo with --kv-cache-quant int8"),
        ({"quant": "none", "kv_cache_quant": "int8"}, "--quant none with --kv-cache-quant int8"),
    ],
)
def test_bad_build_options(tmp_path, tokenizer_dir, options, message):
    with pytest.raises(TrtllmBuildError, match=re.escape(message)):
        run_build(tmp_path, tokenizer_dir, **options)


def test_unsupported_architecture_names_the_alternative(tmp_path, tokenizer_dir):
    recorder = Recorder(architectures=("Qwen2ForCausalLM",))
    with pytest.raises(TrtllmBuildError, match=r"LlamaForCausalLM has no TensorRT engine support .* ENGINE=portable"):
        build_engine(TrtllmBuildOptions(), tokenizer_dir, tmp_path / "e", tmp_path / "w", recorder.api)


# ---------------------------------------------------------------- host checks and command lines


def fake_host(docker: bool, daemon: bool, gpus: int):
    def which(name):
        present = (name == "docker" and docker) or (name == "nvidia-smi" and gpus >= 0)
        return f"/usr/bin/{name}" if present else None

    def run(command, **kwargs):
        if command[:2] == ["docker", "info"]:
            return subprocess.CompletedProcess(command, 0 if daemon else 1, "", "")
        lines = "".join(f"GPU {i}: NVIDIA H200 (UUID: GPU-{i})\n" for i in range(max(gpus, 0)))
        return subprocess.CompletedProcess(command, 0, lines, "")

    return {"run": run, "which": which}


@pytest.mark.parametrize(
    ("host", "needed", "expected"),
    [
        ({"docker": False, "daemon": False, "gpus": 1}, 1, ["Docker is not installed"]),
        ({"docker": True, "daemon": False, "gpus": 1}, 1, ["daemon does not answer"]),
        ({"docker": True, "daemon": True, "gpus": -1}, 1, ["No NVIDIA GPU found"]),
        ({"docker": True, "daemon": True, "gpus": 0}, 1, ["No NVIDIA GPU found"]),
        ({"docker": True, "daemon": True, "gpus": 2}, 4, ["= 4 GPUs, but this host has 2"]),
        ({"docker": True, "daemon": True, "gpus": 8}, 4, []),
    ],
)
def test_host_problems(monkeypatch, host, needed, expected):
    fake = fake_host(**host)
    monkeypatch.setattr(docker.shutil, "which", fake["which"])
    problems = docker.host_problems(needed, run=fake["run"], which=fake["which"])
    assert len(problems) == len(expected)
    for problem, words in zip(problems, expected, strict=True):
        assert words in problem


def test_docker_run_command():
    command = docker.docker_run("img:1", Path("/src/proj"), ["python3", "x.py"], ports={"http": 9000, "grpc": 9001})
    joined = " ".join(command)
    assert command[:4] == ["docker", "run", "--rm", "--init"]
    assert "--gpus all" in joined and "--shm-size=2g" in joined and "--ulimit memlock=-1" in joined
    assert "-v /src/proj:/src/proj -w /src/proj" in joined and "-e PYTHONPATH=/src/proj" in joined
    assert "-p 127.0.0.1:9000:8000" in joined and "-p 127.0.0.1:9001:8001" in joined
    assert command[-3:] == ["img:1", "python3", "x.py"]


def launch_command(world_size: int, **options) -> list[str]:
    return server_command(
        CONTAINER_BINARY, Path("/repo"), address="0.0.0.0", ports=PORTS, world_size=world_size, **options
    )


def test_single_gpu_launch_is_one_tritonserver():
    command = launch_command(1)
    assert command[0] == CONTAINER_BINARY and "mpirun" not in command
    assert "--model-repository=/repo" in command and "--http-address=0.0.0.0" in command


def test_multi_gpu_launch_is_one_rank_per_gpu_under_mpi():
    command = launch_command(2)
    assert command[:2] == ["mpirun", "--allow-run-as-root"]
    ranks = " ".join(command[2:]).split(" : ")
    assert len(ranks) == 2
    assert all(r.startswith(f"-n 1 {CONTAINER_BINARY} ") for r in ranks)
    assert "shm-region-prefix-name=prefix0_" in ranks[0] and "--load-model" not in ranks[0]
    assert "shm-region-prefix-name=prefix1_" in ranks[1]
    assert "--model-control-mode=explicit --load-model=tensorrt_llm_decoupled" in ranks[1]
    decoupled = " ".join(launch_command(2, engine_model="tensorrt_llm"))
    assert "--load-model=tensorrt_llm " in decoupled + " ", "the decoupled deployment's engine is tensorrt_llm"


def test_serve_refuses_a_portable_build_and_missing_pieces(tmp_path, engine_dir, tokenizer_dir):
    with pytest.raises(EngineError, match=r"manifest\.json is missing"):
        load_build(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"engine": "portable"}))
    with pytest.raises(EngineError, match="holds a portable build"):
        load_build(tmp_path)
    manifest = {"engine": "trtllm", "tokenizer_dir": str(tmp_path / "gone"), "engine_dir": str(engine_dir)}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EngineError, match=r"tokenizer folder .* is missing"):
        load_build(tmp_path)
    manifest["tokenizer_dir"] = str(tokenizer_dir)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(EngineError, match=r"rendered from other model templates.*make build ENGINE=trtllm"):
        load_build(tmp_path)  # a build from before an update of the templates
    manifest["templates"] = templates_digest()
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert load_build(tmp_path).version == "1.2.1"


def test_launch_passes_the_build_options_timeout_and_admin_key_to_every_rank():
    options = {"build_options": ["--backend-config=python,thread-pool-size=48"], "admin_key": "k", "exit_timeout": 60}
    expected = [
        "--exit-timeout-secs=60",
        "--backend-config=python,thread-pool-size=48",
        f"--http-restricted-api={RESTRICTED_APIS}:{ADMIN_HEADER}=k",
    ]
    single = launch_command(1, **options)
    assert all(flag in single for flag in expected)
    ranks = " ".join(launch_command(2, **options)[2:]).split(" : ")
    assert all(flag in rank for rank in ranks for flag in expected)


def test_serve_trtllm_in_the_image_launches_with_the_recorded_options(tmp_path, monkeypatch, engine_dir):
    """`make serve ENGINE=trtllm` inside the image runs the same command as the container entrypoint."""
    manifest = {
        "engine": "trtllm",
        "engine_dir": str(engine_dir),
        "tokenizer_dir": str(engine_dir),
        "server_options": ["--backend-config=python,thread-pool-size=48"],
        "templates": templates_digest(),
    }
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    (engine_dir / "tokenizer.json").write_text("{}")
    monkeypatch.setenv("NVIDIA_TRITON_SERVER_VERSION", "26.07")
    monkeypatch.setenv("TRITONLLM_ADMIN_KEY", "secret")
    monkeypatch.setattr(serve_trtllm, "installed_trtllm", lambda: "1.2.1")
    monkeypatch.setattr(container, "version", lambda name: "1.2.1")
    ran = []
    monkeypatch.setattr(container.os, "execvp", lambda binary, command: ran.append(command))
    serve_trtllm.main(["--build-dir", str(tmp_path), "--exit-timeout", "7"])
    (command,) = ran
    assert command[0] == CONTAINER_BINARY
    assert "--backend-config=python,thread-pool-size=48" in command and "--exit-timeout-secs=7" in command
    assert any(flag.startswith("--http-restricted-api=") and flag.endswith("=secret") for flag in command)


def test_build_once_skips_a_build_it_already_made(tmp_path, monkeypatch):
    from tritonllm.repository import builder as build

    calls = []
    monkeypatch.setattr(build, "main", lambda args: calls.append(args) or 0)
    args = ["--engine", "portable", "--build-dir", str(tmp_path)]
    assert container.build_once(args, tmp_path) == 0 and len(calls) == 1
    (tmp_path / "manifest.json").write_text(json.dumps({"templates": templates_digest()}))
    assert container.build_once(args, tmp_path) == 0 and len(calls) == 1, "same arguments: no second build"
    (tmp_path / "manifest.json").write_text("{}")
    assert container.build_once(args, tmp_path) == 0 and len(calls) == 2, "rendered from other templates: again"
    assert container.build_once([*args, "--max-batch-size", "8"], tmp_path) == 0 and len(calls) == 3


# ---------------------------------------------------------------- audit risks: image, guides, beams, mounts, MPI


def trtllm_stage_commands(dockerfile: str) -> list[str]:
    """The shell commands of the trtllm stage's RUN lines, continuation lines joined, split at `&&`."""
    stage = dockerfile.split(" AS trtllm\n", 1)[1].split("\nFROM ", 1)[0].replace("\\\n", " ")
    runs = [line.removeprefix("RUN ") for line in stage.splitlines() if line.startswith("RUN ")]
    return [" ".join(command.split()) for run in runs for command in run.split("&&")]


def test_the_trtllm_image_installs_tritonclient_without_resolving_its_dependencies():
    """tritonclient 2.51's metadata caps numpy<2 and protobuf<5: resolving them would downgrade NVIDIA's own."""
    commands = trtllm_stage_commands((ROOT / "Dockerfile").read_text())
    installs = [c for c in commands if "pip install" in c]
    assert installs and all("--no-deps" in c for c in installs), installs
    (install,) = [c for c in installs if "tritonclient" in c]
    assert '"tritonclient==2.51.0"' in install and "[" not in install, "extras mean nothing without dependencies"
    used = (ROOT / "tritonllm" / "text" / "model_config.py").read_text()
    assert "from tritonclient.grpc import model_config_pb2" in used
    check = 'python3 -c "from tritonclient.grpc import model_config_pb2"'
    assert check in commands[commands.index(install) + 1 :], "the image build imports what the project uses"


@pytest.fixture
def slow_tokenizer_dir(tmp_path) -> Path:
    """A model folder whose tokenizer has no fast form (ByT5's, pure Python: no tokenizer.json)."""
    folder = tmp_path / "byt5"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "ByT5Tokenizer"}))
    (folder / "config.json").write_text(json.dumps({"model_type": "t5"}))
    return folder


def test_a_tokenizer_without_a_fast_form_builds_with_guided_decoding_off(engine_dir, slow_tokenizer_dir, capsys):
    plan = plan_trtllm(slow_tokenizer_dir, engine_dir, args())
    params = render_configs(plan.template_values(), flavor="trtllm")[ENGINE][1].parameters
    # Both empty: getGuidedDecodingConfigFromParams returns no config, and the engine loads without guides.
    assert params["guided_decoding_backend"].string_value == ""
    assert params["xgrammar_tokenizer_info_path"].string_value == ""
    assert plan.files == {} and plan.details["guided_decoding"] is False
    err = capsys.readouterr().err
    assert "guided decoding is off for this model" in err and "ByT5Tokenizer" in err and "no fast form" in err


@pytest.mark.parametrize("fast", [True, False])
def test_the_manifest_says_whether_guided_decoding_is_on(engine_dir, tokenizer_dir, slow_tokenizer_dir, tmp_path, fast):
    build_dir = tmp_path / "build"
    model = tokenizer_dir if fast else slow_tokenizer_dir
    options = ["--engine-dir", str(engine_dir), "--model", str(model), "--build-dir", str(build_dir)]
    assert builder_main(["--engine", "trtllm", *options]) == 0
    assert json.loads((build_dir / "manifest.json").read_text())["guided_decoding"] is fast
    written = (build_dir / "model_repository" / ENGINE / "1" / "xgrammar_tokenizer_info.json").is_file()
    assert written is fast, "no tokenizer file when guides are off"


def test_a_tokenizer_beyond_the_engines_vocabulary_is_still_a_build_error(tmp_path, tokenizer_dir):
    config = engine_config()
    config["pretrained_config"]["vocab_size"] = 100
    with pytest.raises(BuildError, match=r"guided decoding: .* beyond the engine's vocabulary of 100"):
        plan_trtllm(tokenizer_dir, write_engine(tmp_path / "engine", config), args())


# The values ModelInstanceState::getExecutorConfigFromParams takes for decoding_mode (model_instance_state.cc);
# any other is logged as invalid and left to the executor.
BACKEND_DECODING_MODES = {"top_k", "top_p", "top_k_top_p", "beam_search", "medusa", "redrafter", "lookahead", "eagle"}


@pytest.mark.parametrize(("beams", "mode"), [(1, "top_k_top_p"), (4, "beam_search")])
def test_the_decoding_mode_is_stated_for_the_engines_beam_width(tmp_path, tokenizer_dir, capsys, beams, mode):
    """beam_search for max_beam_width > 1: the executor runs it as top_k_top_p while it runs beam_width 1
    requests (getDecodingMode), where top_k_top_p would give beam_width > 1 requests a sampling decoder."""
    path = write_engine(tmp_path / "engine", engine_config(max_beam_width=beams))
    params = render_configs(trtllm_values(path, tokenizer_dir), flavor="trtllm")[ENGINE][1].parameters
    assert params["decoding_mode"].string_value == mode and mode in BACKEND_DECODING_MODES
    assert params["max_beam_width"].string_value == str(beams)
    err = capsys.readouterr().err
    if beams == 1:
        assert "max_beam_width" not in err
    else:
        assert f"built with max_beam_width {beams}" in err and "one beam width at a time" in err


def test_docker_run_mounts_folders_outside_the_project_at_their_own_paths():
    folders = [Path("/src/proj/build"), Path("/data/engines/e1"), Path("/data"), Path("/models/tok"), Path("/data")]
    command = docker.docker_run("img:1", Path("/src/proj"), ["x"], folders=folders)
    mounts = [command[i + 1] for i, arg in enumerate(command) if arg == "-v"]
    assert mounts == ["/src/proj:/src/proj", "/data:/data", "/models/tok:/models/tok"], "each once, none inside another"


def test_serve_trtllm_mounts_the_build_engine_and_tokenizer_folders(tmp_path, monkeypatch, engine_dir, tokenizer_dir):
    """The rendered configs name them by absolute path (gpt_model_path, xgrammar_tokenizer_info_path, tokenizer_dir):
    outside the project, the container must still find them there."""
    build_dir, project = tmp_path / "build", tmp_path / "project"
    build_dir.mkdir()
    project.mkdir()
    manifest = {
        "engine": "trtllm",
        "engine_dir": str(engine_dir),
        "tokenizer_dir": str(tokenizer_dir),
        "templates": templates_digest(),
    }
    (build_dir / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.chdir(project)
    monkeypatch.delenv("NVIDIA_TRITON_SERVER_VERSION", raising=False)
    monkeypatch.delenv(docker.IMAGE_MARKER, raising=False)
    monkeypatch.setattr(docker, "host_problems", lambda gpus_needed: [])
    monkeypatch.setattr(serve_trtllm.subprocess, "run", lambda command, **kw: subprocess.CompletedProcess(command, 0))
    ran = []
    monkeypatch.setattr(serve_trtllm.os, "execvp", lambda binary, command: ran.append(command))
    serve_trtllm.main(["--build-dir", str(build_dir)])
    (command,) = ran
    mounts = {command[i + 1] for i, arg in enumerate(command) if arg == "-v"}
    for folder in (project, build_dir, engine_dir, tokenizer_dir):
        assert f"{folder}:{folder}" in mounts


def write_launch_build(build_dir: Path, engine: Path) -> None:
    manifest = {"engine": "trtllm", "engine_dir": str(engine), "engine_model": ENGINE, "server_options": []}
    (build_dir / "manifest.json").write_text(json.dumps(manifest))


def test_launch_refuses_a_parallel_engine_when_mpirun_is_missing(tmp_path, monkeypatch, capsys):
    config = engine_config()
    config["pretrained_config"]["mapping"].update(world_size=2, tp_size=2)
    write_launch_build(tmp_path, write_engine(tmp_path / "tp2", config, ranks=2))
    monkeypatch.setattr(container, "version", lambda name: "1.2.1")
    ran = []
    monkeypatch.setattr(container.os, "execvp", lambda binary, command: ran.append(command))
    monkeypatch.setattr(container.shutil, "which", lambda name: None)
    assert container.main(["launch", str(tmp_path)]) == 1 and ran == []
    err = capsys.readouterr().err
    assert "mpirun is not on PATH" in err and "tp 2 x pp 1" in err and "--tp 1 --pp 1" in err
    monkeypatch.setattr(container.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert container.main(["launch", str(tmp_path)]) == 0
    assert ran[0][0] == "mpirun"


def test_launch_of_a_single_gpu_engine_needs_no_mpirun(tmp_path, monkeypatch, engine_dir):
    write_launch_build(tmp_path, engine_dir)
    monkeypatch.setattr(container, "version", lambda name: "1.2.1")
    ran = []
    monkeypatch.setattr(container.os, "execvp", lambda binary, command: ran.append(command))
    monkeypatch.setattr(container.shutil, "which", lambda name: None)
    assert container.main(["launch", str(tmp_path)]) == 0
    assert ran[0][0] == CONTAINER_BINARY


def test_the_engine_build_in_the_image_mounts_the_build_model_and_engine_folders(tmp_path, monkeypatch):
    """The engine built in the image must land where the host's build renders its configs to look for it."""
    from tritonllm.repository import builder

    project, outside = tmp_path / "project", tmp_path / "elsewhere"
    project.mkdir()
    build_dir, model_dir, engine_dir = outside / "build", outside / "model", outside / "build" / "engines" / "e"
    monkeypatch.chdir(project)
    monkeypatch.setattr(TrtllmApi, "load", classmethod(lambda cls: (_ for _ in ()).throw(ImportError("no"))))
    monkeypatch.setattr(docker, "host_problems", lambda gpus_needed: [])
    ran = []
    monkeypatch.setattr(builder.subprocess, "run", lambda command: ran.append(command) or SimpleNamespace(returncode=0))
    args = builder.parse_args(["--engine", "trtllm"])
    builder.build_trtllm_engine(model_dir, engine_dir, build_dir, args, ["--engine", "trtllm"])
    (command,) = ran
    mounts = {command[i + 1] for i, arg in enumerate(command) if arg == "-v"}
    for folder in (project, build_dir, model_dir):
        assert f"{folder.resolve()}:{folder.resolve()}" in mounts
