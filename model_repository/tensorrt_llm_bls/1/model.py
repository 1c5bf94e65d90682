"""Triton Python-backend entry point; the logic lives in tritonllm.bls_model."""

from tritonllm.bls_model import StreamingModel as TritonPythonModel

__all__ = ["TritonPythonModel"]
