"""Train an nn model on the demo's sentence pairs with data, fully sharded, tensor and pipeline parallelism.

One process (``python -m attnres_kernels.train``) or one per device under torchrun::

    torchrun --standalone --nproc-per-node 4 -m attnres_kernels.train --fsdp 2 --pp 2 --schedule interleaved

The ranks form a device mesh ``(pp, dp, fsdp, tp)`` (the product of the degrees is the number
of processes; ``tp`` varies fastest):

- ``--pp``: the model is cut into pipeline stages (``model.pipeline_stages``, cuts balanced
  over the legal ones) and run by PyTorch's ``--schedule``: ``gpipe`` / ``1f1b`` (one stage
  per rank) or ``interleaved`` (``--stages-per-rank`` stages per rank, with cross-stage
  caching unless ``--no-cross-stage-cache``), on ``--microbatches`` microbatches per step;
- ``--dp`` (replicas) and ``--fsdp`` (shards): FSDP2 over ``model.shard_units()`` and the
  root of each stage, on the 2-D ``(dp, fsdp)`` mesh (HSDP: parameters sharded over
  ``fsdp``, replicated and gradient-averaged over ``dp``); each of the ``dp * fsdp`` data
  ranks trains on its slice of the batch;
- ``--tp``: the tensor-parallel plan ``attnres_kernels.nn.tensor_parallel_plan(model)``
  applied with ``parallelize_module`` on the ``tp`` mesh before the other wrappers.

The batch is the demo's (``zh <sep> en <eos>`` sequences, loss on the English half),
every sequence padded to the longest pair so that every step has the same shape (the
pipeline stages learn their shapes once). The loss of a step is the mean over the target
tokens of the whole batch on every layout, so any layout trains like one process (to
fp32 round-off). AdamW with cosine decay as the demo; the epoch order of the pairs
depends only on ``--seed`` and the epoch.

Writes to ``--out``: ``loss.jsonl`` (one line per step: step, epoch, loss, lr, seconds)
and ``checkpoints/step-<N>`` (DCP, every ``--checkpoint-every`` steps and at the end:
model and optimizer state by the model's parameter names, so a checkpoint loads into
any other layout, and the step). ``--resume`` continues from the newest checkpoint.
Rank 0 shows a progress bar.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

import attnres_kernels as ak
from attnres_kernels import demo

MODELS = ("standard", "full", "block")
SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}
MESH_DIMS = ("pp", "dp", "fsdp", "tp")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_argument_group("model (default: the demo's)")
    model.add_argument("--model", default="block", choices=MODELS)
    model.add_argument("--d-model", type=int, default=128)
    model.add_argument("--layers", type=int, default=6)
    model.add_argument("--heads", type=int, default=4)
    model.add_argument("--blocks", type=int, default=3, help="Block AttnRes: blocks (layers must divide evenly)")
    model.add_argument("--block-schedule", default=ak.nn.DEFAULT_BLOCK_SCHEDULE, choices=("per_site", "two_phase"))
    model.add_argument("--chunk-size", type=int, default=ak.nn.DEFAULT_CHUNK_SIZE, help="Full AttnRes: sites per chunk")
    model.add_argument("--backend", default="auto", choices=ak.BACKENDS, help="depth-attention backend")
    train = parser.add_argument_group("training")
    train.add_argument("--epochs", type=int, default=300)
    train.add_argument("--steps", type=int, default=None, help="total optimizer steps (default: --epochs worth)")
    train.add_argument("--batch-size", type=int, default=10, help="sequences per step, over all data ranks")
    train.add_argument("--lr", type=float, default=3e-3)
    train.add_argument("--seed", type=int, default=0)
    par = parser.add_argument_group("parallelism (their product is the number of processes)")
    for dim in ("dp", "fsdp", "tp", "pp"):
        par.add_argument(f"--{dim}", type=int, default=1, help=f"{dim} degree")
    par.add_argument("--schedule", default="1f1b", choices=list(SCHEDULES), help="pipeline schedule (--pp > 1)")
    par.add_argument("--stages-per-rank", type=int, default=None, help="pipeline stages per rank (interleaved: 2)")
    par.add_argument("--microbatches", type=int, default=None, help="per step and data rank (default: the stages)")
    par.add_argument("--no-cross-stage-cache", action="store_true", help="send the whole depth state at every cut")
    out = parser.add_argument_group("output")
    out.add_argument("--out", default="train_out", help="folder for loss.jsonl and checkpoints/")
    out.add_argument(
        "--checkpoint-every", type=int, default=100, help="steps between DCP checkpoints (0: only the last)"
    )
    out.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    args = parser.parse_args(argv)
    if args.stages_per_rank is None:
        args.stages_per_rank = 2 if args.schedule == "interleaved" else 1
    if args.schedule != "interleaved" and args.stages_per_rank != 1:
        parser.error(f"--schedule {args.schedule} runs one stage per rank; use --schedule interleaved")
    if args.pp > 1 and args.microbatches is None:
        args.microbatches = args.pp * args.stages_per_rank
    return args


# ------------------------------------------------------------------------------ setup


def init_distributed(args) -> tuple:
    """The process group (torchrun's env://, or one process alone), the device and the mesh."""
    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        else:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    degrees = tuple(getattr(args, dim) for dim in MESH_DIMS)
    world = dist.get_world_size()
    if math.prod(degrees) != world:
        sizes = " x ".join(f"{d}={n}" for d, n in zip(MESH_DIMS, degrees))
        raise SystemExit(f"the degrees ({sizes}) need {math.prod(degrees)} processes, got {world}")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, degrees, mesh_dim_names=MESH_DIMS)
    return device, mesh


