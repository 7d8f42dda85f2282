"""CPU sweep of fused attention; writes a markdown report and its json.

    python benchmarks/attention_sweep.py [--out benchmarks/results/attention_cpu.md] [--quick] [--gemm]
        [--lengths T ...] [--head-dims DH ...] [--dtypes fp32 bf16] [--causal no yes]
        [--reference-max-t T] [--memory-lengths T ...] [--append]

Time: forward and forward+backward of the C++ op (``ak.attention(backend="cpu")``),
PyTorch's ``scaled_dot_product_attention`` (its CPU flash kernel), the eager
reference and ``torch.compile`` of the reference, for B = 2, H = 8,
T ∈ {512, 1024, 2048, 4096}, Dh ∈ {64, 128}, fp32 and bf16, causal and not.
Wall time on all torch threads; every implementation of a shape is timed
back to back (the machine is shared: compare ratios within a row). Each cell is
the median of the runs, with their spread (max - min) / median.

Memory: peak resident memory of one forward+backward above the resident memory
just before it (inputs allocated), in a fresh process per measurement
(``/proc/self/clear_refs`` resets the high-water mark ``VmHWM``), against T.

The grid options restrict it (on a loaded or small machine the whole grid takes
hours): ``--lengths``, ``--head-dims``, ``--dtypes`` and ``--causal`` pick the
rows (their product), ``--reference-max-t`` the largest T at which the eager
reference and its compiled form are timed (default and always in the memory
table: 2048), ``--memory-lengths`` the memory table's T (none: no memory
table). ``--append`` adds this run's rows to the json already at ``--out`` and
rewrites the report from all of them (a grid that is no product: e.g. T = 4096
for causal rows only), keeping its memory table unless this run measures one;
every run's date, arguments and load are listed.

``--gemm`` also times the tile GEMM the kernels use (oneDNN brgemm through
``at::native::cpublas``) against the at::vec micro-kernel of
csrc/cpu/attention_cpu.cpp on the tile shapes of the kernels (one thread, in a
separate process that compiles the kernel file).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

BATCH, HEADS = 2, 8
LENGTHS, HEAD_DIMS = (512, 1024, 2048, 4096), (64, 128)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The reference materializes [B, H, T, T] scores and probabilities in fp32 (and
# autograd keeps several): 1 GiB each at T = 4096, more than this machine can spare.
REFERENCE_MAX_T = 2048
MEMORY_LENGTHS = (512, 1024, 2048, 4096, 8192)


def timed_runs(fn, min_runs: int = 3, min_seconds: float = 1.0, max_runs: int = 15) -> list:
    fn()  # warm-up (and compilation)
    times = []
    start = time.perf_counter()
    while len(times) < min_runs or (time.perf_counter() - start < min_seconds and len(times) < max_runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def summary(times: list) -> dict:
    median = statistics.median(times)
    return {"median_s": median, "spread": (max(times) - min(times)) / median, "runs": len(times)}


def package():
    """attnres_kernels and its reference (imported on use: the --gemm-child process
    compiles the kernel file itself and must not load the package's copy)."""
    import attnres_kernels
    from attnres_kernels import reference

    return attnres_kernels, reference


def implementations(causal: bool, compiled: dict) -> dict:
    ak, reference = package()

    def fused(q, k, v):
        return ak.attention(q, k, v, causal=causal, backend="cpu")

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    def eager(q, k, v):
        return reference.attention(q, k, v, causal=causal)

    return {"cpu": fused, "sdpa": sdpa, "eager": eager, "compiled": compiled[causal]}


def bench_shape(
    t: int, dh: int, dtype: torch.dtype, causal: bool, compiled: dict, quick: bool, reference_max_t: int
) -> dict:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(BATCH, HEADS, t, dh, generator=gen).to(dtype).requires_grad_() for _ in range(3))
    grad_out = torch.randn(BATCH, HEADS, t, dh, generator=gen).to(dtype)
    result = {"load_before": os.getloadavg()[0]}
    runs = {"min_runs": 2, "min_seconds": 0.0} if quick else {}
    for name, fn in implementations(causal, compiled).items():
        if name in ("eager", "compiled") and t > reference_max_t:
            continue

        def forward(fn=fn):
            with torch.no_grad():
                fn(q, k, v)

        def forward_backward(fn=fn):
            torch.autograd.grad(fn(q, k, v), (q, k, v), grad_out)

        result[name] = {
            "fwd": summary(timed_runs(forward, **runs)),
            "fwd_bwd": summary(timed_runs(forward_backward, **runs)),
        }
    result["load_after"] = os.getloadavg()[0]
    return result


