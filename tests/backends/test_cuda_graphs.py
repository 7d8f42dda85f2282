"""CUDA graphs (marked `cuda`: skipped without a GPU): the fused ops and the models captured once and
replayed. On a GPU the models' steps are host-bound (a Triton read costs the host more than its kernels
below about 1 ms of device time); a captured graph replays without that host work, so the ops must be
capturable: no synchronizing copy, no host state that a replay would read after it changed."""

import copy

import pytest
import torch
import torch.nn.functional as F

import attnres_kernels as ak
from attnres_kernels.triton import depth_attention_ops as launch
from tests.nn.test_nn_training import MODELS, VOCAB, make_trainable_pair

pytestmark = pytest.mark.cuda


def _capture(step):
    """``step()``'s outputs as a captured graph's static outputs, after the warm-up on a side stream
    that PyTorch's documentation asks for."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = step()
    return graph, outputs


@pytest.mark.parametrize("dtypes", ["bf16", "mixed"])
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_depth_read_replays_in_a_cuda_graph(backend, dtypes):
    """Forward + backward of a read with the output norm, captured once, replayed on new input values:
    bitwise the same as the op called eagerly on those values. ``mixed``: an fp32 source among bf16
    ones, out of the kernels' slot order (the order table is made on the device in the capture). Pinned
    host memory is allocated and overwritten between replays: a launch table copied from a freed pinned
    buffer would read those bytes."""
    n, m, d = 5, 300, 1000
    dts = [torch.bfloat16] * n if dtypes == "bf16" else [torch.bfloat16, torch.float32] + [torch.bfloat16] * (n - 2)
    sources = [torch.randn(m, d, device="cuda", dtype=dt, requires_grad=True) for dt in dts]
    query, norm_weight, out_norm_weight = (torch.randn(d, device="cuda", requires_grad=True) for _ in range(3))
    grad_out = torch.randn(m, d, device="cuda", dtype=torch.bfloat16)
    leaves = [*sources, query, norm_weight, out_norm_weight]

    def step():
        out = ak.depth_attention(query, sources, norm_weight, out_norm_weight=out_norm_weight, backend=backend)
        return (out, *torch.autograd.grad(out, leaves, grad_out))

    tables_before = len(launch._CAPTURED_HOST_TABLES)
    graph, captured = _capture(step)
    if backend == "triton":
        assert len(launch._CAPTURED_HOST_TABLES) > tables_before  # the capture made its own launch tables
    for _ in range(2):
        with torch.no_grad():
            for t in (*leaves, grad_out):
                t.copy_(torch.randn_like(t))
        scratch = [torch.full((4096,), -7, dtype=torch.int64).pin_memory() for _ in range(32)]
        graph.replay()
        expected = step()
        del scratch
        for got, want in zip(captured, expected, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_training_replays_as_a_graphed_callable(name):
    """``torch.cuda.make_graphed_callables(model, ...)`` (forward and backward captured, the loss and the
    AdamW step eager): three training steps give the losses and parameters of the same model run eagerly
    (the depth reads and attention on Triton in both)."""
    _, model = make_trainable_pair(name)
    model = model.cuda()
    eager = copy.deepcopy(model)
    batches = [torch.randint(0, VOCAB, (2, 9), device="cuda") for _ in range(3)]
    graphed = torch.cuda.make_graphed_callables(model, (batches[0][:, :-1].contiguous(),))

    def train(net, params):
        opt = torch.optim.AdamW(params, lr=1e-2)
        losses = []
        for batch in batches:
            logits = net(batch[:, :-1].contiguous())
            loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return torch.stack(losses)

    got = train(graphed, model.parameters())
    want = train(eager, eager.parameters())
    torch.testing.assert_close(got, want)
    for (key, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=lambda m, key=key: f"{key}: {m}")


def _train_losses(net, params, batches):
    """Three AdamW steps of ``net`` on ``batches``: the losses."""
    opt = torch.optim.AdamW(params, lr=1e-2)
    losses = []
    for batch in batches:
        logits = net(batch[:, :-1].contiguous())
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_compiled_with_reduce_overhead_trains_like_eager(name):
    """``torch.compile(mode="reduce-overhead")`` (Inductor replaying CUDA graphs): every fused op is
    captured (Inductor skips no graph for them) and three training steps give the eager model's losses
    and parameters (to Inductor's fusion round-off)."""
    from torch._dynamo.utils import counters

    _, model = make_trainable_pair(name)
    model = model.cuda()
    eager = copy.deepcopy(model)
    batches = [torch.randint(0, VOCAB, (2, 9), device="cuda") for _ in range(3)]
    counters.clear()
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    got = _train_losses(compiled, model.parameters(), batches)
    want = _train_losses(eager, eager.parameters(), batches)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for (key, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=lambda m, key=key: f"{key}: {m}")


def _inkling2_pair():
    """A tiny random Inkling2 model on the GPU and a copy patched by ``apply_attnres_kernels``."""
    pytest.importorskip("transformers", minversion="5.23")
    import transformers

    from attnres_kernels.hf import apply_attnres_kernels
    from tests.hf.test_hf_inkling2 import randomize, text_config

    torch.manual_seed(0)
    eager = randomize(transformers.Inkling2ForCausalLM(text_config())).cuda()
    patched = apply_attnres_kernels(copy.deepcopy(eager))
    return eager, patched


def test_patched_inkling2_read_replays_as_a_graphed_callable():
    """The patched AttnRes read of an Inkling2 layer, forward and backward captured by
    ``torch.cuda.make_graphed_callables`` and replayed on new values, equals the eager read."""
    eager, patched = _inkling2_pair()
    read = next(m for m in patched.modules() if type(m).__name__ == "AttnResKernelsBlockAttentionResidual")
    reference = next(m for m in eager.modules() if type(m).__name__ == "Inkling2BlockAttentionResidual")
    d = eager.config.get_text_config().hidden_size
    blocks = torch.randn(2, 7, 3, d, device="cuda", requires_grad=True)
    partial = torch.randn(2, 7, d, device="cuda", requires_grad=True)
    graphed = torch.cuda.make_graphed_callables(read, (blocks, partial))
    for _ in range(2):
        with torch.no_grad():
            blocks.copy_(torch.randn_like(blocks))
            partial.copy_(torch.randn_like(partial))
        got = graphed(blocks, partial)
        want = reference(blocks, partial)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
        grads_got = torch.autograd.grad(sum(g.sum() for g in got), (blocks, partial))
        grads_want = torch.autograd.grad(sum(w.sum() for w in want), (blocks, partial))
        for g, w in zip(grads_got, grads_want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)


def test_patched_inkling2_compiled_with_reduce_overhead_equals_eager():
    """``torch.compile(mode="reduce-overhead")`` of a patched Inkling2 model: logits and loss of three
    calls equal the unpatched eager model's."""
    eager, patched = _inkling2_pair()
    compiled = torch.compile(patched, mode="reduce-overhead")
    ids = torch.randint(1, 90, (2, 16), device="cuda")
    want = eager(ids, labels=ids)
    for _ in range(3):
        got = compiled(ids, labels=ids)
    torch.testing.assert_close(got.logits, want.logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got.loss, want.loss, rtol=1e-4, atol=1e-4)
