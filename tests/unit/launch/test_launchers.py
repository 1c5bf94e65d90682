"""The launchers: the watchdog restarts with the first start's load timeout; no launcher serves the admin APIs open."""

import stat
import subprocess
from pathlib import Path

import pytest

from tritonllm.launch import serve
from tritonllm.launch.server_command import ADMIN_KEY_FILE, admin_key
from tritonllm.protocol import ADMIN_HEADER


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


def private_key_in(path: Path) -> str:
    """The key a launcher wrote to `path`, checking that only its user may read the file."""
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    return path.read_text().strip()


def test_the_image_entrypoint_never_serves_the_admin_apis_open(tmp_path, monkeypatch, capsys):
    """It listens on 0.0.0.0: without TRITONLLM_ADMIN_KEY it makes a key, restricts the APIs, and writes the key to
    a file beside the build's repository (readable by its user only), whose path it prints, never the key itself:
    stdout is the container's log."""
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
    assert len(key) >= 24 and private_key_in(tmp_path / ADMIN_KEY_FILE) == key
    out = capsys.readouterr().out
    assert key not in out and ADMIN_HEADER in out and str(tmp_path / ADMIN_KEY_FILE) in out


def test_a_generated_admin_key_replaces_its_file_whole_and_never_follows_a_link(tmp_path, capsys):
    """Each start makes a new key: it replaces the file (a temporary file, then a rename), so a reader never sees a
    wider mode or half a key, and a link left at that path is replaced, not written through."""
    key_file = tmp_path / ADMIN_KEY_FILE
    key_file.write_text("old key\n")
    key_file.chmod(0o644)
    first = admin_key("0.0.0.0", None, "serve", key_file)
    assert private_key_in(key_file) == first and "old key" not in key_file.read_text()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("untouched")
    key_file.unlink()
    key_file.symlink_to(elsewhere)
    second = admin_key("::", None, "serve", key_file)
    assert second != first and not key_file.is_symlink() and private_key_in(key_file) == second
    assert elsewhere.read_text() == "untouched"
    assert sorted(p.name for p in tmp_path.iterdir()) == [ADMIN_KEY_FILE, "elsewhere"]  # no temporary file left
    assert first not in capsys.readouterr().out


def test_a_given_key_or_loopback_writes_no_key_file(tmp_path, capsys):
    key_file = tmp_path / ADMIN_KEY_FILE
    assert admin_key("0.0.0.0", "chosen", "serve", key_file) == "chosen"
    assert admin_key("127.0.0.1", None, "serve", key_file) is None
    assert not key_file.exists() and capsys.readouterr().out == ""


def test_a_key_file_that_cannot_be_written_stops_the_launcher_saying_what_to_do(tmp_path, capsys):
    """A read-only build folder (a mounted volume): no server open to all, no traceback, the key never printed."""
    with pytest.raises(SystemExit) as stopped:
        admin_key("0.0.0.0", None, "launch", tmp_path / "missing" / ADMIN_KEY_FILE)
    assert "TRITONLLM_ADMIN_KEY" in str(stopped.value) and str(tmp_path / "missing") in str(stopped.value)
    assert capsys.readouterr().out == ""


def test_serve_writes_the_generated_key_beside_the_repository(tmp_path, monkeypatch, capsys):
    """`make serve HOST=0.0.0.0` without a key: the server gets the key, build/admin-key holds it, the log does not."""
    from tritonllm.launch.pytriton_wheel import ServerError

    started = []

    class Server:
        def __init__(self, repository, *args, admin_key=None) -> None:
            started.append(admin_key)

        def start(self, timeout):
            raise ServerError("not here")

        def stop(self) -> None:
            pass

    monkeypatch.setattr(serve, "TritonServer", Server)
    monkeypatch.delenv("TRITONLLM_ADMIN_KEY", raising=False)
    (tmp_path / "model_repository").mkdir()
    arguments = ["--repository", str(tmp_path / "model_repository"), "--host", "0.0.0.0", "--openai-port", "0"]
    assert serve.main(arguments) == 1
    (key,) = started
    assert key and private_key_in(tmp_path / ADMIN_KEY_FILE) == key
    assert key not in capsys.readouterr().out


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
