"""pytest-benchmark cases of the depth read on a GPU: ``pytest -m cuda --benchmark benchmarks/``
(part of ``make gpu-bench``; skipped without a CUDA device or without ``--benchmark``).

Forward and forward+backward of every implementation :mod:`gpu` (``benchmarks/gpu.py``) knows
(ours, the eager and compiled reference, the peers that are installed), on a few bf16 shapes.
pytest-benchmark times each call plus a ``torch.cuda.synchronize()``; ``extra_info`` adds
``triton.testing.do_bench``'s median (L2 flushed, no host overhead) and the achieved GB/s over the
I/O floor. An implementation that cannot run a case is skipped with its reason. The full report
with accuracy checks and ratios is ``python benchmarks/gpu.py``.
"""

import pytest
import torch
from gpu import reads as gpu  # the depth-read section of benchmarks/gpu/ (its Env and Skip included)

pytestmark = [
    pytest.mark.benchmark_suite,
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

CASES = [
    gpu.ReadCase(9, 4, 2048, 1024, 1, torch.bfloat16),
    gpu.ReadCase(33, 4, 2048, 1024, 1, torch.bfloat16),
    gpu.ReadCase(17, 4, 2048, 4096, 1, torch.bfloat16),
    gpu.ReadCase(8, 4, 2048, 2048, 4, torch.bfloat16),
]


def _env():
    return gpu.Env(torch.device("cuda"), dry_run=False, rep_ms=100, compile_backend="inductor")


def _synchronized(fn):
    def run():
        fn()
        torch.cuda.synchronize()

    return run


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd_bwd"])
@pytest.mark.parametrize("case", CASES, ids=[c.label.replace(" ", "-") for c in CASES])
@pytest.mark.parametrize("impl", gpu.IMPLS, ids=[i.name for i in gpu.IMPLS])
def test_depth_read(benchmark, impl, case, backward):
    env = _env()
    try:
        read = impl.make(case, env)
    except gpu.Skip as exc:
        pytest.skip(str(exc))
    sources, w, gamma, grad_out = gpu.make_inputs(case, env.device)
    leaves = gpu._leaves(sources, w, gamma)
    if backward:

        def fn():
            out = read(*leaves)
            return torch.autograd.grad(out, [*leaves[0], leaves[1], leaves[2]], grad_out.to(out.dtype))
    else:

        def fn():
            with torch.no_grad():
                return read(*leaves)

    median_ms = env.timer(fn)[0]
    benchmark.pedantic(_synchronized(fn), rounds=20, warmup_rounds=3)
    benchmark.extra_info["do_bench median ms"] = median_ms
    benchmark.extra_info["GB/s (floor bytes / do_bench median)"] = case.floor_bytes(backward) / median_ms / 1e6
