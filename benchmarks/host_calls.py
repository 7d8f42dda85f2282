"""Host instructions per call of each op and backend on CPU, counted by callgrind; writes Markdown and JSON.

    python benchmarks/host_calls.py [--calls 20] [--out benchmarks/results] [--baseline PATH]
    python benchmarks/host_calls.py --dry-run [--out DIR]   # no valgrind: every call twice, nothing counted

What it counts: the instructions the CPU executes per call (callgrind's ``Ir``, all threads) of the
forward (under ``no_grad``) and of forward + ``torch.autograd.grad`` of every input, for the depth read
(one site; four sites, ``[Q, D]`` parameters), the merge, the Block step and attention, on each backend
whose host path runs here. Unlike wall time on a shared machine, instruction counts repeat: two runs
of the same code count exactly the same (valgrind runs the process deterministically, and the child's
``PYTHONHASHSEED`` is fixed); a change elsewhere in the process (other code, other allocation addresses)
moved the Triton rows by under 0.5 %, the others by up to 4 % and the reference, whose count is mostly
its kernels (see below), by up to 6 %. Only steady-state calls count: every case first runs twice per shape
without instrumentation (Triton compiles, caches fill), then twice more instrumented, then ``--calls``
calls between two client requests to callgrind (zero the counters, dump them under the case's label),
issued from Python through a five-line C helper built with ``valgrind/callgrind.h``. A region of as
many no-op calls is measured the same way and subtracted (the loop and the requests themselves); the
per-call number is the rest divided by ``--calls``. Python's cyclic garbage collector is off while
counting (its passes depend on the whole heap, not on the call).

Backends:

- ``triton``: the real host path (``ak.*`` → dispatch → ``torch.library`` op → C++ autograd → the
  launcher's Python → ``JITFunction.run``: argument binding, specialization, the compiled-kernel
  lookup → Triton's ``CudaLauncher``) on CPU tensors, with only the last step stubbed: the CUDA driver
  call that launches the compiled kernel (``driver.active.utils.launch``, which in Triton packs the
  arguments in C and calls ``cuLaunchKernelEx``) is a no-op that counts launches. A launcher that caches
  its compiled kernel (``CompiledKernel[grid](...)``) instead of going through ``JITFunction.run``, or an
  op registered by ``torch.library.triton_op`` run eagerly (``wrap_triton``), reaches the same call, so it
  is stubbed the same way. The launches per call are reported, and a call that launched nothing through
  the stub is an error, so a launch path that bypasses the stub shows. How it runs without a GPU or the
  interpreter (:func:`stubbed_triton_launches`): Triton's active driver is replaced by a
  ``CudaDriver`` whose target is sm_90 (the kernels are compiled for it for real, once, into Triton's
  cache) and whose module loading and launch do nothing; the package's Triton backend is told to accept
  CPU tensors (``attnres_kernels.triton.INTERPRETING``) while ``TRITON_INTERPRET`` stays unset, so the
  kernels are ``JITFunction`` objects, not interpreted. All of it is put back on exit. Not counted: the C
  launch itself, and host code that runs only for CUDA tensors (current-stream and device queries
  through torch.cuda, pinned host-to-device table copies): ``python -m benchmarks.gpu --sections host`` times
  those on a GPU. The number is the mean of the counts at both shapes below, which differ by a few
  percent: the ATen ops of the launchers (zero fills, ``u = w ⊙ γ``, casts) still run on CPU, and the
  launch tables' cache hits depend on where the allocator put the gradients.
- ``cpu``: the C++ CPU ops, kernels included (they cannot be stubbed from outside); likewise
  ``reference`` (the plain-PyTorch reference through the same public function), ``sdpa``
  (``ak.attention``'s backend that calls ``F.scaled_dot_product_attention``) and ``torch``, the
  yardsticks in plain PyTorch: ``F.scaled_dot_product_attention`` itself on the attention's shapes,
  and one ``a + b`` of the read's output shape (one ATen op, one autograd node). Their host part is
  estimated by measuring at M = 64 and 128 rows (batch 2 and 4 of T = 32) and extrapolating to zero
  rows, ``host = 2·I(64) − I(128)`` (the kernels' work is linear in the rows); the count at 64 rows is
  reported beside it. Checked with a third shape (256 rows; all but the reference): the estimates from
  128 and 256 rows agree within 3 % for every forward and for the backward of the C++ merge, Block step
  and attention and of ``a + b``; the C++ depth read's backward and SDPA's backward grow faster than
  linearly beyond 128 rows (their estimates from 128 and 256 rows are 15–35 % lower), so their host
  numbers are less certain.
- ``cuda`` (the C++/CUDA binding) is not measured: its host code needs a CUDA device, and this CPU
  build of torch has none (the ``cuda`` backend on CPU tensors is the SIMT emulator, a different
  program). ``python -m benchmarks.gpu --sections host`` measures it.

valgrind cannot execute AVX-512 instructions, so the counted process imports a copy of the package
whose C++ extension is an AVX2 build of the same sources (``ATTNRES_CPU_CAPABILITY=avx2``, built
into ``build/host_calls_avx2``, incrementally after the first time); torch picks its AVX2 kernels
under valgrind by itself. Shapes are small (N = 9 sources, M = 64 rows, D = 256, bf16; attention
B·H·T·Dh = 2·4·32·64) so that the kernels that do run stay a small part of the count.

Before/after: the report of the code as it was when the host path's rework began is kept as
``benchmarks/results/host_calls_cpu_baseline.json``. Every run reads the baseline (``--baseline``,
``--baseline ''`` for none) and adds, per row, the ratio of its host instructions to the baseline's
(the target of the rework is ≤ 1/3). To make a run the new baseline, copy its JSON over that file.
Counts are comparable between runs with the same Python, torch and Triton (the header names them).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import functools
import gc
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
from triton.backends.nvidia import driver as nvidia_driver
from triton.runtime.driver import driver as triton_driver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # common.py
# The counted process imports a copy of the package with an AVX2 build of its extension (run_callgrind).
sys.path.insert(0, os.environ.get("HOST_CALLS_PACKAGE_ROOT", ROOT))

import attnres_kernels as ak  # noqa: E402
import attnres_kernels.triton as triton_backend  # noqa: E402
from attnres_kernels import reference  # noqa: E402

from common import git_commit, report_header  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
BASELINE = os.path.join(RESULTS, "host_calls_cpu_baseline.json")
AVX2_BUILD = os.path.join(ROOT, "build", "host_calls_avx2")

N_SOURCES, SEQ, DIM, SITES, DTYPE = 9, 32, 256, 4, torch.bfloat16
HEADS, HEAD_DIM = 4, 64
BATCHES = (2, 4)  # M = 64 and 128 rows: the host part of a call that runs kernels is 2·I(64) − I(128)
MODES = ("forward", "forward_backward")
STUBBED = ("triton",)  # backends whose kernels do not run: their count is all host


# ---------------------------------------------------------------- Triton with its launches stubbed


class _StubUtils:
    """The CUDA driver's C utilities without a GPU: loading a module gives a placeholder, a launch is counted."""

    def __init__(self):
        self.launches = 0

    def launch(self, *args):
        self.launches += 1

    def load_binary(self, name, kernel, shared, device):
        return object(), None, 0, 0, 1024  # module, function, registers, spills, max threads per block

    def unload_module(self, module):
        pass

    def build_signature_metadata(self, signature):
        return signature

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448}  # an H100 / H200


