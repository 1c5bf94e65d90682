"""Serving an LLM API build on the release it records (build_engines.py --llm-api-release): the entrypoint's release
and library checks, the tritonserver it runs (NVIDIA's, or the nvidia-pytriton wheel's where the image has none),
and the image `make serve` runs it in."""

from __future__ import annotations

import json
import shlex
import subprocess
from importlib.metadata import PackageNotFoundError
from pathlib import Path

import pytest

from tritonllm.launch import container, serve_trtllm
from tritonllm.launch.pytriton_wheel import pytriton_root
from tritonllm.launch.server_command import CONTAINER_BINARY
from tritonllm.repository.render import templates_digest
from tritonllm.trtllm import docker
from tritonllm.trtllm.engine_dir import EngineError

WHEEL_BINARY = str(pytriton_root() / "tritonserver" / "bin" / "tritonserver")
RELEASE_IMAGE_1_4 = "tritonllm:trtllm-llmapi-1.4.0rc4"


def write_build(build_dir: Path, release: str | None, tp: int = 1) -> Path:
    """An LLM API build's manifest, as build_engines.py writes it (a build before --llm-api-release records none)."""
    tokenizer = build_dir / "model"
    tokenizer.mkdir(parents=True)
    (tokenizer / "tokenizer.json").write_text("{}")
    manifest = {
        "engine": "trtllm-llmapi",
        "model_dir": str(tokenizer),
        "tokenizer_dir": str(tokenizer),
        "tp_size": tp,
        "pp_size": 1,
        "server_options": [],
        "templates": templates_digest(),
        **({"llm_api_release": release} if release else {}),
    }
    (build_dir / "manifest.json").write_text(json.dumps(manifest))
    return build_dir


@pytest.fixture
def in_image(monkeypatch, tmp_path):
    """The image's side: the wheel's backend folder under tmp_path, every program found, exec recorded."""
    monkeypatch.setattr(container, "SERVER_WORK_DIR", tmp_path / "server")
    monkeypatch.setattr(container.shutil, "which", lambda name: f"/usr/bin/{name}")
    ran = []
    monkeypatch.setattr(container.os, "execvp", lambda binary, command: ran.append((command, None)))
    monkeypatch.setattr(container.os, "execvpe", lambda binary, command, env: ran.append((command, env)))
    return ran


def image_with(**versions: str):
    """importlib.metadata.version of an image with these packages."""

    def version(package: str) -> str:
        if package not in versions:
            raise PackageNotFoundError(package)
        return versions[package]

    return version


def test_the_14_build_runs_the_wheels_tritonserver_with_its_backends_and_environment(tmp_path, monkeypatch, in_image):
    build = write_build(tmp_path / "build", "1.4")
    monkeypatch.setattr(container, "version", image_with(tensorrt_llm="1.4.0rc4"))
    assert container.main(["launch", str(build)]) == 0
    ((command, env),) = in_image
    backends = tmp_path / "server" / "backends"
    assert command[0] == WHEEL_BINARY and f"--backend-directory={backends}" in command
    assert (backends / "python" / "triton_python_backend_stub").is_file(), "the stub for this Python, in place"
    assert env is not None and str(pytriton_root().parent / "nvidia_pytriton.libs") in env["LD_LIBRARY_PATH"]


def test_the_121_build_runs_nvidias_tritonserver(tmp_path, monkeypatch, in_image):
    build = write_build(tmp_path / "build", None)  # recorded by no option: 1.2.1
    monkeypatch.setattr(container, "version", image_with(tensorrt_llm="1.2.1", xgrammar="0.1.25"))
    assert container.main(["launch", str(build)]) == 0
    ((command, env),) = in_image
    assert command[0] == CONTAINER_BINARY and env is None
    assert not any(flag.startswith("--backend-directory") for flag in command)


