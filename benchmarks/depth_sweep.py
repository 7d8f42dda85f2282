"""Depth sweep of the ``attnres_kernels.nn`` models: train-step time and the activation
memory saved for backward beyond the Standard model's, against depth L.

    python benchmarks/depth_sweep.py [--depths 6 12 24 48] [--batch 4] [--rounds 8] [--out benchmarks/results]

d=256, 4 heads, T=128, random tokens (vocab 64), batch ``--batch`` (the first rows
of ``model_steps.py``'s d256 batch). Models: Standard; Full (default chunk size)
and Block (``per_site`` and ``two_phase``) each with the fused ``cpu`` depth read
and with the ``reference`` read. Block uses ``--block-size`` S layers per block,
so N = L / S blocks grows with L; a second sweep holds L = ``--n-sweep-depth``
and varies N (S = L / N), which separates the cost per block from the cost per
layer.

Time: one AdamW step per model per round, round-robin within each depth
(``model_steps.time_round_robin``: 1 torch thread, thread CPU time); ratios are
of medians to Standard's at the same depth. Memory: the distinct storages
autograd saves over one forward (``common.saved_activation_bytes``), minus
Standard's at the same depth, per token. The slope of that extra against L (least
squares) is the extra saved per token per layer; against N (second sweep), per
block. Both are printed in bytes and in units of d fp32 elements, next to the
paper's I/O model of one layer's residual path per token (memory traffic, not
saved bytes: Standard 3d, Block (N/S+5)d, two-phase Full (S+N)d).

Writes ``depth_sweep.md``, ``depth_sweep_time.png`` (step time vs L) and ``depth_sweep_memory.png``
(extra saved per token vs L) into ``--out``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # model_steps.py, common.py
import model_steps

from common import report_header, saved_activation_bytes

D_MODEL, N_HEADS = 256, 4
# (label, model_steps model name, depth-read backend); Standard has no depth read.
MODELS = [
    ("Standard", "Standard", "cpu"),
    ("Full cpu", "Full", "cpu"),
    ("Full ref", "Full", "reference"),
    ("Block:per_site cpu", "Block:per_site", "cpu"),
    ("Block:per_site ref", "Block:per_site", "reference"),
    ("Block:two_phase cpu", "Block:two_phase", "cpu"),
    ("Block:two_phase ref", "Block:two_phase", "reference"),
]


def config(n_layers: int, layers_per_block: int) -> dict:
    return dict(d_model=D_MODEL, n_layers=n_layers, n_heads=N_HEADS, layers_per_block=layers_per_block)


def measure(cfg: dict, models: list, x, y, vocab: int, rounds: int) -> dict:
    """``{label: (median step seconds, q1, q3, saved bytes)}`` of ``models`` at ``cfg``, timed round-robin."""
    built = {label: model_steps.build(name, cfg, vocab, backend, "sdpa") for label, name, backend in models}
    saved = {label: saved_activation_bytes(lambda m=m: model_steps.loss_of(m, x, y)) for label, m in built.items()}
    steps = {}
    for label, model in built.items():
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
        steps[label] = lambda model=model, opt=opt: model_steps.train_step(model, opt, x, y)
    times = model_steps.time_round_robin(steps, rounds, warmup=2)
    out = {}
    for label, ts in times.items():
        q1, _, q3 = statistics.quantiles(ts, n=4)
        out[label] = (statistics.median(ts), q1, q3, saved[label])
    return out


def slope(xs: list, ys: list) -> float:
    """Least-squares slope of ``ys`` against ``xs``."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / sum((a - mx) ** 2 for a in xs)


