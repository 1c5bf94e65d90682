"""A stand-in of TensorRT-LLM's LLM API, 1.2.1 or 1.4 (TRITONLLM_STANDIN_RELEASE), for the tests that cannot have the
real one (it needs an NVIDIA GPU and NVIDIA's image): the names, parameters and validation rules the project uses,
as read in that release's sources (each with its file and line in tests/standins/tensorrt_llm/surface.py), over a
real model on the CPU.

Tests put tests/standins on sys.path (a served one on the server's PYTHONPATH), so `import tensorrt_llm` finds this.
Only tritonllm/engine/llmapi.py's `LlmApi.load` imports it; tests/unit/engine/test_llmapi_release.py compares this
surface with the real package where that is installed.
"""

from tensorrt_llm.llm import LLM
from tensorrt_llm.sampling_params import SamplingParams
from tensorrt_llm.surface import VERSION

__version__ = VERSION

__all__ = ["LLM", "SamplingParams"]
