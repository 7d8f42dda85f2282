"""A training step of a small random transformers ``Inkling2ForCausalLM`` on CPU: unpatched vs
``attnres_kernels.hf.apply_attnres_kernels`` (reads only, and reads fused with their RMSNorms), with
the share of the step spent in the AttnRes reads.

    python benchmarks/inkling2_model.py [--dtype float32 bfloat16] [--rounds 9] [--threads 1]

Model: hidden 256, 8 decoder layers (sliding, sliding, sliding, full, ... : two full-attention
layers with 3-query reads), AttnRes blocks of 3 layers (reads over 1 to 3 committed blocks + the
partial sum), 4 experts (top 2, intermediate 512), 4 heads of 64, vocab 2048; B x T tokens.
A step is forward with labels, backward and an AdamW step (lr 1e-6, so routing does not drift).
Each round runs one step of every variant back to back (interleaved); the table gives the median and
[min, max] over the rounds.

Read shares come from one profiled step per variant (``torch.profiler``, CPU): a read is the
forward of an AttnRes read (the module's forward unpatched; the fused op's call patched) plus the
backward nodes its forward ops created (matched by autograd sequence number); "+ norms" adds the
RMSNorms that follow the reads (their own modules unless fused into the read). The profiler slows
small ops more than large ones, so the shares are of the profiled step. Writes
``benchmarks/results/inkling2_model.md``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # common.py

import transformers  # noqa: E402
from transformers.models.inkling2 import modeling_inkling2 as hf_inkling2  # noqa: E402

from attnres_kernels import hf  # noqa: E402
from attnres_kernels.hf import inkling2  # noqa: E402

from common import report_header  # noqa: E402

READ, NORM, ATTN = "attnres_read", "attnres_norm", "self_attn"
VARIANTS = ("unpatched", "reads", "reads+norms")


def make_model(args) -> torch.nn.Module:
    layer_types = ["hybrid" if (i + 1) % 4 == 0 else "hybrid_sliding" for i in range(args.layers)]
    config = transformers.Inkling2TextConfig(
        vocab_size=2048,
        unpadded_vocab_size=2000,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=64,
        sliding_window_size=128,
        d_rel=16,
        rel_extent=128,
        layer_types=layer_types,
        n_layers_per_attn_res_block=args.block,
        moe_intermediate_size=512,
        n_routed_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.Inkling2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".query"):
                p.normal_(0, 1.0)
    return model


def variant(path, name, dtype, backend="auto"):
    """The checkpoint at ``path`` loaded in ``dtype`` (transformers keeps the AttnRes queries, the router and
    the short convolutions in fp32), patched as ``name`` says, its reads on ``backend``."""
    model = transformers.Inkling2ForCausalLM.from_pretrained(path, dtype=dtype)
    if name != "unpatched":
        hf.apply_attnres_kernels(model, backend, fuse_norms=name == "reads+norms")
    return model.train()


def step(model, opt, ids) -> tuple:
    """(CPU time of this thread, wall time) of one training step, seconds. With one torch thread the whole
    step (autograd's CPU work included) runs on this thread, so its CPU time ignores waits for a shared core."""
    cpu, wall = time.thread_time(), time.perf_counter()
    opt.zero_grad(set_to_none=True)
    loss = model(ids, labels=ids).loss
    loss.backward()
    opt.step()
    return time.thread_time() - cpu, time.perf_counter() - wall


def label(fn, name):
    """``fn`` inside a profiler range ``name``."""

    def labelled(*args, **kwargs):
        with torch.profiler.record_function(name):
            return fn(*args, **kwargs)

    return labelled


def mark(model, name):
    """Labels the reads (and the norms after them) of ``model`` for the profiler."""
    layers = model.model.layers
    for layer in layers:
        norms = [layer.post_attention_layernorm]
        if layer.attention_input is not None:
            norms += [getattr(layer, n) for n in ("input_layernorm", "q_input_layernorm") if hasattr(layer, n)]
            norms += [getattr(layer, n) for n in ("k_input_layernorm", "v_input_layernorm") if hasattr(layer, n)]
        for norm in norms:
            norm.forward = label(norm.forward, NORM)  # only runs where the norm is not fused into the read
    model.model.norm.forward = label(model.model.norm.forward, NORM)
    for layer in layers:  # its cat of attention sinks is no block-state cat
        layer.self_attn.forward = label(layer.self_attn.forward, ATTN)
    if name == "unpatched":
        for module in model.modules():
            if isinstance(module, hf_inkling2.Inkling2BlockAttentionResidual):
                module.forward = label(module.forward, READ)


def shares(prof, total_us) -> dict:
    """Microseconds of forward + backward in the READ and NORM ranges, and of block-state concatenations
    outside them, in one profiled step."""
    events = prof.events()
    result = {READ: 0.0, NORM: 0.0, "cat": 0.0, "cats": 0}
    seqs = {READ: set(), NORM: set(), "cat": set()}
    for e in events:
        if e.name in (READ, NORM):
            result[e.name] += e.cpu_time_total
            for child in e.cpu_children:
                if child.sequence_nr >= 0:
                    seqs[e.name].add(child.sequence_nr)
        elif e.name == "aten::cat" and e.sequence_nr >= 0 and _outside(e, (READ, NORM, ATTN, "autograd::engine")):
            result["cat"] += e.cpu_time_total  # a forward cat of block states (the loop's or a layer's)
            result["cats"] += 1
            seqs["cat"].add(e.sequence_nr)
    for e in events:
        if e.name.startswith("autograd::engine::evaluate_function") and e.sequence_nr >= 0:
            for key in seqs:
                if e.sequence_nr in seqs[key]:
                    result[key] += e.cpu_time_total
    return {k: v if k == "cats" else v / total_us for k, v in result.items()}


def _outside(e, labels) -> bool:
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith(labels):
            return False
        p = p.cpu_parent
    return True


def profiled_shares(model, name, ids) -> dict:
    """Shares of one profiled training step of ``model`` (its reads and norms labelled)."""
    real_read = inkling2._read
    if name != "unpatched":
        inkling2._read = label(real_read, READ)
    try:
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _, wall = step(model, opt, ids)
    finally:
        inkling2._read = real_read
    return shares(prof, wall * 1e6)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--block", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--profiled", type=int, default=3, help="profiled steps per variant (median shares)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the machine is shared)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "inkling2_model.md"))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    path = tempfile.mkdtemp(prefix="inkling2_bench_")
    make_model(args).save_pretrained(path)
    ids = torch.randint(1, 2000, (args.batch, args.tokens), generator=torch.Generator().manual_seed(1))
    sections = [header(args, argv)]
    try:
        for dtype_name in args.dtype:
            sections.append(run(args, path, ids, getattr(torch, dtype_name)))
    finally:
        shutil.rmtree(path)
    report = "\n".join(sections + [FOOTER])
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 0


def run(args, path, ids, dtype) -> str:
    """Times and profiles the three variants in ``dtype``; returns the report's section."""
    load_before = os.getloadavg()
    models = {name: variant(path, name, dtype) for name in VARIANTS}
    with torch.no_grad():  # logits against the fp32 unpatched model's, before timing
        ref = variant(path, "unpatched", torch.float32)(ids).logits.double()
        errors = {name: (m(ids).logits.double() - ref).abs() for name, m in models.items()}
    for name, err in errors.items():
        print(f"{name}: |logits - fp32 unpatched| max {err.max():.2e}, mean {err.mean():.2e}")
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-6) for name, m in models.items()}
    cpu, wall = ({name: [] for name in VARIANTS} for _ in range(2))
    for name in VARIANTS:
        step(models[name], opts[name], ids)  # warm-up
    for r in range(args.rounds):
        for name in VARIANTS:
            c, w = step(models[name], opts[name], ids)
            cpu[name].append(c)
            wall[name].append(w)
        print(f"round {r}: " + ", ".join(f"{n} {cpu[n][-1] * 1e3:.0f} ms" for n in VARIANTS))
    profiled = {name: [] for name in VARIANTS}
    labelled = {name: variant(path, name, dtype) for name in VARIANTS}
    for name, model in labelled.items():
        mark(model, name)
        step(model, torch.optim.SGD(model.parameters(), lr=0.0), ids)  # warm-up
    for _ in range(args.profiled):
        for name, model in labelled.items():
            profiled[name].append(profiled_shares(model, name, ids))
    profiled = {n: {k: statistics.median(p[k] for p in ps) for k in ps[0]} for n, ps in profiled.items()}
    return section(dtype, cpu, wall, profiled, errors, load_before, os.getloadavg())


