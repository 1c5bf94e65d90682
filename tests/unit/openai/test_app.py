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