@pytest.mark.parametrize(
    ("release", "running", "expected"),
    [
        (
            "1.4",
            "1.2.1",
            [
                "this image runs TensorRT-LLM 1.2.1",
                "written against 1.4.0rc4",
                "serve it in tritonllm:trtllm-llmapi-1.4.0rc4 (`make trtllm-image LLM_API_RELEASE=1.4` builds it)",
                "`make build ENGINE=trtllm-llmapi LLM_API_RELEASE=1.2.1` (build_engines.py --llm-api-release 1.2.1)",
            ],
        ),
        (
            "1.2.1",
            "1.4.0rc4",
            [
                "this image runs TensorRT-LLM 1.4.0rc4",
                "written against 1.2.1",
                "serve it in tritonllm:trtllm-26.07 (`make trtllm-image LLM_API_RELEASE=1.2.1` builds it)",
                "`make build ENGINE=trtllm-llmapi LLM_API_RELEASE=1.4`",
            ],
        ),
        ("1.4", "1.3.0", ["runs TensorRT-LLM 1.3.0", "no release in tritonllm/versions.py is 1.3.0"]),
        ("1.4", None, ["tensorrt_llm is not installed here; the build is for TensorRT-LLM 1.4.0rc4"]),
    ],
)
def test_the_entrypoint_refuses_another_release_naming_both(
    tmp_path, monkeypatch, in_image, capsys, release, running, expected
):
    build = write_build(tmp_path / "build", release)
    monkeypatch.setattr(container, "version", image_with(tensorrt_llm=running) if running else image_with())
    assert container.main(["launch", str(build)]) == 1 and in_image == []
    err = capsys.readouterr().err
    for part in expected:
        assert part in err


def test_a_build_for_a_release_this_checkout_does_not_know_is_refused(tmp_path, in_image, capsys):
    build = write_build(tmp_path / "build", "1.9")
    assert container.main(["launch", str(build), "--dry-run"]) == 1
    assert "LLM API release '1.9' is not one this checkout knows" in capsys.readouterr().err


