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

Any 3-D layout works (``--pp 2 --fsdp 2 --tp 2`` on 8 processes; ``--pp 2 --tp 2`` on 4),
with every schedule: the depth state crosses a pipeline cut as DTensors on the ``tp``
mesh, sharded on the sequence.

Writes to ``--out``: ``loss.jsonl`` (one line per step: step, epoch, loss, the gradient's
2-norm over the whole model ``grad_norm`` (before the optimizer step), lr, seconds, and
``tokens``, the token positions of the batch, padding included) and ``checkpoints/step-<N>``
(DCP, every ``--checkpoint-every`` steps and at the end: model and optimizer state by the
model's parameter names, so a checkpoint loads into any other layout, and the step; next
to it ``config.json``, the model settings). ``--resume`` continues from the newest
checkpoint, in any layout, with the same model settings.

Arguments are checked against each other, the data, the model's pipeline cuts and the
checkpoint to resume before any process group starts; an error is printed once (by the
first process) and every process exits with status 2. The first process shows a progress
bar (loss, step time, tokens/s), a line for every checkpoint saved or loaded, and a summary
at the end.
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
CONFIG_FILE = "config.json"  # next to each checkpoint: its model_config


class ArgumentParser(argparse.ArgumentParser):
    """Prints usage, help and errors on the first process only: under torchrun every process
    parses the same arguments, and one copy of the message is enough (the others exit quietly
    with the same status)."""

    def print_usage(self, file=None) -> None:
        if _first_process():
            super().print_usage(file)

    def print_help(self, file=None) -> None:
        if _first_process():
            super().print_help(file)

    def exit(self, status=0, message=None):
        super().exit(status, message if _first_process() else None)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every option's default (those that are None or a
    flag's False say in their help what they mean)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _first_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def make_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="python -m attnres_kernels.train", description=__doc__, formatter_class=HelpFormatter)
    model = parser.add_argument_group("model (default: the demo's; a checkpoint resumes only with the same)")
    model.add_argument("--model", default="block", choices=MODELS, help="Standard, Full or Block AttnRes")
    model.add_argument("--d-model", type=int, default=128, help="width")
    model.add_argument("--layers", type=int, default=6, help="transformer layers")
    model.add_argument("--heads", type=int, default=4, help="attention heads, a multiple of --tp")
    model.add_argument("--blocks", type=int, default=3, help="Block AttnRes: blocks (layers must divide evenly)")
    model.add_argument(
        "--block-schedule",
        default=ak.nn.DEFAULT_BLOCK_SCHEDULE,
        choices=("per_site", "two_phase"),
        help="Block AttnRes: order of the depth reads (same parameters and results)",
    )
    model.add_argument(
        "--chunk-size", type=int, default=ak.nn.DEFAULT_CHUNK_SIZE, help="Full AttnRes: sites per multi-query chunk"
    )
    model.add_argument("--backend", default="auto", choices=ak.BACKENDS, help="depth-attention backend")
    train = parser.add_argument_group("training")
    train.add_argument("--epochs", type=int, default=300, help="passes over the pairs")
    train.add_argument("--steps", type=int, default=None, help="total optimizer steps (default: --epochs worth)")
    train.add_argument("--batch-size", type=int, default=10, help="sequences per step, over all data ranks")
    train.add_argument("--lr", type=float, default=3e-3, help="AdamW peak learning rate (cosine decay to 0)")
    train.add_argument("--seed", type=int, default=0, help="initial parameters and the order of the pairs")
    train.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="replay the model's forward and backward from CUDA graphs (torch.cuda.make_graphed_callables; "
        "one process on a GPU): no per-kernel host work",
    )
    par = parser.add_argument_group("parallelism (their product is the number of processes)")
    par.add_argument("--dp", type=int, default=1, help="data-parallel replicas (HSDP: replicated over dp)")
    par.add_argument("--fsdp", type=int, default=1, help="FSDP2 shards")
    par.add_argument("--tp", type=int, default=1, help="tensor (and sequence) parallel degree")
    par.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree")
    par.add_argument("--schedule", default="1f1b", choices=list(SCHEDULES), help="pipeline schedule (--pp > 1)")
    par.add_argument(
        "--stages-per-rank", type=int, default=None, help="pipeline stages per rank (default: 2 if interleaved, else 1)"
    )
    par.add_argument(
        "--microbatches", type=int, default=None, help="per step and data rank (default: the pipeline's stages)"
    )
    par.add_argument("--no-cross-stage-cache", action="store_true", help="send the whole depth state at every cut")
    out = parser.add_argument_group("output")
    out.add_argument("--out", default="train_out", help="folder for loss.jsonl and checkpoints/")
    out.add_argument(
        "--checkpoint-every", type=int, default=100, help="steps between DCP checkpoints (0: only the last)"
    )
    out.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The arguments, checked (see :func:`check_args`) before any process group starts."""
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.stages_per_rank is None:
        args.stages_per_rank = 2 if args.schedule == "interleaved" else 1
    if args.pp > 1 and args.microbatches is None:
        args.microbatches = args.pp * args.stages_per_rank
    check_args(parser, args)
    return args


def check_args(parser: ArgumentParser, args) -> None:
    """``parser.error`` (usage and message once, exit status 2) for any argument that cannot
    work: the degrees against the processes, the batch against the data ranks, the pairs and
    the microbatches, the pipeline's stages against the schedule and the model's cuts, the heads
    against ``--tp``, and with ``--resume`` the checkpoint (there is one, saved by the same model
    settings, before the last step)."""
    positive = ("dp", "fsdp", "tp", "pp", "stages_per_rank", "batch_size", "d_model", "layers", "heads", "blocks")
    for name in (*positive, "epochs" if args.steps is None else "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.checkpoint_every < 0:
        parser.error(f"--checkpoint-every must be at least 0, got {args.checkpoint_every}")
    degrees = tuple(getattr(args, dim) for dim in MESH_DIMS)
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    if math.prod(degrees) != world:
        sizes = sizes_of(args)
        need = math.prod(degrees)
        hint = f"; run torchrun --nproc-per-node {need} -m attnres_kernels.train ..." if world == 1 else ""
        parser.error(f"the degrees ({sizes}) need {need} processes, got {world}{hint}")
    if args.schedule != "interleaved" and args.stages_per_rank != 1:
        parser.error(f"--schedule {args.schedule} runs one stage per rank; use --schedule interleaved")
    pairs, tok, _, _ = load_data()
    data_ranks = args.dp * args.fsdp
    if args.batch_size > len(pairs):
        parser.error(f"--batch-size {args.batch_size} is more than the {len(pairs)} pairs")
    if args.batch_size % data_ranks:
        parser.error(f"--batch-size {args.batch_size} must split evenly into the {data_ranks} data ranks (dp x fsdp)")
    if args.pp > 1:
        _check_pipeline(parser, args, args.batch_size // data_ranks)
    if args.cuda_graphs:
        if not torch.cuda.is_available():
            parser.error("--cuda-graphs needs a GPU (CUDA graphs replay CUDA kernels); this machine has none")
        if world > 1:
            parser.error(f"--cuda-graphs runs one process; the degrees ({sizes_of(args)}) need {world}")
    if args.heads % args.tp:
        parser.error(f"--tp {args.tp} splits the attention by head: --heads {args.heads} must be a multiple of it")
    if args.model == "block" and args.layers % args.blocks:
        parser.error(f"--layers {args.layers} does not divide into --blocks {args.blocks}")
    try:
        with torch.device("meta"):  # the module tree only: no memory, no initialization
            model = build_model(args, len(tok.itos))
    except ValueError as exc:
        parser.error(f"the model: {exc}")
    if args.pp > 1:
        try:
            ak.nn.balanced_cuts(model, args.pp * args.stages_per_rank)
        except ValueError as exc:
            parser.error(f"--pp {args.pp} x --stages-per-rank {args.stages_per_rank}: {exc}")
    if args.resume:
        _check_resume(parser, args)


def sizes_of(args) -> str:
    """The mesh's degrees as the error messages print them (``pp=2 x dp=1 x ...``)."""
    return " x ".join(f"{d}={getattr(args, d)}" for d in MESH_DIMS)


