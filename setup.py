"""Builds the native extension ``attnres_kernels._C``.

C++ CPU kernels are always built. CUDA sources (csrc/cuda/*.cu) are added only
when torch is a CUDA build, nvcc is found and ``ATTNRES_SKIP_CUDA_BUILD`` is not
1. The CPU kernels are compiled for the vector ISA of the build machine
(``ATTNRES_CPU_CAPABILITY=auto|avx512|avx2|default`` overrides the choice).
Build with ``pip install --no-build-isolation -e .`` so the installed torch is used.
"""

import glob
import os
import platform

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

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


def extension():
    cpu_flags = X86_FLAGS[cpu_capability()]
    sources = ["csrc/python_module.cpp", "csrc/bindings.cpp", *sorted(glob.glob("csrc/autograd/*.cpp"))]
    sources += sorted(glob.glob("csrc/cpu/*.cpp"))
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    build_cuda = (
        os.environ.get("ATTNRES_SKIP_CUDA_BUILD", "0") != "1"
        and torch.version.cuda is not None
        and CUDA_HOME is not None
        and bool(cuda_sources)
    )
    # -fopenmp: at::parallel_for is an inline OpenMP loop; without the flag it runs
    # on one thread. libgomp resolves to the copy torch already loaded.
    cxx = ["-O3", "-std=c++17", "-fopenmp", "-DPy_LIMITED_API=0x03090000", *cpu_flags]
    link = ["-fopenmp"]
    if build_cuda:
        archs = os.environ.get("ATTNRES_CUDA_ARCHS", "80;90").split(";")
        nvcc = ["-O3", "-std=c++17", "--use_fast_math", *(f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs)]
        return CUDAExtension(
            "attnres_kernels._C",
            sources + cuda_sources,
            py_limited_api=True,
            extra_compile_args={"cxx": cxx + ["-DATTNRES_WITH_CUDA"], "nvcc": nvcc},
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
        options={"bdist_wheel": {"py_limited_api": "cp39"}},
    )
