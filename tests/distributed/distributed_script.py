"""Distributed training of the nn models on CPU (gloo): DDP, FSDP2 and pipeline schedules.

Run by ``tests/distributed/test_distributed.py`` in two ways: its ``spawn_worker`` under
``torch.multiprocessing`` and this file under torchrun::

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/distributed/distributed_script.py --out DIR

Each rank runs the DDP and FSDP2 checks on its half of one batch and saves what it saw —
losses, step-1 gradients and parameters after two SGD steps, gathered to full tensors —
and the pipeline checks (``PIPELINES``: PyTorch's ``ScheduleGPipe``, ``Schedule1F1B``
with one stage per rank and ``ScheduleInterleaved1F1B`` with two, on the whole batch in
``MICRO_BATCHES`` microbatches) with the per-microbatch losses of the last stage, the
gradients of the parameters of its stages and the bytes each stage sent, to
``DIR/rank{rank}.pt``; under torchrun rank 0 also prints every rank's losses as one
``RESULT {json}`` line. The test compares them with one process on the whole batch.
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
from attnres_kernels.train import exit_process

VOCAB, D, HEADS, LAYERS = 23, 16, 2, 4
BATCH, SEQ, MICRO_BATCHES, STEPS, LR = 4, 6, 4, 2, 0.5
PIPE_LAYERS = 8  # the pipeline cases: enough legal cuts for 4 stages
TIMEOUT = timedelta(seconds=60)  # every collective, send and recv fails after this instead of hanging

CASES = {
    "Standard": ("StandardTransformer", {}),
    "Full": ("FullAttnResTransformer", {"chunk_size": 4}),
    "Block-per-site": ("BlockAttnResTransformer", {"layers_per_block": 2, "schedule": "per_site"}),
    "Block-two-phase": ("BlockAttnResTransformer", {"layers_per_block": 2, "schedule": "two_phase"}),
}
MODES = ("ddp", "fsdp2", "pipeline")

# The pipeline models (PIPE_LAYERS layers): Full with every chunk size (1 .. 2L+1 sites).
PIPE_MODELS = {
    "Standard": ("StandardTransformer", {}),
    **{f"Full-chunk-{c}": ("FullAttnResTransformer", {"chunk_size": c}) for c in range(1, 2 * PIPE_LAYERS + 2)},
    "Block-per-site": ("BlockAttnResTransformer", {"layers_per_block": 2, "schedule": "per_site"}),
    "Block-two-phase": ("BlockAttnResTransformer", {"layers_per_block": 3, "schedule": "two_phase"}),
}
# Schedule name -> (class name in torch.distributed.pipelining, stages per rank).
SCHEDULES = {"gpipe": ("ScheduleGPipe", 1), "1f1b": ("Schedule1F1B", 1), "interleaved": ("ScheduleInterleaved1F1B", 2)}
# (model, schedule, cross-stage caching): 2 stages on 2 ranks; 4 stages (interleaved) where the model has the cuts.
PIPELINES = [
    ("Standard", "gpipe", True),
    ("Standard", "interleaved", True),
    *[(f"Full-chunk-{c}", "1f1b" if c % 2 else "gpipe", True) for c in range(1, 2 * PIPE_LAYERS + 2)],
    *[(f"Full-chunk-{c}", "interleaved", True) for c in (1, 2, 3, 4, 6)],
    ("Full-chunk-4", "interleaved", False),
    ("Block-per-site", "gpipe", True),
    ("Block-per-site", "1f1b", True),
    ("Block-per-site", "interleaved", True),
    ("Block-per-site", "interleaved", False),
    ("Block-two-phase", "1f1b", True),
    ("Block-two-phase", "interleaved", True),
    ("Block-two-phase", "interleaved", False),
]

# Under torch.autocast (bf16): the embedding crosses in fp32, the sublayer outputs in bf16.
AUTOCAST_PIPELINES = [("Full-chunk-4", "interleaved", True), ("Block-two-phase", "1f1b", True)]


def pipeline_key(case: str, schedule: str, cache: bool, autocast: bool = False) -> str:
    return f"pipeline/{case}/{schedule}" + ("" if cache else "/no-cache") + ("/autocast" if autocast else "")


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


def make_pipe_model(case: str):
    cls, kwargs = PIPE_MODELS[case]
    return build_model(cls, PIPE_LAYERS, **kwargs)


def run_pipeline(case, schedule, cache, idx, targets, autocast=False):
    """One training step of ``schedule`` over the pipeline stages of this rank, driven as
    PyTorch documents it: ``step(idx)`` on the rank of the first stage,
    ``step(target=..., losses=...)`` on that of the last. Returns the per-microbatch losses
    (last rank), the gradients of the parameters of this rank's stages (by the names of
    ``model.named_parameters()``), what each stage received and the bytes it sent."""
    from torch.distributed import pipelining

    class_name, per_rank = SCHEDULES[schedule]
    model = make_pipe_model(case)
    rank, world = dist.get_rank(), dist.get_world_size()
    num_stages = world * per_rank
    stages = model.pipeline_stages(range(rank, num_stages, world), num_stages, "cpu", cache=cache)
    schedule_class = getattr(pipelining, class_name)
    if per_rank == 1:
        runner = schedule_class(stages[0], MICRO_BATCHES, loss_fn=loss_fn)
    else:
        runner = schedule_class(stages, MICRO_BATCHES, loss_fn=loss_fn)
    losses = []
    first, last = any(s.is_first for s in stages), any(s.is_last for s in stages)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if first and last:
            runner.step(idx, target=targets, losses=losses)
        elif first:
            runner.step(idx)
        elif last:
            runner.step(target=targets, losses=losses)
        else:
            runner.step()
    grads = {}
    for stage in stages:
        for name, p in stage.submod.named_parameters():
            grads[name] = p.grad.clone()
    return {
        "losses": [loss.item() for loss in losses],
        "grads": grads,
        "stages": {
            s.stage_index: {
                "received": s.submod.received,
                "kept": s.submod.kept,
                "layers": [int(i) for i in s.submod.layers],
                "sent_bytes": s.sent_bytes,
                "dtypes": [] if s.is_first else [info.buffer.dtype for info in s.args_recv_info[0]],
            }
            for s in stages
        },
    }


RUNNERS = {"ddp": run_ddp, "fsdp2": run_fsdp2}


def run_checks(cases, modes, out_dir, pipelines=PIPELINES, autocast_pipelines=AUTOCAST_PIPELINES) -> dict:
    """Runs every ``mode`` on every ``case`` (the pipeline mode: every entry of ``pipelines``) in the
    current process group; saves and returns the results."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)  # two ranks share the machine's cores
    idx, targets = make_batch()
    results = {}
    for mode in modes:
        if mode == "pipeline":
            try:  # 4 stages on 2 ranks in the wrong placement for cross-stage caching
                make_pipe_model("Block-per-site").pipeline_stages([rank], 2 * world, "cpu")
            except ValueError as error:
                results["pipeline/placement-error"] = {"error": str(error), "losses": []}
            for case, schedule, cache in pipelines:
                result = run_pipeline(case, schedule, cache, idx, targets)
                results[pipeline_key(case, schedule, cache)] = {**result, "world_size": world}
            for case, schedule, cache in autocast_pipelines:
                result = run_pipeline(case, schedule, cache, idx, targets, autocast=True)
                results[pipeline_key(case, schedule, cache, True)] = {**result, "world_size": world}
            continue
        for case in cases:
            result = RUNNERS[mode](case, idx.chunk(world)[rank], targets.chunk(world)[rank])
            results[f"{mode}/{case}"] = {**result, "world_size": world}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    return results


def spawn_worker(rank: int, world: int, store_path: str, cases, modes, out_dir, pipelines=PIPELINES) -> None:
    """Entry point of ``torch.multiprocessing.spawn``: a gloo group over a FileStore."""
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        run_checks(cases, modes, out_dir, [tuple(p) for p in pipelines])
    finally:
        dist.destroy_process_group()
    exit_process(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for the per-rank result files")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=TIMEOUT)  # env:// from torchrun
    try:
        pipelines = [p for p in PIPELINES if p[0] in args.cases]
        results = run_checks(args.cases, args.modes, args.out, pipelines, [])
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
    exit_process(0)
