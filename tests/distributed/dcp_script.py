"""Distributed checkpoints (``torch.distributed.checkpoint``) of the nn models under FSDP2 on CPU (gloo).

Run by ``tests/distributed/test_dcp.py`` through ``spawn_worker`` under ``torch.multiprocessing``.
For each case, every rank (FSDP2 over ``model.shard_units()`` and the root, each rank on
its half of every batch, AdamW):

1. trains ``STEPS`` steps without interruption;
2. trains a fresh model ``SAVE_AT`` steps and saves model and optimizer state with DCP
   (``get_state_dict``, optimizer state keyed by parameter name);
3. builds another fresh model and optimizer with other initial values, loads the
   checkpoint (``dcp.load`` + ``set_state_dict``) and trains the remaining steps.

It saves the losses (mean over the ranks) of 1. and 3. and the parameters at the end to
``DIR/rank{rank}.pt``; the checkpoint of each case stays in ``DIR/ckpt-{case}``. The test
resumes the same checkpoint in one process (:func:`resume`) and evaluates it with the
reference model. Not collected by pytest.
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

import attnres_kernels as ak
from attnres_kernels.train import exit_process

VOCAB, D, HEADS, LAYERS = 23, 16, 2, 4
BATCH, SEQ, STEPS, SAVE_AT, LR = 4, 6, 4, 2, 1e-2
TIMEOUT = timedelta(seconds=60)
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)  # optimizer state by parameter name

CASES = {
    "Full-chunked": ("FullAttnResTransformer", {"chunk_size": 4}),
    "Block-two-phase": ("BlockAttnResTransformer", {"layers_per_block": 2, "schedule": "two_phase"}),
}


def make_model(case: str, seed: int = 0):
    cls, kwargs = CASES[case]
    torch.manual_seed(seed)
    model = getattr(ak.nn, cls)(VOCAB, D, LAYERS, HEADS, backend="cpu", **kwargs)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def make_reference(case: str):
    """The plain-PyTorch reference model of the case (same parameter names)."""
    from attnres_kernels.reference import models as ref

    cls, kwargs = CASES[case]
    kwargs = {k: v for k, v in kwargs.items() if k == "layers_per_block"}
    return getattr(ref, cls)(VOCAB, D, LAYERS, HEADS, **kwargs)


def batch(step: int):
    generator = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return idx, torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def loss_of(model, idx, targets):
    return torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), targets.flatten())


def train(model, optimizer, steps) -> list:
    """Steps ``steps`` (indices of the batches); on a group of ranks each takes its share of
    every batch. Returns the losses (mean over the ranks)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    losses = []
    for step in steps:
        idx, targets = (t.chunk(world)[rank] for t in batch(step))
        optimizer.zero_grad()
        loss = loss_of(model, idx, targets)
        loss.backward()
        optimizer.step()
        loss = loss.detach().clone()
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
        losses.append(loss.item())
    return losses


def optimizer_of(model):
    return torch.optim.AdamW(model.parameters(), lr=LR)


def sharded(case: str, seed: int = 0):
    from torch.distributed.fsdp import fully_shard

    model = make_model(case, seed)
    for unit in model.shard_units():
        fully_shard(unit)
    fully_shard(model)
    return model, optimizer_of(model)


def load(model, optimizer, path) -> None:
    """Loads a checkpoint into ``model`` and ``optimizer`` (any layout)."""
    model_state, optim_state = get_state_dict(model, optimizer, options=OPTIONS)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"], options=OPTIONS)


def resume(case: str, path) -> list:
    """One process, no process group: a plain model and optimizer loaded from the checkpoint
    train the remaining steps on the whole batches."""
    model = make_model(case, seed=1)
    optimizer = optimizer_of(model)
    load(model, optimizer, path)
    return train(model, optimizer, range(SAVE_AT, STEPS))


def params_of(model) -> dict:
    full = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in model.named_parameters()}
    return {n: p.detach().clone() for n, p in full.items()}


def run_case(case: str, out_dir: Path) -> dict:
    model, optimizer = sharded(case)
    uninterrupted = train(model, optimizer, range(STEPS))
    final = params_of(model)

    model, optimizer = sharded(case)
    before = train(model, optimizer, range(SAVE_AT))
    path = out_dir / f"ckpt-{case}"
    model_state, optim_state = get_state_dict(model, optimizer, options=OPTIONS)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(path))

    model, optimizer = sharded(case, seed=1)  # other initial values: the checkpoint must set them all
    load(model, optimizer, path)
    after = train(model, optimizer, range(SAVE_AT, STEPS))
    resumed_final = params_of(model)
    return {"uninterrupted": uninterrupted, "resumed": before + after, "final": final, "resumed_final": resumed_final}


def spawn_worker(rank: int, world: int, store_path: str, cases, out_dir) -> None:
    torch.set_num_threads(1)  # the ranks share the machine's cores
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        with warnings.catch_warnings():  # FSDP2 warns that layers return (pass-through) views
            warnings.simplefilter("ignore", UserWarning)
            results = {case: run_case(case, Path(out_dir)) for case in cases}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    exit_process(0)  # past gloo's abort at interpreter exit (attnres_kernels.train.exit_process)
