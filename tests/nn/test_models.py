"""Model semantics (DESIGN.md §2.2) and the reference ↔ nn contract."""

import pytest
import torch

import attnres_kernels as ak
from attnres_kernels import reference
from tests.support import attnres_ops_called

VOCAB, D, HEADS = 37, 16, 2


def expected_block_schedule(n_layers, layers_per_block):
    """Sources per site for Block AttnRes, counted directly from the rule."""
    counts, blocks, partial = [], 0, True  # the embedding is the first partial
    for i in range(n_layers):
        if i % layers_per_block == 0:
            blocks, partial = blocks + 1, False
        for _ in range(2):  # attention, then MLP
            counts.append(blocks + int(partial))
            partial = True
    return counts + [blocks + 1]


def depth_weights(model, idx):
    _, weights = model(idx, return_depth_weights=True)
    return weights


@pytest.mark.parametrize("impl", [reference, ak.nn])
def test_full_schedule_site_k_reads_k_plus_one_sources(impl):
    model = impl.FullAttnResTransformer(VOCAB, D, 3, HEADS)
    weights = depth_weights(model, torch.randint(0, VOCAB, (2, 5)))
    assert [w.shape[0] for w in weights] == [1, 2, 3, 4, 5, 6, 7]
    assert all(w.shape[1:] == (2, 5) for w in weights)


@pytest.mark.parametrize("impl", [reference, ak.nn])
@pytest.mark.parametrize("n_layers,per_block", [(6, 2), (6, 4), (5, 2), (3, 1), (4, 4)])
def test_block_schedule(impl, n_layers, per_block):
    model = impl.BlockAttnResTransformer(VOCAB, D, n_layers, HEADS, layers_per_block=per_block)
    weights = depth_weights(model, torch.randint(0, VOCAB, (2, 5)))
    counts = [w.shape[0] for w in weights]
    assert counts == expected_block_schedule(n_layers, per_block)
    if (n_layers, per_block) == (6, 2):
        assert counts == [1, 2, 2, 2, 2, 3, 3, 3, 3, 4, 4, 4, 4]  # DESIGN.md §2.2


@pytest.mark.parametrize("impl", [reference, ak.nn])
@pytest.mark.parametrize("kind", ["Full", "Block"])
def test_uniform_weights_at_init(impl, kind):
    kwargs = {"layers_per_block": 2} if kind == "Block" else {}
    model = getattr(impl, f"{kind}AttnResTransformer")(VOCAB, D, 4, HEADS, **kwargs)
    for w in depth_weights(model, torch.randint(0, VOCAB, (3, 7))):
        torch.testing.assert_close(w, torch.full_like(w, 1.0 / w.shape[0]))


@pytest.mark.parametrize("impl", [reference, ak.nn])
@pytest.mark.parametrize("n_layers", [1, 6])
def test_parameter_delta_is_two_d_per_site(impl, n_layers):
    count = lambda m: sum(p.numel() for p in m.parameters())
    standard = count(impl.StandardTransformer(VOCAB, D, n_layers, HEADS))
    n_sites = 2 * n_layers + 1
    assert count(impl.FullAttnResTransformer(VOCAB, D, n_layers, HEADS)) - standard == 2 * D * n_sites
    block = impl.BlockAttnResTransformer(VOCAB, D, n_layers, HEADS, layers_per_block=2)
    assert count(block) - standard == 2 * D * n_sites


def test_site_parameters_are_zero_query_and_unit_norm():
    model = ak.nn.FullAttnResTransformer(VOCAB, D, 2, HEADS)
    sites = [m for m in model.modules() if isinstance(m, ak.nn.DepthAttentionSite)]
    assert len(sites) == 5
    for site in sites:
        assert torch.equal(site.query, torch.zeros(D)) and torch.equal(site.norm_weight, torch.ones(D))


def _perturbed(model):
    """Moves every parameter away from its init so depth reads are not uniform."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return model


MODEL_CASES = [
    ("StandardTransformer", {}),
    ("FullAttnResTransformer", {}),
    ("BlockAttnResTransformer", {"layers_per_block": 2}),
    ("BlockAttnResTransformer", {"layers_per_block": 4}),
]


@pytest.mark.parametrize("name,kwargs", MODEL_CASES)
def test_state_dicts_load_both_ways(name, kwargs):
    ref = _perturbed(getattr(reference, name)(VOCAB, D, 5, HEADS, **kwargs))
    fused = getattr(ak.nn, name)(VOCAB, D, 5, HEADS, **kwargs)
    fused.load_state_dict(ref.state_dict(), strict=True)
    assert ref.state_dict().keys() == fused.state_dict().keys()
    back = getattr(reference, name)(VOCAB, D, 5, HEADS, **kwargs)
    back.load_state_dict(_perturbed(fused).state_dict(), strict=True)
    for (k, a), b in zip(fused.state_dict().items(), back.state_dict().values()):
        assert torch.equal(a, b), k


@pytest.mark.parametrize("name,kwargs", MODEL_CASES)
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_nn_models_match_reference(name, kwargs, backend):
    """Same state dict → logits rel. err < 1e-5 and gradients < 1e-4 (fp32). The depth
    reads run on ``backend``; attention on PyTorch's SDPA (tests/nn/test_nn_training.py
    checks the models' attention on our op)."""
    ref = _perturbed(getattr(reference, name)(VOCAB, D, 6, HEADS, **kwargs))
    fused = getattr(ak.nn, name)(VOCAB, D, 6, HEADS, backend=backend, attention_backend="sdpa", **kwargs)
    fused.load_state_dict(ref.state_dict())
    idx = torch.randint(0, VOCAB, (3, 9))
    a, b = ref(idx), fused(idx)
    assert ((a - b).norm() / a.norm()).item() < 1e-5
    target = torch.randn_like(a)
    (a * target).sum().backward()
    (b * target).sum().backward()
    for (k, p), q in zip(ref.named_parameters(), fused.parameters()):
        assert ((p.grad - q.grad).norm() / p.grad.norm().clamp_min(1e-12)).item() < 1e-4, k


