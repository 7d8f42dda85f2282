"""Builds the native extension ``attnres_kernels._C``.

C++ CPU kernels are always built. The CUDA kernels (csrc/cuda/*.cu) are added
when torch is a CUDA build, nvcc is found and ``ATTNRES_SKIP_CUDA_BUILD`` is not
1; they are compiled for ``TORCH_CUDA_ARCH_LIST`` (default ``8.0;9.0``, no GPU
needed). The CUDA library headers torch includes (cuBLAS, cuSPARSE, ...) are
taken from torch's ``nvidia-*`` wheels when the toolkit does not have them.
The CPU kernels are compiled for the vector ISA of the build machine
(``ATTNRES_CPU_CAPABILITY=auto|avx512|avx2|default`` overrides the choice).
Build with ``pip install --no-build-isolation -e .`` so the installed torch is used.
"""

import glob
import os
import platform
import shutil
import sys

import torch
from setuptools import setup


def _cuda_toolkit():
    """The CUDA toolkit root for torch's CUDA_HOME when neither CUDA_HOME nor CUDA_PATH is
    set: torch takes the parent of the nvcc on PATH, which for a wrapper such as
    /usr/local/bin/nvcc is /usr/local, without the CUDA runtime library."""
    nvcc = shutil.which("nvcc")
    candidates = [os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))] if nvcc else []
    for root in [*candidates, "/usr/local/cuda"]:
        if os.path.isfile(os.path.join(root, "bin", "nvcc")) and os.path.isdir(os.path.join(root, "lib64")):
            return root
    return None


if not (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")) and _cuda_toolkit():
    os.environ["CUDA_HOME"] = _cuda_toolkit()

from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

X86_FLAGS = {
    "avx512": [
        "-mavx512f",
        "-mavx512bw",
        "-mavx512vl",
        "-mavx512dq",
        "-mfma",
        "-mf16c",
        "-DCPU_CAPABILITY=AVX512",
        "-DCPU_CAPABILITY_AVX512",
    ],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "default": [],
}


def cpu_capability() -> str:
    choice = os.environ.get("ATTNRES_CPU_CAPABILITY", "auto")
    if choice not in ("auto", *X86_FLAGS):
        raise SystemExit(f"ATTNRES_CPU_CAPABILITY must be auto, avx512, avx2 or default, got {choice!r}")
    if platform.machine() not in ("x86_64", "AMD64") or choice != "auto":
        return choice if platform.machine() in ("x86_64", "AMD64") else "default"
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(f.read().split())
    except OSError:
        return "default"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma"} <= flags:
        return "avx512"
    if {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return "default"


def cuda_build_enabled(cuda_sources: list) -> bool:
    """Whether the CUDA kernels are compiled into the extension (see the module docstring)."""
    if os.environ.get("ATTNRES_SKIP_CUDA_BUILD", "0") == "1" or not cuda_sources or torch.version.cuda is None:
        return False
    return CUDA_HOME is not None and shutil.which("nvcc", path=os.path.join(CUDA_HOME, "bin")) is not None


def cuda_wheel_include_dirs() -> list:
    """Include directories of torch's CUDA library wheels (``site-packages/nvidia/*/include``),
    for toolkits that ship nvcc without the library headers."""
    site = os.path.dirname(os.path.dirname(torch.__file__))
    found = glob.glob(os.path.join(site, "nvidia", "*", "include"))
    return sorted(d for d in found if os.path.isdir(d))


def extension():
    cpu_flags = X86_FLAGS[cpu_capability()]
    sources = ["csrc/python_module.cpp", "csrc/bindings.cpp", *sorted(glob.glob("csrc/autograd/*.cpp"))]
    sources += sorted(glob.glob("csrc/cpu/*.cpp"))
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    # -fopenmp: at::parallel_for is an inline OpenMP loop; without the flag it runs
    # on one thread. libgomp resolves to the copy torch already loaded. Apple's Clang
    # has no OpenMP and rejects the flag: on macOS (not tested here) the kernels are
    # built without it and run on one thread.
    # C++20: torch >= 2.14 requires it (and 2.13 builds with it too).
    # -g0: no debug info (Python's default flags ask for it): a third less compile time.
    # Py_LIMITED_API: BuildExtension defines it for a py_limited_api extension, as the oldest Python torch
    # supports (3.10, as requires-python); the wheel's abi3 tag below says the same.
    openmp = [] if sys.platform == "darwin" else ["-fopenmp"]
    cxx = ["-O3", "-g0", "-std=c++20", *openmp, *cpu_flags]
    link = openmp
    if cuda_build_enabled(cuda_sources):
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        # No --use_fast_math: the kernels are memory-bound, and exp/log/sqrt/division
        # must round like the CPU kernels and the reference.
        # --threads: the architectures compile in parallel. The CUDA sources come first,
        # so that ninja starts the longest compile first.
        nvcc = ["-O3", "-std=c++20", "--threads=2"]
        return CUDAExtension(
            "attnres_kernels._C",
            cuda_sources + sources,
            include_dirs=cuda_wheel_include_dirs(),
            py_limited_api=True,
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            extra_link_args=link,
        )
    return CppExtension(
        "attnres_kernels._C", sources, py_limited_api=True, extra_compile_args={"cxx": cxx}, extra_link_args=link
    )


if __name__ == "__main__":  # CMakeLists.txt imports this file for X86_FLAGS and cpu_capability()
    os.environ.setdefault("MAX_JOBS", "2")
    setup(
        ext_modules=[extension()],
        cmdclass={"build_ext": BuildExtension},
        options={"bdist_wheel": {"py_limited_api": "cp310"}},
    )
