"""Ahead-of-time check of every Triton kernel configuration, no GPU needed.

    python -m attnres_kernels.triton.check [--arch 80 90] [--dtype bfloat16 float32 float64]

For each launch an op family's ``aot_launches(dtype)`` lists (every kernel ×
tile/warp configuration its dispatcher can select, see :data:`AOT_FAMILIES`)
× dtype × architecture, compiles the kernel with Triton for a ``GPUTarget`` (feature
flags at their most register-hungry setting) down to the cubin, reads the report of
the ``ptxas -v`` run Triton makes for it (its own ptxas, or ``TRITON_PTXAS_PATH``'s; a
kernel from Triton's cache: its PTX assembled by that ptxas here), and prints registers,
spill bytes and shared memory. Exits non-zero on any
compile failure or spill.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import importlib
import io
import os
import re
import subprocess
import sys
import tempfile
import time

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    # The check needs real JIT functions, not interpreted ones.
    os.environ["TRITON_INTERPRET"] = "0"
    if "attnres_kernels.triton.depth_attention_kernels" in sys.modules:
        raise SystemExit("run the AOT check in a fresh process without TRITON_INTERPRET=1")

import torch
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.compiler import compile as triton_compile
from triton.runtime.jit import create_function_from_signature

# Modules whose ``aot_launches(dtype)`` lists every launch (an :class:`AotLaunch`
# per kernel × configuration the dispatcher can choose) of one op family.
AOT_FAMILIES = (
    "attnres_kernels.triton.depth_attention_ops",
    "attnres_kernels.triton.attention_ops",
    "attnres_kernels.triton.block_step_ops",
)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}
PTXAS_LINE = re.compile(r"Used (\d+) registers")
SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
SMEM = re.compile(r"(\d+) bytes smem")
PTX_TARGET = re.compile(r"^\.target\s+(sm_\w+)", re.MULTILINE)
# Shared memory one block may use on every sm_80+ GPU (99 KiB on sm_86/sm_89; more on
# sm_80 and sm_90): Triton refuses to launch a kernel that needs more than the device has.
SMEM_LIMIT = 101376


def _compile(kernel, args, constexprs, launch_options, arch):
    """Compiles one launch for ``arch`` through Triton's whole pipeline, down to the cubin its own
    ``ptxas -v`` assembles (the ptxas and flags of a launch on a GPU); returns (registers, spill
    bytes, shared memory bytes: ptxas's static + Triton's dynamic). A kernel in Triton's cache skips
    that stage: its cached PTX is assembled here instead (:func:`_ptxas_report`)."""
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(constexprs, **launch_options)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constants, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    source = ASTSource(kernel, signature, constants, attrs)
    log = io.StringIO()
    with knobs.nvidia.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True  # printed after the cubin stage's ptxas run
        compiled = triton_compile(source, target=target, options=options.__dict__)
    report = log.getvalue()
    if PTXAS_LINE.search(report) is None:
        report = _ptxas_report(compiled.asm["ptx"])
    regs = int(PTXAS_LINE.search(report).group(1))
    spill_st, spill_ld = (int(x) for x in SPILL.search(report).groups())
    static_smem = SMEM.search(report)
    return regs, spill_st + spill_ld, (int(static_smem.group(1)) if static_smem else 0) + compiled.metadata.shared


def _ptxas_report(ptx: str) -> str:
    """``ptxas -v``'s report on ``ptx``, assembled by Triton's ptxas with the register allocation flag of
    its own cubin stage."""
    gpu_name = PTX_TARGET.search(ptx).group(1)  # e.g. sm_90a: Triton targets the arch-specific ISA
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        command = [knobs.nvidia.ptxas.path, "-v", "--regAllocOptLevel=2", f"--gpu-name={gpu_name}", path]
        result = subprocess.run([*command, "-o", os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(result.stderr.strip())
    return result.stderr


def _check_one(job):
    """Compiles and assembles one (kernel, configuration, dtype, arch); returns its report line and status."""
    module_name, name, config, dtype_name, arch = job
    launch = next(
        x
        for x in importlib.import_module(module_name).aot_launches(DTYPES[dtype_name])
        if (x.name, x.config) == (name, config)
    )
    line = format_line("triton", name, dtype_name, config, arch)
    try:
        regs, spill, smem = _compile(launch.kernel, launch.args, launch.constexprs, launch.options, arch)
    except Exception as exc:  # every failure is reported, then fails the run
        return f"{line} FAILED: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", False
    problems = ("  SPILLS" if spill else "") + ("  SMEM" if smem > SMEM_LIMIT else "")
    return f"{line} {regs:5d} {spill:7d} {smem:7d}{problems}", not problems


HEADER = " ".join(
    [
        f"{'backend':7s} {'kernel':30s} {'dtype':9s} {'config':34s}",
        f"{'arch':>6s} {'regs':>5s} {'spill B':>7s} {'smem B':>7s}",
    ]
)


def format_line(backend: str, kernel: str, dtype_name: str, config: str, arch: int) -> str:
    """The first columns of a report line (the check of every backend prints the same columns)."""
    return f"{backend:7s} {kernel:30s} {dtype_name:9s} {config:34s} {'sm_' + str(arch):>6s}"


def run(archs, dtype_names, max_workers: int, emit=print) -> tuple:
    """Compiles every launch of every family for ``archs`` × ``dtype_names``; calls
    ``emit`` with each report line; returns (number of jobs, number failing)."""
    jobs = [
        (module_name, launch.name, launch.config, dtype_name, arch)
        for module_name in AOT_FAMILIES
        for dtype_name in dtype_names
        for launch in importlib.import_module(module_name).aot_launches(DTYPES[dtype_name])
        for arch in archs
    ]
    failures = 0
    with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, max_workers)) as pool:
        for line, ok in pool.map(_check_one, jobs):
            failures += not ok
            emit(line)
    return len(jobs), failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", nargs="+", type=int, default=[80, 90])
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["bfloat16", "float32", "float64"])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    start = time.time()
    print(HEADER)
    count, failures = run(args.arch, args.dtype, args.jobs, emit=lambda line: print(line, flush=True))
    print(
        f"{'FAILED' if failures else 'OK'}: {count} Triton kernel configurations compiled for "
        f"{', '.join('sm_' + str(a) for a in args.arch)}, {failures} failing, {time.time() - start:.0f} s"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