def build_model(args, vocab: int) -> nn.Module:
    common = dict(
        vocab_size=vocab, d_model=args.d_model, n_layers=args.layers, n_heads=args.heads, backend=args.backend
    )
    if args.model == "standard":
        return ak.nn.StandardTransformer(**common)
    if args.model == "full":
        return ak.nn.FullAttnResTransformer(**common, chunk_size=args.chunk_size)
    if args.layers % args.blocks:
        raise SystemExit(f"--layers {args.layers} does not divide into --blocks {args.blocks}")
    return ak.nn.BlockAttnResTransformer(
        **common, layers_per_block=args.layers // args.blocks, schedule=args.block_schedule
    )


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> None:
    """``parallelize_module(model, tp_mesh, attnres_kernels.nn.tensor_parallel_plan(model))``."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, tp_mesh, ak.nn.tensor_parallel_plan(model))


class LocalParts(nn.Module):
    """The modules of this rank's pipeline stages under the model's names (``embed``,
    ``layers.<i>``, ``out_site``, ``final_norm``, ``head``, those it holds): what its
    optimizer steps and its checkpoint shards hold."""

    def __init__(self, submodules):
        super().__init__()
        layers = {}
        for submodule in submodules:
            for name, child in submodule.named_children():
                if name == "layers":
                    layers.update(child.items())
                else:
                    self.add_module(name, child)
        self.layers = nn.ModuleDict(sorted(layers.items(), key=lambda item: int(item[0])))


def shard(module: nn.Module, units, mesh) -> None:
    """FSDP2: each shard unit whose layers ``module`` holds, then ``module`` itself."""
    from torch.distributed.fsdp import fully_shard

    held = {id(m) for m in module.modules()}
    for unit in units:
        if all(id(layer) in held for layer in unit):
            fully_shard(unit, mesh=mesh)
    fully_shard(module, mesh=mesh)


class Trainer:
    """The model as this rank runs it: the whole model (no pipeline) or its pipeline stages
    under a schedule, wrapped for the data ranks; ``step`` runs one optimizer step."""

    def __init__(self, args, vocab: int, device, mesh):
        self.args, self.device, self.mesh = args, device, mesh
        torch.manual_seed(args.seed)
        model = build_model(args, vocab).to(device)
        if args.tp > 1:
            apply_tensor_parallel(model, mesh["tp"])
        self.data_ranks = args.dp * args.fsdp
        data_mesh = mesh["dp", "fsdp"] if args.dp > 1 else mesh["fsdp"]
        self.pipelined = args.pp > 1
        self.n_tokens = 1  # target tokens of the whole batch of the current step (set by `step`)
        if self.pipelined:
            self._build_pipeline(model, data_mesh)
        else:
            if self.data_ranks > 1:
                shard(model, model.shard_units(), data_mesh)
            self.parts, self.first, self.last = model, True, True
        self.model = model
        self.optimizer = torch.optim.AdamW(self.parts.parameters(), lr=args.lr)

    def _build_pipeline(self, model, data_mesh) -> None:
        from torch.distributed import pipelining

        args = self.args
        pp_rank = self.mesh["pp"].get_local_rank()
        num_stages = args.pp * args.stages_per_rank
        indices = range(pp_rank, num_stages, args.pp)
        group = self.mesh["pp"].get_group()
        stages = model.pipeline_stages(
            indices, num_stages, self.device, group=group, cache=not args.no_cross_stage_cache
        )
        if self.data_ranks > 1:
            for stage in stages:
                shard(stage.submod, model.shard_units(), data_mesh)
        schedule_class = getattr(pipelining, SCHEDULES[args.schedule])
        target = stages if args.schedule == "interleaved" else stages[0]
        # The loss is already normalized by the whole batch's tokens: no division by the microbatches.
        self.schedule = schedule_class(target, args.microbatches, loss_fn=self._loss, scale_grads=False)
        self.stages = stages
        self.parts = LocalParts([stage.submod for stage in stages])
        self.first = any(stage.is_first for stage in stages)
        self.last = any(stage.is_last for stage in stages)

    def _loss(self, logits, targets):
        """Summed cross entropy over the global batch's target tokens, times the data ranks
        (whose gradients FSDP averages): the batch mean on every layout."""
        if hasattr(logits, "full_tensor"):  # a DTensor from a tensor-parallel head
            logits = logits.full_tensor()
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction="sum")
        return loss * (self.data_ranks / self.n_tokens)

    def step(self, x, y, lr: float) -> float:
        """One optimizer step on the whole batch ``(x, y)`` (every rank has it; each data rank
        trains on its slice). Returns the batch's mean loss (on every rank)."""
        data_rank = self.mesh["dp"].get_local_rank() * self.args.fsdp + self.mesh["fsdp"].get_local_rank()
        self.n_tokens = int((y != -100).sum())
        x = x.chunk(self.data_ranks)[data_rank].to(self.device)
        y = y.chunk(self.data_ranks)[data_rank].to(self.device)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        if self.pipelined:
            losses = []
            if self.first and self.last:
                self.schedule.step(x, target=y, losses=losses)
            elif self.first:
                self.schedule.step(x)
            elif self.last:
                self.schedule.step(target=y, losses=losses)
            else:
                self.schedule.step()
            local = torch.stack(losses).sum().detach() if self.last else torch.zeros((), device=self.device)
        else:
            loss = self._loss(self.model(x), y)
            loss.backward()
            local = loss.detach()
        self.optimizer.step()
        # Every rank of the last stage holds its data rank's share (tensor-parallel ranks repeat it).
        total = (local.float() / (self.data_ranks * self.args.tp)).reshape(1)
        dist.all_reduce(total)
        return total.item()

    # ---------------------------------------------------------------- checkpoints

    def save(self, path: Path, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        model_state, optim_state = self._state_dicts()
        dcp.save({"model": model_state, "optim": optim_state, "train": {"step": step}}, checkpoint_id=str(path))

    def load(self, path: Path) -> int:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        model_state, optim_state = self._state_dicts()
        state = {"model": model_state, "optim": optim_state, "train": {"step": 0}}
        dcp.load(state, checkpoint_id=str(path))
        set_state_dict(
            self.parts,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
            options=self._state_dict_options(),
        )
        return int(state["train"]["step"])

    @staticmethod
    def _state_dict_options():
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        # The optimizer's state and hyperparameters keyed by parameter name (not by group
        # position), so that a checkpoint loads into any other layout.
        return StateDictOptions(flatten_optimizer_state_dict=True)

    def _state_dicts(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        return get_state_dict(self.parts, self.optimizer, options=self._state_dict_options())


# ------------------------------------------------------------------------------ data


def load_data():
    """The demo's pairs and tokenizer, and every pair's ``(x, y)`` padded to the longest pair."""
    pairs = demo.load_pairs()
    tok = demo.CharTokenizer([t for pair in pairs for t in pair])
    x, y = demo.make_batch(pairs, tok)
    return pairs, tok, x, y


def batch_of(step: int, x: Tensor, y: Tensor, batch_size: int, seed: int):
    """The pairs of ``step``: epoch ``step // steps_per_epoch`` of a permutation seeded by
    ``(seed, epoch)``, whole batches only."""
    per_epoch = len(x) // batch_size
    epoch, index = divmod(step, per_epoch)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed * 100_003 + epoch))
    rows = order[index * batch_size : (index + 1) * batch_size]
    return epoch, x[rows], y[rows]