class _StubCudaDriver(nvidia_driver.CudaDriver):
    """Triton's CUDA driver for an sm_90 device that is not there. Its device key is its own, so the
    compiled kernels it loads sit in their own entry of each kernel's cache, never used for a GPU."""

    def __init__(self):
        self.utils = _StubUtils()
        self.launcher_cls = nvidia_driver.CudaLauncher  # Triton's own launcher, around the stubbed launch
        self.get_current_device = lambda: "host_calls stub"
        self.get_current_stream = lambda device: 0
        self.set_current_device = lambda device: None
        self.get_device_capability = lambda device: (9, 0)


@dataclass(frozen=True)
class _KernelArg:
    nested_tuple: object
    type: str


# The argument annotations of Triton's launcher, which its C utilities define when a GPU is there.
_LAUNCHER_ANNOTATIONS = dict(PyKernelArg=_KernelArg, ARG_CONSTEXPR="constexpr", ARG_KERNEL="arg", ARG_TUPLE="tuple")


@functools.cache
def _stub_driver() -> _StubCudaDriver:
    """One per process: a compiled kernel keeps the launch function of the driver that first loaded it."""
    return _StubCudaDriver()


@contextlib.contextmanager
def stubbed_triton_launches():
    """Within: ``backend="triton"`` runs its whole host path on CPU tensors and launches nothing;
    yields the stub's utilities (``.launches`` counts the launches). Everything is put back on exit."""
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        raise SystemExit("run without TRITON_INTERPRET=1: interpreted kernels have no launch to stub")
    saved = {name: getattr(nvidia_driver, name) for name in _LAUNCHER_ANNOTATIONS}
    saved_driver, saved_interpreting = triton_driver._active, triton_backend.INTERPRETING
    try:
        for name, value in _LAUNCHER_ANNOTATIONS.items():
            setattr(nvidia_driver, name, value)
        triton_driver.set_active(_stub_driver())
        triton_backend.INTERPRETING = True  # read by the dispatcher on each call: Triton may take CPU tensors
        yield _stub_driver().utils
    finally:
        triton_backend.INTERPRETING = saved_interpreting
        triton_driver.set_active(saved_driver)
        for name, value in saved.items():
            setattr(nvidia_driver, name, value)


