# warmstart: `make demo` snapshots the real SmolLM2-135M-Instruct and serves it (Ctrl-C stops); it installs only
# what running and building need (the `build` extra). `make test` installs the test toolchain too (the `test` extra)
# and runs lint, types and tests (and, on an AVX-512 CPU, the engine tests again as an AVX2-only CPU runs them).
# GPU machines: `make test TORCH=torch` (pip picks the CUDA build of torch).

TORCH ?= torch==2.13.0
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
TORCH_TAG := $(subst =,_,$(subst <,_,$(subst >,_,$(subst $() ,_,$(TORCH)))))
STAMP := $(VENV)/.installed-test-$(TORCH_TAG)
RUN_STAMP := $(VENV)/.installed-run-$(TORCH_TAG)
SOURCES := pyproject.toml setup.py runtime/kernels/cpu_attention.c runtime/kernels/cpu_small_ops.c \
	runtime/kernels/cpu_gemv.c runtime/kernels/cpu_lora.c runtime/kernels/bf16.h runtime/kernels/decode_attention.h \
	runtime/kernels/vec512.h runtime/kernels/vec256.h runtime/kernels/isa.h

.PHONY: venv demo test test-emulated lint typecheck clean

venv: $(STAMP)

# The venv with torch and warmstart installed editable with the extra $(1).
define install
	@test -n "$(PYTHON)" || { echo "python3.11 (or python3) not found on PATH"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install "$(TORCH)"
	$(BIN)/python -m pip install -e '.[$(1)]'
endef

# The test extra holds the build extra, so a test install serves `make demo` too.
$(STAMP): $(SOURCES)
	$(call install,test)
	rm -f $(VENV)/.installed-*
	touch $@ $(RUN_STAMP)

$(RUN_STAMP): $(SOURCES)
	$(call install,build)
	rm -f $(VENV)/.installed-run-*
	touch $@

demo: $(RUN_STAMP)
	$(BIN)/warmstart demo

lint: venv
	$(BIN)/ruff check .

# mypy names modules after their folders; it checks ours under their installed names through links.
typecheck: venv
	mkdir -p build/typecheck/warmstart
	for folder in runtime snapshot handlers; do ln -sfn ../../../$$folder build/typecheck/warmstart/$$folder; done
	$(BIN)/mypy

# The paths an AVX2-only CPU takes, on a CPU with more: our kernels, oneDNN and ATen all held to AVX2.
AVX2_ONLY := WARMSTART_CPU_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2

test: venv lint typecheck
	$(BIN)/pytest -q
	if $(BIN)/python -c "import sys; from warmstart.runtime.kernels import isa; sys.exit(not isa.at_least('avx512'))"; then \
		$(AVX2_ONLY) $(BIN)/pytest -q -p no:cacheprovider tests/runtime -m "not kernels"; fi

# The instruction-set-sensitive tests again on emulated CPUs below this one (.ci/emulate-cpu: qemu-user, installed
# from Debian's packages when missing; about 10x slower): AVX2 (Haswell) where this CPU has AVX-512, and one without
# AVX (Nehalem) on every x86 CPU. Not the huge-page tests (qemu-user does not pass madvise(MADV_HUGEPAGE) through)
# nor tests/runtime/test_isa.py (the processes it starts run natively). .ci/run runs this after `make test`.
ISA_TESTS := $(addprefix tests/runtime/,test_cpu_attention.py test_cpu_gemv.py test_cpu_lora.py \
	test_cpu_prefill_attention.py test_cpu_small_ops.py test_fused_decode.py test_packed_linear.py \
	test_engine_matches_transformers.py test_last_layer_rows.py)

test-emulated: venv
	@if [ "$$(uname -m)" != x86_64 ]; then echo "test-emulated: qemu-user emulates x86-64 CPUs; nothing to do here"; exit 0; fi; \
	for cpu in $$($(BIN)/python -c "from warmstart.runtime.kernels import isa; print(*['avx2'] * isa.at_least('avx512'), 'sse')"); do \
		echo "== the instruction-set tests on an emulated $$cpu CPU"; \
		.ci/emulate-cpu $$cpu $(BIN)/python -m pytest -q -rs -p no:cacheprovider -m "not kernels" $(ISA_TESTS) || exit 1; \
	done

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .mypy_cache .ruff_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
