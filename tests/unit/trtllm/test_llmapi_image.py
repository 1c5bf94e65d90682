"""The images of the LLM API releases (tritonllm/versions.py LLM_API_RELEASES): ./Dockerfile's targets, their tags
and `docker build` arguments, the Makefile's choice of release, and the Helm chart's.

No image is built here (no Docker engine): the Dockerfile is checked as text, and the check its build runs on
numpy is run with stand-in numpy modules.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tritonllm import versions
from tritonllm.trtllm import docker
from tritonllm.trtllm.engine_dir import EngineError

DOCKERFILE = (ROOT / "Dockerfile").read_text()
RELEASE_1_4 = versions.LLM_API_RELEASES["1.4"]


def stage(target: str) -> str:
    """The Dockerfile's lines of one target, continuation lines joined."""
    text = DOCKERFILE.split(f" AS {target}\n", 1)[1].split("\nFROM ", 1)[0]
    return text.replace("\\\n", "")


def run_commands(target: str) -> list[str]:
    """The shell commands of a target's RUN lines, split at `&&`."""
    runs = [line.removeprefix("RUN ") for line in stage(target).splitlines() if line.startswith("RUN ")]
    return [" ".join(command.split()) for run in runs for command in run.split(" && ")]


def targets() -> list[str]:
    return re.findall(r"^FROM \S+ AS (\S+)$", DOCKERFILE, re.M)


# ---------------------------------------------------------------- ./Dockerfile


def test_every_release_has_its_target_and_its_arg_default_names_the_releases_base_image():
    """`docker build --target T .` with no build argument builds on the locked base image, as `make trtllm-image`
    does with its arguments."""
    arg_defaults = dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE, re.M))
    for name, release in versions.LLM_API_RELEASES.items():
        assert release.target in targets(), name
        args = docker.image_build_args(release)
        assert args[:4] == ["--target", release.target, "-t", release.image]
        arg, value = args[5].split("=", 1)
        assert arg_defaults[arg] == value, f"ARG {arg}'s default differs from release {name}'s base image"
        template = re.search(rf"^FROM (\S+) AS {re.escape(release.target)}$", DOCKERFILE, re.M)[1]
        assert template.replace(f"${{{arg}}}", value) == release.base_image
    assert docker.image_build_args(RELEASE_1_4)[4:] == ["--build-arg", "TRTLLM_RELEASE_TAG=1.4.0rc4"]
    assert "FROM nvcr.io/nvidia/tensorrt-llm/release:${TRTLLM_RELEASE_TAG} AS trtllm-llmapi-1.4" in DOCKERFILE


def test_a_release_the_dockerfile_cannot_build_is_an_error(tmp_path):
    moved = dataclasses.replace(RELEASE_1_4, base_image="nvcr.io/nvidia/other:1.4.0rc4")
    with pytest.raises(EngineError, match=re.escape("which no build argument makes nvcr.io/nvidia/other:1.4.0rc4")):
        docker.image_build_args(moved)
    with pytest.raises(EngineError, match="has no target trtllm-llmapi-9"):
        docker.image_build_args(dataclasses.replace(RELEASE_1_4, target="trtllm-llmapi-9"))


def test_the_1_4_image_installs_the_wheels_tritonserver_without_resolving_dependencies():
    """nvidia-pytriton's metadata pins numpy<2 and tritonclient~=2.50: resolving them would change NVIDIA's packages."""
    commands = run_commands("trtllm-llmapi-1.4")
    installs = [c for c in commands if "pip install" in c]
    assert installs and all("--no-deps" in c for c in installs), installs
    (install,) = installs
    for package in ('"nvidia-pytriton==0.7.0"', '"tritonclient==2.51.0"', "grpcio", "python-rapidjson"):
        assert package in install.split(), package
    check = commands.index('python3 -c "from tritonclient.grpc import model_config_pb2"')
    assert check > commands.index(install)
    assert commands[-1] == "python3 -m tritonllm.launch.container check-server", "the server's libraries, last"


def test_the_1_4_image_checks_numpy_before_installing():
    commands = run_commands("trtllm-llmapi-1.4")
    (numpy_check,) = [c for c in commands if "numpy.__version__" in c]
    assert commands.index(numpy_check) < min(i for i, c in enumerate(commands) if "pip install" in c)


