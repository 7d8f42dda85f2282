# The README's two commands:
#   make demo    set up .venv (CPU build of torch), build the C++ ops, run the demo
#   make test    also install the test tools, run pytest (the CUDA kernels run on CPU under
#                the SIMT harness) and the ahead-of-time check of all GPU code
# Other targets: make lint (ruff + clang-format), make bench (pytest --benchmark),
# make sweep (benchmarks/results/cpu.md), make cmake, make cuda-build (the CUDA
# binding built for real against a CUDA build of torch in .venv-cuda; no GPU needed).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CUDA_VENV ?= .venv-cuda
CUDA_TORCH ?= torch==2.14.1
ARGS ?=
export MAX_JOBS ?= 2
NATIVE_SOURCES := setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*.h csrc/autograd/*.cpp csrc/autograd/*.h csrc/cpu/*.cpp csrc/cpu/*.h csrc/cuda/*.cu csrc/cuda/*.cuh csrc/cuda/*.h)

.PHONY: demo test pytest aot-check lint format bench sweep cmake cuda-build clean gpu-bench

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

# `make test` runs both parts; `make -j2 test` runs them side by side (CI does, with cuda-build).
test: pytest aot-check

# pytest-xdist workers: the suite is mostly single-threaded (Triton's interpreter, the SIMT harness, Python-level
# checks), so two workers take about a third off its time on a 2-core machine. PYTEST_WORKERS=0 runs it in one process.
PYTEST_WORKERS ?= 2
pytest: $(VENV)/.dev $(VENV)/.built
	$(PY) -m pytest -n $(PYTEST_WORKERS) $(ARGS)

aot-check: $(VENV)/.dev $(VENV)/.built
	$(PY) -m attnres_kernels.check

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

# A separate venv with the CUDA build of torch: builds the package with its CUDA
# sources (nvcc) from a copy of the sources (its own build/ dir, no objects shared
# with the CPU build), imports it without a GPU and checks that the attnres::
# depth-read, attention and Block-step ops have CUDA kernels registered. For sm_80
# only (CUDA_BUILD_ARCHS; a release build takes setup.py's default 8.0;9.0): the
# ahead-of-time check already compiles every kernel for sm_80 and sm_90.
CUDA_SRC := build/cuda-src
CUDA_BUILD_ARCHS ?= 8.0
$(CUDA_VENV)/.installed:
	test -x $(CUDA_VENV)/bin/python || $(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/python -m pip install $(CUDA_TORCH) numpy setuptools wheel ninja
	touch $@

cuda-build: $(CUDA_VENV)/.installed
	rm -rf $(CUDA_SRC) && mkdir -p $(CUDA_SRC)
	cp -r setup.py pyproject.toml README.md csrc attnres_kernels $(CUDA_SRC)/
	rm -f $(CUDA_SRC)/attnres_kernels/_C*.so
	cd $(CUDA_SRC) && TORCH_CUDA_ARCH_LIST="$(CUDA_BUILD_ARCHS)" \
	  $(abspath $(CUDA_VENV))/bin/python -m pip install --no-build-isolation --no-deps .
	cd $(CUDA_VENV) && bin/python -c "import torch, attnres_kernels.ops._native as n; \
	  assert torch.version.cuda, 'torch in $(CUDA_VENV) is not a CUDA build'; \
	  assert n.available(), n.LOAD_ERROR; \
	  missing = [op for op in ('depth_attn_fwd', 'depth_attn_bwd', 'attn_fwd', 'attn_bwd', 'block_step_fwd', \
	                           'block_step_bwd') if not n.has_kernel(op, 'cuda')]; \
	  assert not missing, f'no CUDA kernel registered for {missing}'; \
	  print('cuda-build OK: torch', torch.__version__, '(CUDA', torch.version.cuda + '):', \
	        'attnres::depth_attn_fwd/bwd, attn_fwd/bwd and block_step_fwd/bwd have CUDA kernels;', \
	        torch.ops.attnres.build_info())"

clean:
	rm -rf build $(VENV) $(CUDA_VENV) attnres_kernels/_C*.so *.egg-info