def newest_checkpoint(folder: Path) -> Path | None:
    done = [p for p in folder.glob("step-*") if (p / ".metadata").exists()]
    return max(done, key=lambda p: int(p.name.removeprefix("step-")), default=None)


def open_log(path: Path, start: int):
    """``loss.jsonl`` for appending, keeping the lines of the steps up to ``start`` (a resumed run's)."""
    kept = []
    if start and path.exists():
        kept = [line for line in path.read_text().splitlines() if json.loads(line)["step"] <= start]
    log = path.open("w")
    log.writelines(line + "\n" for line in kept)
    return log


# ------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    args = parse_args(argv)
    # A pipeline stage hands on views of its state (pass-through tensors); nothing changes them in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    torch.set_num_threads(max(1, torch.get_num_threads() // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    try:
        device, mesh = init_distributed(args)
        rank = dist.get_rank()
        pairs, tok, x_all, y_all = load_data()
        data_ranks = args.dp * args.fsdp
        per_rank = args.batch_size // data_ranks
        if args.batch_size % data_ranks or (args.pp > 1 and per_rank % args.microbatches):
            raise SystemExit(
                f"--batch-size {args.batch_size} must split into {data_ranks} data ranks"
                + (f" x {args.microbatches} microbatches" if args.pp > 1 else "")
            )
        if args.batch_size > len(pairs):
            raise SystemExit(f"--batch-size {args.batch_size} is more than the {len(pairs)} pairs")
        steps_per_epoch = len(pairs) // args.batch_size
        total_steps = args.steps if args.steps is not None else args.epochs * steps_per_epoch
        trainer = Trainer(args, len(tok.itos), device, mesh)
        out = Path(args.out)
        checkpoints = out / "checkpoints"
        start = 0
        if args.resume:
            path = newest_checkpoint(checkpoints)
            if path is None:
                raise SystemExit(f"--resume: no complete checkpoint in {checkpoints}")
            start = trainer.load(path)
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            sizes = ", ".join(f"{d}={getattr(args, d)}" for d in MESH_DIMS)
            print(
                f"{args.model} d={args.d_model} L={args.layers}: {sum(p.numel() for p in trainer.model.parameters()):,}"
                f" parameters; {dist.get_world_size()} processes ({sizes})"
                + (f", {args.schedule} x {args.microbatches} microbatches" if args.pp > 1 else "")
                + (f"; resumed at step {start}" if args.resume else ""),
                flush=True,
            )
        log = open_log(out / "loss.jsonl", start) if rank == 0 else None
        bar = tqdm(total=total_steps, initial=start, unit="step", disable=rank != 0, dynamic_ncols=True)
        try:
            for step in range(start, total_steps):
                epoch, x, y = batch_of(step, x_all, y_all, args.batch_size, args.seed)
                lr = 0.5 * args.lr * (1 + math.cos(math.pi * step / total_steps))
                began = time.perf_counter()
                loss = trainer.step(x, y, lr)
                seconds = time.perf_counter() - began
                if log is not None:
                    record = {"step": step + 1, "epoch": epoch, "loss": loss, "lr": lr, "seconds": seconds}
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", epoch=epoch)
                done = step + 1
                if done == total_steps or (args.checkpoint_every and done % args.checkpoint_every == 0):
                    trainer.save(checkpoints / f"step-{done:06d}", done)
        finally:
            bar.close()
            if log is not None:
                log.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def exit_process(code: int) -> None:
    """Ends a distributed process with ``code`` without Python's finalization.

    After ``destroy_process_group`` a gloo worker thread can still be releasing its last
    finished collective (an FSDP2 all-gather holding tensors) when the interpreter finalizes;
    the release then needs the GIL, the thread is torn down mid-destructor, and the process
    aborts ("terminate called without an active exception") although the run succeeded
    (PyTorch's gloo backend; seen in about 1 run in 7 of a 2-rank FSDP2 run under load).
    Files are closed and the groups destroyed before this; only the flush of the standard
    streams is left to do."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_process(main())