def quadratic_fit(xs: list, ys: list) -> tuple:
    """``(a, b, c)`` of the least-squares fit ``y = a + b x + c x^2``."""
    powers = np.array([[1.0, x, x * x] for x in xs])
    return tuple(np.linalg.lstsq(powers, np.array(ys, dtype=float), rcond=None)[0])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--depths", type=int, nargs="+", default=[6, 12, 24, 48])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=3, help="layers per block S of the L sweep")
    parser.add_argument("--n-sweep-depth", type=int, default=24)
    parser.add_argument("--n-sweep", type=int, nargs="+", default=[2, 4, 8], help="block counts N at that depth")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    vocab, x, y = model_steps.batch("d256")
    x, y = x[: args.batch], y[: args.batch]
    tokens = x.numel()
    elem = 4 * D_MODEL  # bytes of d fp32 elements

    lines = [
        report_header("Depth sweep: train-step time and extra saved activations vs depth", argv),
        f"1 torch thread, step time = thread CPU time, {args.rounds} rounds round-robin per depth. "
        "Load average at the end: LOAD_AFTER.",
        "",
        f"d={D_MODEL}, {N_HEADS} heads, B={args.batch}, T={x.shape[1]} ({tokens} tokens), attention sdpa, "
        f"Block S={args.block_size} layers per block (N = L/S), "
        f"Full chunk size {model_steps.ak.nn.DEFAULT_CHUNK_SIZE}. "
        "Extra = bytes autograd saves for backward beyond Standard's at the same L, per token.",
        "",
        "| L | N | model | median ms | q1 ms | q3 ms | vs Standard | saved MiB | extra B/token | extra/(4d) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    results = {}
    for n_layers in args.depths:
        cfg = config(n_layers, args.block_size)
        res = measure(cfg, MODELS, x, y, vocab, args.rounds)
        results[n_layers] = res
        base_t, _, _, base_saved = res["Standard"]
        for label, (med, q1, q3, saved) in res.items():
            extra = (saved - base_saved) / tokens
            lines.append(
                f"| {n_layers} | {n_layers // args.block_size} | {label} | {med * 1e3:.1f} | {q1 * 1e3:.1f} | "
                f"{q3 * 1e3:.1f} | {med / base_t:.3f}x | {saved / 2**20:.2f} | {extra:.0f} | {extra / elem:.2f} |"
            )
        print("\n".join(lines[-len(res) :]), flush=True)

    depths = args.depths
    lines += [
        "",
        "## Slopes against L (least squares over the depths)",
        "",
        "Linear: extra = a + b L. Quadratic: extra = a + b2 L + c2 L^2 (the L^2 term holds what grows with "
        "sites x sources, e.g. the saved logits, O(L^2) scalars per token, not O(L d)).",
        "",
        "| model | b: extra B/token/layer | b/(4d) | quadratic b2 B/token/layer | b2/(4d) | c2 B/token/layer^2 "
        "| step ms/layer |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, *_ in MODELS[1:]:
        extra = [(results[n][label][3] - results[n]["Standard"][3]) / tokens for n in depths]
        ms = [results[n][label][0] * 1e3 for n in depths]
        b = slope(depths, extra)
        _, b2, c2 = quadratic_fit(depths, extra)
        lines.append(
            f"| {label} | {b:.0f} | {b / elem:.2f} | {b2:.0f} | {b2 / elem:.2f} | {c2:.1f} | {slope(depths, ms):.2f} |"
        )
    std_ms = [results[n]["Standard"][0] * 1e3 for n in depths]
    lines.append(f"| Standard | 0 | 0 | 0 | 0 | 0 | {slope(depths, std_ms):.2f} |")

    n_layers = args.n_sweep_depth
    block_models = [m for m in MODELS if m[0] == "Standard" or (m[1].startswith("Block") and m[2] == "cpu")]
    lines += ["", f"## Block at L={n_layers}: N blocks (S = L/N)", ""]
    lines += [
        "| N | S | model | median ms | vs Standard | extra B/token | extra/(4d) |",
        "|---|---|---|---|---|---|---|",
    ]
    by_n = {}
    for n_blocks in args.n_sweep:
        res = measure(config(n_layers, n_layers // n_blocks), block_models, x, y, vocab, args.rounds)
        by_n[n_blocks] = res
        base_t, _, _, base_saved = res["Standard"]
        for label, (med, _, _, saved) in res.items():
            extra = (saved - base_saved) / tokens
            lines.append(
                f"| {n_blocks} | {n_layers // n_blocks} | {label} | {med * 1e3:.1f} | {med / base_t:.3f}x | "
                f"{extra:.0f} | {extra / elem:.2f} |"
            )
        print("\n".join(lines[-len(res) :]), flush=True)
    lines += ["", "| model | extra saved B/token/block (slope vs N) | in d fp32 elements |", "|---|---|---|"]
    for label, *_ in block_models[1:]:
        extra = [(by_n[n][label][3] - by_n[n]["Standard"][3]) / tokens for n in args.n_sweep]
        b = slope(args.n_sweep, extra)
        lines.append(f"| {label} | {b:.0f} | {b / elem:.2f} |")

    chunk = model_steps.ak.nn.DEFAULT_CHUNK_SIZE
    lines += [
        "",
        "## The paper's I/O model (residual-path memory traffic per token per layer, in d)",
        "",
        "Standard 3d; Block (N/S+5)d with N blocks of S layers; two-phase Full (S+N)d, here with S = the chunk "
        f"size ({chunk} sites) and N = ceil((2L+1)/S) chunks. Traffic, not saved bytes: beside them the measured "
        "step-time ratios (fused cpu read) from the first table.",
        "",
        "| L | Block N | Block (N/S+5) / 3 | Block:per_site time | Block:two_phase time | Full N | Full (S+N) / 3 "
        "| Full time |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for n in depths:
        blocks, chunks = n // args.block_size, -(-(2 * n + 1) // chunk)
        ratio = {label: results[n][label][0] / results[n]["Standard"][0] for label, *_ in MODELS}
        lines.append(
            f"| {n} | {blocks} | {(blocks / args.block_size + 5) / 3:.2f}x | {ratio['Block:per_site cpu']:.3f}x | "
            f"{ratio['Block:two_phase cpu']:.3f}x | {chunks} | {(chunk + chunks) / 3:.2f}x | {ratio['Full cpu']:.3f}x |"
        )

    os.makedirs(args.out, exist_ok=True)
    plots = {
        "time": ("train step (ms, thread CPU time)", lambda n, label: results[n][label][0] * 1e3),
        "memory": (
            "saved for backward beyond Standard (KiB/token)",
            lambda n, label: (results[n][label][3] - results[n]["Standard"][3]) / tokens / 2**10,
        ),
    }
    for kind, (ylabel, value) in plots.items():
        fig, ax = plt.subplots(figsize=(6.4, 4.4))
        for label, *_ in MODELS:
            ax.plot(depths, [value(n, label) for n in depths], marker="o", label=label)
        ax.set_xlabel("depth L (layers)")
        ax.set_ylabel(ylabel)
        ax.set_xticks(depths)
        ax.set_title(f"d={D_MODEL}, B={args.batch}, T={x.shape[1]}, Block S={args.block_size} (N = L/S)")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, f"depth_sweep_{kind}.png"), dpi=110)
        plt.close(fig)
    lines[1] = lines[1].replace("LOAD_AFTER", " / ".join(f"{x:.2f}" for x in os.getloadavg()))
    with open(os.path.join(args.out, "depth_sweep.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
