"""The one place where the versions the engines depend on are pinned.

An engine runs only under the TensorRT-LLM (and TensorRT) release that built it: the most reported
upstream failure is "Serialization assertion stdVersionRead == kSERIALIZATION_VERSION failed",
an engine from another release. So engines are built inside the same image that serves them.
Triton releases 26.04 to 26.07 ship TensorRT-LLM 1.2.1 (TensorRT 10.14.1.48, CUDA 13.1), the last
release line with the TensorRT engine backend (NVIDIA's compatibility matrix; docs/gpu.md).
"""

from __future__ import annotations

from dataclasses import dataclass

# The transformers release the portable engine's transformers path is written against: it drives transformers'
# continuous-batching internals (step graphs, its attention registry, its output queue), which change between
# releases, so another release is refused when the engine loads (tritonllm/engine/portable.py). requirements.txt
# pins the same (tests/unit/engine/test_portable.py checks it).
TRANSFORMERS_VERSION = "5.24.0"

TRITON_TAG = "26.07"
TRTLLM_VERSION = "1.2.1"
# The xgrammar compiled into that release's C++ runtime (its requirements.txt), which reads the tokenizer-info file
# the build writes (tritonllm/trtllm/guided_decoding.py; tests/unit/trtllm/test_xgrammar_release.py).
TRTLLM_XGRAMMAR = "0.1.25"
TRTLLM_IMAGE = f"nvcr.io/nvidia/tritonserver:{TRITON_TAG}-trtllm-python-py3"
PORTABLE_IMAGE = f"nvcr.io/nvidia/tritonserver:{TRITON_TAG}-py3"


@dataclass(frozen=True)
class LlmApiRelease:
    """A TensorRT-LLM release the LLM API flavor is written against, locked with the image it runs in.

    xgrammar and transformers are the release's own pins (its requirements.txt), where they could be read; None
    where not: the entrypoint then reports what the image has instead of checking it (docs/llmapi.md)."""

    trtllm: str  # tensorrt_llm.__version__ in the image
    base_image: str  # NVIDIA's image, which ./Dockerfile's `target` builds the project's image on
    target: str
    image: str  # the project's image, what `make trtllm-image` builds and `make serve` runs
    # True: NVIDIA's image has tritonserver and its Python backend. False (NVIDIA's TensorRT-LLM release images, which
    # ship no Triton): the nvidia-pytriton wheel's tritonserver 2.51 is installed into it, as the portable flavor
    # runs it outside any image.
    nvidia_tritonserver: bool
    xgrammar: str | None
    transformers: str | None


DEFAULT_LLM_API_RELEASE = "1.2.1"
LLM_API_RELEASES = {
    # Triton 26.07's TensorRT-LLM image: the engine flavor's too. transformers 4.57.1 is the 1.2 line's pin
    # (requirements.txt of a 1.2.0 commit and of 1.3.0rc3).
    "1.2.1": LlmApiRelease(
        TRTLLM_VERSION, TRTLLM_IMAGE, "trtllm", f"tritonllm:trtllm-{TRITON_TAG}", True, TRTLLM_XGRAMMAR, "4.57.1"
    ),
    # The 1.4 line: NVIDIA ships it only in its TensorRT-LLM release container (Triton 26.11 has no TensorRT-LLM
    # image). 1.4.0rc4 is the newest release whose documentation could be read; its pins could not be.
    "1.4": LlmApiRelease(
        "1.4.0rc4",
        "nvcr.io/nvidia/tensorrt-llm/release:1.4.0rc4",
        "trtllm-llmapi-1.4",
        "tritonllm:trtllm-llmapi-1.4.0rc4",
        False,
        None,
        None,
    ),
}

if __name__ == "__main__":  # `python -m tritonllm.versions NAME` prints one value, for the Makefile
    import sys

    print(globals()[sys.argv[1]])