# ---------------------------------------------------------------- the calls


@dataclass
class Case:
    """One op: ``make(batch)`` returns ``(run, leaves, grads)``; ``run(backend)`` makes one call and returns
    its outputs, whose gradients ``grads`` are taken with respect to ``leaves``."""

    op: str
    backends: tuple
    make: Callable


def _activation(gen, *shape):
    return torch.randn(shape, generator=gen).to(DTYPE).requires_grad_()


def _param(gen, shape, mean: float, std: float):
    return (mean + std * torch.randn(shape, generator=gen)).requires_grad_()


def _site(gen, shape):
    """A site's ``w`` (logits of a few units) and ``γ``."""
    return _param(gen, shape, 0.0, 2 / DIM**0.5), _param(gen, shape, 1.0, 0.1)


def _prefix(gen, batch, query, norm_weight):
    """A read over 4 committed blocks, ``(out, lse)``, as leaves."""
    committed = [torch.randn(batch, SEQ, DIM, generator=gen).to(DTYPE) for _ in range(4)]
    with torch.no_grad():
        out, lse = reference.depth_attention(query, committed, norm_weight, return_lse=True)
    return out.requires_grad_(), lse.requires_grad_()


def _read(sites: int):
    def make(batch):
        gen = torch.Generator().manual_seed(0)
        sources = [_activation(gen, batch, SEQ, DIM) for _ in range(N_SOURCES)]
        query, norm_weight = _site(gen, (DIM,) if sites == 1 else (sites, DIM))
        grad = torch.randn(((sites,) if sites > 1 else ()) + (batch, SEQ, DIM), generator=gen).to(DTYPE)

        def run(backend):
            return (ak.depth_attention(query, sources, norm_weight, backend=backend),)

        return run, [*sources, query, norm_weight], [grad]

    return make


def _merge(batch):
    gen = torch.Generator().manual_seed(0)
    sources = [_activation(gen, batch, SEQ, DIM) for _ in range(N_SOURCES - 4)]
    query, norm_weight = _site(gen, (DIM,))
    prefix_out, prefix_lse = _prefix(gen, batch, query, norm_weight)
    grad = torch.randn(batch, SEQ, DIM, generator=gen).to(DTYPE)

    def run(backend):
        return (ak.depth_attention_merge(query, prefix_out, prefix_lse, sources, norm_weight, backend=backend),)

    return run, [*sources, prefix_out, prefix_lse, query, norm_weight], [grad]


