"""benchmarks/host_calls.py without valgrind: its dry run calls every op on every backend with Triton's
launches stubbed and puts the stub back; the arithmetic from callgrind dumps to the report's numbers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from benchmarks import host_calls

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_dry_run_stubs_triton_launches_and_puts_them_back(tmp_path):
    # A process of its own: this one runs Triton under its interpreter, which has no launch to stub.
    script = textwrap.dedent(f"""
        import torch
        import triton.backends.nvidia.driver as nvidia
        from triton.runtime.driver import driver
        import attnres_kernels as ak
        from benchmarks import host_calls

        before = driver._active, nvidia.PyKernelArg
        assert host_calls.main(["--dry-run", "--out", {str(tmp_path)!r}, "--baseline", ""]) == 0
        assert (driver._active, nvidia.PyKernelArg) == before
        try:
            ak.depth_attention(torch.ones(8), [torch.ones(2, 8)], backend="triton")
        except ak.BackendUnavailableError:
            pass
        else:
            raise AssertionError("the Triton backend still takes CPU tensors after the stub")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((tmp_path / "host_calls_cpu.json").read_text())
    entries = {(e["op"], e["backend"], e["mode"]): e for e in report["entries"]}
    expected = {(c.op, b, m) for c in host_calls.CASES for b in c.backends for m in host_calls.MODES}
    assert set(entries) == expected
    assert not [e for e in entries.values() if "error" in e], entries
    for (_, backend, mode), entry in entries.items():
        if backend == "triton":  # one forward kernel; the backward adds at least one
            assert entry["launches"] >= (1 if mode == "forward" else 2), entry
    assert "| depth read | triton |" in (tmp_path / "host_calls_cpu.md").read_text()


def test_counts_become_host_instructions_per_call(tmp_path):
    """Per call: (region − empty region) / calls; stubbed kernels: the mean over both shapes; kernels that
    run: extrapolated to zero rows; ratios to a baseline's host counts."""
    calls, rows, counts = 10, [], {host_calls.EMPTY: 500}
    for backend, per_call in (("triton", (2900, 3100)), ("cpu", (5000, 7000))):
        for batch, instructions in zip(host_calls.BATCHES, per_call):
            for mode in host_calls.MODES:
                label = host_calls._label("merge", backend, mode, batch)
                rows.append(
                    dict(op="merge", backend=backend, mode=mode, batch=batch, rows=batch * host_calls.SEQ, label=label)
                )
                rows[-1]["launches"] = 2.0
                counts[label] = 500 + calls * instructions
    entries = host_calls.summarize(rows, counts, calls)
    assert {(e["backend"], e["host"]) for e in entries} == {("triton", 3000), ("cpu", 3000)}
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(dict(environment=dict(commit="abc", date="then"), entries=entries)))
    for entry in entries:
        entry["host"] //= 3
    assert host_calls._with_baseline(entries, str(baseline))["commit"] == "abc"
    assert [round(e["ratio"], 3) for e in entries] == [0.333] * 4
