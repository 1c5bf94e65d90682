"""Triton Python-backend entry point; the logic lives in tritonllm.bridge_model."""

from tritonllm.bridge_model import BridgeModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
