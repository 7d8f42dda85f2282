"""Bytes crossing each pipeline boundary per microbatch (Full vs Block, with and without
cross-stage caching) and train-step times of the pipeline schedules, on 2 gloo CPU ranks.

    python benchmarks/pipeline_boundary.py [--d-model 128] [--layers 8] [--seq 32] [--micro-batch 2] [--steps 5]

Spawns 2 ranks; for each model (Full with chunks of 1 and 4 sites, Block with 2 layers per
block in both schedules, Standard) runs ``ScheduleInterleaved1F1B`` with 4 stages (2 per
rank; balanced cuts) with and without cross-stage caching and ``Schedule1F1B`` with 2
stages, and prints, per boundary, the forward bytes each stage sent per microbatch
(``stage.sent_bytes``; the gradients sent back are as many) next to the layout's formula
``tensors x b x T x D x 4`` (fp32): Full ``1 + 2c`` tensors at cut ``c``, Block
``ceil(c / S) + 1``, minus, with caching, the tensors the receiving rank already holds.
Then the median step time (wall clock, 1 thread per rank) of each schedule next to one
process training the same model on the same batch. The machine is shared: compare ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import attnres_kernels as ak

WORLD = 2
VOCAB, HEADS = 64, 4
MODELS = {
    "Standard": ("StandardTransformer", {}),
    "Full:1": ("FullAttnResTransformer", {"chunk_size": 1}),
    "Full:4": ("FullAttnResTransformer", {"chunk_size": 4}),
    "Block:per_site": ("BlockAttnResTransformer", {"layers_per_block": 2, "schedule": "per_site"}),
    "Block:two_phase": ("BlockAttnResTransformer", {"layers_per_block": 2, "schedule": "two_phase"}),
}
RUNS = [("interleaved", True), ("interleaved", False), ("1f1b", True)]


def make(name, args):
    cls, kwargs = MODELS[name]
    torch.manual_seed(0)
    return getattr(ak.nn, cls)(VOCAB, args.d_model, args.layers, HEADS, backend="cpu", **kwargs)


def batch(args):
    g = torch.Generator().manual_seed(1)
    shape = (args.micro_batch * args.microbatches, args.seq)
    return torch.randint(0, VOCAB, shape, generator=g), torch.randint(0, VOCAB, shape, generator=g)


def loss_fn(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def one_process_times(name, args) -> list:
    model = make(name, args)
    idx, targets = batch(args)
    times = []
    for _ in range(args.steps + 1):
        start = time.perf_counter()
        loss_fn(model(idx), targets).backward()
        times.append(time.perf_counter() - start)
    return times[1:]


def pipeline_run(name, schedule, cache, args) -> dict:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B

    model = make(name, args)
    rank = dist.get_rank()
    per_rank = 2 if schedule == "interleaved" else 1
    num_stages = WORLD * per_rank
    stages = model.pipeline_stages(range(rank, num_stages, WORLD), num_stages, "cpu", cache=cache)
    if per_rank == 1:
        runner = Schedule1F1B(stages[0], args.microbatches, loss_fn=loss_fn)
    else:
        runner = ScheduleInterleaved1F1B(stages, args.microbatches, loss_fn=loss_fn)
    idx, targets = batch(args)
    times = []
    for _ in range(args.steps + 1):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            runner.step(idx)
        else:
            runner.step(target=targets, losses=[])
        dist.barrier()
        times.append(time.perf_counter() - start)
    info = {
        s.stage_index: {"bytes": s.sent_bytes["forward"].get(0, 0), "start": s.submod.plan.start, "kept": s.submod.kept}
        for s in stages
    }
    return {"times": times[1:], "stages": info}


def worker(rank, store_path, args, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD)
    try:
        results = {}
        for name in MODELS:
            for schedule, cache in RUNS:
                results[(name, schedule, cache)] = pipeline_run(name, schedule, cache, args)
        gathered = [None] * WORLD
        dist.all_gather_object(gathered, results)
        if rank == 0:
            torch.save(gathered, Path(out) / "results.pt")
    finally:
        dist.destroy_process_group()


def formula_tensors(model, cut: int, kept: int) -> int:
    if isinstance(model, ak.nn.StandardTransformer):
        return 1
    if isinstance(model, ak.nn.FullAttnResTransformer):
        return 1 + 2 * cut - kept
    return (0 if cut == 0 else -(-cut // model.layers_per_block)) + 1 - kept


def main(argv=None) -> int:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(worker, args=(str(Path(tmp) / "store"), args, tmp), nprocs=WORLD, start_method="spawn")
        gathered = torch.load(Path(tmp) / "results.pt")
    torch.set_num_threads(1)
    row = args.micro_batch * args.seq * args.d_model * 4
    print(
        f"d={args.d_model}, L={args.layers}, microbatch {args.micro_batch} x {args.seq} tokens: one fp32 tensor "
        f"= {row} B; forward bytes per microbatch sent into each stage (as many gradient bytes come back)\n"
    )
    print("| model | schedule | caching | into stage 1 | into stage 2 | into stage 3 | formula (tensors) |")
    print("|---|---|---|---|---|---|---|")
    for name in MODELS:
        model = make(name, args)
        for schedule, cache in RUNS:
            stages = {i: s for g in gathered for i, s in g[(name, schedule, cache)]["stages"].items()}
            cells, formula = [], []
            for s in range(1, len(stages)):
                sent = stages[s - 1]["bytes"]
                tensors = formula_tensors(model, stages[s]["start"], len(stages[s]["kept"]))
                assert sent == tensors * row, (name, schedule, cache, s, sent, tensors * row)
                cells.append(f"{sent:,}")
                formula.append(str(tensors))
            cells += ["-"] * (3 - len(cells))
            print(
                f"| {name} | {schedule} | {'yes' if cache else 'no'} | "
                + " | ".join(cells)
                + f" | {', '.join(formula)} |"
            )
    print(
        "\nmedian step time (ms), wall clock, 1 thread per rank; one process = the same batch in one forward/backward\n"
    )
    print("| model | one process | " + " | ".join(f"{s}{'' if c else ' (no cache)'}" for s, c in RUNS) + " |")
    print("|---|---|" + "---|" * len(RUNS))
    for name in MODELS:
        one = statistics.median(one_process_times(name, args)) * 1e3
        cells = [f"{statistics.median(gathered[0][(name, s, c)]['times']) * 1e3:.1f}" for s, c in RUNS]
        print(f"| {name} | {one:.1f} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
