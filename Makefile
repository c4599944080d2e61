# warmstart: `make demo` snapshots a random model and serves it (Ctrl-C stops), `make test` runs lint, types
# and tests.
# GPU machines: `make test TORCH=torch` (pip picks the CUDA build of torch).

TORCH ?= torch==2.13.0
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(subst =,_,$(subst <,_,$(subst >,_,$(subst $() ,_,$(TORCH)))))

.PHONY: venv demo test lint typecheck clean

venv: $(STAMP)

$(STAMP): pyproject.toml setup.py runtime/kernels/cpu_attention.c runtime/kernels/cpu_small_ops.c runtime/kernels/cpu_gemv.c runtime/kernels/cpu_lora.c runtime/kernels/bf16.h runtime/kernels/decode_attention.h runtime/kernels/vec512.h
	@test -n "$(PYTHON)" || { echo "python3.11 (or python3) not found on PATH"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install "$(TORCH)"
	$(BIN)/python -m pip install -e '.[test]'
	rm -f $(VENV)/.installed-*
	touch $@

demo: venv
	$(BIN)/warmstart demo

lint: venv
	$(BIN)/ruff check .

typecheck: venv
	$(BIN)/mypy

test: venv lint typecheck
	$(BIN)/pytest -q

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
