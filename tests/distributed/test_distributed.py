"""The nn models train under torch.distributed on CPU (gloo, 2 ranks): DDP, FSDP2 with
``shard_units()`` and the pipeline stages of ``model.pipeline_stages`` under PyTorch's
``ScheduleGPipe``, ``Schedule1F1B`` (2 stages) and ``ScheduleInterleaved1F1B`` (4 stages, with
and without cross-stage caching) each give the loss and gradients (and, for DDP/FSDP2, the
parameters after two SGD steps) of one process on the whole batch.

One ``torch.multiprocessing`` spawn runs every check (``tests/distributed/distributed_script.py``); one
torchrun launch of the same script checks the launcher path. Both fail after a timeout
instead of hanging."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import attnres_kernels as ak
from tests.distributed import distributed_script as script
from tests.support import spawn_ranks

WORLD = 2
SPAWN_TIMEOUT_S = 300
TORCHRUN_TIMEOUT_S = 300
TORCHRUN_CASE = "Block-two-phase"
TOL = {"rtol": 1e-5, "atol": 1e-6}  # fp32: ranks sum rows in other orders and all-reduce


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """Results of every rank of one 2-rank spawn that runs all modes on all cases."""
    out = tmp_path_factory.mktemp("spawned")
    spawn_ranks(
        script.spawn_worker,
        WORLD,
        (WORLD, str(out / "store"), list(script.CASES), list(script.MODES), str(out)),
        SPAWN_TIMEOUT_S,
    )
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


_EXPECTED_PIPE = {}


def expected_pipe(case):
    """One process, whole batch, the pipeline model: the loss and its gradients."""
    if case not in _EXPECTED_PIPE:
        model = script.make_pipe_model(case)
        loss = script.loss_fn(model(script.make_batch()[0]), script.make_batch()[1])
        loss.backward()
        _EXPECTED_PIPE[case] = {"loss": loss.item(), "grads": {n: p.grad for n, p in model.named_parameters()}}
    return _EXPECTED_PIPE[case]


ROW_BYTES = script.BATCH // script.MICRO_BATCHES * script.SEQ * script.D * 4  # one fp32 [b, T, D] tensor


def check_pipeline(results, case, schedule, cache):
    """Losses, gradients, stage layouts and the bytes sent per microbatch of one pipeline run."""
    key = script.pipeline_key(case, schedule, cache)
    want = expected_pipe(case)
    runs = [result[key] for result in results]
    stages = {index: stage for run in runs for index, stage in run["stages"].items()}
    num_stages = WORLD * script.SCHEDULES[schedule][1]
    assert sorted(stages) == list(range(num_stages))
    # Every layer on exactly one stage, in order.
    assert [i for s in range(num_stages) for i in stages[s]["layers"]] == list(range(script.PIPE_LAYERS))
    # The last stage (rank num_stages - 1 % WORLD) has one loss per microbatch; their mean is the batch loss.
    last_rank = (num_stages - 1) % WORLD
    assert all(run["losses"] == [] for rank, run in enumerate(runs) if rank != last_rank)
    assert len(runs[last_rank]["losses"]) == script.MICRO_BATCHES
    mean_loss = sum(runs[last_rank]["losses"]) / script.MICRO_BATCHES
    torch.testing.assert_close(mean_loss, want["loss"], **TOL)
    # Every parameter's gradient, from the one rank that holds it.
    assert not runs[0]["grads"].keys() & runs[1]["grads"].keys(), "a parameter got gradients on both ranks"
    assert_tensors_close({**runs[0]["grads"], **runs[1]["grads"]}, want["grads"], f"{key} gradient of")
    # What crosses each boundary: the layout after the kept tensors, in both directions.
    model = script.make_pipe_model(case)
    for s in range(1, num_stages):
        layout = ak.nn.boundary_layout(model, stages[s]["layers"][0])
        kept = stages[s]["kept"]
        assert layout == kept + stages[s]["received"]
        assert bool(kept) == (cache and s >= WORLD and not case.startswith("Standard"))
        n_bytes = {mb: len(stages[s]["received"]) * ROW_BYTES for mb in range(script.MICRO_BATCHES)}
        assert stages[s - 1]["sent_bytes"]["forward"] == n_bytes
        assert stages[s]["sent_bytes"]["backward"] == n_bytes


@pytest.mark.parametrize(("case", "schedule", "cache"), script.PIPELINES, ids=lambda v: str(v))
def test_pipeline_schedule(spawned, case, schedule, cache):
    check_pipeline(spawned, case, schedule, cache)


@pytest.mark.parametrize("case", ["Full-chunk-4", "Block-per-site", "Block-two-phase"])
def test_cross_stage_caching_bytes(spawned, case):
    """Interleaved, 4 stages on 2 ranks: stages 2 and 3 receive only what their rank does not
    hold yet (Full: the sources of the layers since its earlier stage's cut; Block: the blocks
    completed since, and the partial sum); stage 1 receives the whole state either way."""
    per_stage = {}
    for cache in (True, False):
        key = script.pipeline_key(case, "interleaved", cache)
        stages = {i: st for result in spawned for i, st in result[key]["stages"].items()}
        per_stage[cache] = [stages[s]["sent_bytes"]["forward"][0] for s in range(3)]
    cached, full = per_stage[True], per_stage[False]
    assert cached[0] == full[0]
    assert all(c < f for c, f in zip(cached[1:], full[1:])), (cached, full)
    model = script.make_pipe_model(case)
    cuts = ak.nn.balanced_cuts(model, 4)
    kept = [ak.nn.reusable_tensors(model, c) for c in cuts]  # stage s + 2 keeps what stage s sent at cuts[s]
    for s, c in enumerate(cuts[1:], start=1):
        assert full[s] == len(ak.nn.boundary_layout(model, c)) * ROW_BYTES
        assert cached[s] == (len(ak.nn.boundary_layout(model, c)) - kept[s - 1]) * ROW_BYTES


@pytest.mark.parametrize(("case", "schedule", "cache"), script.AUTOCAST_PIPELINES, ids=lambda v: str(v))
def test_pipeline_under_autocast(spawned, case, schedule, cache):
    """bf16 autocast: each boundary tensor crosses in its own dtype (the embedding fp32, sublayer
    outputs bf16); loss and gradients as one process under autocast, to bf16 rounding."""
    key = script.pipeline_key(case, schedule, cache, autocast=True)
    runs = [result[key] for result in spawned]
    stages = {index: stage for run in runs for index, stage in run["stages"].items()}
    for s in range(1, len(stages)):
        want = [
            torch.float32 if name in ("sources[0]", "blocks[0]") else torch.bfloat16 for name in stages[s]["received"]
        ]
        assert stages[s]["dtypes"] == want, (s, stages[s]["received"])
    model = script.make_pipe_model(case)
    idx, targets = script.make_batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = script.loss_fn(model(idx), targets)
    loss.backward()
    losses = [x for run in runs for x in run["losses"]]
    torch.testing.assert_close(sum(losses) / len(losses), loss.item(), rtol=1e-3, atol=1e-3)
    grads = {**runs[0]["grads"], **runs[1]["grads"]}
    assert grads.keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        scale = p.grad.abs().max().item()
        assert (grads[name] - p.grad).abs().max().item() <= 5e-2 * scale + 1e-6, name


def test_caching_needs_the_interleaved_placement(spawned):
    for result in spawned:
        assert "cross-stage caching needs stage s on rank s % 2" in result["pipeline/placement-error"]["error"]


@pytest.mark.parametrize("case", list(script.CASES))
def test_ddp(spawned, case):
    check_data_parallel(spawned, "ddp", case)


@pytest.mark.parametrize("case", list(script.CASES))
def test_fsdp2_shard_units(spawned, case):
    check_data_parallel(spawned, "fsdp2", case)
    for result in spawned:
        r = result[f"fsdp2/{case}"]
        assert r["local_numel"] < r["numel"], "FSDP2 did not shard the parameters"


def test_torchrun(tmp_path):
    """The script under ``torchrun --nproc-per-node 2`` (env:// rendezvous on a free port)."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    env["TMPDIR"] = str(tmp_path)  # torchrun's agent leaves a torchelastic_* folder in the temporary directory
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
    command += [
        str(root / "tests" / "distributed" / "distributed_script.py"),
        "--out",
        str(tmp_path),
        "--cases",
        TORCHRUN_CASE,
    ]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TORCHRUN_TIMEOUT_S)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, run.stdout
    printed = json.loads(lines[0].removeprefix("RESULT "))
    assert printed["world_size"] == WORLD
    want = expected(TORCHRUN_CASE)["losses"]
    for mode in ("ddp", "fsdp2"):
        torch.testing.assert_close(printed["losses"][f"{mode}/{TORCHRUN_CASE}"], [want] * WORLD, **TOL)
    pipelines = [p for p in script.PIPELINES if p[0] == TORCHRUN_CASE]
    assert pipelines
    for case, schedule, cache in pipelines:
        per_rank = printed["losses"][script.pipeline_key(case, schedule, cache)]
        assert per_rank[0] == [] and len(per_rank[1]) == script.MICRO_BATCHES
        torch.testing.assert_close(sum(per_rank[1]) / script.MICRO_BATCHES, expected_pipe(case)["loss"], **TOL)
    results = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(WORLD)]
    check_data_parallel(results, "ddp", TORCHRUN_CASE)
    check_data_parallel(results, "fsdp2", TORCHRUN_CASE)
    for pipeline in pipelines:
        check_pipeline(results, *pipeline)


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


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("case", ["Standard", "Full-chunk-3", "Block-two-phase"])
def test_stage_modules_in_one_process(one_rank_group, case):
    """The stages of one rank: the model's parameters under its own names, each on one stage;
    their submodules chained give the model's logits and gradients."""
    model = script.make_pipe_model(case)
    stages = model.pipeline_stages(range(3), 3, "cpu")
    assert all(isinstance(s, torch.distributed.pipelining.PipelineStage) for s in stages)
    params = dict(model.named_parameters())
    seen = {}
    for stage in stages:
        for name, p in stage.submod.named_parameters():
            assert name not in seen and p is params[name]
            seen[name] = p
    assert seen.keys() == params.keys()
    idx, targets = script.make_batch()
    want = script.loss_fn(model(idx), targets)
    want.backward()
    want_grads = {n: p.grad.clone() for n, p in params.items()}
    model.zero_grad(set_to_none=True)
    out = (idx,)
    for stage in stages:
        assert len(out) == len(stage.submod.received)
        out = stage.submod(*out)
        out = out if isinstance(out, tuple) else (out,)
    got = script.loss_fn(out[0], targets)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got.backward()
    assert_tensors_close({n: p.grad for n, p in params.items()}, want_grads, "chained stages' gradient of")


