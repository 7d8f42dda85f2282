"""Tensor / sequence parallel and FSDP2 x TP runs of the nn models on CPU (gloo).

Run by ``tests/distributed/test_tensor_parallel.py`` through ``spawn_worker`` under
``torch.multiprocessing``: ``tp`` mode puts the plan of
``attnres_kernels.nn.tensor_parallel_plan`` on a 1-D mesh of every rank (each rank
called with the whole batch); ``fsdp_tp`` on a 2-D ``("dp", "tp")`` mesh: the plan on
``mesh["tp"]``, then FSDP2 over ``model.shard_units()`` and the root on ``mesh["dp"]``,
each dp rank on its half of the batch. Each rank saves its losses, step-1 gradients and
parameters after the SGD steps (all gathered to full tensors with ``full_tensor()``) to
``DIR/rank{rank}.pt``; the test compares them with one process (:func:`train`).
``ops`` mode checks the fused ops on DTensor arguments directly. Not collected by pytest.
"""

from __future__ import annotations

import time
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import attnres_kernels as ak
from attnres_kernels.ops import _dispatch
from attnres_kernels.train import exit_process
from tests.support import model_variants

VOCAB, D, HEADS, LAYERS = 23, 16, 2, 4
BATCH, SEQ, STEPS, LR = 4, 7, 2, 0.5  # SEQ = 7: uneven sequence shards (4 + 3) on 2 ranks
TIMEOUT = timedelta(seconds=60)  # every collective fails after this instead of hanging

CASES = model_variants(chunk_size=4)