# ---------------------------------------------------------------- memory (child processes)


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not found in /proc/self/status")


def memory_child(impl: str, t: int, dh: int) -> None:
    """One forward+backward; prints the peak RSS above the RSS before it (bytes) as json."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(BATCH, HEADS, t, dh).requires_grad_() for _ in range(3))
    grad_out = torch.randn(BATCH, HEADS, t, dh)
    fn = implementations(True, {True: None})[impl]
    small = [x[:, :, :16].detach().clone().requires_grad_() for x in (q, k, v)]
    torch.autograd.grad(fn(*small), small, grad_out[:, :, :16])  # load libraries, create threads
    before = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    grads = torch.autograd.grad(fn(q, k, v), (q, k, v), grad_out)
    peak = _rss_kib("VmHWM")
    outputs = sum(g.numel() * g.element_size() for g in grads) + q.numel() * q.element_size()  # dq, dk, dv, out
    print(json.dumps({"extra_bytes": (peak - before) * 1024, "output_bytes": outputs}))


def measure_memory(impl: str, t: int, dh: int):
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-child", impl, str(t), str(dh)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        return {"error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- tile GEMM choice (child process)

GEMM_BENCH_SOURCE = r"""
#include "%s"
#include <time.h>
static double thread_seconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}
// Seconds per call of C[M, N] += A[M, K] B[K, N] (row-major, fp32) on one thread.
double tile_gemm_seconds(int64_t M, int64_t N, int64_t K, int64_t reps, bool use_vec) {
  std::vector<float> A(M * K), B(K * N), C(M * N, 0.f);
  for (size_t i = 0; i < A.size(); ++i) A[i] = float(i %% 7) * 0.1f;
  for (size_t i = 0; i < B.size(); ++i) B[i] = float(i %% 5) * 0.1f;
  auto run = [&] {
    if (use_vec) attnres::gemm_vec<float>(M, N, K, A.data(), K, B.data(), N, C.data(), N, true);
    else at::native::cpublas::brgemm(M, N, K, K, N, N, true, A.data(), B.data(), C.data(), false);
  };
  run();
  const double start = thread_seconds();
  for (int64_t r = 0; r < reps; ++r) run();
  return (thread_seconds() - start) / reps;
}
"""

# (M, N, K) of the kernels' GEMMs for Dh = 64 and 128. Forward (256 query rows,
# 256-key tiles): S = Qs Kᵀ (256, 256, Dh), O += P V (256, Dh, 256). Backward
# (256-key blocks, 64-query tiles): Sᵀ = K qᵀ and dPᵀ (256, 64, Dh), dV += Pᵀ dO
# and dK (256, Dh, 64), dQᵀ += Kᵀ dSᵀ (Dh, 64, 256).
GEMM_SHAPES = [
    (256, 256, 64),
    (256, 64, 256),
    (256, 256, 128),
    (256, 128, 256),
    (256, 64, 64),
    (256, 64, 128),
    (256, 128, 64),
    (64, 64, 256),
    (128, 64, 256),
]


def gemm_child() -> None:
    from torch.utils.cpp_extension import load_inline

    from setup import X86_FLAGS, cpu_capability

    kernel = os.path.join(ROOT, "csrc", "cpu", "attention_cpu.cpp")
    build = os.path.join(ROOT, "build", "attention_gemm_bench")
    os.makedirs(build, exist_ok=True)
    mod = load_inline(
        "attention_gemm_bench",
        cpp_sources=[GEMM_BENCH_SOURCE % kernel],
        functions=["tile_gemm_seconds"],
        extra_cflags=["-O3", "-fopenmp", *X86_FLAGS[cpu_capability()]],
        build_directory=build,
    )
    torch.set_num_threads(1)
    rows = []
    for m, n, k in GEMM_SHAPES:
        flops = 2 * m * n * k
        reps = max(20, int(2e8 / flops))
        times = {"brgemm": [], "vec": []}
        for _ in range(7):  # interleaved
            for name in times:
                times[name].append(mod.tile_gemm_seconds(m, n, k, reps, name == "vec"))
        rows.append({"shape": [m, n, k], **{name: flops / statistics.median(ts) / 1e9 for name, ts in times.items()}})
    print(json.dumps(rows))


def measure_gemm():
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--gemm-child"], capture_output=True, text=True, cwd=ROOT
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- report


def ms(cell) -> str:
    return f"{1e3 * cell['median_s']:.1f} ±{100 * cell['spread']:.0f}%" if cell else "—"


def ratio(a, b) -> str:
    return f"{b['median_s'] / a['median_s']:.2f}" if a and b else "—"


def write_report(results: dict, path: str) -> None:
    meta = results["meta"]
    lines = [
        meta["header"],
        f"{meta['threads']} torch threads. The rows come from the runs below (an `--append` run adds rows to the "
        "report; the header above is the last run's); per row below: load before → after. Compare ratios within a "
        "row, not absolute times across runs.",
        "",
        *(
            f"- {run['date']}, commit {run.get('commit', 'not recorded')}, "
            f"`{' '.join(run['args']) or '(no options)'}`: load average (1 min) "
            f"{run['load_start']:.1f} at the start, {run['load_end']:.1f} at the end"
            for run in meta["runs"]
        ),
        "",
        f"B = {BATCH}, H = {HEADS}. Each cell: median wall time over the runs (after a warm-up: at least 3 "
        "runs and 1 s; 2 runs in a `--quick` run) and the spread "
        "(max - min) / median. `× sdpa`: time of `scaled_dot_product_attention` / time of the C++ op (> 1: the C++ "
        "op is faster); `× eager`, `× compile`: the same against the eager reference and `torch.compile` of it "
        f"(compile time excluded). `—`: not run (the reference's T×T tensors: slow, and beyond T = 2048 more memory "
        "than this machine can spare; see the runs' `--reference-max-t`).",
        "",
    ]
    for phase, title in (("fwd_bwd", "Forward + backward"), ("fwd", "Forward")):
        lines += [
            f"## {title}",
            "",
            "| dtype | causal | T | Dh | cpu ms | sdpa ms | eager ms | compile ms "
            "| × sdpa | × eager | × compile | load |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for row in sorted(
            results["timings"], key=lambda r: (list(DTYPES).index(r["dtype"]), r["causal"], r["Dh"], r["T"])
        ):
            cell = {name: row[name][phase] if name in row else None for name in ("cpu", "sdpa", "eager", "compiled")}
            lines.append(
                f"| {row['dtype']} | {'yes' if row['causal'] else 'no'} | {row['T']} | {row['Dh']} | "
                f"{ms(cell['cpu'])} | {ms(cell['sdpa'])} | {ms(cell['eager'])} | {ms(cell['compiled'])} | "
                f"{ratio(cell['cpu'], cell['sdpa'])} | {ratio(cell['cpu'], cell['eager'])} | "
                f"{ratio(cell['cpu'], cell['compiled'])} | {row['load_before']:.1f}→{row['load_after']:.1f} |"
            )
        lines.append("")
    memory = results.get("memory")
    if memory:
        dh = memory["Dh"]
        lines += [
            "## Peak memory against T",
            "",
            f"One forward+backward, fp32, causal, B = {BATCH}, H = {HEADS}, Dh = {dh}: peak resident memory above the "
            "resident memory just before the call (inputs already allocated), measured in a fresh process per cell "
            "(`/proc/self/clear_refs` resets the high-water mark `VmHWM`, read after the call). `outputs`: the bytes "
            "of out, dq, dk and dv, which any implementation must allocate. MiB per 1k tokens staying flat as T grows "
            "is O(T) memory; the reference's T×T scores make it grow with T.",
            "",
            "| T | outputs MiB | cpu MiB | cpu MiB / 1k tokens | sdpa MiB | eager MiB | eager MiB / 1k tokens |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in memory["rows"]:

            def mib(name, row=row):
                cell = row.get(name)
                return f"{cell['extra_bytes'] / 2**20:.0f}" if cell and "extra_bytes" in cell else "—"

            def per_k(name, row=row):
                cell = row.get(name)
                if not cell or "extra_bytes" not in cell:
                    return "—"
                return f"{cell['extra_bytes'] / 2**20 / (row['T'] / 1024):.1f}"

            outputs = next(c["output_bytes"] for c in row.values() if isinstance(c, dict) and "output_bytes" in c)
            lines.append(
                f"| {row['T']} | {outputs / 2**20:.0f} | {mib('cpu')} | {per_k('cpu')} | {mib('sdpa')} | "
                f"{mib('eager')} | {per_k('eager')} |"
            )
        lines.append("")
    gemm = results.get("gemm")
    if gemm:
        lines += [
            "## Tile GEMM: oneDNN brgemm vs an at::vec micro-kernel",
            "",
            "fp32 `C[M, N] += A[M, K] B[K, N]` on the tile shapes of the kernels, one thread, thread CPU time, the two "
            "interleaved, median of 7 rounds (`--gemm`). The kernels use brgemm for fp32/bf16/fp16 tiles; the "
            "at::vec kernel (2 × MR vector accumulators, MR = 8 rows on AVX512) serves fp64.",
            "",
            "| M | N | K | brgemm GFLOP/s | at::vec GFLOP/s | brgemm / at::vec |",
            "|---|---|---|---|---|---|",
        ]
        for row in gemm:
            m, n, k = row["shape"]
            lines.append(
                f"| {m} | {n} | {k} | {row['brgemm']:.1f} | {row['vec']:.1f} | {row['brgemm'] / row['vec']:.2f} |"
            )
        lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "attention_cpu.md"))
    parser.add_argument("--quick", action="store_true", help="T = 512 and 1024 only, two runs per cell")
    parser.add_argument("--gemm", action="store_true", help="also time the tile GEMM choice")
    parser.add_argument("--lengths", type=int, nargs="+", help=f"T values (default {LENGTHS})")
    parser.add_argument("--head-dims", type=int, nargs="+", default=list(HEAD_DIMS))
    parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    parser.add_argument("--causal", nargs="+", choices=["no", "yes"], default=["no", "yes"])
    parser.add_argument("--reference-max-t", type=int, default=REFERENCE_MAX_T, help="largest T of eager/compile")
    parser.add_argument("--memory-lengths", type=int, nargs="*", help=f"memory table's T (default {MEMORY_LENGTHS})")
    parser.add_argument("--append", action="store_true", help="add the rows to the json at --out")
    parser.add_argument("--memory-child", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--gemm-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        impl, t, dh = args.memory_child
        memory_child(impl, int(t), int(dh))
        return
    if args.gemm_child:
        gemm_child()
        return

    from tqdm import tqdm

    ak, reference = package()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from common import git_commit, report_header

    if "cpu" not in ak.available_backends("cpu"):
        raise SystemExit(f"the C++ attention kernels are not available: {ak.build_info()}")
    torch._dynamo.config.recompile_limit = 1024  # one compiled graph per shape
    compiled = {
        causal: torch.compile(lambda q, k, v, causal=causal: reference.attention(q, k, v, causal=causal))
        for causal in (False, True)
    }
    lengths = args.lengths or (LENGTHS[:2] if args.quick else LENGTHS)
    run = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "commit": git_commit(),
        "args": sys.argv[1:],
        "load_start": os.getloadavg()[0],
    }
    json_path = os.path.splitext(args.out)[0] + ".json"
    if args.append:
        with open(json_path) as f:
            results = json.load(f)
        meta = results["meta"]
    else:
        meta = {
            "cpu": cpu_name(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "build_info": ak.build_info(),
            "runs": [],
        }
        results = {"meta": meta, "timings": []}
    meta["runs"].append(run)
    meta["header"] = report_header("CPU benchmark: fused attention")
    shapes = [
        (d, c == "yes", t, dh) for d in args.dtypes for c in args.causal for dh in args.head_dims for t in lengths
    ]
    for dtype_name, causal, t, dh in tqdm(shapes, desc="attention timings"):
        row = bench_shape(t, dh, DTYPES[dtype_name], causal, compiled, args.quick, args.reference_max_t)
        results["timings"].append({"dtype": dtype_name, "causal": causal, "T": t, "Dh": dh, **row})
    memory_lengths = args.memory_lengths
    if memory_lengths is None:
        memory_lengths = MEMORY_LENGTHS[:3] if args.quick else MEMORY_LENGTHS
    mem_rows = []
    for t in tqdm(memory_lengths, desc="attention memory"):
        row = {"T": t}
        for impl in ("cpu", "sdpa", "eager"):
            if impl == "eager" and t > REFERENCE_MAX_T:
                continue
            row[impl] = measure_memory(impl, t, 64)
        mem_rows.append(row)
    if mem_rows:
        results["memory"] = {"Dh": 64, "rows": mem_rows}
    if args.gemm:
        results["gemm"] = measure_gemm()
    run["load_end"] = os.getloadavg()[0]
    write_report(results, args.out)
    with open(json_path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
