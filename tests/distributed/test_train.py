"""``python -m attnres_kernels.train`` at tiny size: one process, then torchrun layouts (data
parallel, pipeline schedules, tensor parallel, FSDP2 x pipeline on 4 ranks) train with the same per-step
losses (fp32 round-off); a DCP checkpoint of one layout resumes in another."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from attnres_kernels import train

if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300
TINY = ["--d-model", "16", "--layers", "4", "--heads", "2", "--blocks", "2", "--batch-size", "8", "--steps", "4"]
TOL = {"rtol": 1e-5, "atol": 1e-6}


def run(out: Path, nproc: int, *args: str) -> subprocess.CompletedProcess:
    """The entry point alone (``nproc=1``) or under ``torchrun --nproc-per-node nproc``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env["OMP_NUM_THREADS"] = "1"
    env["TMPDIR"] = str(out.parent)  # torchrun's agent leaves a torchelastic_* folder in the temporary directory
    command = [sys.executable, "-m"]
    if nproc > 1:
        command += ["torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m"]
    command += ["attnres_kernels.train", *TINY, "--out", str(out), *args]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, result.stdout + result.stderr
    return result


def losses(out: Path) -> list:
    records = [json.loads(line) for line in (out / "loss.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    return [r["loss"] for r in records]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process: the per-step losses of 4 steps."""
    out = tmp_path_factory.mktemp("one")
    result = run(out, 1, "--checkpoint-every", "2")
    assert "4/4" in result.stderr  # the progress bar
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    return losses(out)


@pytest.mark.parametrize(
    "layout",
    [["--dp", "2"], ["--pp", "2", "--schedule", "interleaved"], ["--tp", "2"]],
    ids=["dp2", "pp2-interleaved", "tp2"],
)
def test_two_ranks(reference, tmp_path, layout):
    run(tmp_path, 2, *layout, "--checkpoint-every", "0")
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-000004"]
    torch.testing.assert_close(losses(tmp_path), reference, **TOL)


def test_four_ranks_then_resume_in_another_layout(reference, tmp_path):
    """FSDP2 x pipeline (GPipe) on 4 ranks with a checkpoint every 2 steps; then the step-2
    checkpoint resumes on 2 ranks as a 1F1B pipeline and steps 3 and 4 repeat."""
    run(tmp_path, 4, "--fsdp", "2", "--pp", "2", "--schedule", "gpipe", "--checkpoint-every", "2")
    first = losses(tmp_path)
    torch.testing.assert_close(first, reference, **TOL)
    last = tmp_path / "checkpoints" / "step-000004"
    for f in last.iterdir():
        f.unlink()
    last.rmdir()
    result = run(tmp_path, 2, "--pp", "2", "--schedule", "1f1b", "--resume")
    assert "resumed at step 2" in result.stdout
    torch.testing.assert_close(losses(tmp_path), reference, **TOL)


def test_bad_arguments(tmp_path):
    with pytest.raises(SystemExit, match="need 4 processes, got 1"):
        train.main([*TINY, "--out", str(tmp_path), "--dp", "2", "--pp", "2"])
    assert not dist.is_initialized()
    with pytest.raises(SystemExit):
        train.parse_args(["--schedule", "1f1b", "--stages-per-rank", "2"])
