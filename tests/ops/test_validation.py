"""Bad input raises a clear error before any kernel runs, on every backend."""

import pytest
import torch

import attnres_kernels as ak
from attnres_kernels import ops, reference

D = 6


def backends():
    """The reference and every fused backend that can run on CPU tensors here."""
    return ["reference"] + [b for b in ak.available_backends("cpu", D) if b != "reference"]


@pytest.fixture
def no_kernel(monkeypatch):
    """Makes any fused-kernel launch fail the test: errors must come from validation."""

    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched before the bad input was rejected")

    monkeypatch.setattr(ops._dispatch, "fused_op", lambda backend, name: launched)


def call(backend, query, sources, norm_weight=None, **kwargs):
    if backend == "reference":
        return reference.depth_attention(query, sources, norm_weight, **kwargs)
    return ak.depth_attention(query, sources, norm_weight, backend=backend, **kwargs)


def good_sources(n=3):
    return [torch.randn(2, 4, D) for _ in range(n)]


BAD_READS = [
    ("empty list", lambda: (torch.zeros(D), []), {}, ValueError, "empty"),
    ("empty stacked tensor", lambda: (torch.zeros(D), torch.empty(0, 2, D)), {}, ValueError, "N = 0"),
    ("not a tensor", lambda: (torch.zeros(D), [torch.randn(2, D), [1.0] * D]), {}, TypeError, "sources\\[1\\]"),
    (
        "mismatched shapes",
        lambda: (torch.zeros(D), [torch.randn(2, D), torch.randn(3, D)]),
        {},
        ValueError,
        "mismatched source shapes",
    ),
    ("query width", lambda: (torch.zeros(D + 1), good_sources()), {}, ValueError, "query"),
    ("query rank", lambda: (torch.zeros(1, 2, D), good_sources()), {}, ValueError, "query"),
    (
        "Q mismatch",
        lambda: (torch.zeros(3, D), good_sources()),
        {"norm_weight": torch.ones(2, D)},
        ValueError,
        "Q = 2 sites but `query` has Q = 3",
    ),
    (
        "[Q, D] norm for single site",
        lambda: (torch.zeros(D), good_sources()),
        {"norm_weight": torch.ones(2, D)},
        ValueError,
        "single",
    ),
    (
        "out norm width",
        lambda: (torch.zeros(D), good_sources()),
        {"out_norm_weight": torch.ones(D - 1)},
        ValueError,
        "out_norm_weight",
    ),
    ("integer sources", lambda: (torch.zeros(D), [torch.ones(2, D, dtype=torch.int32)] * 2), {}, TypeError, "dtype"),
    ("integer query", lambda: (torch.zeros(D, dtype=torch.int64), good_sources()), {}, TypeError, "floating"),
    (
        "integer source after a float one",
        lambda: (torch.zeros(D), [torch.randn(2, D), torch.ones(2, D, dtype=torch.int64)]),
        {},
        TypeError,
        "sources\\[1\\] has dtype torch.int64",
    ),
    (
        "sources on different devices",
        lambda: (torch.zeros(D), [torch.randn(2, D), torch.empty(2, D, device="meta")]),
        {},
        ValueError,
        "different devices",
    ),
    ("query on another device", lambda: (torch.zeros(D, device="meta"), good_sources()), {}, ValueError, "query"),
    ("negative eps", lambda: (torch.zeros(D), good_sources()), {"eps": -1.0}, ValueError, "eps"),
    ("zero width", lambda: (torch.zeros(0), [torch.randn(2, 0)]), {}, ValueError, "D = 0"),
]


@pytest.mark.usefixtures("no_kernel")
@pytest.mark.parametrize("backend", backends())
@pytest.mark.parametrize("case", BAD_READS, ids=[c[0] for c in BAD_READS])
def test_bad_input_is_rejected(backend, case):
    _, make, kwargs, error, message = case
    query, sources = make()
    kwargs = dict(kwargs)  # the case table is shared by every backend
    norm_weight = kwargs.pop("norm_weight", None)
    with pytest.raises(error, match=message):
        call(backend, query, sources, norm_weight, **kwargs)