def dockerfile_check() -> str:
    """The Python code of the 1.4 target's numpy and glibc check, as the shell passes it to python3 -c."""
    (command,) = [c for c in run_commands("trtllm-llmapi-1.4") if "numpy.__version__" in c]
    return re.fullmatch(r'python3 -c "(.*)"', command)[1]


@pytest.mark.parametrize(("numpy_version", "fails"), [("1.26.4", False), ("2.1.0", True), ("2.5.0", True)])
def test_the_numpy_check_fails_the_image_build_on_numpy_2(tmp_path, numpy_version, fails):
    (tmp_path / "numpy.py").write_text(f"__version__ = {numpy_version!r}\n")
    result = subprocess.run(
        [sys.executable, "-c", dockerfile_check()],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert (result.returncode != 0) is fails, result.stderr
    if fails:
        assert f"this image has numpy {numpy_version}" in result.stderr
        assert "needs numpy < 2" in result.stderr and "LLM_API_RELEASE=1.2.1" in result.stderr
    else:
        assert result.stderr == ""


def test_every_target_marks_the_image_and_the_llmapi_target_copies_the_project_as_trtllm_does():
    for target in targets():
        (env,) = [line for line in stage(target).splitlines() if line.startswith("ENV ")]
        assert f"{docker.IMAGE_MARKER}={target}" in env.split(), target
    copies = [line for line in stage("trtllm").splitlines() if line.startswith("COPY ")]
    assert copies and copies == [line for line in stage("trtllm-llmapi-1.4").splitlines() if line.startswith("COPY ")]
    assert "PYTHONPATH=/opt/tritonllm" in stage("trtllm-llmapi-1.4")


def test_inside_image_needs_the_projects_marker_or_nvidias(monkeypatch):
    monkeypatch.delenv("NVIDIA_TRITON_SERVER_VERSION", raising=False)
    monkeypatch.delenv(docker.IMAGE_MARKER, raising=False)
    assert not docker.inside_image()
    monkeypatch.setenv(docker.IMAGE_MARKER, "trtllm-llmapi-1.4")  # NVIDIA's TensorRT-LLM image sets no variable of its
    assert docker.inside_image()
    monkeypatch.delenv(docker.IMAGE_MARKER)
    monkeypatch.setenv("NVIDIA_TRITON_SERVER_VERSION", "26.07")
    assert docker.inside_image()


# ---------------------------------------------------------------- tags and the Makefile's arguments


def test_image_tags_per_release(capsys):
    assert docker.IMAGE_TAG == versions.LLM_API_RELEASES["1.2.1"].image == "tritonllm:trtllm-26.07"
    assert docker.served_release("trtllm", "1.4").image == docker.IMAGE_TAG, "TensorRT engines: 1.2.1's image only"
    assert docker.served_release("trtllm-llmapi", "1.4").image == "tritonllm:trtllm-llmapi-1.4.0rc4"
    for argv, printed in [
        (["image"], "tritonllm:trtllm-26.07"),
        (["image", "1.2.1"], "tritonllm:trtllm-26.07"),
        (["image", "1.4"], "tritonllm:trtllm-llmapi-1.4.0rc4"),
        (["build-args"], "--target trtllm -t tritonllm:trtllm-26.07 --build-arg TRITON_TAG=26.07"),
        (["build-args", "1.4"], " ".join(docker.image_build_args(RELEASE_1_4))),
    ]:
        assert docker.main(argv) == 0
        assert capsys.readouterr().out == printed + "\n", argv


def test_an_unknown_release_is_refused_naming_the_known_ones(capsys):
    assert docker.main(["image", "1.3"]) == 1
    err = capsys.readouterr().err
    assert "LLM API release '1.3' is not one this checkout knows (1.2.1, 1.4" in err


def test_make_serve_builds_the_image_of_the_release_the_build_records(tmp_path, capsys):
    assert docker.main(["build-args", "1.2.1", "--build-dir", str(tmp_path)]) == 0  # no build yet: LLM_API_RELEASE's
    assert "--target trtllm " in capsys.readouterr().out
    (tmp_path / "manifest.json").write_text(json.dumps({"engine": "trtllm-llmapi", "llm_api_release": "1.4"}))
    assert docker.main(["build-args", "1.2.1", "--build-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    assert "--target trtllm-llmapi-1.4 " in out and "holds a build for LLM API release 1.4" in err


def make_dry_run(*args: str) -> str:
    """`make -n`: the recipes as make would run them (nothing runs)."""
    result = subprocess.run(["make", "-n", *args], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return " ".join(result.stdout.replace("\\\n", " ").split())


def test_the_makefiles_default_release_is_the_projects():
    assert re.search(
        rf"^LLM_API_RELEASE \?= {re.escape(versions.DEFAULT_LLM_API_RELEASE)}$", (ROOT / "Makefile").read_text(), re.M
    )


@pytest.mark.parametrize(
    ("engine", "passed"),
    [("trtllm-llmapi", "--llm-api-release 1.4"), ("portable", None), ("synthetic", None)],
)
def test_make_build_passes_the_release_to_the_llm_api_build_only(engine, passed):
    """build_engines.py refuses another engine's options by name."""
    recipe = make_dry_run("build", f"ENGINE={engine}", "LLM_API_RELEASE=1.4")
    assert f"build_engines.py --engine {engine} " in recipe
    if passed:
        assert passed in recipe
    else:
        assert "--llm-api-release" not in recipe


@pytest.mark.parametrize(
    ("engine", "release"),
    [("trtllm-llmapi", "1.4"), ("trtllm", ""), ("portable", "1.4")],
)
def test_make_trtllm_image_builds_the_release_of_the_flavor(engine, release):
    """ENGINE=trtllm: 1.2.1's image always (the docker module's default); otherwise LLM_API_RELEASE's."""
    recipe = make_dry_run("trtllm-image", f"ENGINE={engine}", "LLM_API_RELEASE=1.4")
    assert re.search(rf"tritonllm\.trtllm\.docker build-args {re.escape(release)} ?\)", recipe), recipe


def test_make_serve_builds_the_image_of_the_build_first():
    recipe = make_dry_run("serve", "ENGINE=trtllm-llmapi", "LLM_API_RELEASE=1.4", "BUILD_DIR=/tmp/b")
    image = recipe.index("tritonllm.trtllm.docker build-args 1.4 --build-dir /tmp/b")
    assert image < recipe.index("serve-trtllm --build-dir /tmp/b")


# ---------------------------------------------------------------- the Helm chart (make deploy-check renders it)


def deploy_check():
    spec = importlib.util.spec_from_file_location("deploy_check", ROOT / "deploy" / "check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_values_file_names_its_releases_image():
    check = deploy_check()
    files = sorted(check.CHART.glob("values-*.yaml"))
    assert check.CHART / "values-trtllm-llmapi-1.4.yaml" in files
    for values in [None, *files]:
        check.check_image(values.stem if values else "values", values)
    assert check.chart_values(check.CHART / "values-trtllm-llmapi-1.4.yaml")["build"]["llmApiRelease"] == "1.4"


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            "flavor: trtllm-llmapi\nbuild: {llmApiRelease: '1.4'}\nimage: {tag: trtllm-26.07}\n",
            "set image.tag to trtllm-llmapi-1.4.0rc4",
        ),
        ("flavor: trtllm-llmapi\nbuild: {llmApiRelease: '1.3'}\n", "build.llmApiRelease: LLM API release '1.3'"),
        (
            "flavor: trtllm\nbuild: {llmApiRelease: '1.4'}\nimage: {tag: trtllm-llmapi-1.4.0rc4}\n",
            "set image.tag to trtllm-26.07",
        ),
    ],
)
def test_a_values_file_with_another_releases_image_is_refused(tmp_path, values, message):
    check = deploy_check()
    (tmp_path / "values-x.yaml").write_text(values)
    with pytest.raises(check.DeployCheckError, match=re.escape(message)):
        check.check_image("x", tmp_path / "values-x.yaml")


def test_the_init_containers_build_must_be_for_the_charts_release(tmp_path):
    check = deploy_check()
    values = check.CHART / "values-trtllm-llmapi-1.4.yaml"
    args = ["--engine", "trtllm-llmapi", "--build-dir", "/models/build", "--tp", "1", "--pp", "1"]
    doc = {"spec": {"template": {"spec": {"initContainers": [{"name": "build", "args": args}]}}}}
    with pytest.raises(
        check.DeployCheckError, match=re.escape("the build is for LLM API release 1.2.1, build.llmApiRelease is 1.4")
    ):
        check.check_build_args("x", doc, values)
    args += ["--llm-api-release", "1.4"]
    check.check_build_args("x", doc, values)
