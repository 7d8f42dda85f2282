"""The training-step section: Standard, Full and Block AttnRes models, one AdamW step each."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

import attnres_kernels as ak

from .environment import Env, Split, failure_status


@dataclass(frozen=True)
class ModelConfig:
    vocab: int
    d_model: int
    layers: int
    heads: int
    seq: int
    batch: int
    layers_per_block: int


def model_config(dry_run: bool, batch: int) -> ModelConfig:
    if dry_run:
        return ModelConfig(vocab=32, d_model=16, layers=2, heads=2, seq=4, batch=1, layers_per_block=1)
    return ModelConfig(vocab=32000, d_model=1024, layers=12, heads=16, seq=1024, batch=batch, layers_per_block=2)


def build_model(name: str, cfg: ModelConfig, backend: str) -> torch.nn.Module:
    # Every model, whatever its depth-read backend, runs the same attention: the attention op's own "auto" choice
    # (SDPA on a GPU where it is faster), so the rows compare the residual schemes alone.
    common = dict(
        vocab_size=cfg.vocab,
        d_model=cfg.d_model,
        n_layers=cfg.layers,
        n_heads=cfg.heads,
        backend=backend,
        attention_backend="auto",
    )
    if name == "Standard":
        return ak.nn.StandardTransformer(**common)
    if name == "Full":
        return ak.nn.FullAttnResTransformer(**common)
    return ak.nn.BlockAttnResTransformer(**common, layers_per_block=cfg.layers_per_block)


@dataclass
class ModelRow:
    model: str
    depth_read: str
    status: str
    step_ms: tuple | None = None
    tokens_per_s: float | None = None
    peak_mib: float | None = None
    step_split: Split | None = None


def _train_step(name: str, cfg: ModelConfig, backend: str, device: torch.device, graphed: bool = False) -> Callable:
    """One AdamW step of a fresh model on a fixed batch, under bf16 autocast. ``graphed``: the model's
    forward and backward captured by ``torch.cuda.make_graphed_callables`` (autocast without its cast
    cache, as capture requires), the loss and the AdamW step eager."""
    torch.manual_seed(0)
    model = build_model(name, cfg, backend).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), device=device)
    inputs = idx[:, :-1].contiguous()
    autocast = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16, cache_enabled=not graphed)
    if graphed:
        with autocast():
            model = torch.cuda.make_graphed_callables(model, (inputs,))

    def step():
        with autocast():
            logits = model(inputs)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), idx[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def bench_models(cfg: ModelConfig, env: Env) -> list:
    """One AdamW step per model and depth-read backend, under bf16 autocast. The fused reads use
    ``backend="auto"`` on a GPU, and ``"cuda"`` (the C++ kernels) beside it; a dry run asks for
    ``"triton"`` (the interpreter), the backend "auto" picks on a GPU. The models' attention follows
    their ``backend``, except in the ``"cuda"`` rows, whose attention runs on Triton (:func:`build_model`)."""
    fused = "triton" if env.dry_run else "auto"
    runs = [("Standard", fused), ("Full", fused), ("Full", "reference"), ("Block", fused), ("Block", "reference")]
    runs = [(name, backend, False) for name, backend in runs]
    if not env.dry_run:  # the CUDA C++ reads: fewer host µs per call than Triton's, more device time
        runs[3:3] = [("Full", "cuda", False)]
        runs.append(("Block", "cuda", False))
    if env.device.type == "cuda":  # the steps are host-bound: the same steps replayed from CUDA graphs
        runs += [(name, fused, True) for name in ("Standard", "Full", "Block")]
    rows = []
    for name, backend, graphed in runs:
        row = ModelRow(f"{name}, CUDA graph" if graphed else name, "-" if name == "Standard" else backend, "ok")
        try:
            if backend != "reference" and name != "Standard":
                row.depth_read = ak.ops.resolve_backend(backend, env.device, cfg.d_model, torch.bfloat16)
            step = _train_step(name, cfg, backend, env.device, graphed)
            if env.device.type == "cuda":  # (a dry run's times mean nothing: no warm-up step)
                step()
                torch.cuda.reset_peak_memory_stats(env.device)
            row.step_ms = env.timer(step)
            row.tokens_per_s = cfg.batch * cfg.seq / row.step_ms[0] * 1e3
            if env.device.type == "cuda":
                row.peak_mib = torch.cuda.max_memory_allocated(env.device) / 2**20
            row.step_split = env.split(step, calls=2)
            step = None  # frees the model before the next one is built
        except Exception as exc:  # e.g. out of memory on a small GPU: reported, the rest still runs
            row.status = failure_status(exc)
        rows.append(row)
        if env.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows
