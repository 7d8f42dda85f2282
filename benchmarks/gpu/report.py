"""The Markdown report of every section measured."""

from __future__ import annotations

from .environment import Split
from .models import ModelConfig
from .reads import PEERS, Row


def _ms(t) -> str:
    return "–" if t is None else f"{t[0]:.3f} ({t[1]:.3f}–{t[2]:.3f})"


def _gbps(x) -> str:
    return "–" if x is None else f"{x:.3g}"


def _ratio(a, b) -> str:
    return "–" if a is None or b is None else f"{b[0] / a[0]:.2f}×"


def _error(row: Row) -> str:
    if not row.accuracy:
        return "–"
    return f"{max(row.accuracy['errors'].values()):.1e} ({max(row.accuracy['reference_errors'].values()):.1e})"


def _host_us(split: Split | None) -> str:
    return "–" if split is None else f"{split.host_us:.0f}"


def _device_ms(split: Split | None) -> str:
    return "–" if split is None or split.device_ms is None else f"{split.device_ms:.3f}"


def _bound_by(split: Split | None) -> str:
    return "–" if split is None else split.bound_by


SPLIT_COLUMNS = "fwd host µs/call | fwd device ms | fwd+bwd host µs/call | fwd+bwd device ms | bound by"


def _split_cells(row: Row) -> str:
    """The cells of :data:`SPLIT_COLUMNS`; what bounds the row is what bounds its fwd+bwd."""
    fwd, fwd_bwd = row.fwd_split, row.fwd_bwd_split
    cells = [_host_us(fwd), _device_ms(fwd), _host_us(fwd_bwd), _device_ms(fwd_bwd), _bound_by(fwd_bwd)]
    return " | ".join(cells)


def _op_section(title: str, intro: list, cases: dict, baseline: str, short: str) -> list:
    """A report section: its title, intro lines and one ``_op_table`` per case (nothing without cases)."""
    if not cases:
        return []
    lines = ["", f"## {title}", "", *intro]
    for case, rows in cases.items():
        lines += ["", f"### {case}", "", *_op_table(rows, baseline, short)]
    return lines


def _op_table(rows: list, baseline: str, short: str) -> list:
    """One case of attention or the Block step: times, speed-ups over ``baseline`` (named ``short``
    in the header), the host/device split and the accuracy."""
    base = next((r for r in rows if r.impl == baseline and r.fwd_ms), None)
    lines = [
        f"| implementation | status | fwd ms | fwd ×{short} | fwd+bwd ms | fwd+bwd ×{short} | {SPLIT_COLUMNS} "
        "| error (ref) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.impl} | {r.status} | {_ms(r.fwd_ms)} | {_ratio(r.fwd_ms, base.fwd_ms if base else None)} | "
            f"{_ms(r.fwd_bwd_ms)} | {_ratio(r.fwd_bwd_ms, base.fwd_bwd_ms if base else None)} | {_split_cells(r)} | "
            f"{_error(r)} |"
        )
    return lines


