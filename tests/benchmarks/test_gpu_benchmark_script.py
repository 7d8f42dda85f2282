"""``python -m benchmarks.gpu`` without a GPU: its ``--dry-run`` mode (the same code paths on tiny CPU
tensors, Triton under the interpreter) and its adapters to the peers' APIs, checked against
stand-ins that implement each peer's documented semantics."""

from __future__ import annotations

import json
import math
import sys
import time
import types

import pytest
import torch
import torch.nn.functional as F

import attnres_kernels as ak
from attnres_kernels import reference
from benchmarks import gpu


def _assert_host_time_only(split):
    """A dry run measures the host's cost of a call and no device time."""
    assert split["host_us"] > 0 and split["device_ms"] is None, split


def _assert_op_rows(rows, impls, ran, accuracy_names):
    """Rows of attention or the Block step: every implementation listed, those in ``ran`` checked and
    timed, ours on CUDA skipped with the reason."""
    by_name = {r["impl"]: r for r in rows}
    assert list(by_name) == [impl.name for impl in impls]
    for name in ran:
        row = by_name[name]
        assert row["status"] == "ok", (name, row["status"])
        assert all(t > 0 for t in row["fwd_ms"] + row["fwd_bwd_ms"])
        _assert_host_time_only(row["fwd_split"])
        _assert_host_time_only(row["fwd_bwd_split"])
        assert set(row["accuracy"]["errors"]) == accuracy_names
    cuda = by_name["cuda (ours)"]
    assert cuda["status"].startswith("skipped: ") and "cuda tensors" in cuda["status"], cuda["status"]
    assert cuda["fwd_ms"] is None and cuda["fwd_split"] is None


def test_dry_run_writes_the_report(tmp_path):
    assert gpu.main(["--dry-run", "--out", str(tmp_path)]) == 0
    report = (tmp_path / "gpu.md").read_text()
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["environment"]["dry_run"] is True
    cases = result["depth_read"]
    assert len(cases) == 2
    for label, rows in cases.items():
        by_name = {r["impl"]: r for r in rows}
        assert set(by_name) == {impl.name for impl in gpu.reads.IMPLS}
        for name in ("triton (ours)", "reference, eager", "reference, torch.compile"):
            row = by_name[name]
            assert row["status"] == "ok", (label, name, row["status"])
            assert all(t > 0 for t in row["fwd_ms"] + row["fwd_bwd_ms"])
            assert row["fwd_gbps"] > 0 and row["fwd_bwd_gbps"] > 0
            assert set(row["accuracy"]["errors"]) == {"out", "d_sources", "d_w", "d_gamma"}
            _assert_host_time_only(row["fwd_split"])
            _assert_host_time_only(row["fwd_bwd_split"])
            assert f"| {name} | {row['fwd_split']['host_us']:.0f} | – |" in report  # its host/device split
        # Absent backends and packages are skipped with a reason, not errors, and have no split.
        assert by_name["cuda (ours)"]["status"].startswith("skipped: ")
        for impl in gpu.reads.IMPLS:
            if impl.kind == "peer":
                assert by_name[impl.name]["status"].startswith("skipped: ")
                assert by_name[impl.name]["fwd_split"] is None
        assert f"### {label}" in report
    assert report.count(f"| implementation | {gpu.report.SPLIT_COLUMNS} |") == len(cases)
    assert result["copy_gbps"] and all(v > 0 for v in result["copy_gbps"].values())
    attention = result["attention"]
    assert list(attention) == ["B=1 H=2 T=8 Dh=16 causal bfloat16"]
    for label, rows in attention.items():
        _assert_op_rows(rows, gpu.ops.ATTENTION_IMPLS, ("triton (ours)", "torch SDPA"), {"out", "d_q", "d_k", "d_v"})
        assert f"### {label}" in report
    assert "## Attention" in report and "| fwd ×SDPA |" in report
    block_step = result["block_step"]
    assert len(block_step) == 1
    step_names = {"new_partial", "out"} | {
        f"d_{name}"
        for name in ("partial", "update", "query", "prefix_out", "prefix_lse", "norm_weight", "out_norm_weight")
    }
    for label, rows in block_step.items():
        _assert_op_rows(rows, gpu.ops.BLOCK_STEP_IMPLS, ("triton (ours)", "reference, eager"), step_names)
        assert f"### {label}" in report
    assert "## Block step" in report and "| fwd ×eager |" in report
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
        _assert_host_time_only(row["step_split"])
    assert "## Training step" in report and "## How the peers are called" in report
    assert "| peak MiB | device ms/step | bound by |" in report
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
        _assert_host_time_only(row["step_split"])
        assert math.isclose(row["loss"], step[0]["loss"], rel_tol=2e-2), (row, step[0])  # bf16 round-off
    assert "## Inkling2 training step, patched vs unpatched" in report
    assert "| first loss | device ms/step | bound by |" in report


def test_sections_and_the_report_after_each(tmp_path, monkeypatch):
    """``--sections`` measures only the sections named, and the report is on disk after each one: a run
    cut short (here, the Block step interrupted) keeps what it measured."""

    def interrupted(env):
        raise KeyboardInterrupt

    monkeypatch.setattr(gpu.cli, "bench_block_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        gpu.main(["--dry-run", "--out", str(tmp_path), "--sections", "attention", "block_step"])
    report = (tmp_path / "gpu.md").read_text()
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert list(result["attention"]) == ["B=1 H=2 T=8 Dh=16 causal bfloat16"] and "## Attention" in report
    assert result["depth_read"] == {} and "### N=" not in report
    assert result["block_step"] == {} and "## Block step" not in report
    assert result["models"]["rows"] == [] and "## Training step" not in report
    assert result["inkling2_reads"] == [] and result["inkling2_step"] is None


def test_without_a_gpu_the_real_run_refuses(capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    assert gpu.main(["--skip-models"]) == 2
    assert "--dry-run" in capsys.readouterr().err


def test_failures_are_reported_per_implementation():
    """A skip is listed with its reason, an exception as an error; both leave the others running."""

    def skipping(case, env):
        raise gpu.environment.Skip("not here")

    def broken(case, env):
        return lambda sources, w, gamma: torch.linalg.inv(torch.zeros(2, 2))

    env = gpu.environment.Env(torch.device("cpu"), dry_run=True, rep_ms=1, compile_backend="aot_eager")
    case = gpu.reads.ReadCase(2, 1, 2, 8, 1, torch.float32)
    impls = [gpu.reads.Impl("a", "peer", skipping), gpu.reads.Impl("b", "peer", broken), gpu.reads.IMPLS[2]]
    rows, copy_gbps = gpu.reads.bench_case(case, env, impls)
    assert [r.status.split(":")[0] for r in rows] == ["skipped", "error", "ok"]
    assert rows[0].status == "skipped: not here" and "LinAlgError" in rows[1].status
    assert copy_gbps > 0


def test_split_times_the_host_and_names_the_bound():
    env = gpu.environment.Env(torch.device("cpu"), dry_run=True, rep_ms=1, compile_backend="aot_eager")
    calls = []
    split = env.split(lambda: calls.append(time.sleep(0.002)))
    assert len(calls) == 1  # a dry run times one call, without a warm-up
    assert split.host_us >= 2000 and split.device_ms is None and split.bound_by == "–"
    assert gpu.environment.Split(host_us=500.0, device_ms=0.069).bound_by == "host"
    assert gpu.environment.Split(host_us=50.0, device_ms=0.069).bound_by == "device"


def test_report_shows_each_split_and_what_bounds_it():
    """The GPU numbers of the first H100 session, as the report prints them."""
    label = "N=9 Q=1 M=8192 D=1024 bfloat16"
    triton = gpu.reads.Row(label, "triton (ours)", "ours", "ok", fwd_split=gpu.environment.Split(360.0, 0.069))
    triton.fwd_bwd_split = gpu.environment.Split(2400.0, 0.4)
    cuda = gpu.reads.Row(label, "cuda (ours)", "ours", "ok", fwd_split=gpu.environment.Split(90.0, 0.07))
    cuda.fwd_bwd_split = gpu.environment.Split(300.0, 0.41)
    skipped = gpu.reads.Row(label, "fla fused_attnres", "peer", "skipped: fla-core is not installed")
    step = gpu.models.ModelRow(
        "Full", "triton", "ok", step_ms=(70.0, 69.0, 71.0), step_split=gpu.environment.Split(70000.0, 31.0)
    )
    report = gpu.report.markdown(
        {"dry_run": False},
        {label: [triton, cuda, skipped]},
        {label: 1.0},
        [step],
        gpu.models.model_config(True, 1),
        attention_rows={"Dh=64": [triton]},
        block_step_rows={"M=8192": [cuda]},
    )
    assert "| triton (ours) | 360 | 0.069 | 2400 | 0.400 | host |" in report
    assert "| cuda (ours) | 90 | 0.070 | 300 | 0.410 | device |" in report
    assert "| fla fused_attnres | skipped: fla-core is not installed |" in report
    assert "| fla fused_attnres | –" not in report  # rows that did not run are left out of the split table
    assert "| triton (ours) | ok | – | – | – | – | 360 | 0.069 | 2400 | 0.400 | host | – |" in report
    assert "| cuda (ours) | ok | – | – | – | – | 90 | 0.070 | 300 | 0.410 | device | – |" in report
    assert "| 31.000 | host |" in report


def test_attention_and_block_step_report_each_failure(monkeypatch):
    """A backend that is not available is skipped with its reason, a wrong result is a FAIL (still
    timed), an exception an error; the other rows still run."""

    def unavailable(**inputs):
        raise ak.BackendUnavailableError("backend 'cuda' cannot run this call: not built here")

    def broken(**inputs):
        return torch.linalg.inv(torch.zeros(2, 2))

    def without_out_norm(partial, update, query, prefix_out, prefix_lse, norm_weight, out_norm_weight):
        return ak.block_step(partial, update, query, prefix_out, prefix_lse, norm_weight, backend="reference")

    env = gpu.environment.Env(torch.device("cpu"), dry_run=True, rep_ms=1, compile_backend="aot_eager")
    wrong = {
        "ATTENTION_IMPLS": lambda q, k, v: F.scaled_dot_product_attention(q, k, v),  # not causal
        "BLOCK_STEP_IMPLS": without_out_norm,
    }
    for impls, bench in (("ATTENTION_IMPLS", gpu.ops.bench_attention), ("BLOCK_STEP_IMPLS", gpu.ops.bench_block_step)):
        right = getattr(gpu.ops, impls)[-1]  # SDPA, the eager Block step
        tried = [
            gpu.ops.OpImpl(name, "ours", fn) for name, fn in (("a", unavailable), ("b", wrong[impls]), ("c", broken))
        ]
        monkeypatch.setattr(gpu.ops, impls, [*tried, right])
        (rows,) = bench(env).values()
        assert [r.status.split(":")[0] for r in rows] == ["skipped", "FAIL", "error", "ok"], impls
        assert rows[0].status == "skipped: not built here" and "LinAlgError" in rows[2].status
        assert rows[1].fwd_ms is not None and rows[1].fwd_bwd_split is not None


def test_accuracy_check_flags_a_wrong_read():
    env = gpu.environment.Env(torch.device("cpu"), dry_run=True, rep_ms=1, compile_backend="aot_eager")
    case = gpu.reads.ReadCase(3, 2, 2, 8, 1, torch.bfloat16)
    inputs = gpu.reads.make_inputs(case, env.device)
    oracle = gpu.reads.run_with_grads(gpu.reads._reference(case, env), *inputs, dtype=torch.float32)
    same = gpu.reads.run_with_grads(gpu.reads._reference(case, env), *inputs)
    right = gpu.reads.check_accuracy(gpu.reads._reference(case, env), case, inputs, oracle, same)
    no_norm = lambda sources, w, gamma: reference.depth_attention(w, sources, None, eps=gpu.environment.EPS)
    wrong = gpu.reads.check_accuracy(no_norm, case, inputs, oracle, same)
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
def test_peer_adapters_map_our_arguments(monkeypatch, peer, q):
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
    monkeypatch.setattr(gpu.reads, "_needs_cuda", lambda env, package: None)
    env = gpu.environment.Env(torch.device("cpu"), dry_run=True, rep_ms=1, compile_backend="aot_eager")
    case = gpu.reads.ReadCase(3, 2, 3, 16, q, torch.bfloat16)
    impl = next(i for i in gpu.reads.IMPLS if i.name == peer)
    read = impl.make(case, env)
    sources, w, gamma, grad_out = gpu.reads.make_inputs(case, env.device)
    got = gpu.reads.run_with_grads(read, sources, w, gamma, grad_out, dtype=torch.float32)
    want = gpu.reads.run_with_grads(gpu.reads._reference(case, env), sources, w, gamma, grad_out, dtype=torch.float32)
    tol = 1e-2 if peer == "flash-attn-res phase 1" else 1e-5  # it writes bf16 outputs
    for name in want:
        torch.testing.assert_close(got[name].float(), want[name], rtol=tol, atol=tol * math.sqrt(16), msg=name)


def test_flash_attn_res_limits_are_skips(monkeypatch):
    for name, obj in _fake_flash_attn_res().items():
        module = types.ModuleType(name)
        module.phase_1_batched_attention_triton_op = obj
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(gpu.reads, "_needs_cuda", lambda env, package: None)
    env = gpu.environment.Env(torch.device("cpu"), dry_run=True, rep_ms=1, compile_backend="aot_eager")
    with pytest.raises(gpu.environment.Skip, match="power-of-two"):
        gpu.reads._flash_attn_res(gpu.reads.ReadCase(3, 1, 2, 24, 1, torch.bfloat16), env)
    with pytest.raises(gpu.environment.Skip, match="bf16"):
        gpu.reads._flash_attn_res(gpu.reads.ReadCase(3, 1, 2, 16, 1, torch.float32), env)


def test_host_section_splits_a_read_and_restores_the_launcher(tmp_path):
    """``--sections host``: the plain-PyTorch calls, every available fused backend's read at each layer, and
    Triton's own launches (timed by wrapping the launcher's kernels, which are put back afterwards)."""
    from attnres_kernels.triton import depth_attention_ops as launch

    kernels = {name: getattr(launch, name) for name in gpu.host._TimedLaunches.KERNELS}
    assert gpu.main(["--dry-run", "--out", str(tmp_path), "--sections", "host"]) == 0
    assert {name: getattr(launch, name) for name in kernels} == kernels
    rows = json.loads((tmp_path / "gpu.json").read_text())["host"]
    assert all(0 < r["best_us"] <= r["median_us"] for r in rows), rows
    calls = {(r["backend"], r["call"]) for r in rows}
    assert ("torch", "3 chained adds, forward + `autograd.grad`") in calls
    backends = [b for b in ("triton", "cuda", "cpu") if b in ak.available_backends("cpu", 16, torch.bfloat16)]
    assert "cpu" in backends and {r["backend"] for r in rows} == {"torch", *backends}
    for backend in backends:
        for call in ("`depth_attention`, forward + `autograd.grad`", "raw backward op (no autograd)"):
            assert (backend, call) in calls
    launches = {r["call"] for r in rows if r["call"].startswith("Triton's launch")}
    assert len(launches) == (3 if "triton" in backends else 0)
    assert "## Host cost of a depth read" in (tmp_path / "gpu.md").read_text()
