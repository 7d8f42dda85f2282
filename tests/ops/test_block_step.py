"""The fused Block residual step (DESIGN.md §2.3): every fused backend against the reference.

``block_step(partial, update, ...)`` = ``new_partial = partial + update``, then
the next site's merge of its phase-1 read ``(h_a, lse_a)`` with the one source
``new_partial``, then optionally the output RMSNorm. The C++ CPU op runs the
full grid; Triton runs tiny shapes under the interpreter.
"""

import itertools

import pytest
import torch

import attnres_kernels as ak
import attnres_kernels.triton as triton_backend
from attnres_kernels import reference
from attnres_kernels.ops import _dispatch
from attnres_kernels.ops.block_step import resolve_backend
from tests.support import assert_close_to_oracle, attnres_ops_called, make_sources, site_params

FUSED = [b for b in ("cpu", "triton") if _dispatch.unavailable_reason(b, torch.device("cpu"), "block_step_fwd") is None]
OP_NAMESPACES = {"cpu": "attnres", "triton": "attnres_triton"}
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
LAYOUTS = ("contiguous", "strided", "transposed")


def test_fused_backends_are_available():
    """The CPU op must be built here; a silently missing backend must not shrink the suite."""
    assert "cpu" in FUSED, ak.build_info()
    assert "triton" in FUSED, "Triton interpreter backend unavailable (TRITON_INTERPRET=1 and triton installed?)"


def _acc(*dtypes):
    promoted = dtypes[0]
    for dt in dtypes[1:]:
        promoted = torch.promote_types(promoted, dt)
    return torch.float64 if promoted == torch.float64 else torch.float32


def make_step(lead, d, partial_dtype, update_dtype, prefix_dtype, layout="contiguous", out_norm=True):
    """Inputs of one step: ``(partial, update, query, prefix_out, prefix_lse, norm_weight,
    out_norm_weight)``; the prefix is a real read over two blocks, so ``lse_a`` has the
    scale of the logits."""
    layouts = [layout if len(lead) > 1 or layout != "transposed" else "strided"]
    partial = make_sources(1, lead, d, partial_dtype, *layouts)[0] if partial_dtype is not None else None
    update = make_sources(1, lead, d, update_dtype, *layouts)[0]
    w, g, g_out = site_params(None, d)
    blocks = make_sources(2, lead, d, torch.float64)
    h_a, lse_a = reference.depth_attention(w.double(), blocks, g.double(), return_lse=True)
    acc = _acc(*(dt for dt in (partial_dtype, update_dtype, prefix_dtype) if dt is not None))
    return partial, update, w, h_a.to(prefix_dtype), lse_a.to(acc), g, g_out if out_norm else None


def step_with_grads(fn, inputs, out_weights):
    """Outputs of ``fn(*inputs)`` and the gradients of a random linear function of them
    w.r.t. every tensor input (None for absent ones)."""
    leaves = [x.detach().clone().requires_grad_() if x is not None else None for x in inputs]
    outs = fn(*leaves)
    loss = sum((o.double() * w).sum() for o, w in zip(outs, out_weights))
    present = [x for x in leaves if x is not None]
    grads = iter(torch.autograd.grad(loss, present))
    return list(outs), [next(grads) if x is not None else None for x in leaves]


def stepper(backend, eps=1e-6, return_lse=True):
    def fn(partial, update, w, h_a, lse_a, g, g_out):
        kwargs = dict(eps=eps, out_norm_weight=g_out, return_lse=return_lse)
        if backend == "reference":
            return reference.block_step(partial, update, w, h_a, lse_a, g, **kwargs)
        return ak.block_step(partial, update, w, h_a, lse_a, g, backend=backend, **kwargs)

    return fn


INPUT_NAMES = ("partial", "update", "query", "prefix_out", "prefix_lse", "norm_weight", "out_norm_weight")
OUTPUT_NAMES = ("new_partial", "out", "lse")


def compare_step(backend, inputs, return_lse=True):
    """Outputs and all gradients of ``backend`` vs the reference, by FlashAttention's rule
    against the fp64 oracle; dtypes and shapes must match the reference's exactly."""
    with torch.no_grad():
        shapes = [o.shape for o in stepper("reference", return_lse=return_lse)(*inputs)]
    out_weights = [torch.randn(s, dtype=torch.float64) for s in shapes]
    fused = step_with_grads(stepper(backend, return_lse=return_lse), inputs, out_weights)
    same = step_with_grads(stepper("reference", return_lse=return_lse), inputs, out_weights)
    oracle_inputs = [x.double() if x is not None else None for x in inputs]
    oracle = step_with_grads(stepper("reference", return_lse=return_lse), oracle_inputs, out_weights)
    # new_partial is the plain sum, rounded once: bitwise the reference's.
    assert torch.equal(fused[0][0], same[0][0])
    for name, a, b, c in zip(OUTPUT_NAMES, fused[0], same[0], oracle[0]):
        assert a.dtype == b.dtype and a.shape == b.shape, (name, a.dtype, b.dtype, a.shape, b.shape)
        assert_close_to_oracle(name, a, b, c)
    for name, a, b, c in zip(INPUT_NAMES, fused[1], same[1], oracle[1]):
        if a is None:
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, ("d_" + name, a.dtype, b.dtype)
        assert_close_to_oracle("d_" + name, a, b, c)


def _grid(backend):
    dims = (1, 7, 100, 1000) if backend == "cpu" else (1, 7, 100)
    leads = ((3,), (2, 5, 11), (4, 3)) if backend == "cpu" else ((3,), (2, 3), (4,))
    cases = []
    for k, (dtype, d) in enumerate(itertools.product(DTYPES, dims)):
        lead, layout = leads[k % 3], LAYOUTS[k % 3]
        has_partial, out_norm, return_lse = k % 2 == 0, (k // 2) % 2 == 0, k % 3 != 1
        case_id = f"{backend}-{dtype}-D{d}-{lead}-{layout}-partial{int(has_partial)}-norm{int(out_norm)}"
        cases.append(pytest.param(backend, dtype, d, lead, layout, has_partial, out_norm, return_lse, id=case_id))
    return cases


@pytest.mark.parametrize(
    "backend,dtype,d,lead,layout,has_partial,out_norm,return_lse", [c for b in FUSED for c in _grid(b)]
)
def test_matches_reference(backend, dtype, d, lead, layout, has_partial, out_norm, return_lse):
    inputs = make_step(lead, d, dtype if has_partial else None, dtype, dtype, layout, out_norm)
    compare_step(backend, inputs, return_lse)


# (partial, update, prefix_out) dtypes: models under autocast keep the embedding
# (the first partial sum and block 0) in fp32 and produce bf16/fp16 sublayer outputs.
MIXES = {
    "bf16+bf16|fp32": (torch.bfloat16, torch.bfloat16, torch.float32),
    "fp32+bf16|fp32": (torch.float32, torch.bfloat16, torch.float32),
    "none+bf16|fp32": (None, torch.bfloat16, torch.float32),
    "fp16+bf16|bf16": (torch.float16, torch.bfloat16, torch.bfloat16),
    "bf16+bf16|fp64": (torch.bfloat16, torch.bfloat16, torch.float64),
    "fp64+fp32|fp16": (torch.float64, torch.float32, torch.float16),
}


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("mix", sorted(MIXES))
def test_mixed_dtypes_match_reference(backend, mix):
    """Each tensor is read in its own dtype: new_partial has the promotion of the addends,
    out the promotion with the prefix, and each input its gradient in its own dtype."""
    partial_dtype, update_dtype, prefix_dtype = MIXES[mix]
    inputs = make_step((2, 3), 37, partial_dtype, update_dtype, prefix_dtype, "strided", out_norm=True)
    compare_step(backend, inputs)


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("has_partial,out_norm", [(True, True), (False, False)])
def test_equals_the_unfused_merge(backend, has_partial, out_norm):
    """``block_step(...)[1]`` is the merge read over ``[partial + update]``, and its lse the
    lse of that merge, both through the same backend's fused ops."""
    partial, update, w, h_a, lse_a, g, g_out = make_step(
        (4, 3), 24, torch.float64 if has_partial else None, torch.float64, torch.float64, out_norm=out_norm
    )
    new, out, lse = ak.block_step(
        partial, update, w, h_a, lse_a, g, out_norm_weight=g_out, return_lse=True, backend=backend
    )
    summed = update if partial is None else partial + update
    want_out, want_lse = ak.depth_attention_merge(
        w, h_a, lse_a, [summed], g, out_norm_weight=g_out, return_lse=True, backend=backend
    )
    assert torch.equal(new, summed)
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", FUSED)
def test_two_phase_block_equals_one_read_over_all_blocks(backend):
    """Phase 1 (one multi-query read of the committed blocks for two sites) + the step of
    each site equals each site's single read over the blocks and the partial sum."""
    lead, d = (3, 4), 16
    blocks = make_sources(3, lead, d, torch.float64)
    w, g, g_out = site_params(2, d, torch.float64)
    h_a, lse_a = ak.depth_attention(w, blocks, g, return_lse=True, backend=backend)
    partial = make_sources(1, lead, d, torch.float64)[0]
    for site, update in enumerate(make_sources(2, lead, d, torch.float64)):
        partial, out = ak.block_step(
            partial, update, w[site], h_a[site], lse_a[site], g[site], out_norm_weight=g_out[site], backend=backend
        )
        want = reference.depth_attention(w[site], [*blocks, partial], g[site], out_norm_weight=g_out[site])
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)