def test_cuts_and_stage_plans():
    full = script.make_pipe_model("Full-chunk-3")  # 8 layers; units start at layers 0, 3, 6
    assert ak.nn.pipeline_cuts(full) == [0, 3, 6]
    assert ak.nn.balanced_cuts(full, 2) == [3] and ak.nn.balanced_cuts(full, 4) == [0, 3, 6]
    with pytest.raises(ValueError, match="5 stages need 4 cuts"):
        ak.nn.balanced_cuts(full, 5)
    block = script.make_pipe_model("Block-per-site")  # 8 layers, 2 per block, every layer a unit
    assert ak.nn.balanced_cuts(block, 4) == [2, 4, 6] and ak.nn.balanced_cuts(block, 3) == [2, 5]
    assert [ak.nn.reusable_tensors(block, c) for c in (0, 1, 2, 3, 4)] == [1, 1, 2, 2, 3]
    plans = ak.nn.pipeline.stage_plans(block, 4, 2)
    assert [p.kept_in for p in plans] == [0, 0, 2, 3] and [p.sent_from for p in plans] == [0, 2, 3, 0]
    assert [p.kept_out for p in plans] == [2, 3, 0, 0]
    assert all(p.kept_in == 0 for p in ak.nn.pipeline.stage_plans(block, 4, 2, cache=False))
    assert all(p.kept_in == 0 for p in ak.nn.pipeline.stage_plans(block, 4, 4))  # one stage per rank
    for cuts, match in [([2, 4], "need 3 cuts"), ([4, 2, 6], "increase strictly"), ([2, 4, 8], "cannot start")]:
        with pytest.raises(ValueError, match=match):
            ak.nn.pipeline.stage_plans(block, 4, 2, cuts)
    two_phase = script.make_pipe_model("Block-two-phase")  # 3 layers per block: cuts at block starts only
    with pytest.raises(ValueError, match="cannot start at layer 2"):
        ak.nn.pipeline.stage_plans(two_phase, 2, 2, [2])
