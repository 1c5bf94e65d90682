"""Triton Python-backend entry point; the logic lives in tritonllm.backend.bls_model."""

from tritonllm.backend.bls_model import StreamingModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