def _gradcheck_inputs(has_partial, d=5, lead=(2, 3)):
    mk = lambda *s: torch.randn(*s, dtype=torch.float64, requires_grad=True)
    return [mk(*lead, d) if has_partial else None, mk(*lead, d), mk(d), mk(*lead, d), mk(*lead), mk(d), mk(d)]


def _gradcheck_cases():
    # Every combination on the C++ op; under Triton's slow interpreter, both optional
    # inputs present and both absent.
    combos = {
        "cpu": [(True, True), (True, False), (False, True), (False, False)],
        "triton": [(True, True), (False, False)],
    }
    return [pytest.param(b, p, n, id=f"{b}-partial{int(p)}-norm{int(n)}") for b in FUSED for p, n in combos[b]]


def _with_absent(inputs):
    """``fn`` of the present inputs (for gradcheck) that fills in the absent ones as None."""
    present = [i for i, x in enumerate(inputs) if x is not None]

    def bind(fn):
        def bound(*args):
            full = list(inputs)
            for i, a in zip(present, args):
                full[i] = a
            return fn(*full)

        return bound

    return bind, [inputs[i] for i in present]


@pytest.mark.parametrize("backend,has_partial,out_norm", _gradcheck_cases())
def test_gradcheck_fp64(backend, has_partial, out_norm):
    """Every differentiable input through every output (new_partial, out, lse)."""
    inputs = _gradcheck_inputs(has_partial)
    if not out_norm:
        inputs[6] = None
    bind, present = _with_absent(inputs)
    assert torch.autograd.gradcheck(bind(stepper(backend)), present, fast_mode=backend == "triton")


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("used", OUTPUT_NAMES)
def test_gradients_with_unused_outputs(backend, used):
    """Outputs the loss does not use reach the backward as absent gradients (the kernels'
    paths without grad_new_partial, grad_out or grad_lse): the reference's gradients."""
    inputs = _gradcheck_inputs(True)
    index = OUTPUT_NAMES.index(used)
    weight = torch.randn_like(stepper("reference")(*inputs)[index])
    got, want = (
        torch.autograd.grad((stepper(b)(*inputs)[index] * weight).sum(), inputs, materialize_grads=True)
        for b in (backend, "reference")
    )
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("backend,has_partial,out_norm", _gradcheck_cases())
def test_gradgradcheck_fp64(backend, has_partial, out_norm):
    """Double backward (through the reference, see ops._registration) is exact."""
    inputs = _gradcheck_inputs(has_partial, d=4, lead=(3,))
    if not out_norm:
        inputs[6] = None
    bind, present = _with_absent(inputs)
    assert torch.autograd.gradgradcheck(bind(stepper(backend)), present, fast_mode=backend == "triton")


