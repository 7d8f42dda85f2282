"""``benchmarks/gpu.py`` without a GPU: its ``--dry-run`` mode (the same code paths on tiny CPU
tensors, Triton under the interpreter) and its adapters to the peers' APIs, checked against
stand-ins that implement each peer's documented semantics."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
import types

import pytest
import torch

from attnres_kernels import reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def gpu():
    spec = importlib.util.spec_from_file_location("gpu_benchmark", os.path.join(ROOT, "benchmarks", "gpu.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script is loaded
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[spec.name]


def test_dry_run_writes_the_report(gpu, tmp_path):
    assert gpu.main(["--dry-run", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "gpu.md").read_text()
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["environment"]["dry_run"] is True
    cases = result["depth_read"]
    assert len(cases) == 2
    for label, rows in cases.items():
        by_name = {r["impl"]: r for r in rows}
        assert set(by_name) == {impl.name for impl in gpu.IMPLS}
        for name in ("triton (ours)", "reference, eager", "reference, torch.compile"):
            row = by_name[name]
            assert row["status"] == "ok", (label, name, row["status"])
            assert all(t > 0 for t in row["fwd_ms"] + row["fwd_bwd_ms"])
            assert row["fwd_gbps"] > 0 and row["fwd_bwd_gbps"] > 0
            assert set(row["accuracy"]["errors"]) == {"out", "d_sources", "d_w", "d_gamma"}
        # Absent backends and packages are skipped with a reason, not errors.
        assert by_name["cuda (ours)"]["status"].startswith("skipped: ")
        for impl in gpu.IMPLS:
            if impl.kind == "peer":
                assert by_name[impl.name]["status"].startswith("skipped: ")
        assert f"### {label}" in report
    assert result["copy_gbps"] and all(v > 0 for v in result["copy_gbps"].values())
    models = result["models"]["rows"]
    assert [(r["model"], r["depth_read"]) for r in models] == [
        ("Standard", "-"),
        ("Full", "triton"),
        ("Full", "reference"),
        ("Block", "triton"),
        ("Block", "reference"),
    ]
    for row in models:
        assert row["status"] == "ok", row
        assert row["step_ms"][0] > 0 and row["tokens_per_s"] > 0
    assert "## Training step" in report and "## How the peers are called" in report
    inkling2 = result["inkling2_reads"]
    assert [(r["queries"], r["partial"]) for r in inkling2] == [
        (1, "bfloat16"),
        (1, "float32"),
        (3, "bfloat16"),
        (3, "float32"),
    ]
    for row in inkling2:
        assert row["status"] == "ok", row
        assert row["unpatched_ms"][0] > 0 and row["patched_ms"][0] > 0
        assert row["patched_saved_mib"] < row["unpatched_saved_mib"]
    assert "## Inkling2 read module, patched vs unpatched" in report
    step = result["inkling2_step"]["rows"]
    assert [r["variant"] for r in step] == ["unpatched", "reads", "reads+norms"]
    for row in step:
        assert row["status"] == "ok", row
        assert row["step_ms"][0] > 0
        assert math.isclose(row["loss"], step[0]["loss"], rel_tol=2e-2), (row, step[0])  # bf16 round-off
    assert "## Inkling2 training step, patched vs unpatched" in report


def test_without_a_gpu_the_real_run_refuses(gpu, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert gpu.main(["--skip-models"]) == 2
    assert "--dry-run" in capsys.readouterr().err


def test_failures_are_reported_per_implementation(gpu):
    """A skip is listed with its reason, an exception as an error; both leave the others running."""

    def skipping(case, env):
        raise gpu.Skip("not here")

    def broken(case, env):
        return lambda sources, w, gamma: torch.linalg.inv(torch.zeros(2, 2))

    env = gpu.Env(torch.device("cpu"), dry_run=True, rep_ms=1, compile_backend="aot_eager")
    case = gpu.ReadCase(2, 1, 2, 8, 1, torch.float32)
    impls = [gpu.Impl("a", "peer", skipping), gpu.Impl("b", "peer", broken), gpu.IMPLS[2]]
    rows, copy_gbps = gpu.bench_case(case, env, impls)
    assert [r.status.split(":")[0] for r in rows] == ["skipped", "error", "ok"]
    assert rows[0].status == "skipped: not here" and "LinAlgError" in rows[1].status
    assert copy_gbps > 0


def test_accuracy_check_flags_a_wrong_read(gpu):
    env = gpu.Env(torch.device("cpu"), dry_run=True, rep_ms=1, compile_backend="aot_eager")
    case = gpu.ReadCase(3, 2, 2, 8, 1, torch.bfloat16)
    inputs = gpu.make_inputs(case, env.device)
    oracle = gpu.run_with_grads(gpu._reference(case, env), *inputs, dtype=torch.float32)
    same = gpu.run_with_grads(gpu._reference(case, env), *inputs)
    right = gpu.check_accuracy(gpu._reference(case, env), case, inputs, oracle, same)
    no_norm = lambda sources, w, gamma: reference.depth_attention(w, sources, None, eps=gpu.EPS)
    wrong = gpu.check_accuracy(no_norm, case, inputs, oracle, same)
    assert right.ok and not wrong.ok


# ---------------------------------------------------------------- peer adapters


def _rms_logits(v, q, eps):
    """``rsqrt(mean(v²) + eps) · <q, v>`` over the last dim, in fp32."""
    v = v.float()
    return torch.rsqrt(v.square().mean(-1) + eps) * (v * q.float()).sum(-1)


def _mix(values, logits):
    """``Σ_i softmax_i(logits) v_i`` over the leading dim, in fp32."""
    return (torch.softmax(logits, 0).unsqueeze(-1) * values.float()).sum(0)


def _fake_fla():
    def fused_attnres(query, residuals, rms_weight, rms_eps=1e-6, scale=1.0, return_weights=False):
        v = torch.stack(list(residuals))
        return _mix(v, scale * _rms_logits(v, query * rms_weight, rms_eps)).to(v.dtype)

    return {"fla": types.ModuleType("fla"), "fla.ops": types.ModuleType("fla.ops"), "fla.ops.attnres": fused_attnres}


def _fake_liger():
    class LigerAttnResFunction:
        @staticmethod
        def apply(v, w_query, w_norm, eps):
            return _mix(v, _rms_logits(v, w_query * w_norm, eps)).to(v.dtype)

    return {
        "liger_kernel": types.ModuleType("liger_kernel"),
        "liger_kernel.ops": types.ModuleType("liger_kernel.ops"),
        "liger_kernel.ops.attn_res": LigerAttnResFunction,
    }


def _fake_fast_attnres():
    def attnres(values, query, *, eps=2**-23, scale=1.0):
        v = torch.stack(list(values))
        return _mix(v, scale * _rms_logits(v, query, eps)).to(v.dtype)

    return {"attnres": attnres}


def _fake_flash_attn_res():
    def phase_1_batched_attention_triton_op(blocks, pseudo_queries, eps):
        outs, lses = [], []
        for q in pseudo_queries:
            logits = _rms_logits(blocks, q, eps)
            outs.append(_mix(blocks, logits).to(torch.bfloat16))
            lses.append(torch.logsumexp(logits, 0))
        return torch.stack(outs), torch.stack(lses)

    return {"flash_attn_res": phase_1_batched_attention_triton_op}


FAKES = {
    "fla fused_attnres": (_fake_fla, "fused_attnres"),
    "liger attn_res": (_fake_liger, "LigerAttnResFunction"),
    "fast-attnres": (_fake_fast_attnres, "attnres"),
    "flash-attn-res phase 1": (_fake_flash_attn_res, "phase_1_batched_attention_triton_op"),
}


@pytest.mark.parametrize("q", [1, 3])
@pytest.mark.parametrize("peer", sorted(FAKES))
def test_peer_adapters_map_our_arguments(gpu, monkeypatch, peer, q):
    """Each adapter, run on a stand-in with the peer's signature and documented math, equals our
    reference read with the same (sources, w, γ), forward and gradients: the γ folding, the
    stacking and the per-site calls are right."""
    make_fake, attr = FAKES[peer]
    for name, obj in make_fake().items():
        if not isinstance(obj, types.ModuleType):
            module = types.ModuleType(name)
            setattr(module, attr, obj)
            obj = module
        monkeypatch.setitem(sys.modules, name, obj)
    monkeypatch.setattr(gpu, "_needs_cuda", lambda env, package: None)
    env = gpu.Env(torch.device("cpu"), dry_run=True, rep_ms=1, compile_backend="aot_eager")
    case = gpu.ReadCase(3, 2, 3, 16, q, torch.bfloat16)
    impl = next(i for i in gpu.IMPLS if i.name == peer)
    read = impl.make(case, env)
    sources, w, gamma, grad_out = gpu.make_inputs(case, env.device)
    got = gpu.run_with_grads(read, sources, w, gamma, grad_out, dtype=torch.float32)
    want = gpu.run_with_grads(gpu._reference(case, env), sources, w, gamma, grad_out, dtype=torch.float32)
    tol = 1e-2 if peer == "flash-attn-res phase 1" else 1e-5  # it writes bf16 outputs
    for name in want:
        torch.testing.assert_close(got[name].float(), want[name], rtol=tol, atol=tol * math.sqrt(16), msg=name)


def test_flash_attn_res_limits_are_skips(gpu, monkeypatch):
    for name, obj in _fake_flash_attn_res().items():
        module = types.ModuleType(name)
        module.phase_1_batched_attention_triton_op = obj
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(gpu, "_needs_cuda", lambda env, package: None)
    env = gpu.Env(torch.device("cpu"), dry_run=True, rep_ms=1, compile_backend="aot_eager")
    with pytest.raises(gpu.Skip, match="power-of-two"):
        gpu._flash_attn_res(gpu.ReadCase(3, 1, 2, 24, 1, torch.bfloat16), env)
    with pytest.raises(gpu.Skip, match="bf16"):
        gpu._flash_attn_res(gpu.ReadCase(3, 1, 2, 16, 1, torch.float32), env)
