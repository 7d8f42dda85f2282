"""Ahead-of-time check of all GPU code, no GPU needed (DESIGN.md §4).

    python -m attnres_kernels.check [--arch 80 90] [--dtype bfloat16 float32 float64] [--backend all|triton|cuda]

- Triton: every kernel configuration the launchers can choose is compiled for
  each architecture down to the cubin, the report of Triton's own ``ptxas -v``
  run read (for a kernel from Triton's cache, its PTX assembled again)
  (:mod:`attnres_kernels.triton.check`).
- CUDA: ``csrc/cuda/tools/aot_check.cu`` is compiled with ``nvcc -Xptxas -v`` for
  each architecture, which instantiates every kernel the launchers can choose,
  and run on the host: it checks that every launch plan maps to a compiled kernel
  and reports each kernel's largest dynamic shared memory.

Prints one line per kernel × configuration × architecture, starting with the
backend name, with registers, spill bytes and shared memory (Triton: ptxas's static
plus Triton's dynamic allocation; CUDA: the largest dynamic allocation of any launch). Exits
non-zero on any compile failure or spill.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Importing the Triton check switches off TRITON_INTERPRET (it needs real JIT functions).
from .triton.check import DTYPES, HEADER, format_line
from .triton.check import run as run_triton

AOT_SOURCE = Path(__file__).resolve().parents[1] / "csrc" / "cuda" / "tools" / "aot_check.cu"
ENTRY = re.compile(r"Compiling entry function '(\S+)' for '(sm_\d+)'")
SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
REGISTERS = re.compile(r"Used (\d+) registers")
KERNEL = re.compile(r"(\w+)_kernel<([^>]*)>")


def _ptxas_entries(report: str) -> list:
    """(mangled name, arch, registers, spill bytes) of every kernel in an ``nvcc -Xptxas -v`` report."""
    entries, current = [], None
    for line in report.splitlines():
        if m := ENTRY.search(line):
            current = [m.group(1), m.group(2), None, 0]
            entries.append(current)
        elif current is not None and (m := SPILL.search(line)):
            current[3] = int(m.group(1)) + int(m.group(2))
        elif current is not None and (m := REGISTERS.search(line)):
            current[2] = int(m.group(1))
    return entries


def _demangle(names: list) -> list:
    result = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True)
    return result.stdout.splitlines()


ATTENTION_DTYPES = {"attnres::cuda::Half": "fp16", "attnres::cuda::BFloat16": "bf16", "float": "fp32", "double": "fp64"}


def _cuda_label(demangled: str) -> tuple:
    """(kernel, dtype column, config column) of a demangled kernel name."""
    m = KERNEL.search(demangled)
    name, args = m.group(1), [a.strip() for a in m.group(2).split(",")]
    if name.startswith("attn_"):  # fused attention: per storage dtype (tensor cores: and head-size bucket)
        return name, ATTENTION_DTYPES[args[0]], f"Dh<={args[1]}" if len(args) > 1 else "-"
    acc = "acc=fp64" if args[0] == "double" else "acc=fp32"
    config = f"G={args[1]} K={args[2]} QT={args[3]}" if len(args) >= 4 else "-"
    if len(args) == 3:  # the Block step: one site, no QT
        config = f"G={args[1]} K={args[2]}"
    if len(args) == 6:  # the backward: without and with the fused output norm, and the source cache
        config += f" norm={int(args[4] == 'true')} cache={int(args[5] == 'true')}"
    return name, acc, config


def run_cuda(archs, nvcc: str, emit=print) -> tuple:
    """Compiles the CUDA kernels for ``archs`` (one nvcc per architecture, in parallel);
    calls ``emit`` with each report line; returns (number of kernel × arch lines, number failing)."""
    with tempfile.TemporaryDirectory() as tmp:
        common = [nvcc, "-std=c++20", "-O3", "-Xptxas", "-v"]
        procs = []
        for i, arch in enumerate(archs):
            target = (
                ["-o", os.path.join(tmp, "aot_check")] if i == 0 else ["-cubin", "-o", os.path.join(tmp, "k.cubin")]
            )
            cmd = [*common, f"-gencode=arch=compute_{arch},code=sm_{arch}", *target, str(AOT_SOURCE)]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        reports = [p.communicate()[0] for p in procs]
        failed = [(arch, r) for arch, p, r in zip(archs, procs, reports) if p.returncode != 0]
        if failed:
            for arch, report in failed:
                line = format_line("cuda", "aot_check.cu", "-", "-", arch)
                emit(f"{line} FAILED: {report.strip().splitlines()[-1] if report.strip() else 'nvcc failed'}")
            return len(failed), len(failed)
        plans = subprocess.run([os.path.join(tmp, "aot_check")], capture_output=True, text=True)
    if plans.returncode != 0:
        emit(f"{format_line('cuda', 'launch plans', '-', '-', archs[0])} FAILED: {plans.stderr.strip()}")
        return 1, 1
    # name, largest dynamic shared memory (attention: for sm_80 code, then for sm_90)
    shared = {cols[0]: cols[1:] for cols in (line.split("\t") for line in plans.stdout.splitlines())}
    entries = [e for report in reports for e in _ptxas_entries(report)]
    names = _demangle([e[0] for e in entries])
    rows, failures = [], 0
    for (_, arch, regs, spill), demangled in zip(entries, names):
        kernel, acc, config = _cuda_label(demangled)
        key = KERNEL.search(demangled).group(0)
        smem = int(shared[key][-1 if arch == "sm_90" else 0]) if key in shared else -1
        ok = spill == 0 and regs is not None and smem >= 0
        failures += not ok
        line = format_line("cuda", kernel, acc, config, int(arch[3:]))
        status = "" if ok else ("  SPILLS" if spill else "  NO LAUNCH PLAN")
        rows.append((kernel, acc, config, arch, f"{line} {regs or 0:5d} {spill:7d} {smem:7d}{status}"))
    for *_, line in sorted(rows):
        emit(line)
    return len(rows), failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", nargs="+", type=int, default=[80, 90])
    parser.add_argument(
        "--dtype",
        nargs="+",
        choices=sorted(DTYPES),
        default=["bfloat16", "float32", "float64"],
        help="source dtypes of the Triton configurations (the CUDA kernels take every dtype at run time)",
    )
    parser.add_argument("--backend", choices=["all", "triton", "cuda"], default="all")
    parser.add_argument("--nvcc", default=shutil.which("nvcc"), help="nvcc for the CUDA kernels")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    start = time.time()
    print(HEADER)
    emit = lambda line: print(line, flush=True)
    counts, failures = {}, 0
    if args.backend in ("all", "triton"):
        counts["Triton kernel configurations"], failed = run_triton(args.arch, args.dtype, args.jobs, emit)
        failures += failed
    if args.backend in ("all", "cuda"):
        if args.nvcc is None:
            print("nvcc not found (install the CUDA toolkit or pass --nvcc)", file=sys.stderr)
            return 2
        counts["CUDA kernels"], failed = run_cuda(args.arch, args.nvcc, emit)
        failures += failed
    archs = ", ".join(f"sm_{a}" for a in args.arch)
    what = " and ".join(f"{n} {name}" for name, n in counts.items())
    status = "FAILED" if failures else "OK"
    print(f"{status}: {what} compiled for {archs}, {failures} failing, {time.time() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