def _block_step(batch):
    """The Block model's step: ``partial + update`` and the next site's merge read with its PreNorm."""
    gen = torch.Generator().manual_seed(0)
    partial, update = _activation(gen, batch, SEQ, DIM), _activation(gen, batch, SEQ, DIM)
    query, norm_weight = _site(gen, (DIM,))
    out_norm_weight = _param(gen, (DIM,), 1.0, 0.1)
    prefix_out, prefix_lse = _prefix(gen, batch, query, norm_weight)
    grads = [torch.randn(batch, SEQ, DIM, generator=gen).to(DTYPE) for _ in range(2)]

    def run(backend):
        return ak.block_step(
            partial,
            update,
            query,
            prefix_out,
            prefix_lse,
            norm_weight,
            out_norm_weight=out_norm_weight,
            backend=backend,
        )

    return run, [partial, update, query, prefix_out, prefix_lse, norm_weight, out_norm_weight], grads


def _attention(batch):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (_activation(gen, batch, HEADS, SEQ, HEAD_DIM) for _ in range(3))
    grad = torch.randn(batch, HEADS, SEQ, HEAD_DIM, generator=gen).to(DTYPE)

    def run(backend):
        if backend == "torch":
            return (F.scaled_dot_product_attention(q, k, v, is_causal=True),)
        return (ak.attention(q, k, v, causal=True, backend=backend),)

    return run, [q, k, v], [grad]


def _add(batch):
    gen = torch.Generator().manual_seed(0)
    a, b = _activation(gen, batch, SEQ, DIM), _activation(gen, batch, SEQ, DIM)
    grad = torch.randn(batch, SEQ, DIM, generator=gen).to(DTYPE)
    return (lambda backend: (a + b,)), [a, b], [grad]


FUSED = ("cpu", "triton", "reference")
CASES = [
    Case("depth read", FUSED, _read(1)),
    Case(f"depth read, Q={SITES}", FUSED, _read(SITES)),
    Case("merge", FUSED, _merge),
    Case("Block step", FUSED, _block_step),
    Case("attention", (*FUSED, "sdpa", "torch"), _attention),
    Case("a + b", ("torch",), _add),
]


# ---------------------------------------------------------------- counting


class Meter:
    """Runs a region of calls; counts nothing (a dry run, and the uninstrumented first pass)."""

    def start(self):
        pass

    def region(self, label: str, fn: Callable, calls: int) -> None:
        for _ in range(calls):
            fn()


class CallgrindMeter(Meter):
    """Brackets each region with client requests to callgrind: zero the counters, then dump them under
    ``label`` (one dump file per region, read by :func:`read_dumps`)."""

    def __init__(self, helper: str):
        # Looked up once here: the first lookup of a symbol costs thousands of instructions.
        lib = ctypes.CDLL(helper)
        self.start, self.zero, self.dump = lib.host_calls_start, lib.host_calls_zero, lib.host_calls_dump

    def region(self, label: str, fn: Callable, calls: int) -> None:
        self.zero()
        for _ in range(calls):
            fn()
        self.dump(label.encode())


CALLGRIND_HELPER = """#include <valgrind/callgrind.h>
void host_calls_start(void) { CALLGRIND_START_INSTRUMENTATION; }
void host_calls_zero(void) { CALLGRIND_ZERO_STATS; }
void host_calls_dump(const char *label) { CALLGRIND_DUMP_STATS_AT(label); }
"""
EMPTY = "empty region"


def _label(op: str, backend: str, mode: str, batch: int) -> str:
    return f"{op} | {backend} | {mode} | batch {batch}"


def run_calls(meter: Meter, calls: int, warmup: int) -> list:
    """Every case on every backend and shape, each mode a region of ``calls`` calls after ``warmup``
    calls: one row per region (label, launches per call, or the error that stopped it)."""
    torch.set_num_threads(1)
    rows = []
    gc.collect()
    gc.disable()
    try:
        with stubbed_triton_launches() as stub:
            meter.region(EMPTY, lambda: None, calls)
            for case in CASES:
                for batch in BATCHES:
                    rows += _run_case(case, batch, meter, stub, calls, warmup)
    finally:
        gc.enable()
    return rows