def test_a_library_that_differs_from_the_lock_is_a_warning_naming_both(tmp_path, monkeypatch, in_image, capsys):
    build = write_build(tmp_path / "build", "1.2.1")
    monkeypatch.setattr(
        container, "version", image_with(tensorrt_llm="1.2.1", xgrammar="0.1.21", transformers="4.57.1")
    )
    assert container.main(["launch", str(build)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert [line for line in err if "warning" in line] == [
        "launch: warning: this image has xgrammar 0.1.21; TensorRT-LLM 1.2.1 pins 0.1.25 (tritonllm/versions.py): "
        "if NVIDIA's image ships it, correct the pin there"
    ]
    assert not any("transformers" in line for line in err), "the same as the lock: nothing to say"


def test_libraries_the_lock_has_no_pin_for_are_reported_in_one_line(tmp_path, monkeypatch, in_image, capsys):
    build = write_build(tmp_path / "build", "1.4")
    monkeypatch.setattr(container, "version", image_with(tensorrt_llm="1.4.0rc4", xgrammar="0.1.29"))
    assert container.main(["launch", str(build)]) == 0
    reported = [line for line in capsys.readouterr().err.splitlines() if "xgrammar" in line]
    assert reported == [
        "launch: TensorRT-LLM 1.4.0rc4's pins of xgrammar and transformers are not recorded (tritonllm/versions.py); "
        "this image has xgrammar 0.1.29, transformers none"
    ]


@pytest.mark.parametrize(("release", "binary"), [("1.4", WHEEL_BINARY), ("1.2.1", CONTAINER_BINARY)])
def test_the_dry_run_prints_each_releases_command_without_checking_or_writing(
    tmp_path, monkeypatch, capsys, release, binary
):
    monkeypatch.setattr(container, "SERVER_WORK_DIR", tmp_path / "server")
    monkeypatch.setattr(container, "version", lambda package: pytest.fail(f"checked {package}"))
    build = write_build(tmp_path / "build", release, tp=2)
    assert container.main(["launch", str(build), "--dry-run"]) == 0
    command = shlex.split(capsys.readouterr().out.splitlines()[-1])
    ranks = " ".join(command[3:]).split(" : ")
    assert command[:3] == ["mpirun", "--allow-run-as-root", "--oversubscribe"] and len(ranks) == 2
    assert all(rank.startswith(f"-n 1 trtllm-llmapi-launch {binary} ") for rank in ranks)
    backend_flag = f"--backend-directory={tmp_path / 'server' / 'backends'}"
    assert all((backend_flag in rank.split()) is (release == "1.4") for rank in ranks)
    assert not (tmp_path / "server").exists(), "a dry run writes nothing"


def test_the_image_build_stops_where_the_wheels_server_misses_a_library(monkeypatch, capsys):
    assert container.main(["check-server"]) == 0, capsys.readouterr().err  # this machine's wheel and Python
    listing = "\tlibpython3.12.so.1.0 => not found\n\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x1)\n"
    monkeypatch.setattr(
        container.subprocess, "run", lambda command, **kw: subprocess.CompletedProcess(command, 0, listing, "")
    )
    assert container.main(["check-server"]) == 1
    err = capsys.readouterr().err
    assert "not found: tritonserver needs libpython3.12.so.1.0" in err and "libc.so.6" not in err


# ---------------------------------------------------------------- `make serve`: the image of the build's release


def host(monkeypatch, images: set[str]) -> list[list[str]]:
    monkeypatch.delenv("NVIDIA_TRITON_SERVER_VERSION", raising=False)
    monkeypatch.delenv(docker.IMAGE_MARKER, raising=False)
    monkeypatch.setattr(docker, "host_problems", lambda gpus_needed: [])
    monkeypatch.setattr(
        serve_trtllm.subprocess,
        "run",
        lambda command, **kw: subprocess.CompletedProcess(command, 0 if command[-1] in images else 1),
    )
    ran = []
    monkeypatch.setattr(serve_trtllm.os, "execvp", lambda binary, command: ran.append(command))
    return ran


def test_serve_runs_the_build_in_its_releases_image(tmp_path, monkeypatch):
    ran = host(monkeypatch, {RELEASE_IMAGE_1_4})
    build = write_build(tmp_path / "build", "1.4")
    assert serve_trtllm.main(["--build-dir", str(build)]) == 0
    (command,) = ran
    assert RELEASE_IMAGE_1_4 in command and docker.IMAGE_TAG not in command


def test_serve_says_which_image_to_build_when_it_is_missing(tmp_path, monkeypatch, capsys):
    ran = host(monkeypatch, {docker.IMAGE_TAG})
    build = write_build(tmp_path / "build", "1.4")
    assert serve_trtllm.main(["--build-dir", str(build)]) == 1 and ran == []
    assert (
        "image tritonllm:trtllm-llmapi-1.4.0rc4 is missing: run `make trtllm-image LLM_API_RELEASE=1.4`"
        in capsys.readouterr().err
    )


def test_the_host_compares_the_build_with_the_release_its_image_runs(tmp_path):
    served = serve_trtllm.load_build(write_build(tmp_path / "build", "1.4"))
    assert (served.version, served.image, served.llm_api_release) == ("1.4.0rc4", RELEASE_IMAGE_1_4, "1.4")
    serve_trtllm.check_release(served, docker.served_release(served.engine, served.llm_api_release).trtllm)
    with pytest.raises(
        EngineError, match=r"runs TensorRT-LLM 1\.2\.1; the trtllm-llmapi flavor is written against 1\.4"
    ):
        serve_trtllm.check_release(served, "1.2.1")


def test_serve_in_the_14_image_becomes_the_wheels_tritonserver(tmp_path, monkeypatch, in_image):
    """NVIDIA's TensorRT-LLM image sets no NVIDIA_TRITON_SERVER_VERSION: the project's marker says it is the image."""
    monkeypatch.delenv("NVIDIA_TRITON_SERVER_VERSION", raising=False)
    monkeypatch.setenv(docker.IMAGE_MARKER, "trtllm-llmapi-1.4")
    monkeypatch.setattr(serve_trtllm, "installed_trtllm", lambda: "1.4.0rc4")
    monkeypatch.setattr(container, "version", image_with(tensorrt_llm="1.4.0rc4"))
    build = write_build(tmp_path / "build", "1.4")
    assert serve_trtllm.main(["--build-dir", str(build)]) == 0
    ((command, env),) = in_image
    assert command[0] == WHEEL_BINARY and env is not None


def test_what_the_build_records_is_what_the_entrypoint_reads(tmp_path, manifest, capsys):
    from tritonllm.repository.builder import main as builder_main

    options = ["--engine", "trtllm-llmapi", "--model", manifest["model_dir"], "--build-dir", str(tmp_path)]
    assert builder_main([*options, "--llm-api-release", "1.4"]) == 0
    capsys.readouterr()
    assert container.main(["launch", str(tmp_path), "--dry-run"]) == 0
    assert shlex.split(capsys.readouterr().out.splitlines()[-1])[0] == WHEEL_BINARY
    assert serve_trtllm.load_build(tmp_path).image == RELEASE_IMAGE_1_4
