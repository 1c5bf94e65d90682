"""Unit: a hub model is downloaded once, whole, with whichever weights it has (a fake hub: no network)."""

from __future__ import annotations

import fnmatch
from pathlib import Path

import huggingface_hub
import pytest

from tritonllm.repository import model_source
from tritonllm.repository.model_source import ModelSourceError

SAFETENSORS_REPO = {
    "config.json": "{}",
    "tokenizer.json": "{}",
    "model.safetensors": "weights",
    "pytorch_model.bin": "the same weights again",
}
BIN_ONLY_REPO = {"config.json": "{}", "tokenizer.json": "{}", "pytorch_model.bin": "weights"}


class FakeHub:
    """snapshot_download over one repository's files; `fail_after` files written, it raises (a dropped link)."""

    def __init__(self, files: dict[str, str], fail_after: int | None = None) -> None:
        self.files, self.fail_after, self.calls = files, fail_after, 0

    def snapshot_download(self, repo_id: str, local_dir: Path, allow_patterns: list[str]) -> str:
        self.calls += 1
        Path(local_dir).mkdir(parents=True, exist_ok=True)
        wanted = [n for n in self.files if any(fnmatch.fnmatch(n, p) for p in allow_patterns)]
        for written, name in enumerate(wanted):
            if written == self.fail_after:
                raise ConnectionError("the connection dropped")
            (Path(local_dir) / name).write_text(self.files[name])
        return str(local_dir)


@pytest.fixture
def hub(monkeypatch):
    def install(files: dict[str, str], fail_after: int | None = None) -> FakeHub:
        fake = FakeHub(files, fail_after)
        monkeypatch.setattr(huggingface_hub, "snapshot_download", fake.snapshot_download)
        return fake

    return install


def test_a_finished_download_is_reused(tmp_path, hub):
    fake = hub(SAFETENSORS_REPO)
    out = model_source.download("org/model", tmp_path / "org--model")
    assert model_source.download("org/model", tmp_path / "org--model") == out
    assert fake.calls == 1


def test_an_interrupted_download_is_never_served(tmp_path, hub):
    hub(SAFETENSORS_REPO, fail_after=1)  # config.json is written, then the link drops
    out = tmp_path / "org--model"
    with pytest.raises(ModelSourceError, match="download from the Hugging Face hub failed"):
        model_source.download("org/model", out)
    assert not (out / "config.json").exists()
    fake = hub(SAFETENSORS_REPO)
    assert model_source.download("org/model", out) == out
    assert fake.calls == 1 and (out / "model.safetensors").is_file()


def test_a_half_finished_folder_from_before_is_downloaded_again(tmp_path, hub):
    out = tmp_path / "org--model"
    out.mkdir()
    (out / "config.json").write_text("{}")  # what an interrupted snapshot_download left in place
    fake = hub(SAFETENSORS_REPO)
    model_source.download("org/model", out)
    assert fake.calls == 1 and (out / "model.safetensors").is_file()


def test_safetensors_weights_only_when_the_model_has_them(tmp_path, hub):
    hub(SAFETENSORS_REPO)
    out = model_source.download("org/model", tmp_path / "org--model")
    assert (out / "model.safetensors").is_file() and not (out / "pytorch_model.bin").exists()


def test_pytorch_bin_weights_when_the_model_has_no_safetensors(tmp_path, hub):
    hub(BIN_ONLY_REPO)
    out = model_source.download("org/old", tmp_path / "org--old")
    assert (out / "pytorch_model.bin").read_text() == "weights"
