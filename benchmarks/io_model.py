"""Bytes each residual schedule's kernels move, counted by the SIMT harness, next to the
paper's I/O model (Attention Residuals, Table 1).

Runs one forward and, separately, one backward of the kernel-backed models
(:mod:`attnres_kernels.nn`, ``backend="cuda"`` emulated on CPU tensors with
``ATTNRES_CUDA_EMULATE=1``, attention on PyTorch's SDPA) and sums the global-memory
traffic of the depth-read and Block-step launches (the harness counts every byte per
buffer, :func:`attnres_kernels.cuda.emulation.launch_log`). The traffic is split into

- rows: ``[tokens, d]`` activations (sources, outputs, prefixes, partial sums and their
  gradients), reported per token per sublayer in units of ``d * itemsize``: the
  quantity the paper's model counts;
- per-row scalars (logits, lse, rinv): O(sources) words per token, no d;
- parameters: the site vectors staged once per row team, the per-chunk partials of
  their gradients and the gradients themselves: O(d) per launch, vanishing per token
  as the token count grows.

The rows part is checked to scale exactly with d (two widths). Standard residuals run
no kernel of ours (``h + f(norm(h))`` is PyTorch): their 3d is the paper's count.

    python benchmarks/io_model.py [--d 32 64] [--layers 4] [--layers-per-block 2] [--tokens 8]
        [--out benchmarks/results/io_model.md]
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("ATTNRES_CUDA_EMULATE", "1")

from attnres_kernels import nn as ak_nn  # noqa: E402
from attnres_kernels.cuda import emulation  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
from common import report_header  # noqa: E402

ROW_GROUPS = {
    "sources",
    "out",
    "prefix_out",
    "partial",
    "update",
    "new_partial",
    "dy",
    "grad_sources",
    "grad_prefix_out",
    "grad_out",
    "grad_new_partial",
    "grad_total",
}
SCALAR_GROUPS = {
    "lse",
    "logits",
    "logit",
    "rinv",
    "prefix_lse",
    "dlse",
    "dlogits",
    "grad_lse",
    "grad_prefix_lse",
}
PARAM_GROUPS = {
    "query",
    "norm_weight",
    "out_norm_weight",
    "du_part",
    "dg_part",
    "dvw_part",
    "grad_query",
    "grad_norm_weight",
    "grad_out_norm_weight",
}
KERNELS = ("depth_attn_fwd", "depth_attn_bwd", "block_step_fwd", "block_step_bwd", "site_grads")


@dataclass
class Traffic:
    rows: int = 0
    scalars: int = 0
    params: int = 0
    launches: int = 0
    rows_by_kernel: dict = field(default_factory=dict)  # "depth_attn_fwd" / "block_step_fwd" / ... -> row bytes

    def add(self, launch) -> None:
        if not launch.kernel.startswith(KERNELS):
            raise AssertionError(f"unexpected kernel {launch.kernel}")
        self.launches += 1
        for group, (read, written) in launch.traffic.items():
            if read + written == 0:
                continue
            if group in ROW_GROUPS:
                self.rows += read + written
                family = launch.kernel.split("<")[0]
                self.rows_by_kernel[family] = self.rows_by_kernel.get(family, 0) + read + written
            elif group in SCALAR_GROUPS:
                self.scalars += read + written
            elif group in PARAM_GROUPS:
                self.params += read + written
            else:  # "untracked" or a buffer this script does not know: the count would be wrong
                raise AssertionError(f"{launch.kernel}: traffic to {group!r} ({read}, {written})")


def schedules(layers_per_block: int) -> dict:
    """The kernel-backed schedules: name -> model constructor kwargs."""
    return {
        "Full, per site": (ak_nn.FullAttnResTransformer, dict(chunk_size=1)),
        "Full, chunks of 4 sites": (ak_nn.FullAttnResTransformer, dict(chunk_size=4)),
        "Block, per site": (
            ak_nn.BlockAttnResTransformer,
            dict(layers_per_block=layers_per_block, schedule="per_site"),
        ),
        "Block, two-phase": (
            ak_nn.BlockAttnResTransformer,
            dict(layers_per_block=layers_per_block, schedule="two_phase"),
        ),
    }


def measure(cls, kwargs, d: int, layers: int, tokens: int, seed: int = 0) -> tuple:
    """(forward, backward) Traffic of one step of a model with random weights."""
    torch.manual_seed(seed)
    model = cls(64, d, layers, 2, backend="cuda", attention_backend="sdpa", **kwargs)
    for p in model.parameters():  # non-zero queries: every site's softmax is a real one
        if p.dim() == 1:
            p.data.add_(0.1 * torch.randn_like(p))
    idx = torch.randint(0, 64, (1, tokens))
    emulation.launch_log()
    logits = model(idx)
    fwd, bwd = Traffic(), Traffic()
    for launch in emulation.launch_log():
        fwd.add(launch)
    logits.float().square().mean().backward()
    for launch in emulation.launch_log():
        bwd.add(launch)
    return fwd, bwd


def paper_model(layers: int, layers_per_block: int, chunk: int) -> dict:
    """Table 1 of the paper per token per (residual) layer, in units of d, with the paper's
    L = residual layers = our sublayers (2 per transformer layer), S = sublayers per block
    (or per chunk of the two-phase Full schedule) and N = L / S blocks (chunks)."""
    sublayers = 2 * layers
    s_block, s_chunk = 2 * layers_per_block, chunk
    n_block, n_chunk = sublayers / s_block, sublayers / s_chunk
    return {
        "Standard": ("3", 3.0),
        "Full, chunks of 4 sites": (f"S + N = {s_chunk} + {n_chunk:g}", s_chunk + n_chunk),
        "Block, two-phase": (f"N/S + 5 = {n_block:g}/{s_block} + 5", n_block / s_block + 5),
    }


def pytorch_rows(name: str, layers: int, layers_per_block: int, chunk: int = 4) -> int:
    """Rows (in d per token) the schedule moves in PyTorch ops outside our kernels, per
    forward: residual adds (read 2, write 1) and the PreNorm of a phase-1 row taken as a
    site's input (read 1, write 1; every other site's PreNorm is fused into its read)."""
    sublayers = 2 * layers
    blocks = -(-layers // layers_per_block)
    if name == "Full, per site":
        return 0
    if name == "Full, chunks of 4 sites":
        starts = range(0, sublayers + 1, chunk)
        return 2 * sum(1 for s in starts if min(s + chunk, sublayers + 1) - s > 1)
    if name == "Block, per site":  # every sublayer output but a block's first is added to the partial sum
        return 3 * (sublayers - blocks)
    if name == "Block, two-phase":  # a block's first site takes its phase-1 row; each commit adds the last output
        return 2 * blocks + 3 * (blocks - 1)
    raise ValueError(name)


READING = [
    "",
    "## Reading",
    "",
    "- **What is compared.** The paper's model (its Table 1: Standard 3d, Block (N/S + 5)d,",
    "  two-phase Full (S + N)d per token per layer) counts d-vectors read or written per residual layer. The",
    "  `rows` columns are the same quantity for our kernels, counted byte by byte by the harness, exactly",
    "  proportional to d (checked at both widths); `+ PyTorch ops` adds, from the schedule's structure, the",
    "  rows our models move outside the kernels: residual adds (3 each) and the PreNorm of a phase-1 row",
    "  that a block's (chunk's) first site takes as its input (2). Every other PreNorm is fused into a read",
    "  and costs nothing extra, while Standard's `norm(h)` reads h once more than its 3d (not counted there",
    "  either).",
    "- **Two-phase Block vs N/S + 5.** The Block step moves 5 rows (partial, sublayer output and the phase-1",
    "  row in; new partial and the normed input out) like the paper's 5, but a block's first site runs no step",
    "  (its partial is empty: it takes its phase-1 row), the step after it has no partial to read (4 rows),",
    "  and phase 1 of block j reads the j + 1 blocks committed so far, not N. Phase 1 also writes one row per",
    "  site (read back by that site's step), and each block commit is a PyTorch add of the last sublayer",
    "  output. Net: the kernels alone come in under the formula, and with the PyTorch adds slightly over it.",
    "- **Chunked Full vs S + N.** Phase 1 of a chunk reads the sources committed before it (on average half of",
    "  all sources, where the formula takes all) and writes one row per site; each later site of the chunk",
    "  merges its phase-1 row with the chunk's own sources so far. Site by site (chunk 1), site k reads all its",
    "  k + 1 sources: the O(L) per layer that the chunked schedule removes.",
    "- **Per-site Block** reads the committed blocks at every site (N + 1 rows) but keeps the partial sum in",
    "  PyTorch adds; two-phase moves fewer rows in total once blocks are long and many (the N/S amortization).",
    "- **Not in the paper's model:** per-row scalars (logits, lse, rinv: O(N) words per token, no d) and",
    "  the site parameters (query, key-norm and output-norm weights read once per row team, the per-chunk",
    "  partial sums of their gradients, the gradients): O(d) per launch, shrinking per token as tokens grow",
    "  (8 tokens here, so they look large). At d = 4096 in bf16 a row is 8 KiB: the scalars are under 1% of",
    "  the rows.",
    "- **Backward** (no paper numbers): the depth read's backward reads each source once where a row's",
    "  sources fit in shared memory (its source cache, fp32 math: every read here), else twice (δ = <do, h>",
    "  needs every source before any source gradient can be written), and writes each source gradient",
    "  once; the Block step's backward reads new_partial, the phase-1 row and the incoming gradients once",
    "  and writes both row gradients once.",
]


def run(ds, layers: int, layers_per_block: int, tokens: int) -> str:
    """The report's body (everything below its header) and the traffic counted per schedule and d."""
    reason = emulation.load()
    if reason is not None:
        raise SystemExit(reason)
    sublayers = 2 * layers
    itemsize = 4  # fp32 model
    results = {}
    for name, (cls, kwargs) in schedules(layers_per_block).items():
        results[name] = {d: measure(cls, kwargs, d, layers, tokens) for d in ds}
    paper = paper_model(layers, layers_per_block, 4)

    def per_unit(traffic_bytes, d):
        return traffic_bytes / (tokens * sublayers * d * itemsize)

    lines = [
        f"fp32 models with {layers} transformer layers "
        f"({sublayers} sublayers = residual layers in the paper's sense, plus the output site), Block with "
        f'{layers_per_block} layers per block, {tokens} tokens, `backend="cuda"` under the SIMT harness '
        "(the very CUDA kernel code, every global byte counted), attention on SDPA. Units: bytes per token per "
        "sublayer / (d × 4 bytes).",
        "",
        "## Forward: activation rows moved by the depth-read and Block-step kernels",
        "",
        "| schedule | "
        + " | ".join(f"rows, d={d}" for d in ds)
        + " | + PyTorch ops (analytic) | total | paper (Table 1) | by kernel | launches |",
        "|---|" + "---|" * len(ds) + "---|---|---|---|---|",
    ]
    lines.append(
        "| Standard (PyTorch `h + f(norm(h))`, no kernel of ours) | "
        + " | ".join("-" for _ in ds)
        + " | 3 | 3 | 3 | - | 0 |"
    )
    for name, by_d in results.items():
        values = [per_unit(by_d[d][0].rows, d) for d in ds]
        formula = paper.get(name)
        cell = f"{formula[0]} = {formula[1]:g}" if formula else "-"
        split = ", ".join(f"{k} {per_unit(v, ds[0]):.3f}" for k, v in sorted(by_d[ds[0]][0].rows_by_kernel.items()))
        extra = pytorch_rows(name, layers, layers_per_block) / sublayers
        lines.append(
            f"| {name} | " + " | ".join(f"{v:.3f}" for v in values) + f" | {extra:.3f} | {values[0] + extra:.3f} | "
            f"{cell} | {split} | {by_d[ds[0]][0].launches} |"
        )
    lines += [
        "",
        "## Backward: activation rows moved by the backward kernels",
        "",
        "| schedule | " + " | ".join(f"rows, d={d}" for d in ds) + " | kernel launches |",
        "|---|" + "---|" * len(ds) + "---|",
    ]
    for name, by_d in results.items():
        values = [per_unit(by_d[d][1].rows, d) for d in ds]
        lines.append(f"| {name} | " + " | ".join(f"{v:.3f}" for v in values) + f" | {by_d[ds[0]][1].launches} |")
    lines += [
        "",
        "## What does not scale with d (bytes per token per sublayer, forward / backward)",
        "",
        "| schedule | "
        + " | ".join(f"scalars, d={d}" for d in ds)
        + " | "
        + " | ".join(f"parameters, d={d}" for d in ds)
        + " |",
        "|---|" + "---|" * (2 * len(ds)),
    ]
    for name, by_d in results.items():
        scal = [
            f"{by_d[d][0].scalars / (tokens * sublayers):.0f} / {by_d[d][1].scalars / (tokens * sublayers):.0f}"
            for d in ds
        ]
        par = [
            f"{by_d[d][0].params / (tokens * sublayers):.0f} / {by_d[d][1].params / (tokens * sublayers):.0f}"
            for d in ds
        ]
        lines.append(f"| {name} | " + " | ".join(scal + par) + " |")
    lines += READING
    return "\n".join(lines) + "\n", results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d", nargs="+", type=int, default=[32, 64])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--layers-per-block", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None, help="write the Markdown report here")
    args = parser.parse_args(argv)
    header = report_header("Bytes moved per schedule vs the paper's I/O model", argv)
    body, results = run(args.d, args.layers, args.layers_per_block, args.tokens)
    report = header + "\n" + body
    for name, by_d in results.items():  # the row traffic is exactly proportional to d
        units = {round(by_d[d][k].rows / d, 9) for d in args.d for k in (0,)}
        if len(units) != 1:
            raise SystemExit(f"{name}: forward row bytes do not scale with d: {units}")
    print(report)
    if args.out is not None:
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
