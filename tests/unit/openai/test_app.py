"""Unit: the OpenAI layer's process, as a launcher sees it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from uvicorn.config import STARTUP_FAILURE

from tritonllm.launch.tritonserver import free_port


@pytest.mark.parametrize("workers", [1, 2])
def test_workers_that_cannot_start_end_the_layer_with_a_failure_code(tmp_path, workers):
    """uvicorn's supervisor stops every worker when one cannot start, and returns as from a clean stop: the layer
    must not exit 0 then, or a launcher would take the failure for a normal end; one worker exits the same way."""
    command = [sys.executable, "-m", "tritonllm.openai.app", "--tokenizer-dir", str(tmp_path / "missing")]
    command += ["--max-input-len", "8", "--max-seq-len", "16", "--workers", str(workers), "--port", str(free_port())]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == STARTUP_FAILURE, done.stderr[-2000:]


@pytest.mark.parametrize(
    ("host", "api_key", "warned"),
    [("0.0.0.0", None, True), ("::", None, True), ("0.0.0.0", "k", False), ("127.0.0.1", None, False)],
)
def test_an_open_layer_beyond_loopback_warns(tokenizer_dir, monkeypatch, capsys, host, api_key, warned):
    """Without an API key, anyone who can reach the port can use the model: said when the layer listens beyond
    loopback (the image's chart listens on 0.0.0.0), with how to set a key."""
    import uvicorn

    from tritonllm.openai import app

    monkeypatch.setattr(app, "port_free", lambda host, port: True)
    monkeypatch.setattr(uvicorn, "run", lambda *args, **kwargs: None)
    monkeypatch.delenv("TRITONLLM_API_KEY", raising=False)
    argv = ["--tokenizer-dir", tokenizer_dir, "--max-input-len", "8", "--max-seq-len", "16", "--workers", "1"]
    assert app.main([*argv, "--host", host, *(["--api-key", api_key] if api_key else [])]) == 0
    err = capsys.readouterr().err
    assert ("anyone who can reach" in err and "TRITONLLM_API_KEY" in err) is warned, err
