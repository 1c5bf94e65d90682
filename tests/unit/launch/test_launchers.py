"""The launchers: the watchdog restarts with the first start's load timeout; no launcher serves the admin APIs open."""

import subprocess

from tritonllm.launch import serve


class StubServer:
    """Runs `waits` watchdog intervals, then exits 0; records how it was restarted."""

    host, grpc_port = "127.0.0.1", 1

    def __init__(self, waits: int) -> None:
        self.waits, self.starts, self.kills = waits, [], 0
        self.process = self

    def wait(self, timeout=None) -> int:
        if self.waits:
            self.waits -= 1
            raise subprocess.TimeoutExpired("tritonserver", timeout)
        return 0

    def kill(self) -> None:
        self.kills += 1

    def start(self, timeout: float = 300.0) -> None:
        self.starts.append(timeout)


def test_a_restart_waits_as_long_as_the_first_start(monkeypatch):
    monkeypatch.setattr(serve, "probe_engine", lambda address: "no answer")
    server = StubServer(waits=2)  # two failed probes in a row: one restart
    assert serve.supervise(server, 0.01, load_timeout=900.0) == 1  # exit code 0 is reported as 1: it stopped
    assert server.kills == 1 and server.starts == [900.0]


def test_the_image_entrypoint_never_serves_the_admin_apis_open(tmp_path, monkeypatch, capsys):
    """It listens on 0.0.0.0: without TRITONLLM_ADMIN_KEY it makes a key, prints it and restricts the APIs."""
    import json

    from tritonllm.launch import container

    (tmp_path / "manifest.json").write_text(json.dumps({"engine": "portable", "server_options": []}))
    monkeypatch.delenv("TRITONLLM_ADMIN_KEY", raising=False)
    ran = []
    monkeypatch.setattr(container.os, "execvp", lambda binary, command: ran.append(command))
    assert container.main(["launch", str(tmp_path)]) == 0
    (command,) = ran
    [flag] = [f for f in command if f.startswith("--http-restricted-api=")]
    key = flag.rsplit("=", 1)[1]
    assert len(key) >= 24 and f"tritonllm-admin-key: {key}" in capsys.readouterr().out


def test_the_openai_layer_for_a_trtllm_build_sends_none_of_the_portable_additions(monkeypatch, tmp_path):
    """Without --trtllm the layer sends openai_penalties and num_top_log_probs, which the flavor refuses by name."""
    import pytest

    from tritonllm.launch.tritonserver import OpenAIFrontend, free_port

    commands = []

    def record(command, **kwargs):
        commands.append(command)
        raise OSError("not started")

    monkeypatch.setattr(subprocess, "Popen", record)
    for engine in ("trtllm", "portable"):
        manifest = {"engine": engine, "tokenizer_dir": str(tmp_path), "max_input_len": 8, "max_seq_len": 16}
        with pytest.raises(OSError):
            OpenAIFrontend.for_build("127.0.0.1:1", manifest, free_port(), repository=str(tmp_path)).start()
    trtllm, portable = commands
    assert "--trtllm" in trtllm and "--repository" not in trtllm
    assert "--trtllm" not in portable and "--repository" in portable
