"""Stand-in of `tensorrt_llm.executor`: the request types the project passes (request.py)."""

from tensorrt_llm.executor.request import LoRARequest

__all__ = ["LoRARequest"]
