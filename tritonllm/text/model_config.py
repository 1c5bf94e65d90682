"""Triton model configs (`config.pbtxt`) parsed into Triton's own `ModelConfig` message (no server needed), and
their parameters."""

from __future__ import annotations

from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from tritonllm.errors import ConfigError


def flag(value: str) -> bool:
    """A boolean config parameter."""
    return value.strip().lower() in {"1", "true", "yes", "on"}


def parse_config(text: str, where: str) -> mc.ModelConfig:
    try:
        return text_format.Parse(text, mc.ModelConfig())
    except text_format.ParseError as exc:
        raise ConfigError(f"{where}: not a valid Triton model config: {exc}") from None


def read_config(path: Path) -> mc.ModelConfig:
    return parse_config(path.read_text(), str(path))
