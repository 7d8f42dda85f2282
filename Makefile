# The README's two commands:
#   make demo    set up .venv (CPU build of torch), build the C++ ops, run the demo
#   make test    also install the test tools, run pytest and the Triton ahead-of-time check
# Other targets: make lint (ruff + clang-format), make bench (pytest --benchmark),
# make sweep (benchmarks/results/cpu.md), make cmake.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=
export MAX_JOBS ?= 2
NATIVE_SOURCES := setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*.h csrc/autograd/*.cpp csrc/cpu/*.cpp csrc/cuda/*.cu)

.PHONY: demo test lint format bench sweep cmake clean gpu-bench

$(VENV)/.runtime: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -r requirements.txt
	touch $@

$(VENV)/.dev: $(VENV)/.runtime requirements-dev.txt
	$(PY) -m pip install -r requirements-dev.txt
	touch $@

$(VENV)/.built: $(VENV)/.runtime $(NATIVE_SOURCES)
	$(PY) -m pip install --no-build-isolation -e .
	touch $@

demo: $(VENV)/.built
	$(PY) -m attnres_kernels.demo $(ARGS)

test: $(VENV)/.dev $(VENV)/.built
	$(PY) -m pytest $(ARGS)
	$(PY) -m attnres_kernels.triton.check

CXX_SOURCES = $(shell git ls-files 'csrc/*.cpp' 'csrc/*.h' 'csrc/*.cu' 'csrc/*.cuh')

lint: $(VENV)/.dev
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run --Werror $(CXX_SOURCES)

format: $(VENV)/.dev
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
	$(VENV)/bin/clang-format -i $(CXX_SOURCES)

bench: $(VENV)/.dev $(VENV)/.built
	$(PY) -m pytest --benchmark benchmarks/ $(ARGS)

sweep: $(VENV)/.dev $(VENV)/.built
	$(PY) benchmarks/sweep.py $(ARGS)

# On a CUDA machine: the cuda-marked tests and benchmark cases, then benchmarks/results/gpu.md + gpu.json.
gpu-bench: $(VENV)/.dev $(VENV)/.built
	$(PY) -m pytest -m cuda --benchmark $(ARGS)
	$(PY) benchmarks/gpu.py

cmake: $(VENV)/.runtime
	cmake -S . -B build -DPython3_EXECUTABLE=$(abspath $(PY))
	cmake --build build -j $(MAX_JOBS)
	ctest --test-dir build --output-on-failure

clean:
	rm -rf build $(VENV) attnres_kernels/_C*.so *.egg-info