def markdown(
    env_info: dict,
    read_rows: list,
    copies: dict,
    model_rows: list,
    cfg: ModelConfig | None,
    inkling2_rows: list = (),
    inkling2_step: tuple | None = None,
    attention_rows: dict | None = None,
    block_step_rows: dict | None = None,
    host_rows: list = (),
) -> str:
    lines = ["# GPU benchmark" + (" (DRY RUN on CPU: numbers are meaningless)" if env_info["dry_run"] else ""), ""]
    lines += [f"- {k}: {v}" for k, v in env_info.items()]
    lines += [
        "",
        "## Depth read",
        "",
        "Times in ms: median (20 %–80 % quantiles). GB/s: the I/O floor (forward: N sources read, Q outputs",
        "written; forward+backward adds a second read of the sources and of the output gradients and the N",
        "source gradients) over the median time; `copy` is a device copy of the forward's floor in bytes into a",
        "reused buffer. Speed-ups are over the eager reference and over `torch.compile` of it. Accuracy: max",
        "error / max |oracle| against an fp32 oracle, worst of output and gradients, next to the eager",
        "reference's in the input precision; FAIL = more than 3x the reference's error plus slack.",
        "",
        "The second table of each case splits the cost of one call: host µs/call is the time the host takes to",
        "issue it (calls not synchronized); device ms is the time of its kernels (torch.profiler). When the host",
        "takes longer than the kernels (bound by `host`), the device waits for the host and the ms above time the",
        "Python call path, not the kernels.",
        "",
    ]
    for case, rows in read_rows.items():
        eager = next((r for r in rows if r.impl == "reference, eager" and r.fwd_ms), None)
        compiled = next((r for r in rows if r.impl == "reference, torch.compile" and r.fwd_ms), None)
        lines += [f"### {case} (copy: {_gbps(copies[case])} GB/s)", ""]
        lines += [
            "| implementation | status | fwd ms | fwd GB/s | fwd ×eager | fwd ×compile | fwd+bwd ms | fwd+bwd GB/s "
            "| fwd+bwd ×eager | fwd+bwd ×compile | error (ref) |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            lines.append(
                f"| {r.impl} | {r.status} | {_ms(r.fwd_ms)} | {_gbps(r.fwd_gbps)} | "
                f"{_ratio(r.fwd_ms, eager.fwd_ms if eager else None)} | "
                f"{_ratio(r.fwd_ms, compiled.fwd_ms if compiled else None)} | {_ms(r.fwd_bwd_ms)} | "
                f"{_gbps(r.fwd_bwd_gbps)} | {_ratio(r.fwd_bwd_ms, eager.fwd_bwd_ms if eager else None)} | "
                f"{_ratio(r.fwd_bwd_ms, compiled.fwd_bwd_ms if compiled else None)} | {_error(r)} |"
            )
        lines += ["", f"| implementation | {SPLIT_COLUMNS} |", "|---|---|---|---|---|---|"]
        lines += [f"| {r.impl} | {_split_cells(r)} |" for r in rows if r.fwd_split is not None]
        lines.append("")
    lines += ["## How the peers are called", ""]
    lines += [f"- **{name}**: {' '.join(doc.split())}" for name, doc in PEERS.items()]
    lines += _op_section(
        "Attention",
        [
            "`ak.attention(q, k, v, causal=True)` on our backends and PyTorch's `scaled_dot_product_attention`",
            "(cuDNN or FlashAttention on a GPU); q, k, v `[B, H, T, Dh]`. ×SDPA: SDPA's time over the row's (above 1:",
            "faster than SDPA). Host/device columns as in the depth read. Accuracy as in the depth read, except that",
            "the same-precision baseline is plain PyTorch attention in the input dtype (FlashAttention's rule).",
        ],
        attention_rows,
        "torch SDPA",
        "SDPA",
    )
    lines += _op_section(
        "Block step",
        [
            "`ak.block_step`: `partial + update` and the next site's read merged with its phase-1 prefix, PreNorm",
            "fused (`out_norm_weight`), as the Block model runs it. ×eager: the eager reference's time over the",
            "row's. Accuracy: outputs (new partial, read) and the gradients of every input, as in the depth read.",
        ],
        block_step_rows,
        "reference, eager",
        "eager",
    )
    if host_rows:
        lines += [
            "",
            "## Host cost of a depth read",
            "",
            "µs per call on the host, best and median of rounds of calls issued without synchronizing (the device",
            "runs ahead whenever the host is the bound): plain PyTorch calls for scale, then each fused backend's",
            "read (`depth_attention`; `read_unchecked`, as the nn modules call it; the raw ops without autograd) and",
            "Triton's own `kernel[grid](...)` launch of each kernel, timed around the call. The read: N = 9 bf16",
            "sources of [4, 2048, 1024], one site with its key-norm weight (a dry run: 3 of [1, 4, 16]).",
            "",
            "| call | backend | best µs | median µs |",
            "|---|---|---|---|",
        ]
        lines += [f"| {r.call} | {r.backend} | {r.best_us:.1f} | {r.median_us:.1f} |" for r in host_rows]
    if cfg is not None and model_rows:
        lines += [
            "",
            "## Training step",
            "",
            f"AdamW step under bf16 autocast: d={cfg.d_model}, L={cfg.layers}, heads={cfg.heads}, T={cfg.seq}, "
            f"batch {cfg.batch}, vocab {cfg.vocab}, Block with {cfg.layers_per_block} layers per block. "
            "device ms/step: the kernels' time of one step (torch.profiler over 2 steps); bound by `host` when "
            "issuing a step takes the host longer than that (ms/step then exceeds the device time). The model's "
            "`backend` runs its attention too, except in the `cuda` rows (CUDA C++ depth reads, Triton attention). "
            "`CUDA graph`: the model's forward and backward captured by `torch.cuda.make_graphed_callables` and "
            "replayed (autocast without its cast cache), the loss and the AdamW step eager.",
            "",
            "| model | depth read | status | ms/step | × Standard | tokens/s | peak MiB | device ms/step | bound by |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        standard = next((r for r in model_rows if r.model == "Standard" and r.step_ms), None)
        for r in model_rows:
            ratio = "–" if standard is None or r.step_ms is None else f"{r.step_ms[0] / standard.step_ms[0]:.2f}×"
            peak = "–" if r.peak_mib is None else f"{r.peak_mib:.0f}"
            tps = "–" if r.tokens_per_s is None else f"{r.tokens_per_s:.0f}"
            lines.append(
                f"| {r.model} | {r.depth_read} | {r.status} | {_ms(r.step_ms)} | {ratio} | {tps} | {peak} | "
                f"{_device_ms(r.step_split)} | {_bound_by(r.step_split)} |"
            )
    if inkling2_rows:
        lines += [
            "",
            "## Inkling2 read module, patched vs unpatched",
            "",
            "transformers' `Inkling2BlockAttentionResidual` (4 committed bf16 blocks + the partial sum, T = 4096, "
            "D = 1024, fp32 output), forward + backward, unpatched and patched by "
            "`attnres_kernels.hf.apply_attnres_kernels`; saved MiB: tensors autograd keeps that are not the inputs.",
            "",
            "| Q | partial | status | unpatched ms | patched ms | speedup | saved MiB unpatched | patched |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in inkling2_rows:
            mib = lambda x: "–" if x is None else f"{x:.1f}"
            lines.append(
                f"| {r.queries} | {r.partial} | {r.status} | {_ms(r.unpatched_ms)} | {_ms(r.patched_ms)} | "
                f"{_ratio(r.patched_ms, r.unpatched_ms)} | {mib(r.unpatched_saved_mib)} | {mib(r.patched_saved_mib)} |"
            )
    if inkling2_step is not None:
        args, step_rows = inkling2_step
        lines += [
            "",
            "## Inkling2 training step, patched vs unpatched",
            "",
            f"A random `Inkling2ForCausalLM` loaded in bf16 (`benchmarks/inkling2_model.py`'s model: hidden "
            f"{args.hidden}, {args.layers} layers, full attention every 4th, AttnRes blocks of {args.block} layers, "
            f"4 experts top 2), B = {args.batch}, T = {args.tokens}; one AdamW step. `reads`: "
            "`apply_attnres_kernels(model, fuse_norms=False)`; `reads+norms`: the default (reads fused with the "
            'RMSNorm after each); `, cuda`: the same patch with `backend="cuda"` (the C++ kernels). device ms/step '
            "and bound by as in the training-step table.",
            "",
            "| variant | status | ms/step | speedup | peak MiB | first loss | device ms/step | bound by |",
            "|---|---|---|---|---|---|---|---|",
        ]
        unpatched = next((r for r in step_rows if r.variant == "unpatched" and r.step_ms), None)
        for r in step_rows:
            peak = "–" if r.peak_mib is None else f"{r.peak_mib:.0f}"
            loss = "–" if r.loss is None else f"{r.loss:.4f}"
            lines.append(
                f"| {r.variant} | {r.status} | {_ms(r.step_ms)} | "
                f"{_ratio(r.step_ms, unpatched.step_ms if unpatched else None)} | {peak} | {loss} | "
                f"{_device_ms(r.step_split)} | {_bound_by(r.step_split)} |"
            )
    return "\n".join(lines) + "\n"
