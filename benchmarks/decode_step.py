"""One decode step of attention on CPU: one query per sequence and head against a
cache of ``Tk`` keys, :func:`attnres_kernels.attention` (``backend="auto"``, the C++
kernel's decode path) against PyTorch's ``scaled_dot_product_attention`` and a
``copy_`` of the same K/V bytes into a reused buffer, all in one run.

    python benchmarks/decode_step.py [--lengths 64 512 2048 8192] [--batch-sizes 1 4] [--threads 1 2]
                                     [--dtypes float32 bfloat16] [--heads 8] [--kv-heads 8] [--head-dim 64]

The inputs are shaped as the models' decode cache passes them: k, v are the views
``[:, :, :Tk]`` of preallocated ``[B, Hkv, Tk + 64, Dh]`` buffers and q is the
transpose of a ``[B, 1, H, Dh]`` projection (neither is contiguous). Every case
runs its three functions once per round, interleaved, after a warmup. With 1
thread a sample repeats a function until it has run ~2 ms, timed by the CPU time
of the thread (``time.thread_time``, which waiting for a core does not
inflate), for ``--rounds`` rounds; the table gives the median time per call and
the median over rounds of the per-round ratio SDPA time / our time (> 1: ours is
faster). With more threads a sample is one call timed by wall clock, for 20 x
``--rounds`` rounds, and the table gives the fastest call of each (on a shared
machine a call often waits for a core another process holds) and their ratio.
It also gives our GB/s (the K/V bytes read, the
floor of a decode step, over our time) and the copy's GB/s counted the way the
other reports count a copy (bytes read + bytes written over its time); % of copy
is the ratio of the two. The load average before and after the run is recorded
with the table, written to ``benchmarks/results/decode_step.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's package
import attnres_kernels as ak

from common import report_header

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "decode_step.md")
SAMPLE_SECONDS = 0.002
MULTI_THREAD_ROUNDS = 20  # with more than one thread: this many times --rounds single-call samples


def make_case(batch: int, heads: int, kv_heads: int, keys: int, head_dim: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(batch, kv_heads, keys + 64, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(batch, kv_heads, keys + 64, head_dim, generator=gen).to(dtype)
    k, v = k_cache[:, :, :keys], v_cache[:, :, :keys]
    q = torch.randn(batch, 1, heads, head_dim, generator=gen).to(dtype).transpose(1, 2)
    k_copy, v_copy = torch.empty_like(k), torch.empty_like(v)
    group = heads // kv_heads

    def sdpa():
        if group == 1:
            return F.scaled_dot_product_attention(q, k, v)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    def copy():
        k_copy.copy_(k)
        v_copy.copy_(v)

    fns = {"ours": lambda: ak.attention(q, k, v, causal=True), "sdpa": sdpa, "copy": copy}
    kv_bytes = 2 * k.numel() * k.element_size()
    return fns, kv_bytes


def repeats_for(fn, clock) -> int:
    start = clock()
    fn()
    elapsed = clock() - start
    return max(1, int(SAMPLE_SECONDS / max(elapsed, 1e-7)))


def measure(fns: dict, rounds: int, clock, single_calls: bool) -> dict:
    """Seconds per call of each function, one sample per round, interleaved; a sample is
    one call when ``single_calls``, else as many calls as take ~2 ms."""
    for fn in fns.values():  # warmup
        fn()
        fn()
    repeats = {name: 1 if single_calls else repeats_for(fn, clock) for name, fn in fns.items()}
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            n = repeats[name]
            start = clock()
            for _ in range(n):
                fn()
            times[name].append((clock() - start) / n)
    return times


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", nargs="+", type=int, default=[64, 512, 2048, 8192], help="cached keys Tk")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 4])
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument(
        "--kv-heads", nargs="+", type=int, default=None, help="key/value head counts (default: --heads and 2)"
    )
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--output", default=RESULTS)
    args = parser.parse_args(argv)
    kv_head_counts = args.kv_heads or list(dict.fromkeys([args.heads, 2]))
    title = report_header("Decode-step attention", argv)
    load_before = os.getloadavg()

    lines = [
        "| kv heads | dtype | threads | B | keys | ours (µs) | SDPA (µs) | SDPA / ours | ours GB/s | copy GB/s "
        "| % of copy |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    cases = [
        (kv_heads, threads, dtype_name, batch, keys)
        for kv_heads in kv_head_counts
        for threads in args.threads
        for dtype_name in args.dtypes
        for batch in args.batch_sizes
        for keys in args.lengths
    ]
    with torch.no_grad():
        for kv_heads, threads, dtype_name, batch, keys in cases:
            torch.set_num_threads(threads)
            clock = time.thread_time if threads == 1 else time.perf_counter
            dtype = getattr(torch, dtype_name)
            fns, kv_bytes = make_case(batch, args.heads, kv_heads, keys, args.head_dim, dtype)
            ours, sdpa = fns["ours"](), fns["sdpa"]()
            torch.testing.assert_close(ours, sdpa, atol=2e-2, rtol=2e-2)
            if threads == 1:
                times = measure(fns, args.rounds, clock, single_calls=False)
                med = {name: statistics.median(t) for name, t in times.items()}
                ratio = statistics.median(s / o for s, o in zip(times["sdpa"], times["ours"]))
            else:  # the fastest single call: one that had every core
                times = measure(fns, args.rounds * MULTI_THREAD_ROUNDS, clock, single_calls=True)
                med = {name: min(t) for name, t in times.items()}
                ratio = med["sdpa"] / med["ours"]
            ours_gbs = kv_bytes / med["ours"] / 1e9
            copy_gbs = 2 * kv_bytes / med["copy"] / 1e9
            line = (
                f"| {kv_heads} | {dtype_name} | {threads} | {batch} | {keys} | {med['ours'] * 1e6:.1f} | "
                f"{med['sdpa'] * 1e6:.1f} | {ratio:.2f} | {ours_gbs:.1f} | {copy_gbs:.1f} | "
                f"{100 * ours_gbs / copy_gbs:.0f} % |"
            )
            print(line, flush=True)
            lines.append(line)
    load_after = os.getloadavg()
    header = (
        f"One decode step: B x {args.heads} query heads (grouped over `kv heads` key/value heads), 1 query each, "
        f"Dh={args.head_dim}, over Tk cached keys. 1 thread: median of {args.rounds} interleaved rounds of ~2 ms "
        "samples timed by the thread's CPU time, SDPA / ours = median of the per-round ratios. More threads: the "
        "fastest of "
        f"{args.rounds * MULTI_THREAD_ROUNDS} interleaved single calls by wall clock (the cores are shared: a call "
        "that waits for a core held by another process is not the kernel's time), SDPA / ours = ratio of those. "
        "GB/s: ours = K/V bytes read / time; copy = a `copy_` of the same K/V bytes into a reused buffer, (read + "
        "written) / time. Load average (1, 5, 15 min) before: "
        f"{', '.join(f'{x:.2f}' for x in load_before)}; after: {', '.join(f'{x:.2f}' for x in load_after)}."
    )
    table = header + "\n\n" + "\n".join(lines)
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        f.write(f"{title}\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
