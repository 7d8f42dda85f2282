"""The multi-query schedules of the nn models: two-phase Block and chunked Full AttnRes
give the per-site results and the reference models' (logits and every gradient), run
their multi-query reads for real, and carry their state across layer boundaries."""

import pytest
import torch

import attnres_kernels as ak
from attnres_kernels import reference
from attnres_kernels.nn import layers as nn_layers
from attnres_kernels.ops import _dispatch
from tests.support import attnres_ops_called

VOCAB, D, HEADS = 29, 16, 2


def perturbed(model):
    """Moves every parameter away from its init so that depth reads are not uniform."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


def logits_and_grads(model, idx, target):
    model.zero_grad(set_to_none=True)
    logits = model(idx)
    (logits * target).sum().backward()
    return logits.detach(), {k: p.grad for k, p in model.named_parameters()}


def assert_same_model_outputs(actual, expected, what):
    """Logits rel. err < 1e-5, every gradient rel. err < 1e-4 (fp32; the fused tolerances
    of tests/nn/test_models.py)."""
    (a, grads_a), (b, grads_b) = actual, expected
    assert ((a - b).norm() / b.norm()).item() < 1e-5, what
    assert grads_a.keys() == grads_b.keys()
    for k, g in grads_b.items():
        assert grads_a[k] is not None, f"{what}: no gradient for {k}"
        assert ((grads_a[k] - g).norm() / g.norm().clamp_min(1e-12)).item() < 1e-4, f"{what}: {k}"


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("n_layers,per_block", [(6, 2), (7, 3), (12, 4)])
def test_two_phase_block_equals_per_site_and_reference(backend, n_layers, per_block):
    ref = perturbed(reference.BlockAttnResTransformer(VOCAB, D, n_layers, HEADS, layers_per_block=per_block))
    idx = torch.randint(0, VOCAB, (2, 7))
    target = torch.randn(2, 7, VOCAB)
    expected = logits_and_grads(ref, idx, target)
    results = {}
    for schedule in ("per_site", "two_phase"):
        model = ak.nn.BlockAttnResTransformer(
            VOCAB,
            D,
            n_layers,
            HEADS,
            layers_per_block=per_block,
            schedule=schedule,
            backend=backend,
            attention_backend="sdpa",
        )
        model.load_state_dict(ref.state_dict())
        results[schedule] = logits_and_grads(model, idx, target)
        assert_same_model_outputs(results[schedule], expected, f"{schedule} vs reference")
    assert_same_model_outputs(results["two_phase"], results["per_site"], "two_phase vs per_site")


def spy_reads(monkeypatch):
    """Records ``(number of sources, query shape, merged)`` of every depth read the nn layers run."""
    calls = []
    original = nn_layers.read_unchecked

    def spy(backend, sources, query, *args, prefix=None, **kwargs):
        calls.append((len(sources), tuple(query.shape), prefix is not None))
        return original(backend, sources, query, *args, prefix=prefix, **kwargs)

    monkeypatch.setattr(nn_layers, "read_unchecked", spy)
    return calls


def test_two_phase_block_runs_one_multi_query_read_per_block(monkeypatch):
    """L=6, S=2: phase 1 reads blocks 0..b with Q = 4, 4 and 5 sites (the last block's
    sites and the output site) on the C++ op; every other read merges one source."""
    model = perturbed(
        ak.nn.BlockAttnResTransformer(
            VOCAB, D, 6, HEADS, layers_per_block=2, schedule="two_phase", backend="cpu", attention_backend="sdpa"
        )
    )
    calls = spy_reads(monkeypatch)
    idx = torch.randint(0, VOCAB, (2, 5))
    ops = attnres_ops_called(lambda: model(idx).sum().backward())
    phase1 = [c for c in calls if len(c[1]) == 2]
    assert phase1 == [(1, (4, D), False), (2, (4, D), False), (3, (5, D), False)]
    assert "attnres::depth_attn_fwd" in ops and "attnres::depth_attn_bwd" in ops
    if nn_layers.fused_step_backend("cpu") is None:  # phase 2 = partial sum + a one-source merge read
        assert [c for c in calls if len(c[1]) == 1] == [(1, (D,), True)] * 10
    else:
        assert "attnres::block_step_fwd" in ops and len(calls) == 3


def test_per_site_block_reads_site_by_site(monkeypatch):
    model = ak.nn.BlockAttnResTransformer(
        VOCAB, D, 6, HEADS, layers_per_block=2, schedule="per_site", backend="cpu", attention_backend="sdpa"
    )
    calls = spy_reads(monkeypatch)
    model(torch.randint(0, VOCAB, (2, 5)))
    assert [n for n, _, _ in calls] == [1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4]
    assert all(q == (D,) and not merged for _, q, merged in calls)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_chunked_full_equals_per_site_and_reference(backend):
    n_layers = 5  # 11 sites
    ref = perturbed(reference.FullAttnResTransformer(VOCAB, D, n_layers, HEADS))
    idx = torch.randint(0, VOCAB, (2, 7))
    target = torch.randn(2, 7, VOCAB)
    expected = logits_and_grads(ref, idx, target)
    per_site = None
    for chunk in (1, 2, 3, 4, 11, 16):
        model = ak.nn.FullAttnResTransformer(
            VOCAB, D, n_layers, HEADS, chunk_size=chunk, backend=backend, attention_backend="sdpa"
        )
        model.load_state_dict(ref.state_dict())
        result = logits_and_grads(model, idx, target)
        assert_same_model_outputs(result, expected, f"chunk {chunk} vs reference")
        per_site = per_site or result
        assert_same_model_outputs(result, per_site, f"chunk {chunk} vs chunk 1")


def test_chunked_full_reads(monkeypatch):
    """L=3 (7 sites), C=3: chunks {0,1,2}, {3,4,5}, {6}. Phase 1 reads 1 and 4 sources for
    3 sites each; sites 1, 2 merge 1, 2 chunk sources, sites 4, 5 likewise; the output
    site is a chunk of its own (a plain read of 7 sources)."""
    model = ak.nn.FullAttnResTransformer(VOCAB, D, 3, HEADS, chunk_size=3, backend="cpu", attention_backend="sdpa")
    calls = spy_reads(monkeypatch)
    model(torch.randint(0, VOCAB, (2, 5)))
    Q = (3, D)
    assert calls == [
        (1, Q, False),
        (1, (D,), True),
        (2, (D,), True),
        (4, Q, False),
        (1, (D,), True),
        (2, (D,), True),
        (7, (D,), False),
    ]


@pytest.mark.parametrize(
    "kind,kwargs",
    [("Full", {"chunk_size": 3}), ("Block", {"layers_per_block": 3, "schedule": "two_phase"})],
)
def test_state_crosses_layer_boundaries(kind, kwargs):
    """A pipeline-style run (the layers in two slices, the state handed over between them,
    each layer called on its own) equals the model's forward."""
    model = perturbed(
        getattr(ak.nn, f"{kind}AttnResTransformer")(VOCAB, D, 5, HEADS, attention_backend="sdpa", **kwargs)
    )
    idx = torch.randint(0, VOCAB, (2, 6))
    state = model.initial_state(model.embed(idx))
    for layer in model.layers[:2]:  # the cut falls inside a chunk / block
        state = layer(state)
    assert state.prefix_out is not None
    assert all(isinstance(t, torch.Tensor) for t in torch.utils._pytree.tree_leaves(state) if t is not None)
    for layer in model.layers[2:]:
        state = layer(state)
    torch.testing.assert_close(model.logits(state), model(idx), rtol=0, atol=0)


