"""Triton Python-backend entry point; the logic lives in tritonllm.engine_model."""

from tritonllm.engine_model import EngineModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