def _run_case(case: Case, batch: int, meter: Meter, stub: _StubUtils, calls: int, warmup: int) -> list:
    run, leaves, grads = case.make(batch)
    rows = []
    for backend in case.backends:
        calls_of_mode = {
            "forward": lambda: run(backend),
            "forward_backward": lambda: torch.autograd.grad(run(backend), leaves, grads),
        }
        for mode, fn in calls_of_mode.items():
            row = dict(op=case.op, backend=backend, mode=mode, batch=batch, rows=batch * SEQ)
            row["label"] = _label(case.op, backend, mode, batch)
            try:
                with torch.set_grad_enabled(mode == "forward_backward"):
                    for _ in range(warmup):
                        fn()
                    launches = stub.launches
                    meter.region(row["label"], fn, calls)
                row["launches"] = (stub.launches - launches) / calls
            except Exception as exc:  # recorded in the report; the other rows still run
                row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
            if backend in STUBBED and row.get("launches") == 0:
                row["error"] = "no launch reached the stub: the count would miss the launch path"
            rows.append(row)
    return rows


def _child(workdir: str, calls: int) -> None:
    """The process callgrind runs: a first pass uninstrumented, then the counted pass."""
    meter = CallgrindMeter(os.path.join(workdir, "libhost_calls.so"))
    run_calls(Meter(), 1, 1)
    meter.start()
    rows = run_calls(meter, calls, 2)
    with open(os.path.join(workdir, "rows.json"), "w") as f:
        json.dump(rows, f)


