"""Triton Python-backend entry point; the logic lives in tritonllm.backend.engine_model."""

from tritonllm.backend.engine_model import EngineModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