def _check_pipeline(parser: ArgumentParser, args, per_rank: int) -> None:
    """The microbatches against the batch of a data rank and the schedule (PyTorch's rules)."""
    n, stages = args.microbatches, args.pp * args.stages_per_rank
    if n < 1 or per_rank % n:
        parser.error(f"--microbatches {n}: each data rank's {per_rank} sequences must split evenly into them")
    if args.schedule == "1f1b" and n < args.pp:
        parser.error(f"--schedule 1f1b needs at least as many --microbatches as stages ({args.pp}), got {n}")
    if args.schedule == "interleaved":
        rounds = max(1, n // args.pp)
        if n % rounds:
            parser.error(
                f"--schedule interleaved runs the microbatches in rounds of --pp {args.pp}: --microbatches {n} "
                f"must be a multiple of {rounds} (e.g. {stages})"
            )


def model_config(args) -> dict:
    """The settings a checkpoint's parameters depend on (names as the options')."""
    config = {"model": args.model, "d_model": args.d_model, "layers": args.layers, "heads": args.heads}
    if args.model == "block":
        config["blocks"] = args.blocks
    return config


def _check_resume(parser: ArgumentParser, args) -> None:
    folder = Path(args.out) / "checkpoints"
    path = newest_checkpoint(folder)
    if path is None:
        parser.error(f"--resume: no complete checkpoint in {folder}")
    saved_config = path / CONFIG_FILE
    if saved_config.exists():
        saved, config = json.loads(saved_config.read_text()), model_config(args)
        differ = [key for key in config if key in saved and saved[key] != config[key]]
        if differ:
            option = {key: "--" + key.replace("_", "-") for key in differ}
            parser.error(
                f"--resume: {path} holds a model with "
                + ", ".join(f"{option[key]} {saved[key]}" for key in differ)
                + " where this run has "
                + ", ".join(f"{option[key]} {config[key]}" for key in differ)
                + "; resume with the checkpoint's settings, or train afresh in another --out"
            )
    steps = total_steps(args)
    if checkpoint_step(path) >= steps:
        parser.error(f"--resume: {path} is at step {checkpoint_step(path)}, the run has {steps} steps; raise --steps")


# ------------------------------------------------------------------------------ setup


def init_distributed(args) -> tuple:
    """The process group (torchrun's env://, or one process alone), the device and the mesh
    (the degrees were checked against the processes by :func:`check_args`)."""
    if not dist.is_initialized():
        if "RANK" in os.environ:
            dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        else:
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    degrees = tuple(getattr(args, dim) for dim in MESH_DIMS)
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
        # With --cuda-graphs: the model's forward and backward captured on the first step's batch (every
        # step's batch has its shape) and replayed from then on.
        self.graphed = None
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
        trains on its slice). Returns the batch's mean loss and the gradient's 2-norm (on every rank)."""
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
            if self.args.cuda_graphs and self.graphed is None:
                self.graphed = torch.cuda.make_graphed_callables(self.model, (x,))
            loss = self._loss((self.graphed or self.model)(x), y)
            loss.backward()
            local = loss.detach()
        grad_norm = self._grad_norm()
        self.optimizer.step()
        # Every rank of the last stage holds its data rank's share (tensor-parallel ranks repeat it).
        total = (local.float() / (self.data_ranks * self.args.tp)).reshape(1)
        dist.all_reduce(total)
        return total.item(), grad_norm

    def _grad_norm(self) -> float:
        """The 2-norm of the whole model's gradient (every stage, every shard), on every rank.

        The parameters this rank holds are plain tensors (one process) or DTensors on one mesh
        (FSDP2, tensor parallel, or both): their norm is one reduction over that mesh. The
        stages' norms are then summed (as squares) over the pipeline ranks."""
        grads = [p.grad for p in self.parts.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads).float()
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        squares = norm.reshape(1) ** 2
        if self.pipelined:
            dist.all_reduce(squares, group=self.mesh["pp"].get_group())
        return squares.sqrt().item()

    # ---------------------------------------------------------------- checkpoints

    def save(self, path: Path, step: int) -> None:
        """A DCP checkpoint of the model, the optimizer and ``step`` in ``path``, with the model
        settings in ``path / CONFIG_FILE`` (written first: the checkpoint is complete once DCP
        has written its ``.metadata``)."""
        import torch.distributed.checkpoint as dcp

        if dist.get_rank() == 0:
            path.mkdir(parents=True, exist_ok=True)
            (path / CONFIG_FILE).write_text(json.dumps(model_config(self.args)) + "\n")
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
    return max(done, key=checkpoint_step, default=None)