@pytest.mark.parametrize("backend", FUSED)
def test_gradgradcheck_when_only_some_inputs_require_grad(backend):
    """Inputs that do not require grad get no gradient from the differentiable backward;
    here the addends' gradient flows only through new_partial."""
    partial, update, w, h_a, lse_a, g, g_out = _gradcheck_inputs(True, d=4, lead=(3,))
    h_a, lse_a, g_out = h_a.detach(), lse_a.detach(), g_out.detach()

    def fn(partial, update, w, g):
        return stepper(backend)(partial, update, w, h_a, lse_a, g, g_out)

    assert torch.autograd.gradgradcheck(fn, (partial, update, w, g), fast_mode=backend == "triton")


@pytest.mark.parametrize("backend", FUSED)
def test_double_backward_when_inputs_depend_on_each_other(backend):
    """Addends, prefix and site parameters computed from two tensors: the gradients made
    with create_graph=True are partial derivatives per input (as the kernel's), and their
    own gradients pass gradgradcheck."""
    x, y = torch.randn(3, 4, dtype=torch.float64, requires_grad=True), torch.randn(4, dtype=torch.float64)
    y.requires_grad_()

    def fn(x, y):
        return stepper(backend)(x.sin(), 2 * x, y, x.cos(), x.sum(-1), y.exp(), y.square())

    outs = fn(x, y)
    weights = [torch.randn_like(o) for o in outs]
    plain = torch.autograd.grad(outs, (x, y), weights, retain_graph=True)
    with_graph = torch.autograd.grad(outs, (x, y), weights, create_graph=True)
    for a, b in zip(plain, with_graph):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradgradcheck(fn, (x, y), fast_mode=backend == "triton")


@pytest.mark.skipif("cpu" not in FUSED, reason="needs the C++ op")
def test_create_graph_goes_through_the_differentiable_op():
    """With create_graph=True the C++ autograd calls attnres::block_step_bwd_differentiable,
    never the fused backward (not differentiable); without, the fused backward."""
    inputs = _gradcheck_inputs(True)
    outs = stepper("cpu")(*inputs)
    weights = [torch.randn_like(o) for o in outs]
    called = attnres_ops_called(lambda: torch.autograd.grad(outs, inputs, weights, create_graph=True))
    assert "attnres::block_step_bwd_differentiable" in called and "attnres::block_step_bwd" not in called, called
    called = attnres_ops_called(lambda: torch.autograd.grad(outs, inputs, weights))
    assert "attnres::block_step_bwd" in called and "attnres::block_step_bwd_differentiable" not in called, called


@pytest.mark.parametrize("backend", FUSED)
@pytest.mark.parametrize("dtypes", ["fp64", "bf16+fp32|fp32"])
def test_create_graph_gradients_equal_the_kernel_gradients(backend, dtypes):
    """With create_graph=True the gradients come from autograd through the reference
    instead of the backward kernel: the same values and dtypes."""
    if dtypes == "fp64":
        inputs = _gradcheck_inputs(True)
        tol = dict(rtol=1e-10, atol=1e-12)
    else:
        inputs = [
            x.requires_grad_() if x is not None else None
            for x in make_step((2, 3), 9, torch.bfloat16, torch.float32, torch.float32)
        ]
        tol = dict(rtol=1e-5, atol=1e-5)
    outs = stepper(backend)(*inputs)
    weights = [torch.randn_like(o) for o in outs]
    leaves = [x for x in inputs if x is not None]
    plain = torch.autograd.grad(outs, leaves, weights, retain_graph=True)
    with_graph = torch.autograd.grad(outs, leaves, weights, create_graph=True)
    for leaf, a, b in zip(leaves, plain, with_graph):
        assert a.dtype == b.dtype == leaf.dtype
        torch.testing.assert_close(b, a, **tol)