@pytest.mark.usefixtures("no_kernel")
@pytest.mark.parametrize("backend", backends())
def test_bad_merge_prefix_is_rejected(backend):
    sources = good_sources(2)
    w = torch.zeros(D)
    fn = (
        reference.depth_attention_merge
        if backend == "reference"
        else (lambda *a, **k: ak.depth_attention_merge(*a, backend=backend, **k))
    )
    with pytest.raises(ValueError, match="prefix_out"):
        fn(w, torch.zeros(2, 5, D), torch.zeros(2, 4), sources)
    with pytest.raises(ValueError, match="prefix_lse"):
        fn(w, torch.zeros(2, 4, D), torch.zeros(4), sources)
    with pytest.raises(TypeError, match="prefix_out"):
        fn(w, torch.zeros(2, 4, D, dtype=torch.int32), torch.zeros(2, 4), sources)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="unknown backend"):
        ak.depth_attention(torch.zeros(D), good_sources(), backend="fastest")
    with pytest.raises(ValueError, match="unknown backend"):
        ak.nn.DepthAttentionSite(D, backend="gpu")


def test_named_backend_that_cannot_run_raises_instead_of_falling_back():
    sources = good_sources()
    with pytest.raises(ak.BackendUnavailableError, match="needs cuda tensors"):
        ak.depth_attention(torch.zeros(D), sources, backend="cuda")


def test_missing_extension_is_reported_not_hidden(monkeypatch):
    from attnres_kernels.ops import _native

    monkeypatch.setattr(_native, "LOAD_ERROR", ImportError("not built"))
    with pytest.raises(ak.BackendUnavailableError, match="not built"):
        ak.depth_attention(torch.zeros(D), good_sources(), backend="cpu")
    ops._dispatch._warned_fallbacks.clear()
    with pytest.warns(UserWarning, match="plain-PyTorch reference"):
        ak.depth_attention(torch.zeros(D), good_sources(), backend="auto")
    ops._dispatch._warned_fallbacks.clear()


def test_package_imports_without_the_extension():
    """With ``attnres_kernels._C`` unloadable the reference still works, "auto" warns
    once and falls back, and naming the C++ backend raises with the reason."""
    import subprocess
    import sys

    script = """
import sys, warnings
sys.modules["attnres_kernels._C"] = None  # makes `from .. import _C` raise ImportError
import torch
import attnres_kernels as ak
x = [torch.randn(3, 4) for _ in range(2)]
assert "not loaded" in ak.build_info()
assert ak.available_backends("cpu", 4)[0] == "reference"
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = ak.depth_attention(torch.zeros(4), x)
assert any("plain-PyTorch reference" in str(w.message) for w in caught)
torch.testing.assert_close(out, (x[0] + x[1]) / 2)
try:
    ak.depth_attention(torch.zeros(4), x, backend="cpu")
except ak.BackendUnavailableError as exc:
    assert "not available" in str(exc)
else:
    raise AssertionError("backend='cpu' ran without the extension")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_import_defers_dtensor_and_dynamo():
    """``import attnres_kernels`` imports neither ``torch.distributed.tensor`` nor
    ``torch._dynamo`` (~1 s each); what it registers with them is registered when they
    are imported later (also after ``importlib.util.find_spec`` looked one up without
    importing it): the ops' DTensor rules (a read of DTensors on a one-rank mesh
    returns a DTensor equal to the plain read) and the compile-time constant mark of
    ``fused_step_backend``."""
    import subprocess
    import sys

    script = """
import sys
import torch
import attnres_kernels as ak
from attnres_kernels.nn.layers import fused_step_backend
imported = [m for m in ("torch.distributed.tensor", "torch._dynamo") if m in sys.modules]
assert not imported, f"`import attnres_kernels` imported {imported}"
import importlib.util
assert importlib.util.find_spec("torch._dynamo") is not None  # finding a spec is no import
import torch._dynamo
# What torch.compiler.assume_constant_result sets, and dynamo reads when tracing a call.
assert fused_step_backend._dynamo_marked_constant
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
sources, query = [torch.randn(2, 5, 7) for _ in range(3)], torch.randn(7)
out = ak.depth_attention(
    DTensor.from_local(query, mesh, [Replicate()]), [DTensor.from_local(s, mesh, [Shard(1)]) for s in sources]
)
assert isinstance(out, DTensor) and out.placements == (Shard(1),), out
torch.testing.assert_close(out.to_local(), ak.depth_attention(query, sources))
dist.destroy_process_group()
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