def make_model(case: str):
    """The case's model (fused "cpu" backends), the same in every process: seeded, with every
    parameter perturbed so that no site reads the plain mean of its sources."""
    cls, kwargs = CASES[case]
    torch.manual_seed(0)
    model = getattr(ak.nn, cls)(VOCAB, D, LAYERS, HEADS, backend="cpu", **kwargs)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def make_batch():
    generator = torch.Generator().manual_seed(1)
    idx = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return idx, torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def _full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def train(model, idx, targets) -> dict:
    """``STEPS`` SGD steps on ``(idx, targets)``: the losses (mean over the ranks), step-1
    gradients and the parameters after the last step, as full tensors; seconds per step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses, times = [], []
    for step in range(STEPS):
        start = time.perf_counter()
        optimizer.zero_grad()
        logits = model(idx)
        loss = torch.nn.functional.cross_entropy(_full(logits).flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - start)
        if step == 0:
            grads = {n: _full(p.grad).clone() for n, p in model.named_parameters()}
        loss = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(loss)
            loss /= dist.get_world_size()
        losses.append(loss.item())
    params = {n: _full(p.detach()).clone() for n, p in model.named_parameters()}
    return {"losses": losses, "grads": grads, "params": params, "seconds": times}


def run_tp(case, idx, targets):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    model = make_model(case)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    parallelize_module(model, mesh, ak.nn.tensor_parallel_plan(model))
    layouts = {n: (tuple(p.to_local().shape), repr(p.placements)) for n, p in model.named_parameters()}
    return {**train(model, idx, targets), "layouts": layouts}


def run_fsdp_tp(case, idx, targets):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    model = make_model(case)
    mesh = init_device_mesh("cpu", (2, dist.get_world_size() // 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], ak.nn.tensor_parallel_plan(model))
    for unit in model.shard_units():
        fully_shard(unit, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    dp = mesh["dp"].get_local_rank()
    with warnings.catch_warnings():  # FSDP2 warns that layers return (pass-through) views
        warnings.simplefilter("ignore", UserWarning)
        return train(model, idx.chunk(2)[dp], targets.chunk(2)[dp])


def run_ops(_case, _idx, _targets):
    """The fused ops on DTensors: a depth read (with the fused output norm) over sources
    sharded on the sequence or the batch, a merge, the Block step and attention sharded on
    the heads or the batch run with no communication and equal the op on whole tensors;
    parameter gradients come back partial and reduce to the whole one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.distributed.tensor.parallel import parallelize_module

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(2)
    depth = _dispatch.fused_op("cpu", "depth_attn_fwd", torch.device("cpu"))
    step = _dispatch.fused_op("cpu", "block_step_fwd", torch.device("cpu"))
    attn = _dispatch.fused_op("cpu", "attn_fwd", torch.device("cpu"))
    sources = [torch.randn(3, 5, 8, requires_grad=True) for _ in range(3)]
    query, norm_weight, out_w = (torch.randn(8, requires_grad=True) for _ in range(3))
    q, k, v = (torch.randn(2, 4, 5, 8, requires_grad=True) for _ in range(3))
    checks = {}

    def compare(name, fn, tensors, placements):
        """``fn`` on whole tensors vs on DTensors laid out as ``placements`` (one per tensor)."""
        want = fn(*tensors)
        grads_in = [torch.randn_like(w) for w in want]
        torch.autograd.backward(want, grads_in)
        want_grads = [t.grad.clone() for t in tensors]
        for t in tensors:
            t.grad = None
        leaves = [distribute_tensor(t.detach(), mesh, [p]).requires_grad_() for t, p in zip(tensors, placements)]
        with CommDebugMode() as comm:
            got = fn(*leaves)
        forward_comms = comm.get_total_counts()
        out_grads = [distribute_tensor(g, mesh, list(o.placements)) for g, o in zip(grads_in, got)]
        with CommDebugMode() as comm:
            torch.autograd.backward(got, out_grads)
        checks[name] = {
            "forward_comms": forward_comms,
            "backward_comms": comm.get_total_counts(),
            "outputs": [(o.full_tensor(), w) for o, w in zip(got, want)],
            "grads": [(t.grad.full_tensor(), g) for t, g in zip(leaves, want_grads)],
            "grad_placements": [repr(t.grad.placements) for t in leaves],
        }

    def read(*t):
        out, lse, _, _ = depth(list(t[:3]), t[3], t[4], None, None, t[5], 1e-6, 1e-6, 1.0, False, None, None)
        return out, lse

    def merge(*t):
        prefix_out, prefix_lse, _, _ = depth(
            list(t[:2]), t[3], t[4], None, None, None, 1e-6, 1e-6, 1.0, False, None, None
        )
        out, lse, _, _ = depth([t[2]], t[3], t[4], prefix_out, prefix_lse, t[5], 1e-6, 1e-6, 1.0, False, None, None)
        return out, lse

    def block_step(*t):
        prefix_out, prefix_lse, _, _ = depth([t[0]], t[3], t[4], None, None, None, 1e-6, 1e-6, 1.0, False, None, None)
        new_partial, out, _, _, _ = step(t[1], t[2], t[3], t[4], prefix_out, prefix_lse, t[5], 1e-6, None)
        return new_partial, out

    params = [query, norm_weight, out_w]
    for dim, what in ((1, "sequence"), (0, "batch")):
        layout = [Shard(dim)] * 3 + [Replicate()] * 3
        compare(f"read/{what}", read, sources + params, layout)
        compare(f"merge/{what}", merge, sources + params, layout)
        compare(f"block_step/{what}", block_step, sources + params, layout)
    for dim, what in ((1, "heads"), (0, "batch")):
        compare(f"attention/{what}", lambda *t: (attn(*t, None, True, 8**-0.5)[0],), [q, k, v], [Shard(dim)] * 3)
    try:  # 3 heads do not split over 2 ranks
        model = ak.nn.StandardTransformer(VOCAB, 12, 1, 3, backend="cpu")
        parallelize_module(model, mesh, ak.nn.tensor_parallel_plan(model))
        checks["uneven_heads_error"] = None
    except ValueError as error:
        checks["uneven_heads_error"] = str(error)
    return checks


RUNNERS = {"tp": run_tp, "fsdp_tp": run_fsdp_tp, "ops": run_ops}


def spawn_worker(rank: int, world: int, store_path: str, jobs, out_dir) -> None:
    """Entry point of ``torch.multiprocessing``: a gloo group over a FileStore; ``jobs`` is a
    list of ``(mode, case)``."""
    torch.set_num_threads(1)  # the ranks share the machine's cores
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        idx, targets = make_batch()
        results = {f"{mode}/{case}" if case else mode: RUNNERS[mode](case, idx, targets) for mode, case in jobs}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    exit_process(0)  # past gloo's abort at interpreter exit (attnres_kernels.train.exit_process)
