"""Shared fixtures: the built model (from `make build`) and a real tritonserver on free loopback ports."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tritonllm.launch.tritonserver import free_port

ROOT = Path(__file__).resolve().parent.parent
# The build the tests run against: `make test` passes its BUILD_DIR, so that `make test BUILD_DIR=build/transformers
# BUILD_ARGS="--engine-impl transformers"` runs every test against the other CPU engine.
BUILD = (ROOT / os.environ.get("TRITONLLM_BUILD_DIR", "build")).resolve()


_COLLECTED_FILES: set[Path] = set()


def pytest_itemcollected(item: pytest.Item) -> None:
    _COLLECTED_FILES.add(Path(item.path))  # before -k or -m deselect any


def pytest_collection_finish(session: pytest.Session) -> None:
    """A whole-suite run (no paths given, as `make test`) stops when a test file under tests/ was not collected:
    pytest skips folders by name (by default every `build`, `dist` and `venv`)."""
    given = {(session.config.invocation_params.dir / arg).resolve() for arg in session.config.args}
    if given - {ROOT / "tests", ROOT}:
        return
    on_disk = set((ROOT / "tests").rglob("test_*.py"))
    missing = sorted(path.relative_to(ROOT).as_posix() for path in on_disk - _COLLECTED_FILES)
    if missing:
        raise pytest.UsageError(f"test files pytest did not collect (a folder it skips by name?): {missing}")


def _manifest() -> dict:
    path = BUILD / "manifest.json"
    if not path.is_file():
        pytest.skip(
            "needs the built model: build/manifest.json is missing (run `make build`; make test and make unit do)"
        )
    return json.loads(path.read_text())


@pytest.fixture(scope="session")
def manifest() -> dict:
    return _manifest()


@pytest.fixture(scope="session")
def tokenizer(manifest):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(manifest["tokenizer_dir"])


@pytest.fixture(scope="session")
def log_prob_atol(manifest) -> float:
    """How far a served log probability may be from transformers' forward pass: the transformers engine computes
    the same float32 operations (1e-4); llama.cpp, on the same float32 weights, sums in other orders (0.1, what
    tests/unit/engine/test_llamacpp.py holds it to)."""
    return 0.1 if manifest.get("engine_config", {}).get("impl") == "llamacpp" else 1e-4


@pytest.fixture(scope="session")
def hf_model(manifest):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(manifest["model_dir"], dtype=getattr(torch, manifest["dtype"]))
    return model.eval()


# NVIDIA's decoupled deployment of the same model, which `make test` renders beside the default build.
DECOUPLED_BUILD = BUILD / "decoupled"


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One tritonserver for the integration tests, on the repository `make build` rendered."""
    _manifest()
    yield from _served(BUILD, tmp_path_factory)


@pytest.fixture(scope="module")
def decoupled_server(tmp_path_factory):
    """A tritonserver on the decoupled deployment (build_engines.py --decoupled-mode), for the tests of one module."""
    if not (DECOUPLED_BUILD / "manifest.json").is_file():
        pytest.fail(f"needs the decoupled build: {DECOUPLED_BUILD}/manifest.json is missing (make test renders it)")
    yield from _served(DECOUPLED_BUILD, tmp_path_factory)


def _served(build: Path, tmp_path_factory, admin_key: str | None = None):
    from tritonllm.launch.tritonserver import TritonServer

    log = tmp_path_factory.mktemp("triton") / "server.log"
    triton = TritonServer.on_free_ports(build, log_file=log)
    triton.admin_key = admin_key
    try:
        triton.start(timeout=600)
    except Exception:
        print(log.read_text()[-5000:] if log.exists() else "(no log)")
        triton.stop()
        raise
    yield triton
    code = triton.stop()
    text = log.read_text()
    assert "Traceback" not in text, f"a model raised or crashed in the server; log tail:\n{text[-5000:]}"
    assert code == 0, f"tritonserver exited with {code}; log tail:\n{text[-3000:]}"


def openai_client(server, manifest: dict, tmp_path_factory, workers: int = 1):
    """An OpenAI layer of `workers` in front of `server` (a build's, described by its `manifest`; with the server's
    admin key), and the official client on it, for a module's tests (a generator: `yield from` it in a fixture)."""
    import openai

    from tritonllm.launch.tritonserver import OpenAIFrontend

    frontend = OpenAIFrontend.for_build(
        f"{server.host}:{server.grpc_port}",
        manifest,
        free_port(),
        log_file=tmp_path_factory.mktemp("openai") / "frontend.log",
        workers=workers,
        repository=str(server.repository),
        admin_key=server.admin_key,
    )
    frontend.start()
    yield openai.OpenAI(base_url=f"{frontend.url}/v1", api_key="unused", max_retries=0, timeout=300)
    frontend.stop()


@pytest.fixture(scope="session")
def openai_frontend(server, manifest, tmp_path_factory):
    """Start OpenAI-compatible layers in front of the test server: openai_frontend(api_key=None) -> base URL.
    Two workers each, whatever the host's cores: every OpenAI test goes through uvicorn's worker processes."""
    from tritonllm.launch.tritonserver import OpenAIFrontend

    started = []

    def start(api_key: str | None = None) -> str:
        log = tmp_path_factory.mktemp("openai") / "frontend.log"
        frontend = OpenAIFrontend.for_build(
            f"{server.host}:{server.grpc_port}",
            manifest,
            free_port(),
            api_key=api_key,
            log_file=log,
            workers=2,
            repository=str(server.repository),
        )
        frontend.start()
        started.append(frontend)
        return f"{frontend.url}/v1"

    yield start
    for frontend in started:
        frontend.stop()
