"""Sweep of the CPU depth read and of model training steps; writes a markdown report.

    python benchmarks/sweep.py [--out benchmarks/results/cpu.md] [--quick]

Depth read: forward and forward+backward of the C++ op, the eager reference
(stack + RMSNorm + softmax + einsum) and ``torch.compile`` of the reference,
over N ∈ {3, 9, 17, 33} sources, D ∈ {256, 1024, 4096}, rows ∈ {4096, 16384},
fp32 and bf16. The op's forward is timed with reused outputs (the op keeps the
buffers of freed outputs: what a training loop sees after its first step) and
with fresh ones (that cache emptied before every call: new pages that fault on
first touch), each alternated call by call with a reference of the same
bytes (reused outputs with a ``copy_`` into a reused buffer, fresh ones with
a ``clone``), and reported as GB/s with the median and spread of every
timing. The backward alone is timed against a copy of its floor's bytes over
the same N at the target's rows and D (one and three sites, with and without
the output norm). Small reads (the demo's sizes) get their
per-call times: the raw ops, the public function and ``read_unchecked``.
Cases whose tensors would not fit in memory are skipped and listed as such.

Models: one AdamW training step of Standard, Full and Block AttnRes at the demo
config and at d=512, L=12, T=256 (batch 4), with the bytes autograd saves for
backward, on the fused kernels and on the reference depth read.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attnres_kernels as ak
from attnres_kernels._validation import PAPER_READ
from attnres_kernels.ops.depth_attention import read_unchecked

from common import (
    cpu_description,
    empty_output_cache,
    forward_backward,
    fused_read,
    load_average,
    make_read_inputs,
    median_seconds,
    read_bytes,
    reference_read,
    report_header,
    run_times,
    saved_activation_bytes,
    spread,
    tensor_clone,
    tensor_copy,
)

COUNTS, DIMS, ROWS = (3, 9, 17, 33), (256, 1024, 4096), (4096, 16384)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Source bytes (at fp32 width) above which an implementation is not run here (24 GiB machines):
# the fused op keeps sources + gradients; the reference also stacks and upcasts them.
FUSED_BUDGET, REFERENCE_BUDGET = 4.6e9, 1.2e9
TARGET = ("fp32", 9, 8192, 1024)  # the target case of the CPU-op issue (and its bf16 twin)


def interleaved(fns: dict, min_rounds: int, min_seconds: float, setups: dict | None = None) -> dict:
    """Times every function of ``fns`` once per round, round after round (so that a
    change in the machine's load hits all of them alike); ``setups[name]()`` runs
    untimed before ``fns[name]``. Returns the list of times per name."""
    setups = setups or {}
    times = {name: [] for name in fns}
    for name, fn in fns.items():  # warmup
        setups.get(name, lambda: None)()
        fn()
    start = time.perf_counter()
    while len(times[next(iter(fns))]) < min_rounds or time.perf_counter() - start < min_seconds:
        for name, fn in fns.items():
            setups.get(name, lambda: None)()
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return times


def bench_read(n, rows, dim, dtype, compiled_reference):
    """Timings (seconds: median, min, max, iqr, runs) of one read shape; None when it does not fit."""
    fp32_bytes = n * rows * dim * 4
    if fp32_bytes > FUSED_BUDGET:
        return None
    runs = 7 if fp32_bytes < 1e9 else 5
    copy, copy_bytes = tensor_copy(rows, dim, dtype, (n + 2) // 2)  # touches as many bytes as a forward
    clone, _ = tensor_clone(rows, dim, dtype, (n + 2) // 2)
    result = dict(floor_bytes=read_bytes(n, rows, dim, dtype), copy_bytes=copy_bytes)
    cpu = fused_read("cpu")
    with torch.no_grad():
        sources, query, norm_weight = make_read_inputs(n, rows, dim, dtype, requires_grad=False)
        fwd = lambda: cpu(query, sources, norm_weight)
        # Two pairs, each alternated call by call: a call right after the clone (which maps, faults
        # and unmaps 5 outputs' worth of fresh pages) ran 10-15 % slower than after the op or a copy_,
        # whichever function it was, so each function follows only its own pair's partner.
        times = interleaved({"copy": copy, "cpu_fwd": fwd}, min_rounds=2 * runs, min_seconds=1.0)
        times.update(
            interleaved(
                {"clone": clone, "cpu_fwd_fresh": fwd},
                min_rounds=2 * runs,
                min_seconds=1.0,
                setups={"cpu_fwd_fresh": empty_output_cache},
            )
        )
        if fp32_bytes <= REFERENCE_BUDGET:
            for name, read in (("reference", reference_read), ("compiled", compiled_reference)):
                times[f"{name}_fwd"] = run_times(lambda: read(query, sources, norm_weight), min_runs=runs)
    del sources, copy, clone
    sources, query, norm_weight = make_read_inputs(n, rows, dim, dtype, requires_grad=True)
    grad_out = torch.randn(rows, dim).to(dtype)
    step = lambda read: lambda: forward_backward(read, sources, query, norm_weight, grad_out)
    times.update(interleaved({"cpu_fwdbwd": step(cpu)}, min_rounds=2 * runs, min_seconds=1.0))
    times.update(
        interleaved({"cpu_fwdbwd_fresh": step(cpu)}, runs, 0.5, setups={"cpu_fwdbwd_fresh": empty_output_cache})
    )
    if fp32_bytes <= REFERENCE_BUDGET:
        for name, read in (("reference", reference_read), ("compiled", compiled_reference)):
            times[f"{name}_fwdbwd"] = run_times(step(read), min_runs=runs)
    result.update({name: spread(t) for name, t in times.items()})
    return result


# Backward-bandwidth variants of the target case: (sites Q, fused output norm).
BACKWARD_VARIANTS = [(1, False), (1, True), (3, False), (3, True)]


def bench_backward(n, rows, dim, dtype):
    """The backward alone (``torch.autograd.grad`` on a saved forward) of the variants, each interleaved
    call by call with a ``copy_`` of its floor's bytes into a reused buffer: the N sources and the Q
    output gradients read, the N source gradients written. Returns one dict per variant."""
    results = []
    for q, out_norm in BACKWARD_VARIANTS:
        sources, query, norm_weight = make_read_inputs(n, rows, dim, dtype, requires_grad=True)
        if q > 1:
            query = (0.05 * torch.randn(q, dim)).requires_grad_()
            norm_weight = (1 + 0.1 * torch.randn(q, dim)).requires_grad_()
        g_out = torch.ones(dim, requires_grad=True) if out_norm else None
        out = ak.depth_attention(query, sources, norm_weight, out_norm_weight=g_out, backend="cpu")
        grad_out = torch.randn(out.shape).to(dtype)
        leaves = [*sources, query, norm_weight] + ([g_out] if out_norm else [])
        floor = (2 * n + q) * rows * dim * dtype.itemsize
        copy, copy_bytes = tensor_copy(rows, dim, dtype, (2 * n + q + 1) // 2)
        backward = lambda: torch.autograd.grad(out, leaves, grad_out, retain_graph=True)
        times = interleaved({"copy": copy, "backward": backward}, min_rounds=8, min_seconds=1.0)
        results.append(
            dict(
                q=q,
                out_norm=out_norm,
                floor_bytes=floor,
                copy_bytes=copy_bytes,
                **{name: spread(t) for name, t in times.items()},
            )
        )

    return results


SMALL_READS = [
    (4, (10, 20), 128, False),
    (1, (10, 20), 128, True),
    (3, (10, 20), 128, True),
    (7, (10, 20), 128, True),
    (13, (10, 20), 128, True),
]


def bench_small_reads():
    """Per-call time (µs, median) of small reads, one thread: the raw ops, the public
    function (argument checks + backend resolution) and ``read_unchecked``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        for n, lead, dim, out_norm in SMALL_READS:
            sources, query, norm_weight = make_read_inputs(n, lead[0] * lead[1], dim, torch.float32, True)
            sources = [s.detach().reshape(*lead, dim).requires_grad_() for s in sources]
            g_out = torch.ones(dim, requires_grad=True) if out_norm else None
            leaves = [*sources, query, norm_weight] + ([g_out] if out_norm else [])
            grad_out = torch.randn(*lead, dim)
            fwd_op, bwd_op = torch.ops.attnres.depth_attn_fwd.default, torch.ops.attnres.depth_attn_bwd.default

            def raw_fwd():
                with torch.no_grad():
                    return fwd_op(sources, query, norm_weight, None, None, g_out, *PAPER_READ)

            def raw_fwd_bwd():
                out, _, logits, rinv = raw_fwd()
                with torch.no_grad():
                    bwd_op(
                        grad_out, None, None, sources, query, norm_weight, None, None, g_out, logits, rinv, *PAPER_READ
                    )

            def public():
                return ak.depth_attention(query, sources, norm_weight, out_norm_weight=g_out, backend="cpu")

            def unchecked():
                return read_unchecked("cpu", sources, query, norm_weight, out_norm_weight=g_out)

            rms_in = torch.randn(*lead, dim, requires_grad=True)
            rms_weight = torch.ones(dim, requires_grad=True)

            def rms_norm_fwd_bwd():  # what a site's plain RMSNorm costs per call: the bar for a small read
                out = torch.nn.functional.rms_norm(rms_in, (dim,), rms_weight, 1e-6)
                return torch.autograd.grad(out, [rms_in, rms_weight], grad_out)

            def no_grad(fn):
                def run():
                    with torch.no_grad():
                        fn()

                return run

            def with_backward(fn):
                return lambda: torch.autograd.grad(fn(), leaves, grad_out)

            fns = {
                "raw ops fwd": raw_fwd,
                "raw ops fwd+bwd": raw_fwd_bwd,
                "depth_attention fwd": no_grad(public),
                "depth_attention fwd+bwd": with_backward(public),
                "read_unchecked fwd": no_grad(unchecked),
                "read_unchecked fwd+bwd": with_backward(unchecked),
                "F.rms_norm fwd+bwd": rms_norm_fwd_bwd,
            }

            def loop(fn):  # 20 calls per sample, each result dropped before the next call, as a loop of steps does
                def run():
                    for _ in range(20):
                        fn()

                return run

            times = interleaved({k: loop(f) for k, f in fns.items()}, min_rounds=15, min_seconds=2.0)
            label = f"N={n}, [{lead[0]}, {lead[1]}, {dim}]" + (", out norm" if out_norm else "")
            rows.append(dict(read=label, **{k: spread(t)["median"] / 20 * 1e6 for k, t in times.items()}))
    finally:
        torch.set_num_threads(threads)
    return rows


MODEL_CONFIGS = {
    "demo (d=128, L=6, T=20, B=10)": dict(d_model=128, n_layers=6, n_heads=4, batch=10, seq=20, vocab=146),
    "d=512, L=12, T=256, B=4": dict(d_model=512, n_layers=12, n_heads=8, batch=4, seq=256, vocab=1024),
}


def bench_models():
    rows = []
    for label, cfg in MODEL_CONFIGS.items():
        gen = torch.Generator().manual_seed(0)
        idx = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=gen)
        target = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=gen)
        args = (cfg["vocab"], cfg["d_model"], cfg["n_layers"], cfg["n_heads"])
        base_ms = None
        variants = [
            ("Standard", {}, "cpu"),
            ("Full", {}, "cpu"),
            ("Full", {}, "reference"),
            ("Block", {"layers_per_block": cfg["n_layers"] // 3}, "cpu"),
            ("Block", {"layers_per_block": cfg["n_layers"] // 3}, "reference"),
        ]
        for kind, extra, backend in variants:
            torch.manual_seed(0)
            model = getattr(ak.nn, f"{kind}AttnResTransformer" if kind != "Standard" else "StandardTransformer")(
                *args, backend=backend, attention_backend="sdpa", **extra
            )
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

            def loss_fn():
                logits = model(idx)
                return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))

            def step():
                loss = loss_fn()
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

            ms = median_seconds(step, min_runs=5, min_seconds=1.0, warmup=2) * 1e3
            saved = saved_activation_bytes(loss_fn)
            base_ms = ms if kind == "Standard" else base_ms
            rows.append(
                dict(
                    config=label,
                    model=kind,
                    depth_read=backend if kind != "Standard" else "-",
                    step_ms=ms,
                    vs_standard=ms / base_ms,
                    saved_mib=saved / 2**20,
                    params=sum(p.numel() for p in model.parameters()),
                )
            )
    return rows


def read_report_lines(reads, small_reads, backward=None):
    """The depth-read sections of the report."""
    lines = [
        "## Depth read: forward bandwidth",
        "",
        "GB/s of a forward count its floor: N source rows read once and one output row written. "
        "`reused`: the op's outputs reuse the buffers of freed ones (the op keeps them; what a training loop "
        "sees after its first step); `fresh`: that cache emptied before every call, so every output page "
        "faults on first touch. `copy_`: the same number of bytes copied into a reused buffer; `clone`: into "
        "a fresh one. The op with reused outputs alternates call by call with `copy_`, with fresh outputs with "
        "`clone` (a call right after a `clone` ran 10-15 % slower, whatever it was); times are medians with "
        "[min–max] over the runs. "
        "`× eager` / `× compile`: forward speedup of the op (reused) over the eager reference and over "
        "`torch.compile` of it (stack + RMSNorm + softmax + einsum; their outputs come from PyTorch's allocator). "
        "`—`: not run (the reference's stacked copies would not fit in memory).",
        "",
        "| dtype | N | rows | D | fwd ms [min–max] | fwd GB/s reused | fwd GB/s fresh | copy_ GB/s | clone GB/s "
        "| reused % of copy_ | × eager | × compile |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    skipped = []
    for (dt, n, rows, dim), r in reads.items():
        if r is None:
            skipped.append(f"{dt} N={n} rows={rows} D={dim}")
            continue
        gbps = lambda key, nbytes: nbytes / r[key]["median"] / 1e9
        ratio = lambda a, b: f"{r[a]['median'] / r[b]['median']:.2f}" if a in r and b in r else "—"
        fwd = {k: 1e3 * v for k, v in r["cpu_fwd"].items()}
        lines.append(
            f"| {dt} | {n} | {rows} | {dim} | {fwd['median']:.2f} [{fwd['min']:.2f}–{fwd['max']:.2f}] "
            f"| {gbps('cpu_fwd', r['floor_bytes']):.1f} | {gbps('cpu_fwd_fresh', r['floor_bytes']):.1f} "
            f"| {gbps('copy', r['copy_bytes']):.1f} | {gbps('clone', r['copy_bytes']):.1f} "
            f"| {100 * r['copy']['median'] / r['cpu_fwd']['median'] * r['floor_bytes'] / r['copy_bytes']:.0f}% "
            f"| {ratio('reference_fwd', 'cpu_fwd')} | {ratio('compiled_fwd', 'cpu_fwd')} |"
        )
    lines += [
        "",
        "## Depth read: forward + backward",
        "",
        "Milliseconds, median [min–max] (`median/min` shows the tail); `reused` / `fresh` outputs as above (the "
        "backward's N source gradients included). `× eager` / `× compile`: the op's (reused) speedup.",
        "",
        "| dtype | N | rows | D | cpu reused ms [min–max] | median/min | cpu fresh ms | eager ms | compile ms "
        "| × eager | × compile |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (dt, n, rows, dim), r in reads.items():
        if r is None:
            continue
        ms = lambda key: f"{1e3 * r[key]['median']:.1f}" if key in r else "—"
        ratio = lambda a, b: f"{r[a]['median'] / r[b]['median']:.2f}" if a in r and b in r else "—"
        fb = r["cpu_fwdbwd"]
        lines.append(
            f"| {dt} | {n} | {rows} | {dim} | {1e3 * fb['median']:.1f} [{1e3 * fb['min']:.1f}–{1e3 * fb['max']:.1f}] "
            f"| {fb['median'] / fb['min']:.2f} | {ms('cpu_fwdbwd_fresh')} | {ms('reference_fwdbwd')} "
            f"| {ms('compiled_fwdbwd')} | {ratio('reference_fwdbwd', 'cpu_fwdbwd')} "
            f"| {ratio('compiled_fwdbwd', 'cpu_fwdbwd')} |"
        )
    if skipped:
        lines += ["", "Not run (sources and gradients would not fit in memory): " + "; ".join(skipped) + "."]
    if backward:
        lines += [
            "",
            "## Depth read: backward bandwidth",
            "",
            "The backward alone (`torch.autograd.grad` on a saved forward, outputs reused), timed call by call in "
            "turn with a `copy_` into a reused buffer of as many bytes as its floor: the N sources and the Q "
            "output gradients read, the N source gradients written. Milliseconds: median [min–max]. Each N at "
            "the target case's rows and D.",
            "",
            "| dtype | N | rows | D | sites | out norm | backward ms [min–max] | GB/s | copy_ GB/s | % of copy_ |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for (dt, n, rows, dim), variants in backward.items():
            for v in variants:
                b, c = v["backward"], v["copy"]
                gbps, copy_gbps = v["floor_bytes"] / b["median"] / 1e9, v["copy_bytes"] / c["median"] / 1e9
                lines.append(
                    f"| {dt} | {n} | {rows} | {dim} | {v['q']} | {'yes' if v['out_norm'] else 'no'} "
                    f"| {1e3 * b['median']:.1f} [{1e3 * b['min']:.1f}–{1e3 * b['max']:.1f}] | {gbps:.1f} "
                    f"| {copy_gbps:.1f} | {100 * gbps / copy_gbps:.0f}% |"
                )
    if small_reads:
        keys = [k for k in small_reads[0] if k != "read"]
        lines += [
            "",
            "## Small reads: time per call",
            "",
            "µs per call (median), one thread, float32, `query`/`norm_weight` [D]. `raw ops`: "
            "`torch.ops.attnres.depth_attn_fwd` (+ `depth_attn_bwd`) without autograd; `depth_attention`: the "
            "public function (on plain CPU tensors the op with its C++ autograd, which checks the arguments "
            "itself; fwd+bwd through `torch.autograd.grad`); `read_unchecked`: the op through the backend "
            "dispatch, without checks, for modules that validated their inputs once; `F.rms_norm fwd+bwd`: one "
            "RMSNorm (with weight) of a source's shape, forward and `torch.autograd.grad`, timed in the same "
            "rounds (the bar for a small read: a site's plain norm). A "
            "sample is 20 calls in a row, each result dropped before the next call (holding all 20, as earlier "
            "versions of this table did, made the calls that allocate most pay for fresh memory). The demo model "
            "reads 1 to 13 sources of [10, ~20, 128].",
            "",
            "| read | " + " | ".join(keys) + " |",
            "|---|" + "---|" * len(keys),
        ]
        for row in small_reads:
            lines.append(f"| {row['read']} | " + " | ".join(f"{row[k]:.0f}" for k in keys) + " |")
    return lines


def write_report(path, reads, small_reads, models, meta, backward=None):
    lines = [
        meta["header"],
        f"{meta['threads']} torch threads; load average {meta['load_after']} at the end. "
        "Compare ratios within this run, not absolute times across runs.",
        "",
        *read_report_lines(reads, small_reads, backward),
    ]
    if models:
        lines += [
            "",
            "## Training step (forward + backward + AdamW)",
            "",
            "`depth read`: `cpu` = the fused C++ op (output norm fused into each read), `reference` = the "
            "plain-PyTorch read in the same model. `saved MiB`: distinct storages autograd keeps for backward.",
            "",
            "| config | model | depth read | params | step ms | vs Standard | saved MiB |",
            "|---|---|---|---|---|---|---|",
        ]
    for m in models:
        lines.append(
            f"| {m['config']} | {m['model']} | {m['depth_read']} | {m['params']:,} | {m['step_ms']:.1f} "
            f"| {m['vs_standard']:.2f}x | {m['saved_mib']:.1f} |"
        )
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "cpu.md"))
    parser.add_argument(
        "--quick", action="store_true", help="only the N=9, rows=8192, D=1024 target case (fp32 and bf16)"
    )
    parser.add_argument("--reads-only", action="store_true", help="skip the model training steps")
    args = parser.parse_args(argv)
    meta = dict(
        header=report_header("CPU benchmark: depth attention and AttnRes training steps"),
        date=time.strftime("%Y-%m-%d"),
        cpu=cpu_description(),
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        build=ak.build_info(),
        load_before=load_average(),
    )
    # Every (N, dtype) recompiles; a cache that overflowed would silently run eager code.
    torch._dynamo.config.cache_size_limit = 256
    compiled_reference = torch.compile(reference_read)
    targets = [TARGET, ("bf16", *TARGET[1:])]
    cases = targets + (
        [] if args.quick else [(dt, n, rows, dim) for dt in DTYPES for rows in ROWS for dim in DIMS for n in COUNTS]
    )
    reads = {}
    for dt, n, rows, dim in tqdm(cases, desc="depth read", unit="case"):
        reads[(dt, n, rows, dim)] = bench_read(n, rows, dim, DTYPES[dt], compiled_reference)
    backward = {
        (dt, n, *TARGET[2:]): bench_backward(n, *TARGET[2:], DTYPES[dt])
        for dt in ("fp32", "bf16")
        for n in tqdm(COUNTS, desc=f"backward {dt}", unit="N")
    }
    small_reads = bench_small_reads()
    models = [] if args.quick or args.reads_only else bench_models()
    meta["load_after"] = load_average()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    write_report(args.out, reads, small_reads, models, meta, backward)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        reads_json = {"/".join(map(str, k)): v for k, v in reads.items()}
        backward_json = {"/".join(map(str, k)): v for k, v in backward.items()}
        json.dump(
            dict(meta=meta, reads=reads_json, backward=backward_json, small_reads=small_reads, models=models),
            f,
            indent=1,
        )
    print(open(args.out).read())


if __name__ == "__main__":
    main()
