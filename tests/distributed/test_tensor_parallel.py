"""Tensor / sequence parallel (``attnres_kernels.nn.tensor_parallel_plan``) on CPU with gloo.

- the fused ops on DTensors (depth read with the fused output norm, merge, Block step,
  attention): sharded on the sequence, batch or heads they run with no communication and
  equal the op on whole tensors; site-parameter gradients come back partial and reduce to
  the whole gradient;
- 2 ranks, the plan on a 1-D mesh, every rank on the whole batch: the loss, every gradient
  (``full_tensor()``) and the parameters after two SGD steps equal one process's, for
  Standard, Full (site by site and chunked) and Block (per-site and two-phase);
- 4 ranks, FSDP2 x TP on a 2 x 2 ``("dp", "tp")`` mesh (the plan on ``mesh["tp"]``, then
  ``fully_shard`` over ``shard_units()`` and the root on ``mesh["dp"]``, each dp rank on
  half the batch): the same, for the multi-query schedules (Full chunked, Block two-phase).

The ranks run ``tests/distributed/tensor_parallel_script.py`` under ``torch.multiprocessing`` and fail
after a timeout instead of hanging."""

import pytest
import torch
import torch.distributed as dist

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from tests.distributed import tensor_parallel_script as script
from tests.support import spawn_ranks

SPAWN_TIMEOUT_S = 300
TOL = {"rtol": 1e-5, "atol": 1e-6}  # fp32: ranks sum rows in other orders and reduce
TP_CASES = list(script.CASES)
FSDP_TP_CASES = ["Full-chunked", "Block-two-phase"]


def spawn(tmp_path, world, jobs):
    """Each rank's results of one spawn of ``world`` ranks running ``jobs``."""
    spawn_ranks(script.spawn_worker, world, (world, str(tmp_path / "store"), jobs, str(tmp_path)), SPAWN_TIMEOUT_S)
    return [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(world)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    jobs = [("ops", "")] + [("tp", case) for case in TP_CASES]
    return spawn(tmp_path_factory.mktemp("tp"), 2, jobs)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return spawn(tmp_path_factory.mktemp("fsdp_tp"), 4, [("fsdp_tp", case) for case in FSDP_TP_CASES])


_EXPECTED = {}


def expected(case):
    """One process, whole batch: losses, step-1 gradients, parameters after the steps."""
    if case not in _EXPECTED:
        _EXPECTED[case] = script.train(script.make_model(case), *script.make_batch())
    return _EXPECTED[case]


def check_like_one_process(results, key, case):
    want = expected(case)
    for rank, result in enumerate(results):
        got = result[key]
        torch.testing.assert_close(got["losses"], want["losses"], **TOL)
        for what in ("grads", "params"):
            assert got[what].keys() == want[what].keys()
            for name, tensor in want[what].items():
                torch.testing.assert_close(
                    got[what][name], tensor, **TOL, msg=lambda m: f"rank {rank} {key} {what} {name}: {m}"
                )


@pytest.mark.parametrize("name", ["read", "merge", "block_step"])
@pytest.mark.parametrize("dim", ["sequence", "batch"])
def test_depth_ops_on_token_shards(two_ranks, name, dim):
    check = two_ranks[0]["ops"][f"{name}/{dim}"]
    assert check["forward_comms"] == 0 and check["backward_comms"] == 0
    for got, want in check["outputs"] + check["grads"]:
        torch.testing.assert_close(got, want, **TOL)
    shard = "Shard(dim=1)" if dim == "sequence" else "Shard(dim=0)"
    # Sources keep their layout; query, key-norm and output-norm weights get partial sums.
    assert check["grad_placements"] == [f"({shard},)"] * 3 + ["(Partial(sum),)"] * 3


@pytest.mark.parametrize("dim", ["heads", "batch"])
def test_attention_on_head_or_batch_shards(two_ranks, dim):
    check = two_ranks[0]["ops"][f"attention/{dim}"]
    assert check["forward_comms"] == 0 and check["backward_comms"] == 0
    for got, want in check["outputs"] + check["grads"]:
        torch.testing.assert_close(got, want, **TOL)


def test_heads_must_split_evenly(two_ranks):
    assert "n_heads = 3 must be a multiple" in two_ranks[0]["ops"]["uneven_heads_error"]


@pytest.mark.parametrize("case", TP_CASES)
def test_tensor_parallel_like_one_process(two_ranks, case):
    check_like_one_process(two_ranks, f"tp/{case}", case)
    layouts = two_ranks[0][f"tp/{case}"]["layouts"]
    d, world = script.D, 2
    assert layouts["layers.0.mlp.fc.weight"] == ((4 * d // world, d), "(Shard(dim=0),)")
    assert layouts["layers.0.mlp.proj.weight"] == ((d, 4 * d // world), "(Shard(dim=1),)")
    assert layouts["layers.0.attn.proj.weight"] == ((d, d // world), "(Shard(dim=1),)")
    assert layouts["layers.0.attn.qkv.weight"] == ((3 * d, d), "(Replicate(),)")
    assert layouts["embed.weight"][0] == ((script.VOCAB + 1) // world, d)  # the vocabulary, unevenly
    if case != "Standard":
        assert layouts["layers.0.attn_site.query"] == ((d,), "(Replicate(),)")


@pytest.mark.parametrize("case", FSDP_TP_CASES)
def test_fsdp2_times_tensor_parallel_like_one_process(four_ranks, case):
    check_like_one_process(four_ranks, f"fsdp_tp/{case}", case)
