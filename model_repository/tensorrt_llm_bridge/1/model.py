"""Triton Python-backend entry point; the logic lives in tritonllm.backend.bridge_model."""

from tritonllm.backend.bridge_model import BridgeModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