def _op_samples(d=6, lead=(3, 2)):
    """Argument tuples of ``block_step_fwd``: with and without partial, norm weights,
    grads required or not, an fp32 prefix under bf16 addends."""
    mk = lambda *s, dt=torch.float32: torch.randn(*s, dtype=dt, requires_grad=True)
    partial, update, h_a = mk(*lead, d), mk(*lead, d), mk(*lead, d)
    lse_a, w, g, g_out = mk(*lead), mk(d), torch.rand(d, requires_grad=True), torch.rand(d, requires_grad=True)
    bf16 = lambda t: t.detach().to(torch.bfloat16).requires_grad_()
    return [
        (partial, update, w, g, h_a, lse_a, g_out, 1e-6, None),
        (None, update, w, None, h_a, lse_a, None, 1e-5, None),
        (bf16(partial), bf16(update), w, g, h_a, lse_a, g_out, 1e-6, None),
        (partial.detach(), update.detach(), w.detach(), None, h_a.detach(), lse_a.detach(), g_out.detach(), 1e-6, None),
    ]


@pytest.mark.parametrize("backend", FUSED)
def test_opcheck(backend):
    ns = getattr(torch.ops, OP_NAMESPACES[backend])
    for args in _op_samples():
        torch.library.opcheck(ns.block_step_fwd.default, args)
    # The backward op alone (schema, fake kernel, no autograd of its own).
    partial, update, w, g, h_a, lse_a, g_out, eps, key_rank = [
        x.detach() if torch.is_tensor(x) else x for x in _op_samples()[0]
    ]
    new, out, lse, logit, rinv = ns.block_step_fwd.default(partial, update, w, g, h_a, lse_a, g_out, eps, key_rank)
    for grads in (
        (torch.randn_like(new), torch.randn_like(out), torch.randn_like(lse)),
        (None, torch.randn_like(out), None),
    ):
        torch.library.opcheck(
            ns.block_step_bwd.default, (*grads, new, w, g, h_a, lse_a, g_out, logit, rinv, eps, key_rank)
        )


@pytest.mark.parametrize("backend", FUSED)
def test_the_fused_op_ran_not_the_reference(backend):
    inputs = _gradcheck_inputs(True)

    def step():
        new, out = stepper(backend, return_lse=False)(*inputs)
        (new.sum() + out.sum()).backward()

    called = attnres_ops_called(step)
    ns = OP_NAMESPACES[backend]
    assert {f"{ns}::block_step_fwd", f"{ns}::block_step_bwd"} <= called, called


def test_auto_uses_the_cpu_op_for_cpu_tensors():
    inputs = _gradcheck_inputs(True)
    assert resolve_backend("auto", torch.device("cpu"), 5) == "cpu"
    called = attnres_ops_called(lambda: ak.block_step(*inputs[:2], inputs[2], inputs[3], inputs[4], inputs[5]))
    assert "attnres::block_step_fwd" in called


def test_autograd_saves_the_sum_not_the_addends():
    """Block AttnRes keeps O(N·d) state: the step must not keep the old partial sum alive."""
    partial, update, w, h_a, lse_a, g, g_out = make_step((8,), 64, torch.float32, torch.float32, torch.float32)
    partial, update = partial.requires_grad_(), update.requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        new, _ = ak.block_step(partial, update, w, h_a, lse_a, g, out_norm_weight=g_out, backend="cpu")
    storages = {t.untyped_storage().data_ptr() for t in saved}
    assert new.untyped_storage().data_ptr() in storages
    assert partial.untyped_storage().data_ptr() not in storages
    assert update.untyped_storage().data_ptr() not in storages


