# The README's two commands:
#   make demo    set up .venv (CPU build of torch), build the C++ ops, run the demo
#   make test    also install the test tools, run pytest (the CUDA kernels run on CPU under
#                the SIMT harness) and the ahead-of-time check of all GPU code
# Other targets: make lint (ruff + clang-format), make bench (pytest --benchmark),
# make sweep (benchmarks/results/cpu.md), make cmake, make cuda-build (the CUDA
# binding built for real against a CUDA build of torch in .venv-cuda; no GPU needed),
# make portable-check (the CPU kernels' code for other CPUs than the build machine's).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CUDA_VENV ?= .venv-cuda
CUDA_TORCH ?= torch==2.14.1
ARGS ?=
export MAX_JOBS ?= 2
NATIVE_SOURCES := setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*.h csrc/autograd/*.cpp csrc/autograd/*.h csrc/cpu/*.cpp csrc/cpu/*.h csrc/cuda/*.cu csrc/cuda/*.cuh csrc/cuda/*.h)

.PHONY: demo test pytest aot-check lint format bench sweep cmake cuda-build portable-check clean gpu-bench

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
	$(PY) -m benchmarks.gpu

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

# The CPU kernels' code for CPUs other than the build machine's, which the tests above never run:
# - portable-check-<isa>: the extension built for that vector ISA in a copy of the sources, and the
#   CPU op tests run against it: `default` (no AVX: the code CPUs without AVX2 take, and Arm's with
#   NEON vectors) always, `avx2` too on a machine whose own build is AVX-512 (setup.py's test);
# - portable-check-aarch64: the CPU kernels' sources compiled for aarch64 (-fsyntax-only: parsing and
#   template instantiation against torch's NEON vector headers, no object code; -Wno-psabi: GCC's
#   notes on an ABI change of GCC 10), with Debian's cross compiler, installed here when missing;
# - portable-check-clang: the same sources through Clang (Debian's, installed here when missing), for
#   aarch64 (the compiler of Apple's Arm machines) and for x86 with the AVX-512 build's flags.
#   (apt-get runs through sudo for a user other than root.)
# The tests run torch on one thread: they run beside other jobs (CI's pytest), and PyTorch's OpenMP
# threads spin while they wait (two processes of two threads on two cores: 60 s of tests took 570 s).
# (Not .PHONY: make skips the pattern rule's search for phony targets.)
PORTABLE_SRC := build/portable
APT_GET := $(if $(filter 0,$(shell id -u)),,sudo )apt-get
AARCH64_CXX ?= aarch64-linux-gnu-g++
PORTABLE_TESTS := tests/backends/test_cpu_op.py tests/ops/test_attention.py tests/ops/test_block_step.py
# torch's and Python's include directories (expanded when a recipe runs, after the venv exists).
TORCH_INCLUDES = $(shell $(PY) -c "import sysconfig; from torch.utils.cpp_extension import include_paths; \
                   print(' '.join('-I' + p for p in [*include_paths(), sysconfig.get_paths()['include']]))")
HOST_AVX512 := $(shell grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | grep -w avx512f | grep -w avx512bw \
                 | grep -w avx512vl | grep -w avx512dq | grep -qw fma && echo yes)
PORTABLE_ISAS := default $(if $(HOST_AVX512),avx2)
portable-check: $(addprefix portable-check-,$(PORTABLE_ISAS)) portable-check-aarch64 portable-check-clang

portable-check-%: $(VENV)/.dev $(VENV)/.built
	rm -rf $(PORTABLE_SRC)/$* && mkdir -p $(PORTABLE_SRC)/$*
	cp -r setup.py pyproject.toml README.md csrc attnres_kernels tests $(PORTABLE_SRC)/$*/
	rm -f $(PORTABLE_SRC)/$*/attnres_kernels/_C*.so
	cd $(PORTABLE_SRC)/$* && ATTNRES_CPU_CAPABILITY=$* ATTNRES_SKIP_CUDA_BUILD=1 \
	  $(abspath $(PY)) setup.py -q build_ext --inplace
	cd $(PORTABLE_SRC)/$* && $(abspath $(PY)) -c "import attnres_kernels as ak; info = ak.build_info(); \
	  assert ak.__file__.startswith('$(abspath $(PORTABLE_SRC)/$*)') and 'CPU vector ISA: $*;' in info, info"
	cd $(PORTABLE_SRC)/$* && OMP_NUM_THREADS=1 $(abspath $(PY)) -m pytest -q -p no:cacheprovider $(PORTABLE_TESTS) \
	  -k "not triton"

portable-check-aarch64: $(VENV)/.built
	command -v $(AARCH64_CXX) >/dev/null || $(APT_GET) install -y -q g++-aarch64-linux-gnu \
	  || ($(APT_GET) update -q && $(APT_GET) install -y -q g++-aarch64-linux-gnu)
	for f in csrc/cpu/*.cpp; do \
	  echo "aarch64: $$f"; $(AARCH64_CXX) -fsyntax-only -Wno-psabi -std=c++20 -fopenmp -Icsrc $(TORCH_INCLUDES) $$f || exit 1; \
	done

CLANG_CXX ?= clang++-15
AVX512_FLAGS := -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c -DCPU_CAPABILITY=AVX512 -DCPU_CAPABILITY_AVX512
portable-check-clang: portable-check-aarch64
	command -v $(CLANG_CXX) >/dev/null || $(APT_GET) install -y -q clang-15 \
	  || ($(APT_GET) update -q && $(APT_GET) install -y -q clang-15)
	for f in csrc/cpu/*.cpp; do \
	  echo "clang aarch64, x86 AVX-512: $$f"; \
	  $(CLANG_CXX) --target=aarch64-linux-gnu --sysroot=/usr/aarch64-linux-gnu -fsyntax-only -std=c++20 \
	    -Icsrc $(TORCH_INCLUDES) $$f || exit 1; \
	  $(CLANG_CXX) -fsyntax-only -std=c++20 $(AVX512_FLAGS) -Icsrc $(TORCH_INCLUDES) $$f || exit 1; \
	done

clean:
	rm -rf build $(VENV) $(CUDA_VENV) attnres_kernels/_C*.so *.egg-info
