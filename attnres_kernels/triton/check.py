"""Ahead-of-time check of every Triton kernel configuration, no GPU needed.

    python -m attnres_kernels.triton.check [--arch 80 90] [--dtype bfloat16 float32 float64]

For each kernel × each tile/warp configuration the dispatcher can select
(:func:`attnres_kernels.triton.launch.all_kernel_configs`) × source dtype ×
architecture, compiles the kernel with Triton for a ``GPUTarget`` (feature
flags at their most register-hungry setting), runs ``ptxas -v`` on the PTX and
prints registers, spill bytes and shared memory. Exits non-zero on any
compile failure or spill.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    # The check needs real JIT functions, not interpreted ones.
    os.environ["TRITON_INTERPRET"] = "0"
    if "attnres_kernels.triton.kernels" in sys.modules:
        raise SystemExit("run the AOT check in a fresh process without TRITON_INTERPRET=1")

import torch
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.compiler import compile as triton_compile
from triton.runtime.jit import MockTensor, create_function_from_signature

from . import kernels
from .launch import BWD_ROWS, COLUMN_SUM_BLOCK, all_kernel_configs

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}
PTXAS_LINE = re.compile(r"Used (\d+) registers")
SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
SMEM = re.compile(r"(\d+) bytes smem")
PTX_TARGET = re.compile(r"^\.target\s+(sm_\w+)", re.MULTILINE)


def _launches(cfg, dtype):
    """(name, kernel, args, constexprs) for one configuration: realistic
    pointer/int arguments, every optional feature switched on."""
    acc_torch = torch.float64 if dtype == torch.float64 else torch.float32
    acc_tl = tl.float64 if dtype == torch.float64 else tl.float32
    src, acc, table = MockTensor(dtype), MockTensor(acc_torch), MockTensor(torch.int64)
    tile = dict(BLOCK_Q=cfg.block_q, BLOCK_D=cfg.block_d, ACC=acc_tl, ALIGN=16 // src.dtype.itemsize)
    m, d, n, nq = 4096, 1024, 9, 2
    yield (
        "depth_attn_fwd",
        kernels.depth_attn_fwd_kernel,
        [src, table, table, n, acc, src, acc, acc, src, acc, acc, acc, m, d, nq, n * m],
        dict(EPS=1e-6, HAS_PREFIX=True, HAS_OUT_NORM=True, **tile),
    )
    for out_norm in (True, False):
        yield (
            f"depth_attn_bwd[out_norm={int(out_norm)}]",
            kernels.depth_attn_bwd_kernel,
            [
                src,
                table,
                table,
                src,
                table,
                n,
                src,
                acc,
                acc,
                acc,
                acc,
                acc,
                acc,
                src,
                acc,
                src,
                acc,
                acc,
                acc,
                m,
                d,
                nq,
                n * m,
            ],
            dict(
                EPS=1e-6,
                HAS_OUT_NORM=out_norm,
                HAS_PREFIX=True,
                HAS_DLSE=True,
                HAS_DLOGITS=True,
                ACCUMULATE_DV=True,
                ROWS=BWD_ROWS,
                **tile,
            ),
        )


def _compile_ptx(kernel, args, constexprs, launch_options, arch):
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(constexprs, **launch_options)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constants, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    compiled = triton_compile(ASTSource(kernel, signature, constants, attrs), target=target, options=options.__dict__)
    return compiled.asm["ptx"]


def _ptxas(ptx: str, ptxas: str):
    gpu_name = PTX_TARGET.search(ptx).group(1)  # e.g. sm_90a: Triton targets the arch-specific ISA
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        result = subprocess.run(
            [ptxas, "-v", f"--gpu-name={gpu_name}", path, "-o", os.path.join(tmp, "k.cubin")],
            capture_output=True,
            text=True,
        )
    if result.returncode != 0:
        raise RuntimeError(result.stderr.strip())
    report = result.stderr
    regs = int(PTXAS_LINE.search(report).group(1))
    spill_st, spill_ld = (int(x) for x in SPILL.search(report).groups())
    smem = SMEM.search(report)
    return regs, spill_st + spill_ld, int(smem.group(1)) if smem else 0


def _check_one(job):
    """Compiles and assembles one (kernel, configuration, dtype, arch); returns its report line and status."""
    name, cfg, dtype_name, arch, ptxas = job
    if cfg is None:
        kernel = kernels.column_sum_kernel
        kargs = [MockTensor(torch.float32)] * 2 + [64, 4096]
        constexprs = dict(BLOCK=COLUMN_SUM_BLOCK)
        options, shape = dict(num_warps=4), (COLUMN_SUM_BLOCK, 1, 4)
    else:
        _, kernel, kargs, constexprs = next(x for x in _launches(cfg, DTYPES[dtype_name]) if x[0] == name)
        options, shape = cfg.launch_options(), (cfg.block_d, cfg.block_q, cfg.num_warps)
    line = f"{name:28s} {dtype_name:9s} {shape[0]:7d} {shape[1]:7d} {shape[2]:5d} {'sm_' + str(arch):>6s}"
    try:
        regs, spill, smem = _ptxas(_compile_ptx(kernel, kargs, constexprs, options, arch), ptxas)
    except Exception as exc:  # every failure is reported, then fails the run
        return f"{line} FAILED: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", False
    return f"{line} {regs:5d} {spill:7d} {smem:7d}{'' if spill == 0 else '  SPILLS'}", spill == 0


def _default_ptxas():
    bundled = os.path.join(
        os.path.dirname(triton_compile.__code__.co_filename), "..", "backends", "nvidia", "bin", "ptxas"
    )
    return shutil.which("ptxas") or (os.path.normpath(bundled) if os.path.exists(bundled) else None)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", nargs="+", type=int, default=[80, 90])
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["bfloat16", "float32", "float64"])
    parser.add_argument(
        "--ptxas",
        default=_default_ptxas(),
        help="ptxas binary (default: the CUDA toolkit's on PATH, else the one Triton ships)",
    )
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    if args.ptxas is None:
        print("ptxas not found (install the CUDA toolkit or pass --ptxas)", file=sys.stderr)
        return 2
    start = time.time()
    jobs = [
        (name, cfg, dtype_name, arch, args.ptxas)
        for dtype_name in args.dtype
        for cfg in all_kernel_configs(DTYPES[dtype_name])
        for name, *_ in _launches(cfg, DTYPES[dtype_name])
        for arch in args.arch
    ]
    jobs += [("column_sum", None, "float32", arch, args.ptxas) for arch in args.arch]
    print(
        f"{'kernel':28s} {'dtype':9s} {'BLOCK_D':>7s} {'BLOCK_Q':>7s} {'warps':>5s} {'arch':>6s} "
        f"{'regs':>5s} {'spill B':>7s} {'smem B':>7s}"
    )
    failures = 0
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for line, ok in pool.map(_check_one, jobs):
            failures += not ok
            print(line, flush=True)
    print(
        f"{'FAILED' if failures else 'OK'}: {len(jobs)} kernel configurations compiled for "
        f"{', '.join('sm_' + str(a) for a in args.arch)}, {failures} failing, {time.time() - start:.0f} s"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