@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_backward_is_bitwise_deterministic(threads):
    """Same bits on every run and for 1 and 2 threads: the row reductions (d query, d norm
    weights) use a chunking that depends on the row count only. 300 rows = 19 chunks."""
    inputs = make_step((300,), 64, torch.float32, torch.bfloat16, torch.float32)
    out_weights = [torch.randn(300, 64, dtype=torch.float64), torch.randn(300, 64, dtype=torch.float64)]
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = step_with_grads(stepper("cpu", return_lse=False), inputs, out_weights)
        torch.set_num_threads(threads)
        for _ in range(2):
            got = step_with_grads(stepper("cpu", return_lse=False), inputs, out_weights)
            for a, b in zip(got[0] + got[1], want[0] + want[1]):
                assert (a is None and b is None) or torch.equal(a, b)
    finally:
        torch.set_num_threads(previous)


@pytest.fixture
def poisoned_allocations(monkeypatch):
    """Fresh tensors from ``Tensor.new_empty`` (what the Triton launchers allocate outputs,
    gradients and partials with) start as NaN: an element a kernel fails to write shows."""
    original = torch.Tensor.new_empty

    def new_empty_nan(self, *args, **kwargs):
        t = original(self, *args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch.Tensor, "new_empty", new_empty_nan)


@pytest.mark.skipif("triton" not in FUSED, reason="needs the Triton backend")
@pytest.mark.usefixtures("poisoned_allocations")
@pytest.mark.parametrize("out_norm", [True, False])
def test_triton_writes_every_element(out_norm):
    """19 rows (two backward programs, the second partial) of D = 100 (a masked 128 block)
    must equal the C++ op, with no NaN left from the poisoned buffers."""
    inputs = make_step((19,), 100, torch.float64, torch.float64, torch.float64, "strided", out_norm)
    out_weights = [
        torch.randn(19, 100, dtype=torch.float64),
        torch.randn(19, 100, dtype=torch.float64),
        torch.randn(19, dtype=torch.float64),
    ]
    got = step_with_grads(stepper("triton"), inputs, out_weights)
    want = step_with_grads(stepper("cpu"), inputs, out_weights)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        if a is not None:
            assert not a.isnan().any()
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


@pytest.mark.skipif("triton" not in FUSED, reason="needs the Triton backend")
def test_triton_configs_respect_the_register_budget():
    from attnres_kernels.triton import block_step_ops as triton_step

    for acc in (torch.float32, torch.float64):
        words = 2 if acc == torch.float64 else 1
        configs = triton_step.all_step_configs(acc)
        assert configs[-1].block_d == triton_backend.max_dim(acc)
        for cfg in configs:
            assert cfg.block_d * words // (32 * cfg.num_warps) <= 16 and cfg.num_warps <= 16
            assert cfg.max_registers * 32 * cfg.num_warps <= 65536
        for d in (d for d in (1, 7, 100, 1000, 2048, 4096) if d <= triton_backend.max_dim(acc)):
            assert triton_step.step_config(d, acc) in configs


