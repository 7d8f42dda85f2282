"""The Inkling2 sections: transformers' read module and a training step, unpatched and patched."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

import torch

from .environment import BENCHMARKS, Env, Split, failure_status


@dataclass
class Inkling2Row:
    queries: int
    partial: str
    status: str
    unpatched_ms: tuple | None = None
    patched_ms: tuple | None = None
    unpatched_saved_mib: float | None = None
    patched_saved_mib: float | None = None


def bench_inkling2_reads(env: Env) -> list:
    """One transformers ``Inkling2BlockAttentionResidual`` (Q = 1 and 3 queries over 4 committed bf16
    blocks and the partial sum, bf16 or fp32, T = 4096 tokens, D = 1024) unpatched and patched by
    ``attnres_kernels.hf.apply_attnres_kernels``: forward + backward time and the bytes autograd saves
    (``benchmarks/inkling2_read.py`` measures the same on CPU)."""
    sys.path.insert(0, BENCHMARKS)
    import inkling2_read

    tokens, dim = (8, 16) if env.dry_run else (4096, 1024)
    rows = []
    for queries in (1, 3):
        for partial_dtype in (torch.bfloat16, torch.float32):
            row = Inkling2Row(queries, str(partial_dtype).removeprefix("torch."), "ok")
            try:
                unpatched = inkling2_read.make_module(dim, queries).to(env.device)
                patched = inkling2_read.patched_copy(unpatched)
                gen = torch.Generator(env.device).manual_seed(0)
                blocks = torch.randn(1, tokens, 4, dim, device=env.device, generator=gen).bfloat16().requires_grad_()
                partial = torch.randn(1, tokens, dim, device=env.device, generator=gen).to(partial_dtype)
                partial.requires_grad_()
                for name, module in (("unpatched", unpatched), ("patched", patched)):
                    step = lambda module=module: inkling2_read.fwd_bwd(module, blocks, partial)
                    setattr(row, f"{name}_ms", env.timer(step))
                    saved = inkling2_read.saved_bytes(module, blocks, partial)
                    setattr(row, f"{name}_saved_mib", saved / 2**20)
            except Exception as exc:  # reported, the rest still runs
                row.status = failure_status(exc)
            rows.append(row)
    return rows


@dataclass
class Inkling2StepRow:
    variant: str
    status: str
    step_ms: tuple | None = None
    peak_mib: float | None = None
    loss: float | None = None
    step_split: Split | None = None


def inkling2_model_args(dry_run: bool):
    """The model of ``benchmarks/inkling2_model.py`` at GPU size (tiny in a dry run)."""

    if dry_run:
        return argparse.Namespace(hidden=32, layers=4, block=2, tokens=8, batch=1)
    return argparse.Namespace(hidden=1024, layers=8, block=3, tokens=2048, batch=4)


def bench_inkling2_model(env: Env) -> tuple:
    """An AdamW step (forward with labels, backward, step) of a random ``Inkling2ForCausalLM`` loaded in
    bf16, for each of ``inkling2_model.VARIANTS`` (reads on ``backend="auto"``) and, on a GPU, the default
    patch on the CUDA C++ kernels, one variant on the device at a time; the first step's loss is reported
    so that the variants can be compared. Returns ``(model args, rows)``."""
    import shutil
    import tempfile

    sys.path.insert(0, BENCHMARKS)
    import inkling2_model

    args = inkling2_model_args(env.dry_run)
    path = tempfile.mkdtemp(prefix="inkling2_gpu_bench_")
    rows = []
    try:
        inkling2_model.make_model(args).save_pretrained(path)
        gen = torch.Generator().manual_seed(1)
        ids = torch.randint(1, 2000, (args.batch, args.tokens), generator=gen).to(env.device)
        runs = [(name, "auto") for name in inkling2_model.VARIANTS]
        if not env.dry_run:
            runs.append(("reads+norms", "cuda"))
        for name, backend in runs:
            row = Inkling2StepRow(name if backend == "auto" else f"{name}, {backend}", "ok")
            try:
                model = inkling2_model.variant(path, name, torch.bfloat16, backend).to(env.device)
                opt = torch.optim.AdamW(model.parameters(), lr=1e-6)

                def step(model=model, opt=opt):
                    opt.zero_grad(set_to_none=True)
                    loss = model(ids, labels=ids).loss
                    loss.backward()
                    opt.step()
                    return loss

                row.loss = step().item()
                if env.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(env.device)
                row.step_ms = env.timer(step)
                if env.device.type == "cuda":
                    row.peak_mib = torch.cuda.max_memory_allocated(env.device) / 2**20
                row.step_split = env.split(step, calls=2)
            except Exception as exc:  # reported, the other variants still run
                row.status = failure_status(exc)
            model = opt = step = None  # frees this variant before the next one is loaded
            if env.device.type == "cuda":
                torch.cuda.empty_cache()
            rows.append(row)
    finally:
        shutil.rmtree(path)
    return args, rows
