"""The LLM API flavor's build and launch (build_engines.py --engine trtllm-llmapi): the rendered repository, the LLM
arguments it writes, what it refuses, and the command lines that serve it in NVIDIA's image."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tritonllm.engine.llmapi_config import LLM_API_CONFIG_FILE, LlmApiConfig
from tritonllm.launch import container, serve_trtllm
from tritonllm.launch.serve_trtllm import load_build
from tritonllm.launch.server_command import CONTAINER_BINARY
from tritonllm.repository.builder import main as builder_main
from tritonllm.repository.render import read_config
from tritonllm.trtllm import docker
from tritonllm.trtllm.engine_dir import EngineError


def build(tmp_path: Path, manifest: dict, *options: str) -> Path:
    code = builder_main(
        ["--engine", "trtllm-llmapi", "--model", manifest["model_dir"], "--build-dir", str(tmp_path), *options]
    )
    assert code == 0
    return tmp_path


def test_the_build_writes_the_llm_arguments_beside_the_engine_model(tmp_path, manifest):
    out = build(tmp_path, manifest, "--tp", "2", "--max-batch-size", "32", "--kv-cache-free-gpu-mem-fraction", "0.7")
    settings = json.loads((out / "model_repository" / "tensorrt_llm_decoupled" / "1" / LLM_API_CONFIG_FILE).read_text())
    expected = LlmApiConfig(
        manifest["model_dir"], tensor_parallel_size=2, max_batch_size=32, free_gpu_memory_fraction=0.7, max_seq_len=4096
    ).llm_kwargs()
    assert settings == {"release": "1.2.1", "sampler": "TRTLLMSampler", "llm": expected}
    written = settings["llm"]
    assert written["kv_cache_config"] == {"free_gpu_memory_fraction": 0.7, "enable_block_reuse": True, "dtype": "auto"}
    assert written["guided_decoding_backend"] == "xgrammar" and written["backend"] == "pytorch"
    recorded = json.loads((out / "manifest.json").read_text())
    assert (recorded["engine"], recorded["tp_size"], recorded["pp_size"]) == ("trtllm-llmapi", 2, 1)
    assert recorded["llm_api_release"] == "1.2.1"
    # The portable flavor's Python-backend engine model, one instance: the LLM places its ranks on the GPUs.
    engine = read_config(out / "model_repository" / "tensorrt_llm_decoupled" / "config.pbtxt")
    assert engine.backend == "python" and [g.kind for g in engine.instance_group] == [engine.instance_group[0].KIND_CPU]
    assert engine.instance_group[0].count == 1 and engine.max_batch_size == 32
    # TensorRT-LLM compiles guides in its batch step: preprocessing checks each first, as for the engine flavor.
    preprocessing = read_config(out / "model_repository" / "preprocessing" / "config.pbtxt")
    assert preprocessing.parameters["guided_decoding"].string_value == "compile"


def test_a_build_for_the_1_4_line_sends_no_sampler_and_records_its_release(tmp_path, manifest):
    out = build(tmp_path, manifest, "--llm-api-release", "1.4")
    settings = json.loads((out / "model_repository" / "tensorrt_llm_decoupled" / "1" / LLM_API_CONFIG_FILE).read_text())
    assert (settings["release"], settings["sampler"]) == ("1.4", "TorchSampler")
    assert "sampler_type" not in settings["llm"]  # 1.4 runs TorchSampler only, and refuses TRTLLMSampler
    assert json.loads((out / "manifest.json").read_text())["llm_api_release"] == "1.4"


def test_the_decoupled_deployment_puts_them_beside_tensorrt_llm(tmp_path, manifest):
    out = build(tmp_path, manifest, "--decoupled-mode")
    assert (out / "model_repository" / "tensorrt_llm" / "1" / LLM_API_CONFIG_FILE).is_file()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--quant", "int8_wo"], "quantizes nothing itself"),
        (["--kv-cache-quant", "int8"], "--kv-cache-quant int8: the LLM API flavor takes none, fp8"),
        (["--max-num-tokens", "1000"], "--max-num-tokens 1000 is below the maximum input length 3072"),
        (["--kv-cache-free-gpu-mem-fraction", "1.5"], "must be in \\(0, 1\\]"),
        (["--dtype", "gguf"], "--dtype gguf: the LLM API flavor takes"),
        (
            ["--llm-api-release", "1.4", "--llm-api-sampler", "TRTLLMSampler"],
            "--llm-api-sampler TRTLLMSampler: TensorRT-LLM 1.4 has TorchSampler only",
        ),
    ],
)
def test_bad_options_are_refused_by_name(tmp_path, manifest, capsys, options, message):
    code = builder_main(
        ["--engine", "trtllm-llmapi", "--model", manifest["model_dir"], "--build-dir", str(tmp_path), *options]
    )
    assert code == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--engine", "trtllm-llmapi", "--prefix-cache"], "--prefix-cache is an option of --engine portable;"),
        (["--engine", "trtllm-llmapi", "--engine-dir", "/e"], "--engine-dir is an option of --engine trtllm;"),
        (["--engine", "portable", "--no-kv-cache-reuse"], "--kv-cache-reuse is an option of --engine trtllm-llmapi;"),
        (["--engine", "synthetic", "--tp", "2"], "--tp is an option of --engine trtllm, trtllm-llmapi;"),
    ],
)
def test_another_engines_option_is_refused_by_name(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:
        builder_main([*argv, "--build-dir", str(tmp_path)])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_an_fp8_kv_cache_and_no_cuda_graphs_reach_the_llm_arguments(tmp_path, manifest):
    out = build(tmp_path, manifest, "--kv-cache-quant", "fp8", "--no-llm-api-cuda-graphs", "--no-kv-cache-reuse")
    settings = json.loads((out / "model_repository" / "tensorrt_llm_decoupled" / "1" / LLM_API_CONFIG_FILE).read_text())
    written = settings["llm"]
    assert written["kv_cache_config"]["dtype"] == "fp8" and written["kv_cache_config"]["enable_block_reuse"] is False
    assert written["cuda_graph_config"] is None


# ------------------------------------------------------------------ serving it in NVIDIA's image


def launched(tmp_path: Path, monkeypatch, manifest: dict, *options: str) -> list[str]:
    out = build(tmp_path, manifest, *options)
    ran = []
    monkeypatch.setattr(container.os, "execvp", lambda binary, command: ran.append(command))
    monkeypatch.setattr(container.shutil, "which", lambda name: f"/usr/bin/{name}")
    monkeypatch.setattr(container, "version", lambda name: "1.2.1")
    assert container.main(["launch", str(out)]) == 0
    return ran[0]


def test_one_gpu_is_one_tritonserver(tmp_path, monkeypatch, manifest):
    command = launched(tmp_path, monkeypatch, manifest)
    assert command[0] == CONTAINER_BINARY and "trtllm-llmapi-launch" not in command


def test_tensor_parallel_ranks_run_under_trtllm_llmapi_launch(tmp_path, monkeypatch, manifest):
    """As NVIDIA's launch_triton_server.py --world_size=N --trtllm_llmapi_launch --oversubscribe: every rank is
    `trtllm-llmapi-launch tritonserver ...`, which serves on rank 0 only and runs an LLM API worker on the others."""
    command = launched(tmp_path, monkeypatch, manifest, "--tp", "2")
    assert command[:3] == ["mpirun", "--allow-run-as-root", "--oversubscribe"]
    ranks = " ".join(command[3:]).split(" : ")
    assert len(ranks) == 2
    assert all(rank.startswith(f"-n 1 trtllm-llmapi-launch {CONTAINER_BINARY} ") for rank in ranks)
    assert "shm-region-prefix-name=prefix1_" in ranks[1]


def test_the_command_line_is_printed_for_review_outside_the_image(tmp_path, manifest, capsys):
    out = build(tmp_path, manifest, "--tp", "2")
    capsys.readouterr()
    assert container.main(["launch", str(out), "--dry-run"]) == 0  # no tensorrt_llm, mpirun or launcher here
    printed = capsys.readouterr().out.splitlines()[-1]  # after the note on the administrative APIs' key
    assert printed.startswith("mpirun --allow-run-as-root --oversubscribe -n 1 trtllm-llmapi-launch ")
    assert printed.count("trtllm-llmapi-launch") == 2


def test_serve_checks_gpus_and_mounts_the_checkpoint(tmp_path, monkeypatch, manifest):
    out = build(tmp_path / "build", manifest, "--tp", "2")
    served = load_build(out)
    assert served.world_size == 2 and Path(manifest["model_dir"]) in served.folders
    monkeypatch.delenv("NVIDIA_TRITON_SERVER_VERSION", raising=False)
    monkeypatch.delenv(docker.IMAGE_MARKER, raising=False)
    needed = []
    monkeypatch.setattr(docker, "host_problems", lambda gpus_needed: needed.append(gpus_needed) or ["no GPU here"])
    assert serve_trtllm.main(["--build-dir", str(out)]) == 1
    assert needed == [2]
    with pytest.raises(EngineError, match=r"this image runs TensorRT-LLM 1\.3\.0; the trtllm-llmapi flavor is written"):
        serve_trtllm.check_release(served, "1.3.0")


def test_the_entrypoint_refuses_another_release_and_a_missing_launcher(tmp_path, monkeypatch, manifest, capsys):
    out = build(tmp_path, manifest, "--tp", "2")
    monkeypatch.setattr(container.os, "execvp", lambda binary, command: pytest.fail("started"))
    monkeypatch.setattr(container, "version", lambda name: "1.3.0")
    assert container.main(["launch", str(out)]) == 1
    assert "runs TensorRT-LLM 1.3.0" in capsys.readouterr().err
    monkeypatch.setattr(container, "version", lambda name: "1.2.1")
    monkeypatch.setattr(container.shutil, "which", lambda name: None if name == "trtllm-llmapi-launch" else name)
    assert container.main(["launch", str(out)]) == 1
    assert "trtllm-llmapi-launch is not on PATH" in capsys.readouterr().err


def test_lora_adapters_are_listed_and_passed_to_the_llm_and_the_repository_takes_their_inputs(tmp_path, manifest):
    from tests.unit.engine.test_llmapi import peft_folder

    sql = peft_folder(tmp_path / "peft-sql")
    out = build(tmp_path / "build", manifest, "--lora", f"sql={sql}")
    engine_dir = out / "model_repository" / "tensorrt_llm_decoupled"
    settings = json.loads((engine_dir / "1" / LLM_API_CONFIG_FILE).read_text())
    assert settings["lora_adapters"] == [{"name": "sql", "task_id": 1, "path": str(sql.resolve())}]
    assert settings["llm"]["lora_config"] == {
        "lora_dir": [str(sql.resolve())],
        "lora_target_modules": ["attn_q", "attn_v"],
        "max_lora_rank": 8,
        "max_loras": 1,
        "max_cpu_loras": 1,
    }
    # The portable flavor's repository: the engine model, its face and the ensemble take lora_task_id and lora_name.
    for model in ("tensorrt_llm_decoupled", "tensorrt_llm", "ensemble", "tensorrt_llm_bls"):
        config = read_config(out / "model_repository" / model / "config.pbtxt")
        assert {"lora_task_id", "lora_name"} <= {t.name for t in config.input}, model
    ensemble = read_config(out / "model_repository" / "ensemble" / "config.pbtxt")
    step = next(s for s in ensemble.ensemble_scheduling.step if s.model_name == "tensorrt_llm")
    assert {"lora_task_id", "lora_name"} <= set(step.input_map)


def test_a_lora_folder_that_is_missing_is_refused(tmp_path, manifest, capsys):
    options = ["--model", manifest["model_dir"], "--build-dir", str(tmp_path), "--lora", f"sql={tmp_path / 'none'}"]
    assert builder_main(["--engine", "trtllm-llmapi", *options]) == 2
    err = capsys.readouterr().err
    assert "--lora sql=" in err and "no such folder" in err
