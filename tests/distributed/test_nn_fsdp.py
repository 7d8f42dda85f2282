"""FSDP2 wrapping of the nn models in a single-process gloo group (world size 1): the
structure works (layers own their reads; shard units follow the schedule). Multi-rank
runs come with the distributed tests."""

import warnings

import pytest
import torch
import torch.distributed as dist

import attnres_kernels as ak
from tests.support import model_variants

fsdp = pytest.importorskip("torch.distributed.fsdp")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

VOCAB, D, HEADS, LAYERS = 23, 16, 2, 4


@pytest.fixture(scope="module")
def mesh():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    from torch.distributed.device_mesh import init_device_mesh

    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


CASES = {name: case for name, case in model_variants(chunk_size=4).items() if name != "Standard"}
MULTI_QUERY = {"Full-chunked", "Block-two-phase"}


def make(name):
    cls, kwargs = CASES[name]
    torch.manual_seed(0)
    model = getattr(ak.nn, cls)(VOCAB, D, LAYERS, HEADS, backend="cpu", attention_backend="sdpa", **kwargs)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def logits_and_grads(model, idx, target):
    logits = model(idx)
    (logits * target).sum().backward()
    grads = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in model.parameters()]
    return logits.detach(), grads


def shard(model, mesh, units):
    for unit in units:
        fsdp.fully_shard(unit, mesh=mesh)
    fsdp.fully_shard(model, mesh=mesh)
    return model


@pytest.mark.parametrize("name", sorted(CASES))
def test_shard_units_train_like_the_unsharded_model(name, mesh):
    idx, target = torch.randint(0, VOCAB, (2, 5)), torch.randn(2, 5, VOCAB)
    expected = logits_and_grads(make(name), idx, target)
    model = make(name)
    shard(model, mesh, model.shard_units())
    with warnings.catch_warnings():  # FSDP2 warns that layers return (pass-through) views
        warnings.simplefilter("ignore", UserWarning)
        got = logits_and_grads(model, idx, target)
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    for a, b in zip(got[1], expected[1]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_unit_per_layer(name, mesh):
    """The standard recipe, ``fully_shard(layer)`` for each layer: fine for the per-site
    schedules; the multi-query schedules raise a clear error instead of reading sharded
    parameters of the block's other layers."""
    model = make(name)
    shard(model, mesh, list(model.layers))
    idx = torch.randint(0, VOCAB, (2, 5))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        if name in MULTI_QUERY:
            with pytest.raises(ak.nn.ShardedSiteError, match=r"layers\.1\.attn_site.*shard_units"):
                model(idx)
        else:
            model(idx).sum().backward()
            assert all(p.grad is not None for p in model.parameters())