def test_shard_units_follow_the_schedule():
    block = ak.nn.BlockAttnResTransformer(VOCAB, D, 7, HEADS, layers_per_block=3, schedule="two_phase")
    assert [[list(block.layers).index(m) for m in u] for u in block.shard_units()] == [[0, 1, 2], [3, 4, 5], [6]]
    per_site = ak.nn.BlockAttnResTransformer(VOCAB, D, 3, HEADS, layers_per_block=3, schedule="per_site")
    assert [len(u) for u in per_site.shard_units()] == [1, 1, 1]
    for chunk, sizes in [(1, [1] * 6), (2, [1] * 6), (3, [3, 3]), (4, [2, 2, 2]), (5, [5, 1]), (13, [6])]:
        full = ak.nn.FullAttnResTransformer(VOCAB, D, 6, HEADS, chunk_size=chunk)
        assert [len(u) for u in full.shard_units()] == sizes, chunk
    assert [len(u) for u in ak.nn.StandardTransformer(VOCAB, D, 2, HEADS).shard_units()] == [1, 1]


def test_depth_weights_of_a_two_phase_model_read_site_by_site():
    ref = perturbed(reference.BlockAttnResTransformer(VOCAB, D, 4, HEADS, layers_per_block=2))
    model = ak.nn.BlockAttnResTransformer(
        VOCAB, D, 4, HEADS, layers_per_block=2, schedule="two_phase", attention_backend="sdpa"
    )
    model.load_state_dict(ref.state_dict())
    idx = torch.randint(0, VOCAB, (2, 6))
    (la, wa), (lb, wb) = ref(idx, return_depth_weights=True), model(idx, return_depth_weights=True)
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
    assert len(wa) == len(wb) == 9
    for a, b in zip(wa, wb):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_two_phase_block_calls_a_fused_block_step_with_its_schema(monkeypatch):
    """Where a backend has ``block_step_fwd``, phase 2 is one call of it per site, with the
    arguments in schema order (a stand-in op computed by the reference checks them)."""
    calls = []

    def fake_block_step_fwd(
        partial, update, query, norm_weight, prefix_out, prefix_lse, out_norm_weight, eps, key_rank
    ):
        assert partial is None or partial.shape == update.shape
        assert key_rank is None  # full-width keys
        assert query.shape == norm_weight.shape == out_norm_weight.shape == (D,)
        assert prefix_out.shape == update.shape and prefix_lse.shape == update.shape[:-1]
        assert prefix_lse.dtype == torch.float32 and isinstance(eps, float)
        calls.append(partial is None)
        new_partial, out, lse = reference.block_step(
            partial,
            update,
            query,
            prefix_out,
            prefix_lse,
            norm_weight,
            eps=eps,
            out_norm_weight=out_norm_weight,
            return_lse=True,
        )
        return new_partial, out, lse, torch.zeros_like(lse), torch.zeros_like(lse)

    original_fused_op = _dispatch.fused_op
    monkeypatch.setattr(nn_layers, "fused_step_backend", lambda depth: depth)
    monkeypatch.setattr(
        _dispatch,
        "fused_op",
        lambda backend, name, device: (
            fake_block_step_fwd if name == "block_step_fwd" else original_fused_op(backend, name, device)
        ),
    )
    ref = perturbed(reference.BlockAttnResTransformer(VOCAB, D, 5, HEADS, layers_per_block=2))
    model = ak.nn.BlockAttnResTransformer(
        VOCAB, D, 5, HEADS, layers_per_block=2, schedule="two_phase", backend="cpu", attention_backend="sdpa"
    )
    model.load_state_dict(ref.state_dict())
    idx, target = torch.randint(0, VOCAB, (2, 6)), torch.randn(2, 6, VOCAB)
    assert_same_model_outputs(logits_and_grads(model, idx, target), logits_and_grads(ref, idx, target), "fused step")
    # 11 sites in blocks of layers {0, 1}, {2, 3}, {4}: every site but the first of a block
    # runs a step (8); the MLP site of a block's first layer has no partial sum yet.
    assert calls == [True, False, False, True, False, False, True, False]
