"""The package installs and renders a repository without an editable install: the templates ship inside it."""

import shutil
import subprocess
import sys
import zipfile

from tests.conftest import ROOT
from tritonllm.repository.render import TEMPLATES


def test_the_wheel_carries_every_template(tmp_path):
    source = tmp_path / "src"  # a copy: setuptools writes its build folders beside the sources
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for part in ("tritonllm", "client", "model_repository"):
        shutil.copytree(ROOT / part, source / part, symlinks=True, ignore=ignore)
    shutil.copy2(ROOT / "pyproject.toml", source)
    command = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(source)]
    subprocess.run([*command, "-w", str(tmp_path)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("tritonllm-*.whl")
    packaged = {name for name in zipfile.ZipFile(wheel).namelist() if "/model_repository/" in name}
    expected = {
        f"tritonllm/repository/model_repository/{path.relative_to(TEMPLATES).as_posix()}"
        for path in TEMPLATES.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }
    assert expected and packaged == expected
