"""Distributed checkpoints of the nn models (``torch.distributed.checkpoint``) under FSDP2.

Two gloo ranks save model and optimizer state (``get_state_dict``) at step 2 of 4 and
resume from it: on the same two ranks the losses and the final parameters equal those of
an uninterrupted run bitwise; resharded onto one process (no process group, a plain model)
the losses equal them to fp32 round-off; the checkpoint loads into the plain-PyTorch
reference model, whose logits equal the nn model's. The ranks run ``tests/distributed/dcp_script.py``
under ``torch.multiprocessing`` and fail after a timeout instead of hanging."""

import pytest
import torch
import torch.distributed as dist

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

import torch.distributed.checkpoint as dcp

from tests.distributed import dcp_script as script
from tests.support import spawn_ranks

# dcp.load in the test process (no process group) says it loads in a single process: the point.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

WORLD = 2
SPAWN_TIMEOUT_S = 300
CASES = list(script.CASES)


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    """The checkpoint folder and each rank's results of one 2-rank spawn over every case."""
    out = tmp_path_factory.mktemp("dcp")
    spawn_ranks(script.spawn_worker, WORLD, (WORLD, str(out / "store"), CASES, str(out)), SPAWN_TIMEOUT_S)
    return out, [torch.load(out / f"rank{rank}.pt") for rank in range(WORLD)]


@pytest.mark.parametrize("case", CASES)
def test_resume_on_the_same_ranks_is_bitwise(spawned, case):
    _, results = spawned
    for rank, result in enumerate(results):
        r = result[case]
        assert len(r["uninterrupted"]) == script.STEPS
        assert r["resumed"] == r["uninterrupted"], f"rank {rank}"
        for name, tensor in r["final"].items():
            assert torch.equal(r["resumed_final"][name], tensor), f"rank {rank} {name}"


@pytest.mark.parametrize("case", CASES)
def test_resume_resharded_onto_one_process(spawned, case):
    out, results = spawned
    torch.manual_seed(0)
    losses = script.resume(case, out / f"ckpt-{case}")
    want = results[0][case]["uninterrupted"][script.SAVE_AT :]
    torch.testing.assert_close(losses, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_checkpoint_loads_into_the_reference_model(spawned, case):
    out, _ = spawned
    reference = script.make_reference(case)
    state = {"model": reference.state_dict()}
    dcp.load(state, checkpoint_id=str(out / f"ckpt-{case}"))  # the model's entries only
    reference.load_state_dict(state["model"])
    model = script.make_model(case, seed=1)
    model.load_state_dict(state["model"])
    idx, _ = script.batch(0)
    with torch.no_grad():
        torch.testing.assert_close(reference(idx), model(idx), rtol=1e-5, atol=1e-5)
    # It is the checkpoint's state, not the reference's initial one.
    assert not torch.equal(reference.embed.weight, script.make_reference(case).embed.weight)