@pytest.mark.skipif("triton" not in FUSED, reason="needs the Triton backend")
def test_triton_refuses_too_wide_rows_clearly():
    d = triton_backend.max_dim(torch.float64) + 1
    x = torch.randn(2, d, dtype=torch.float64)
    with pytest.raises(ak.BackendUnavailableError, match="D <="):
        ak.block_step(x, x, torch.zeros(d), x, torch.zeros(2, dtype=torch.float64), backend="triton")


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # numpy, in Triton's interpreter
@pytest.mark.parametrize("backend", FUSED)
def test_nan_and_inf_propagate_like_reference(backend):
    partial, update, w, h_a, lse_a, g, g_out = make_step((5,), 8, torch.float32, torch.float32, torch.float32)
    partial[1, 2] = float("nan")
    update[3, 0] = float("inf")
    h_a[4, 4] = float("nan")
    for norm in (None, g_out):
        got = ak.block_step(partial, update, w, h_a, lse_a, g, out_norm_weight=norm, return_lse=True, backend=backend)
        want = reference.block_step(partial, update, w, h_a, lse_a, g, out_norm_weight=norm, return_lse=True)
        for a, b in zip(got, want):
            assert torch.equal(a.isnan(), b.isnan())
            finite = ~b.isnan()
            torch.testing.assert_close(a[finite], b[finite])


@pytest.mark.parametrize("backend", FUSED)
def test_empty_leading_dims(backend):
    partial, update, h_a = (torch.randn(0, 3, 8, requires_grad=True) for _ in range(3))
    new, out = ak.block_step(partial, update, torch.randn(8), h_a, torch.randn(0, 3), backend=backend)
    assert new.shape == out.shape == (0, 3, 8)
    (new.sum() + out.sum()).backward()
    assert partial.grad.shape == update.grad.shape == h_a.grad.shape == (0, 3, 8)


def _bad_calls():
    x, lse, w = torch.randn(2, 3, 8), torch.randn(2, 3), torch.randn(8)
    yield "shape", ValueError, (x[:1], x, w, x, lse), {}
    yield "dtype", TypeError, (x.int(), x, w, x, lse), {}
    yield "dtype", TypeError, (None, x.int(), w, x, lse), {}
    yield "tensor", TypeError, (None, [1.0], w, x, lse), {}
    yield "is on", ValueError, (x.to("meta"), x, w, x, lse), {}
    yield "one site", ValueError, (x, x, torch.randn(2, 8), x, lse), {}
    yield "query", ValueError, (x, x, torch.randn(7), x, lse), {}
    yield "norm_weight", ValueError, (x, x, w, x, lse, torch.randn(4)), {}
    yield "out_norm_weight", ValueError, (x, x, w, x, lse), {"out_norm_weight": torch.randn(2, 8)}
    yield "prefix_out", ValueError, (x, x, w, x[:, :2], lse), {}
    yield "prefix_lse", ValueError, (x, x, w, x, lse[:1]), {}
    yield "prefix_lse", TypeError, (x, x, w, x, lse.int()), {}
    yield "eps", ValueError, (x, x, w, x, lse), {"eps": -1.0}
    yield "D = 0", ValueError, (None, torch.randn(2, 0), torch.randn(0), torch.randn(2, 0), torch.randn(2)), {}


@pytest.mark.parametrize("backend", [*FUSED, "auto"])
@pytest.mark.parametrize("case", range(len(list(_bad_calls()))))
def test_bad_input_raises_before_any_kernel(monkeypatch, backend, case):
    def no_kernel(*args, **kwargs):
        raise AssertionError("a kernel was reached with bad input")

    monkeypatch.setattr(_dispatch, "fused_op", no_kernel)
    match, error, args, kwargs = list(_bad_calls())[case]
    with pytest.raises(error, match=match):
        ak.block_step(*args, backend=backend, **kwargs)


def test_native_op_checks_its_arguments():
    """Direct callers of the C++ op (no Python validation) get a clear error too."""
    x, lse, w = torch.randn(2, 3, 8), torch.randn(2, 3), torch.randn(8)
    op = torch.ops.attnres.block_step_fwd.default
    with pytest.raises(RuntimeError, match="prefix_lse"):
        op(x, x, w, None, x, lse.double(), None, 1e-6, None)
    with pytest.raises(RuntimeError, match="partial"):
        op(x[:1], x, w, None, x, lse, None, 1e-6, None)
    with pytest.raises(RuntimeError, match="query"):
        op(x, x, torch.randn(2, 8), None, x, lse, None, 1e-6, None)