@pytest.mark.parametrize("kind", ["Full", "Block"])
def test_nn_depth_weights_match_reference(kind):
    kwargs = {"layers_per_block": 2} if kind == "Block" else {}
    ref = _perturbed(getattr(reference, f"{kind}AttnResTransformer")(VOCAB, D, 4, HEADS, **kwargs))
    fused = getattr(ak.nn, f"{kind}AttnResTransformer")(VOCAB, D, 4, HEADS, **kwargs)
    fused.load_state_dict(ref.state_dict())
    idx = torch.randint(0, VOCAB, (2, 6))
    for a, b in zip(depth_weights(ref, idx), depth_weights(fused, idx)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("schedule", ["per_site", "two_phase"])
def test_nn_model_runs_the_cpu_op(schedule):
    model = _perturbed(
        ak.nn.BlockAttnResTransformer(
            VOCAB, D, 4, HEADS, layers_per_block=2, schedule=schedule, attention_backend="sdpa"
        )
    )
    idx = torch.randint(0, VOCAB, (2, 6))
    called = attnres_ops_called(lambda: model(idx).sum().backward())
    assert {"attnres::depth_attn_fwd", "attnres::depth_attn_bwd"} <= called


def test_standard_model_has_no_depth_weights():
    with pytest.raises(ValueError, match="no depth attention"):
        ak.nn.StandardTransformer(VOCAB, D, 2, HEADS)(torch.zeros(1, 3, dtype=torch.long), return_depth_weights=True)


def test_block_state_helper_commits_at_boundaries():
    emb = torch.randn(2, D)
    outputs = [torch.randn(2, D) for _ in range(4)]
    state = ak.nn.BlockAttnResState.start(emb).commit()  # layer 0 commits the embedding as block 0
    assert len(state.sources) == 1 and state.sources[0] is emb and state.partial is None
    state = state.add(outputs[0]).add(outputs[1])
    assert len(state.sources) == 2  # layer 1: inside the block, no commit
    state = state.add(outputs[2]).commit()  # layer 2: the partial sum becomes block 1
    assert len(state.sources) == 2
    torch.testing.assert_close(state.sources[1], outputs[0] + outputs[1] + outputs[2])
    state = state.add(outputs[3])
    assert len(state.sources) == 3 and state.sources[2] is outputs[3]


def test_block_state_block_sum_includes_the_pending_output():
    emb, partial, pending = torch.randn(3, 2, D)
    state = ak.nn.BlockAttnResState((emb,), partial, pending)
    torch.testing.assert_close(state.sources[1], partial + pending)
    committed = state.commit()
    assert committed.partial is None and committed.pending is None and len(committed.blocks) == 2
    torch.testing.assert_close(committed.blocks[1], partial + pending)


def test_full_state_helper_appends_sources():
    emb, y = torch.randn(2, 2, D)
    state = ak.nn.FullAttnResState.start(emb).add(y)
    assert state.sources == (emb, y)


def test_invalid_model_arguments():
    with pytest.raises(ValueError, match="layers_per_block"):
        ak.nn.BlockAttnResTransformer(VOCAB, D, 4, HEADS, layers_per_block=0)
    with pytest.raises(ValueError, match="divisible"):
        ak.nn.FullAttnResTransformer(VOCAB, 10, 2, 3)
    with pytest.raises(ValueError, match="unknown backend"):
        ak.nn.FullAttnResTransformer(VOCAB, D, 2, HEADS, backend="fast")
    with pytest.raises(ValueError, match="unknown attention backend"):
        ak.nn.StandardTransformer(VOCAB, D, 2, HEADS, attention_backend="flash")
    with pytest.raises(ValueError, match="chunk_size"):
        ak.nn.FullAttnResTransformer(VOCAB, D, 2, HEADS, chunk_size=0)
    with pytest.raises(ValueError, match="unknown schedule"):
        ak.nn.BlockAttnResTransformer(VOCAB, D, 2, HEADS, layers_per_block=1, schedule="fast")
