"""Unit: how the OpenAI layer finds the engine's own process (openai.engine_process): by the tritonserver that
listens on its gRPC port on this host, else none (the choice goes over gRPC)."""

from __future__ import annotations

import os
import socket

from tritonllm.openai.engine_process import EngineProcessRoute, listening_pid, server_pid


def test_the_process_listening_on_a_port_is_found_and_a_free_port_has_none():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert listening_pid(port) == os.getpid()
        # Listening, but not a tritonserver: not the engine's server.
        assert server_pid(f"127.0.0.1:{port}") is None
    assert listening_pid(port) is None


def test_a_server_on_another_host_is_reached_over_grpc():
    assert server_pid("10.1.2.3:8001") is None
    assert server_pid("triton:8001") is None


def test_without_a_local_server_the_route_gives_no_client_and_looks_again_later(tmp_path, monkeypatch):
    route = EngineProcessRoute(tmp_path, "tensorrt_llm_decoupled", "127.0.0.1:1")
    looked = []
    monkeypatch.setattr("tritonllm.openai.engine_process.server_pid", lambda url: looked.append(url))
    assert route.client() is None and route.client() is None
    assert looked == ["127.0.0.1:1"], "looked for once, not at every choice"