def header(args, argv) -> str:
    return "\n".join(
        [
            report_header("Inkling2ForCausalLM training step, patched vs unpatched (CPU)", argv),
            f"transformers {transformers.__version__}, {args.threads} torch thread(s). Random model: hidden "
            f"{args.hidden}, {args.layers} layers (full attention every 4th), AttnRes blocks of {args.block} layers, "
            f"4 experts (top 2), vocab 2048; B = {args.batch}, T = {args.tokens}. Step = forward with labels + "
            f"backward + AdamW; {args.rounds} interleaved rounds, then {args.profiled} profiled steps per variant. "
            "The model is loaded with "
            "`from_pretrained(dtype=...)` (bf16: transformers keeps the AttnRes queries, router and short "
            "convolutions in fp32).",
            "",
        ]
    )


def section(dtype, cpu, wall, profiled, errors, load_before, load_after) -> str:
    ms = lambda ts: f"{statistics.median(ts) * 1e3:.0f} [{min(ts) * 1e3:.0f}, {max(ts) * 1e3:.0f}]"
    ratio = lambda ts, name: statistics.median(u / t for u, t in zip(ts["unpatched"], ts[name]))
    pct = lambda x: f"{100 * x:.1f} %"
    lines = [
        f"## {str(dtype).removeprefix('torch.')}",
        "",
        f"Load average (1 / 5 / 15 min) before: {' / '.join(f'{x:.2f}' for x in load_before)}; "
        f"after: {' / '.join(f'{x:.2f}' for x in load_after)}.",
        "",
        "| variant | step CPU ms | speedup | step wall ms | speedup | reads | reads + their norms "
        "| block-state cats outside reads: count, share | logits vs fp32 unpatched: max, mean |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in VARIANTS:
        p = profiled[name]
        lines.append(
            f"| {name} | {ms(cpu[name])} | {ratio(cpu, name):.2f}x | {ms(wall[name])} | {ratio(wall, name):.2f}x | "
            f"{pct(p[READ])} | {pct(p[READ] + p[NORM])} | {p['cats']:.0f}: {pct(p['cat'])} | "
            f"{errors[name].max():.1e}, {errors[name].mean():.1e} |"
        )
    return "\n".join(lines + [""])


FOOTER = (
    "Step times: median [min, max] over the rounds of this thread's CPU time (the step runs on one thread, so "
    "waits for a core shared with other jobs do not count) and of wall time; speedup: the median over rounds of "
    "the unpatched step's time / the variant's in the same round. `unpatched`: transformers' eager code. "
    "`reads`: `apply_attnres_kernels(model, fuse_norms=False)`, each `Inkling2BlockAttentionResidual` on the "
    "fused depth read. `reads+norms`: `apply_attnres_kernels(model)` (the default), the decoder layers' reads "
    "also fused with the RMSNorm that follows each (the output read's norm is not fused: it belongs to the text "
    "model's forward, not patched). Read shares: the median over the profiled steps (interleaved) of the share "
    "of a profiled step's wall time spent in the reads' forward plus the backward nodes their forward ops "
    'created (matched by autograd sequence number); "+ their norms" adds the RMSNorms after the reads where '
    "they run as their own modules. Block-state cats: the forward `torch.cat` of a new block (the text model's "
    "loop and, unless fused, the boundary layer's own) with its backward.\n"
)


if __name__ == "__main__":
    raise SystemExit(main())