def _avx2_package(workdir: str) -> str:
    """A copy of the package whose extension is an AVX2 build of this checkout's sources; returns its root."""
    env = dict(os.environ, ATTNRES_CPU_CAPABILITY="avx2", ATTNRES_SKIP_CUDA_BUILD="1")
    build = [sys.executable, "setup.py", "-q", "build_ext", "--build-lib", AVX2_BUILD]
    done = subprocess.run(
        [*build, "--build-temp", os.path.join(AVX2_BUILD, "temp")], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if done.returncode:
        raise SystemExit(f"the AVX2 build of the extension failed:\n{done.stdout[-5000:]}{done.stderr[-5000:]}")
    root = os.path.join(workdir, "package")
    shutil.copytree(
        os.path.join(ROOT, "attnres_kernels"),
        os.path.join(root, "attnres_kernels"),
        ignore=shutil.ignore_patterns("*.so", "__pycache__"),
    )
    for so in os.listdir(os.path.join(AVX2_BUILD, "attnres_kernels")):
        if so.endswith(".so"):
            shutil.copy(os.path.join(AVX2_BUILD, "attnres_kernels", so), os.path.join(root, "attnres_kernels"))
    return root


def run_callgrind(calls: int) -> tuple:
    """Runs :func:`_child` under callgrind; returns ``(rows, instructions by label)``."""
    with tempfile.TemporaryDirectory(prefix="host_calls.") as workdir:
        source = os.path.join(workdir, "host_calls.c")
        with open(source, "w") as f:
            f.write(CALLGRIND_HELPER)
        helper = os.path.join(workdir, "libhost_calls.so")
        subprocess.run(["cc", "-O2", "-shared", "-fPIC", "-o", helper, source], check=True)
        env = dict(os.environ, HOST_CALLS_PACKAGE_ROOT=_avx2_package(workdir), OMP_NUM_THREADS="1")
        env["PYTHONHASHSEED"] = "0"
        valgrind = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--dump-line=no", "-q"]
        out_file = os.path.join(workdir, "callgrind.out")
        child = [sys.executable, os.path.abspath(__file__), "--child", workdir, "--calls", str(calls)]
        subprocess.run([*valgrind, f"--callgrind-out-file={out_file}", *child], env=env, check=True)
        with open(os.path.join(workdir, "rows.json")) as f:
            rows = json.load(f)
        return rows, read_dumps(workdir)


def read_dumps(workdir: str) -> dict:
    """``{label: instructions}`` of every callgrind dump in ``workdir`` that a region triggered."""
    counts = {}
    for name in os.listdir(workdir):
        if not name.startswith("callgrind.out"):
            continue
        with open(os.path.join(workdir, name)) as f:
            text = f.read()
        label = re.search(r"^desc: Trigger: Client Request: (.*)$", text, re.M)
        total = re.search(r"^summary: (\d+)", text, re.M)  # the total cost of the events
        if label and total:
            counts[label.group(1)] = int(total.group(1))
    return counts


# ---------------------------------------------------------------- the report


def summarize(rows: list, counts: dict, calls: int) -> list:
    """One entry per op, backend and mode: instructions per call at each shape, the host estimate
    (for stubbed kernels the mean over both shapes, else extrapolated to zero rows) and launches per call."""
    empty = counts.get(EMPTY)
    entries = {}
    for row in rows:
        key = (row["op"], row["backend"], row["mode"])
        entry = entries.setdefault(key, dict(op=row["op"], backend=row["backend"], mode=row["mode"], per_call={}))
        if "error" in row:
            entry["error"] = row["error"]
            continue
        if row["batch"] == BATCHES[0]:
            entry["launches"] = row["launches"]
        if empty is not None and row["label"] in counts:
            entry["per_call"][str(row["rows"])] = round((counts[row["label"]] - empty) / calls)
    for entry in entries.values():
        small, large = (entry["per_call"].get(str(b * SEQ)) for b in BATCHES)
        entry["kernels"] = "stubbed" if entry["backend"] in STUBBED else "run"
        if small is None or large is None:
            entry["host"] = None
        else:
            entry["host"] = (small + large) // 2 if entry["backend"] in STUBBED else 2 * small - large
    return list(entries.values())


def environment(args) -> dict:
    """What the report's numbers depend on, for the JSON (the Markdown's header says it too)."""
    valgrind = shutil.which("valgrind") and subprocess.run(["valgrind", "--version"], capture_output=True, text=True)
    return dict(
        commit=git_commit(),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        python=platform.python_version(),
        torch=torch.__version__,
        triton=triton.__version__,
        valgrind=valgrind.stdout.strip() if valgrind else None,
        calls=args.calls,
        shapes=f"N={N_SOURCES} sources, M={BATCHES[0] * SEQ} and {BATCHES[1] * SEQ} rows, D={DIM}, Q={SITES}; "
        f"attention B={BATCHES[0]} and {BATCHES[1]}, H={HEADS}, T={SEQ}, Dh={HEAD_DIM}; "
        f"{str(DTYPE).removeprefix('torch.')} activations, fp32 parameters",
        dry_run=args.dry_run,
    )


def _with_baseline(entries: list, baseline_path: str) -> dict | None:
    """Adds ``ratio`` (host / baseline host) to each entry with a baseline; returns the baseline's environment."""
    if not baseline_path or not os.path.exists(baseline_path):
        return None
    with open(baseline_path) as f:
        baseline = json.load(f)
    before = {(e["op"], e["backend"], e["mode"]): e.get("host") for e in baseline["entries"]}
    for entry in entries:
        old = before.get((entry["op"], entry["backend"], entry["mode"]))
        if old and entry.get("host") is not None:
            entry["ratio"] = entry["host"] / old
    return dict(path=os.path.relpath(baseline_path, ROOT), **baseline["environment"])


def _k(n) -> str:
    return "–" if n is None else f"{n / 1000:.1f}k"


def markdown(header: str, env: dict, entries: list, baseline: dict | None) -> str:
    small = str(BATCHES[0] * SEQ)
    lines = [
        header.rstrip("\n"),
        "- counted: nothing (dry run)"
        if env["dry_run"]
        else f"- counted: {env['valgrind']}, Triton {env['triton']}, {env['calls']} calls per case; the counted "
        "process imports the C++ extension built for AVX2 (valgrind cannot run AVX-512)",
        f"- shapes: {env['shapes']}",
        "",
        "Instructions per call (thousands) of the forward (`no_grad`) / forward + `autograd.grad` of every input, "
        "steady state, from `ak.*` down. **triton**: the whole host path with the CUDA driver's launch of each "
        "compiled kernel stubbed (sm_90 kernels, CPU tensors; mean of 64 and 128 rows); launches per call beside "
        "it. **cpu** (the C++ ops), **reference** (plain PyTorch through the same function), **sdpa** "
        "(`ak.attention` on SDPA), **torch** (plain PyTorch: `F.scaled_dot_product_attention`; one `a + b`) run "
        "their kernels: their host part is extrapolated to zero rows "
        "(2·I(64 rows) − I(128 rows)) and the count at 64 rows, kernels included, is shown beside it. The **cuda** "
        "backend (C++/CUDA binding) is not here: its host code needs a CUDA device (`python -m benchmarks.gpu "
        "--sections host`). How it is counted, how well it repeats and where the extrapolation is less certain: "
        "the docstring of `benchmarks/host_calls.py`.",
        "",
    ]
    if baseline:
        lines += [
            f"Baseline: `{baseline['path']}`, commit `{baseline['commit']}` ({baseline['date']}); "
            f"× baseline = host instructions now / then (target of the host-path rework: ≤ 0.33).",
            "",
        ]
    columns = (
        "| op | backend | host, forward | host, fwd + bwd | launches (fwd / fwd + bwd) | at 64 rows with kernels |"
    )
    rule = "|---|---|---:|---:|---:|---:|"
    if baseline:
        columns, rule = columns + " × baseline (fwd / fwd + bwd) |", rule + "---:|"
    lines += [columns, rule]
    by_key = {(e["op"], e["backend"], e["mode"]): e for e in entries}
    for case in CASES:
        for backend in case.backends:
            fwd, both = (by_key.get((case.op, backend, mode), {}) for mode in MODES)
            errors = [e["error"] for e in (fwd, both) if "error" in e]
            if errors:
                lines.append(f"| {case.op} | {backend} | {errors[0]} | | | |" + (" |" if baseline else ""))
                continue
            launches = f"{fwd.get('launches', 0):g} / {both.get('launches', 0):g}" if backend in STUBBED else ""
            with_kernels = (
                "" if backend in STUBBED else f"{_k(fwd['per_call'].get(small))} / {_k(both['per_call'].get(small))}"
            )
            cells = [case.op, backend, _k(fwd.get("host")), _k(both.get("host")), launches, with_kernels]
            if baseline:
                cells.append(" / ".join("–" if "ratio" not in e else f"{e['ratio']:.2f}" for e in (fwd, both)))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20, help="counted calls per case and mode")
    parser.add_argument("--out", help="directory of host_calls_cpu.md / .json (benchmarks/results; a dry run: none)")
    parser.add_argument("--baseline", default=BASELINE, help="a previous run's JSON to compare with ('' for none)")
    parser.add_argument("--dry-run", action="store_true", help="every call twice, no valgrind, nothing counted")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the process callgrind runs (its work directory)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child, args.calls)
        return 0
    header = report_header("Host instructions per call on CPU (callgrind)", argv)
    if args.dry_run:
        rows, counts = run_calls(Meter(), 1, 1), {}
    else:
        run_calls(Meter(), 1, 1)  # fails fast, and compiles the Triton kernels natively into Triton's cache
        rows, counts = run_callgrind(args.calls)
    entries = summarize(rows, counts, args.calls)
    env = environment(args)
    baseline = _with_baseline(entries, args.baseline)
    report = markdown(header, env, entries, baseline)
    print(report)
    out = args.out or (None if args.dry_run else RESULTS)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "host_calls_cpu.json"), "w") as f:
            json.dump(
                dict(header=header, environment=env, baseline=baseline, entries=entries, regions=rows, counts=counts),
                f,
                indent=1,
            )
        with open(os.path.join(out, "host_calls_cpu.md"), "w") as f:
            f.write(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
