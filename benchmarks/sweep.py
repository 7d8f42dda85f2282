"""Sweep of the CPU depth read and of model training steps; writes a markdown report.

    python benchmarks/sweep.py [--out benchmarks/results/cpu.md] [--quick]

Depth read: forward and forward+backward of the C++ op, the eager reference
(stack + RMSNorm + softmax + einsum) and ``torch.compile`` of the reference,
over N ∈ {3, 9, 17, 33} sources, D ∈ {256, 1024, 4096}, rows ∈ {4096, 16384},
fp32 and bf16, with the forward's achieved GB/s next to a tensor copy of the
same bytes timed in the same run. Cases whose tensors would not fit in memory
are skipped and listed as such.

Models: one AdamW training step of Standard, Full and Block AttnRes at the demo
config and at d=512, L=12, T=256 (batch 4), with the bytes autograd saves for
backward, on the fused kernels and on the reference depth read.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch
from tqdm import tqdm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attnres_kernels as ak

from common import (
    forward_backward,
    fused_read,
    make_read_inputs,
    median_seconds,
    read_bytes,
    reference_read,
    saved_activation_bytes,
    tensor_copy,
)

COUNTS, DIMS, ROWS = (3, 9, 17, 33), (256, 1024, 4096), (4096, 16384)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Source bytes (at fp32 width) above which an implementation is not run here (24 GiB machines):
# the fused op keeps sources + gradients; the reference also stacks and upcasts them.
FUSED_BUDGET, REFERENCE_BUDGET = 4.6e9, 1.2e9


def bench_read(n, rows, dim, dtype, compiled_reference):
    fp32_bytes = n * rows * dim * 4
    if fp32_bytes > FUSED_BUDGET:
        return None
    result = {}
    copy, copy_bytes = tensor_copy(rows, dim, dtype, (n + 2) // 2)  # touches as many bytes as a forward
    result["copy_gbps"] = copy_bytes / median_seconds(copy) / 1e9
    floor = read_bytes(n, rows, dim, dtype)
    impls = {"cpu": fused_read("cpu")}
    if fp32_bytes <= REFERENCE_BUDGET:
        impls["reference"] = reference_read
        impls["compiled"] = compiled_reference
    runs = 5 if fp32_bytes < 1e9 else 3
    with torch.no_grad():
        sources, query, norm_weight = make_read_inputs(n, rows, dim, dtype, requires_grad=False)
        for name, read in impls.items():
            t = median_seconds(lambda: read(query, sources, norm_weight), min_runs=runs)
            result[f"{name}_fwd_ms"] = t * 1e3
            result[f"{name}_fwd_gbps"] = floor / t / 1e9
    del sources
    sources, query, norm_weight = make_read_inputs(n, rows, dim, dtype, requires_grad=True)
    grad_out = torch.randn(rows, dim).to(dtype)
    for name, read in impls.items():
        t = median_seconds(lambda: forward_backward(read, sources, query, norm_weight, grad_out), min_runs=runs)
        result[f"{name}_fwdbwd_ms"] = t * 1e3
    return result


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
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

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


def write_report(path, reads, models, meta):
    lines = [
        "# CPU benchmark: depth attention and AttnRes training steps",
        "",
        f"Measured by `python benchmarks/sweep.py` on {meta['date']}: {meta['cpu']}, "
        f"{meta['threads']} torch threads, torch {meta['torch']}, {meta['build']}. "
        "Shared machine: compare ratios within this run, not absolute times across runs.",
        "",
        "## Depth read",
        "",
        "`fwd GB/s` counts the floor of a forward: N source rows read once and one output row written. "
        "`copy GB/s` is a `copy_` of the same number of bytes into a preallocated tensor, in the same run. "
        "`× eager` / `× compile` are the forward+backward speedups of the C++ op over the eager reference and over "
        "`torch.compile` of the reference (stack + RMSNorm + softmax + einsum). "
        "`—`: not run (the reference's stacked copies would not fit in memory).",
        "",
        "| dtype | N | rows | D | cpu fwd ms | cpu fwd GB/s | copy GB/s | % of copy | cpu fwd+bwd ms "
        "| eager fwd+bwd ms | compile fwd+bwd ms | × eager | × compile | fwd × eager | fwd × compile |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    skipped = []
    for (dt, n, rows, dim), r in reads.items():
        if r is None:
            skipped.append(f"{dt} N={n} rows={rows} D={dim}")
            continue

        def cell(key, fmt="{:.1f}"):
            return fmt.format(r[key]) if key in r else "—"

        ratio = lambda a, b: f"{r[a] / r[b]:.2f}" if a in r and b in r else "—"
        lines.append(
            f"| {dt} | {n} | {rows} | {dim} | {cell('cpu_fwd_ms')} | {cell('cpu_fwd_gbps')} | {cell('copy_gbps')} "
            f"| {100 * r['cpu_fwd_gbps'] / r['copy_gbps']:.0f}% | {cell('cpu_fwdbwd_ms')} "
            f"| {cell('reference_fwdbwd_ms')} | {cell('compiled_fwdbwd_ms')} "
            f"| {ratio('reference_fwdbwd_ms', 'cpu_fwdbwd_ms')} | {ratio('compiled_fwdbwd_ms', 'cpu_fwdbwd_ms')} "
            f"| {ratio('reference_fwd_ms', 'cpu_fwd_ms')} | {ratio('compiled_fwd_ms', 'cpu_fwd_ms')} |"
        )
    if skipped:
        lines += ["", "Not run (sources and gradients would not fit in memory): " + "; ".join(skipped) + "."]
    lines += [
        "",
        "## Training step (forward + backward + AdamW)",
        "",
        "`depth read`: `cpu` = the fused C++ op (output norm fused into each read), `reference` = the plain-PyTorch "
        "read in the same model. `saved MiB`: distinct storages autograd keeps for backward.",
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
    parser.add_argument("--quick", action="store_true", help="only the N=9, rows=8192, D=1024 fp32 target case")
    args = parser.parse_args(argv)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    meta = dict(
        date=time.strftime("%Y-%m-%d"),
        cpu=cpu,
        threads=torch.get_num_threads(),
        torch=torch.__version__,
        build=ak.build_info(),
    )
    # Every (N, dtype) recompiles; a cache that overflowed would silently run eager code.
    torch._dynamo.config.cache_size_limit = 256
    compiled_reference = torch.compile(reference_read)
    cases = (
        [("fp32", 9, 8192, 1024)]
        if args.quick
        else [(dt, n, rows, dim) for dt in DTYPES for rows in ROWS for dim in DIMS for n in COUNTS]
    )
    if not args.quick:
        cases.insert(0, ("fp32", 9, 8192, 1024))  # the target case of the CPU-op issue
    reads = {}
    for dt, n, rows, dim in tqdm(cases, desc="depth read", unit="case"):
        reads[(dt, n, rows, dim)] = bench_read(n, rows, dim, DTYPES[dt], compiled_reference)
    models = [] if args.quick else bench_models()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    write_report(args.out, reads, models, meta)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump(
            dict(meta=meta, reads={"/".join(map(str, k)): v for k, v in reads.items()}, models=models), f, indent=1
        )
    print(open(args.out).read())


if __name__ == "__main__":
    main()
