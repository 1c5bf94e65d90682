"""Triton Python-backend entry point; the logic lives in tritonllm.backend.text_models."""

from tritonllm.backend.text_models import PostprocessingModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
