"""Distributed training of the nn models on CPU (gloo): DDP, FSDP2 and a 2-stage pipeline.

Run by ``tests/test_distributed.py`` in two ways: its ``spawn_worker`` under
``torch.multiprocessing`` and this file under torchrun::

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/distributed_script.py --out DIR

Each rank runs the checks on its half of one batch (the pipeline: stage ``rank``
on the whole batch in two micro-batches) and saves what it saw — losses,
step-1 gradients and parameters after two SGD steps, gathered to full tensors —
to ``DIR/rank{rank}.pt``; under torchrun rank 0 also prints every rank's losses as one
``RESULT {json}`` line.
The test compares them with :func:`train` run by one process on the whole batch.
Not collected by pytest (no ``test_`` prefix).
"""

from __future__ import annotations

import argparse
import json
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import attnres_kernels as ak

VOCAB, D, HEADS, LAYERS = 23, 16, 2, 4
BATCH, SEQ, MICRO_BATCHES, STEPS, LR = 4, 6, 2, 2, 0.5
TIMEOUT = timedelta(seconds=60)  # every collective, send and recv fails after this instead of hanging

CASES = {
    "Standard": ("StandardTransformer", {}),
    "Full": ("FullAttnResTransformer", {"chunk_size": 4}),
    "Block-per-site": ("BlockAttnResTransformer", {"layers_per_block": 2, "schedule": "per_site"}),
    "Block-two-phase": ("BlockAttnResTransformer", {"layers_per_block": 2, "schedule": "two_phase"}),
}
MODES = ("ddp", "fsdp2", "pipeline")


def make_model(case: str):
    """The case's model (fused "cpu" backend), the same in every process."""
    cls, kwargs = CASES[case]
    return build_model(cls, LAYERS, **kwargs)


def build_model(cls: str, n_layers: int, **kwargs):
    """``ak.nn.<cls>`` with seeded random parameters, perturbed so that no site reads the plain
    mean of its sources (zero-initialized queries)."""
    torch.manual_seed(0)
    model = getattr(ak.nn, cls)(VOCAB, D, n_layers, HEADS, backend="cpu", **kwargs)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def make_batch():
    generator = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return idx, torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _full(t):
    """The whole tensor of an FSDP2 (DTensor) parameter or gradient (a collective), else ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _mean_over_ranks(loss):
    if dist.is_initialized():
        loss = loss.clone()
        dist.all_reduce(loss)
        loss /= dist.get_world_size()
    return loss.item()


def train(model, forward, idx, targets) -> dict:
    """``STEPS`` SGD steps of ``forward`` (``model`` or its DDP/FSDP2 wrapping) on ``(idx, targets)``:
    the losses (mean over ranks), the gradients of step 1 and the parameters after the last step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        loss = loss_fn(forward(idx), targets)
        loss.backward()
        if step == 0:
            grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
        optimizer.step()
        losses.append(_mean_over_ranks(loss.detach()))
    params = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params, "local_batch": idx.shape[0]}


def run_ddp(case, idx, targets):
    from torch.nn.parallel import DistributedDataParallel

    model = make_model(case)
    return train(model, DistributedDataParallel(model), idx, targets)


def run_fsdp2(case, idx, targets):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_model(case)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for unit in model.shard_units():
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    local = sum(p.to_local().numel() for p in model.parameters())
    with warnings.catch_warnings():  # FSDP2 warns that layers return (pass-through) views
        warnings.simplefilter("ignore", UserWarning)
        result = train(model, model, idx, targets)
    return {**result, "local_numel": local, "numel": sum(p.numel() for p in result["params"].values())}


def run_pipeline(case, idx, targets):
    """Stage 0 (rank 0): embedding + ``layers[:cut]``; stage 1 (rank 1): ``layers[cut:]`` + head.
    The depth state crosses as :func:`attnres_kernels.nn.pack_boundary`'s list, gradients come
    back in the same order. Micro-batches run one after the other; their gradients accumulate.
    Returns the stage's loss (stage 1) and the gradients of the parameters the stage used."""
    model = make_model(case)
    cut = min(ak.nn.pipeline_cuts(model), key=lambda c: abs(c - LAYERS // 2))
    stage = dist.get_rank()
    total = 0.0
    for mb_idx, mb_targets in zip(idx.chunk(MICRO_BATCHES), targets.chunk(MICRO_BATCHES)):
        if stage == 0:
            state = model.initial_state(model.embed(mb_idx))
            for layer in model.layers[:cut]:
                state = layer(state)
            sent = ak.nn.pack_boundary(model, cut, state)
            for t in sent:
                dist.send(t.detach().contiguous(), dst=1)
            grads = [torch.empty_like(t) for t in sent]
            for g in grads:
                dist.recv(g, src=1)
            torch.autograd.backward(sent, grads)
        else:
            received = [torch.empty(*mb_idx.shape, D) for _ in ak.nn.boundary_layout(model, cut)]
            for t in received:
                dist.recv(t, src=0)
                t.requires_grad_()
            state = ak.nn.unpack_boundary(model, cut, received)
            for layer in model.layers[cut:]:
                state = layer(state)
            loss = loss_fn(model.logits(state), mb_targets) / MICRO_BATCHES
            loss.backward()
            for t in received:
                dist.send(t.grad if t.grad is not None else torch.zeros_like(t), dst=0)
            total += loss.item()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return {"losses": [total] if stage == 1 else [], "grads": grads, "cut": cut}


RUNNERS = {"ddp": run_ddp, "fsdp2": run_fsdp2, "pipeline": run_pipeline}


def run_checks(cases, modes, out_dir) -> dict:
    """Runs every ``mode`` on every ``case`` in the current process group; saves and returns the results."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # two ranks share the machine's cores
    idx, targets = make_batch()
    results = {}
    for mode in modes:
        for case in cases:
            if mode == "pipeline":
                result = RUNNERS[mode](case, idx, targets)
            else:
                result = RUNNERS[mode](case, idx.chunk(world)[rank], targets.chunk(world)[rank])
            results[f"{mode}/{case}"] = {**result, "world_size": world}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    return results


def spawn_worker(rank: int, world: int, store_path: str, cases, modes, out_dir) -> None:
    """Entry point of ``torch.multiprocessing.spawn``: a gloo group over a FileStore."""
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        run_checks(cases, modes, out_dir)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the per-rank result files")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=TIMEOUT)  # env:// from torchrun
    try:
        results = run_checks(args.cases, args.modes, args.out)
        losses = {key: r["losses"] for key, r in results.items()}
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, losses)
        if dist.get_rank() == 0:
            per_rank = {key: [rank_losses[key] for rank_losses in gathered] for key in losses}
            print("RESULT " + json.dumps({"world_size": dist.get_world_size(), "losses": per_rank}), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
