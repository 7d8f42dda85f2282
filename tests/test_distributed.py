"""The nn models train under torch.distributed on CPU (gloo, 2 ranks): DDP, FSDP2 with
``shard_units()`` and a 2-stage pipeline over send/recv each give the loss and gradients (and,
for DDP/FSDP2, the parameters after two SGD steps) of one process on the whole batch.

One ``torch.multiprocessing`` spawn runs every check (``tests/distributed_script.py``); one
torchrun launch of the same script checks the launcher path. Both fail after a timeout
instead of hanging."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import distributed_script as script

import attnres_kernels as ak

WORLD = 2
SPAWN_TIMEOUT_S = 300
TORCHRUN_TIMEOUT_S = 300
TORCHRUN_CASE = "Block-two-phase"
TOL = {"rtol": 1e-5, "atol": 1e-6}  # fp32: ranks sum rows in other orders and all-reduce


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """Results of every rank of one 2-rank spawn that runs all modes on all cases."""
    import torch.multiprocessing as mp

    out = tmp_path_factory.mktemp("spawned")
    context = mp.start_processes(
        script.spawn_worker,
        args=(WORLD, str(out / "store"), list(script.CASES), list(script.MODES), str(out)),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + SPAWN_TIMEOUT_S
    while not context.join(timeout=max(deadline - time.monotonic(), 0)):  # raises if a rank failed
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the distributed ranks did not finish within {SPAWN_TIMEOUT_S} s")
    return [torch.load(out / f"rank{rank}.pt") for rank in range(WORLD)]


_EXPECTED = {}


def expected(case):
    """One process, whole batch: losses, step-1 gradients, parameters after the steps."""
    if case not in _EXPECTED:
        model = script.make_model(case)
        _EXPECTED[case] = script.train(model, model, *script.make_batch())
    return _EXPECTED[case]


def assert_tensors_close(got: dict, want: dict, what: str):
    assert got.keys() == want.keys(), what
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=lambda m: f"{what} {name}: {m}")


def check_data_parallel(results, mode, case):
    want = expected(case)
    for rank, result in enumerate(results):
        r = result[f"{mode}/{case}"]
        assert r["world_size"] == WORLD and r["local_batch"] == script.BATCH // WORLD
        torch.testing.assert_close(r["losses"], want["losses"], **TOL)
        assert_tensors_close(r["grads"], want["grads"], f"rank {rank} step-1 gradient of")
        assert_tensors_close(r["params"], want["params"], f"rank {rank} parameter after {script.STEPS} steps:")


def check_pipeline(results, case):
    want = expected(case)
    stages = [result[f"pipeline/{case}"] for result in results]
    assert 0 < stages[0]["cut"] < script.LAYERS
    assert stages[0]["losses"] == []
    torch.testing.assert_close(stages[1]["losses"][0], want["losses"][0], **TOL)
    assert not stages[0]["grads"].keys() & stages[1]["grads"].keys(), "a parameter got gradients on both stages"
    assert "embed.weight" in stages[0]["grads"] and "head.weight" in stages[1]["grads"]
    assert_tensors_close({**stages[0]["grads"], **stages[1]["grads"]}, want["grads"], "pipeline gradient of")


@pytest.mark.parametrize("case", list(script.CASES))
def test_ddp(spawned, case):
    check_data_parallel(spawned, "ddp", case)


@pytest.mark.parametrize("case", list(script.CASES))
def test_fsdp2_shard_units(spawned, case):
    check_data_parallel(spawned, "fsdp2", case)
    for result in spawned:
        r = result[f"fsdp2/{case}"]
        assert r["local_numel"] < r["numel"], "FSDP2 did not shard the parameters"


@pytest.mark.parametrize("case", list(script.CASES))
def test_two_stage_pipeline(spawned, case):
    check_pipeline(spawned, case)


def test_torchrun(tmp_path):
    """The script under ``torchrun --nproc-per-node 2`` (env:// rendezvous on a free port)."""
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
    command += [str(root / "tests" / "distributed_script.py"), "--out", str(tmp_path), "--cases", TORCHRUN_CASE]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, run.stdout
    printed = json.loads(lines[0].removeprefix("RESULT "))
    assert printed["world_size"] == WORLD
    want = expected(TORCHRUN_CASE)["losses"]
    for mode in script.MODES:
        per_rank = printed["losses"][f"{mode}/{TORCHRUN_CASE}"]
        if mode == "pipeline":
            assert per_rank[0] == [] and len(per_rank[1]) == 1
            torch.testing.assert_close(per_rank[1][0], want[0], **TOL)
        else:
            torch.testing.assert_close(per_rank, [want] * WORLD, **TOL)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    check_data_parallel(results, "ddp", TORCHRUN_CASE)
    check_data_parallel(results, "fsdp2", TORCHRUN_CASE)
    check_pipeline(results, TORCHRUN_CASE)


SPLIT_MODELS = {
    **script.CASES,
    "Full-chunk-3": ("FullAttnResTransformer", {"chunk_size": 3}),
    "Block-per-site-5-layers": ("BlockAttnResTransformer", {"layers_per_block": 2, "n_layers": 5}),
}


@pytest.mark.parametrize("case", list(SPLIT_MODELS))
def test_every_cut_in_one_process(case):
    """Packing the state at every cut and continuing from unpacked copies (leaves, as a receiving
    stage has them), then sending their gradients back, gives the model's logits and gradients."""
    cls, kwargs = SPLIT_MODELS[case]
    kwargs = {"n_layers": script.LAYERS, **kwargs}
    n_layers = kwargs.pop("n_layers")
    model = script.build_model(cls, n_layers, **kwargs)
    idx, _ = script.make_batch()
    grad_logits = torch.randn(*idx.shape, script.VOCAB)
    want = model(idx)
    want.backward(grad_logits)
    want_grads = {n: p.grad for n, p in model.named_parameters()}
    cuts = ak.nn.pipeline_cuts(model)
    assert cuts[0] == 0 and n_layers not in cuts
    for cut in cuts:
        model.zero_grad(set_to_none=True)
        state = model.initial_state(model.embed(idx))
        for layer in model.layers[:cut]:
            state = layer(state)
        sent = ak.nn.pack_boundary(model, cut, state)
        assert len(sent) == len(ak.nn.boundary_layout(model, cut))
        assert all(t.shape == (*idx.shape, script.D) for t in sent)
        received = [t.detach().clone().requires_grad_() for t in sent]
        state = ak.nn.unpack_boundary(model, cut, received)
        for layer in model.layers[cut:]:
            state = layer(state)
        got = model.logits(state)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        got.backward(grad_logits)
        torch.autograd.backward(sent, [t.grad for t in received])
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, want_grads[name], **TOL, msg=lambda m: f"cut {cut}, {name}: {m}")


def test_bad_cuts_and_states():
    model = script.make_model("Block-two-phase")
    assert ak.nn.pipeline_cuts(model) == [0, 2]
    assert ak.nn.boundary_layout(model, 2) == ["blocks[0]", "partial"]
    with pytest.raises(ValueError, match="cannot start at layer 1"):
        ak.nn.boundary_layout(model, 1)
    idx, _ = script.make_batch()
    state = model.initial_state(model.embed(idx), record_weights=True)
    with pytest.raises(ValueError, match="depth weights"):
        ak.nn.pack_boundary(model, 0, state)
    with pytest.raises(ValueError, match="carries 2 tensors"):
        ak.nn.unpack_boundary(model, 2, [state.partial])
    with pytest.raises(TypeError, match="expected one of"):
        ak.nn.pipeline_cuts(torch.nn.Linear(2, 2))
