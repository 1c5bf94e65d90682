"""Triton Python-backend entry point; the logic lives in tritonllm.text_models."""

from tritonllm.text_models import PostprocessingModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
