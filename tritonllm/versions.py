"""The one place where the versions the engines depend on are pinned.

An engine runs only under the TensorRT-LLM (and TensorRT) release that built it: the most reported
upstream failure is "Serialization assertion stdVersionRead == kSERIALIZATION_VERSION failed",
an engine from another release. So engines are built inside the same image that serves them.
Triton releases 26.04 to 26.07 ship TensorRT-LLM 1.2.1 (TensorRT 10.14.1.48, CUDA 13.1), the last
release line with the TensorRT engine backend (NVIDIA's compatibility matrix; docs/gpu.md).
"""

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

if __name__ == "__main__":  # `python -m tritonllm.versions NAME` prints one value, for the Makefile
    import sys

    print(globals()[sys.argv[1]])
