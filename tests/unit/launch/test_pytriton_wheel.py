"""The environment tritonserver (and its Python-backend stubs) start with."""

from __future__ import annotations

from pathlib import Path

from tritonllm.launch import pytriton_wheel as server


def with_libdir(monkeypatch, libdir: str, searched: set[Path]) -> list[str]:
    real = server.sysconfig.get_config_var
    monkeypatch.setattr(server.sysconfig, "get_config_var", lambda name: libdir if name == "LIBDIR" else real(name))
    monkeypatch.setattr(server, "loader_dirs", lambda: searched)
    monkeypatch.setenv("LD_LIBRARY_PATH", "/opt/mine")
    return server.server_env()["LD_LIBRARY_PATH"].split(":")


def test_a_folder_the_loader_searches_stays_off_ld_library_path(monkeypatch):
    """Named there, the system folder's libraries (an image's cuDNN) would shadow pip's CUDA libraries."""
    system = Path("/usr/lib/x86_64-linux-gnu")
    paths = with_libdir(monkeypatch, str(system), {system})
    assert str(system) not in paths
    assert paths[-1] == "/opt/mine"
    assert paths[0].endswith("nvidia_pytriton.libs")


def test_a_private_libpython_folder_goes_first(monkeypatch, tmp_path):
    """A Python installed outside the system's folders (pyenv, uv): the stub must find its libpython."""
    paths = with_libdir(monkeypatch, str(tmp_path), {Path("/usr/lib/x86_64-linux-gnu")})
    assert paths[0] == str(tmp_path)
    assert paths[-1] == "/opt/mine"


def test_loader_dirs_lists_the_cache_folders():
    found = server.loader_dirs()
    assert found, "ldconfig -p listed no libraries"
    assert all(d.is_absolute() and d.is_dir() for d in found)