def checkpoint_step(path: Path) -> int:
    return int(path.name.removeprefix("step-"))


def total_steps(args) -> int:
    return args.steps if args.steps is not None else args.epochs * (len(demo.load_pairs()) // args.batch_size)


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
        first = dist.get_rank() == 0
        _, tok, x_all, y_all = load_data()
        steps = total_steps(args)
        trainer = Trainer(args, len(tok.itos), device, mesh)
        out = Path(args.out)
        checkpoints = out / "checkpoints"
        if first:
            out.mkdir(parents=True, exist_ok=True)
            sizes = ", ".join(f"{d}={getattr(args, d)}" for d in MESH_DIMS)
            print(
                f"{args.model} d={args.d_model} L={args.layers}: {sum(p.numel() for p in trainer.model.parameters()):,}"
                f" parameters; {dist.get_world_size()} process{'es' if dist.get_world_size() > 1 else ''} ({sizes})"
                + (f", {args.schedule} x {args.microbatches} microbatches" if args.pp > 1 else ""),
                flush=True,
            )
        start = 0
        if args.resume:
            path = newest_checkpoint(checkpoints)
            start = trainer.load(path)
            if first:
                print(f"loaded checkpoint {path} (step {start})", flush=True)
        log = open_log(out / "loss.jsonl", start) if first else None
        bar = tqdm(total=steps, initial=start, unit="step", disable=not first, dynamic_ncols=True)
        record, seconds, tokens = None, 0.0, 0
        try:
            for step in range(start, steps):
                epoch, x, y = batch_of(step, x_all, y_all, args.batch_size, args.seed)
                lr = 0.5 * args.lr * (1 + math.cos(math.pi * step / steps))
                began = time.perf_counter()
                loss, grad_norm = trainer.step(x, y, lr)
                took = time.perf_counter() - began
                seconds, tokens = seconds + took, tokens + x.numel()
                record = {"step": step + 1, "epoch": epoch, "loss": loss, "grad_norm": grad_norm, "lr": lr}
                record |= {"seconds": took, "tokens": x.numel()}
                if log is not None:
                    log.write(json.dumps(record) + "\n")
                    log.flush()
                bar.update(1)
                bar.set_postfix_str(
                    f"loss {loss:.4f}, epoch {epoch}, {1000 * took:.0f} ms/step, {x.numel() / took:,.0f} tokens/s"
                )
                done = step + 1
                if done == steps or (args.checkpoint_every and done % args.checkpoint_every == 0):
                    path = checkpoints / f"step-{done:06d}"
                    trainer.save(path, done)
                    if first:
                        bar.write(f"saved checkpoint {path} (step {done})")
        finally:
            bar.close()
            if log is not None:
                log.close()
        if first and record is not None:
            print(
                f"done: step {record['step']} of {steps}, final loss {record['loss']:.4f} (grad norm "
                f"{record['grad_norm']:.3g}); {record['step'] - start} steps in {seconds:.1f} s "
                f"({1000 * seconds / (record['step'] - start):.0f} ms/step, {tokens / seconds:,.0f} tokens/s)\n"
                f"loss log: {(out / 'loss.jsonl').resolve()}\n"
                f"checkpoints: {checkpoints.resolve()} (newest: {newest_checkpoint(checkpoints).name})",
                flush=True,
            )
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
