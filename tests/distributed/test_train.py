"""``python -m attnres_kernels.train`` at tiny size.

- Layouts: one process, then torchrun layouts (data parallel, tensor parallel, a pipeline, and
  the 3-D pipeline x FSDP2 x tensor parallel on 8 ranks) train with the same per-step losses and
  gradient norms (fp32 round-off): a wrong gradient scale shows in the norm, which AdamW's
  scale-invariant step would hide from the losses.
- Checkpoints: a run resumed on its own layout repeats the uninterrupted run bitwise (losses,
  gradient norms, and the final checkpoint's model and optimizer state); a checkpoint resumes in
  another layout (tensor parallel -> one process, pipeline -> tensor parallel, 3-D -> pipeline x
  tensor parallel) with the same losses.
- Manners: the lines of a run (checkpoints saved and loaded, tokens/s in the progress bar, the
  summary), argument errors printed once before any process group starts, a resume with other
  model settings naming them, ``--help`` with the defaults.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

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
LAYOUTS = {  # name: (processes, options); each saves a checkpoint every 2 of its 4 steps
    "tp2": (2, ["--tp", "2"]),
    "pp2-interleaved": (2, ["--pp", "2", "--schedule", "interleaved"]),
}


def run(out: Path, nproc: int, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """The entry point alone (``nproc=1``) or under ``torchrun --nproc-per-node nproc``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    env["OMP_NUM_THREADS"] = "1"
    env["TMPDIR"] = str(out.parent)  # torchrun's agent leaves a torchelastic_* folder in the temporary directory
    command = [sys.executable, "-m"]
    if nproc > 1:
        command += ["torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "-m"]
    command += ["attnres_kernels.train", *TINY, "--out", str(out), *args]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    if check:
        assert result.returncode == 0, result.stdout + result.stderr
    return result


def records(out: Path) -> list:
    lines = [json.loads(line) for line in (out / "loss.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, len(lines) + 1))
    return lines


def assert_like(out: Path, reference: list) -> None:
    """The losses and gradient norms of the run in ``out`` equal ``reference``'s to fp32 round-off."""
    got = records(out)
    for key in ("loss", "grad_norm"):
        torch.testing.assert_close([r[key] for r in got], [r[key] for r in reference], **TOL, msg=key)


def resumable_copy(source: Path, into: Path, step: int = 2) -> Path:
    """``into`` holding ``source``'s log and its checkpoint of ``step`` alone: where a resume starts."""
    name = f"step-{step:06d}"
    shutil.copytree(source / "checkpoints" / name, into / "checkpoints" / name)
    shutil.copy(source / "loss.jsonl", into / "loss.jsonl")
    return into


def checkpoint_state(path: Path) -> dict:
    """Every entry of a DCP checkpoint (model, optimizer, step), read in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(path), str(path.parent / f"{path.name}.pt"))
    state = torch.load(path.parent / f"{path.name}.pt")
    return {f"{group}.{key}": value for group, entries in state.items() for key, value in entries.items()}


class Run(NamedTuple):
    out: Path
    records: list
    result: subprocess.CompletedProcess


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Run:
    """One process, 4 steps, checkpoints at 2 and 4."""
    out = tmp_path_factory.mktemp("one")
    result = run(out, 1, "--checkpoint-every", "2")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002", "step-000004"]
    return Run(out, records(out), result)


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory):
    """The output folder of each of LAYOUTS (run on first use)."""
    outs = {}

    def get(name):
        if name not in outs:
            outs[name] = tmp_path_factory.mktemp(name)
            nproc, options = LAYOUTS[name]
            run(outs[name], nproc, *options, "--checkpoint-every", "2")
        return outs[name]

    return get


def test_one_process_says_what_it_does(reference):
    out, lines, result = reference
    assert f"saved checkpoint {out / 'checkpoints' / 'step-000002'} (step 2)" in result.stdout
    assert f"saved checkpoint {out / 'checkpoints' / 'step-000004'} (step 4)" in result.stdout
    final = result.stderr.replace("\r", "\n").splitlines()[-1]  # the progress bar's last state
    assert "4/4" in final and "ms/step" in final and "tokens/s" in final, final
    summary = result.stdout.splitlines()[-3:]
    assert summary[0].startswith(f"done: step 4 of 4, final loss {lines[-1]['loss']:.4f}"), summary
    assert summary[1] == f"loss log: {(out / 'loss.jsonl').resolve()}"
    assert summary[2] == f"checkpoints: {(out / 'checkpoints').resolve()} (newest: step-000004)"
    assert json.loads((out / "checkpoints" / "step-000004" / "config.json").read_text()) == {
        "model": "block",
        "d_model": 16,
        "layers": 4,
        "heads": 2,
        "blocks": 2,
    }
    assert all(r["tokens"] == lines[0]["tokens"] > 0 and r["grad_norm"] > 0 for r in lines)


def test_data_parallel(reference, tmp_path):
    run(tmp_path, 2, "--dp", "2", "--checkpoint-every", "0")
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-000004"]
    assert_like(tmp_path, reference.records)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_like_one_process(reference, layout_runs, layout):
    assert_like(layout_runs(layout), reference.records)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_on_the_same_layout_is_bitwise(layout_runs, tmp_path, layout):
    """The step-2 checkpoint of the layout, resumed on the same layout: steps 3 and 4 repeat the
    uninterrupted run's losses and gradient norms exactly, and its step-4 checkpoint holds the
    same model and optimizer state to the bit."""
    uninterrupted = layout_runs(layout)
    nproc, options = LAYOUTS[layout]
    out = resumable_copy(uninterrupted, tmp_path)
    result = run(out, nproc, *options, "--checkpoint-every", "2", "--resume")
    assert f"loaded checkpoint {out / 'checkpoints' / 'step-000002'} (step 2)" in result.stdout
    got, want = records(out), records(uninterrupted)
    assert len(got) == len(want) == 4
    assert [{**r, "seconds": None} for r in got] == [{**r, "seconds": None} for r in want]
    want = checkpoint_state(uninterrupted / "checkpoints" / "step-000004")
    got = checkpoint_state(out / "checkpoints" / "step-000004")
    assert got.keys() == want.keys() and any(key.startswith("optim.state.") for key in want)
    for key, value in want.items():
        assert torch.equal(got[key], value) if isinstance(value, torch.Tensor) else got[key] == value, key


@pytest.mark.parametrize(
    "layout,nproc,options",
    [("tp2", 1, []), ("pp2-interleaved", 2, ["--tp", "2"])],
    ids=["tensor-parallel-to-one-process", "pipeline-to-tensor-parallel"],
)
def test_resume_in_another_layout(reference, layout_runs, tmp_path, layout, nproc, options):
    out = resumable_copy(layout_runs(layout), tmp_path)
    result = run(out, nproc, *options, "--resume")
    assert "loaded checkpoint" in result.stdout and "(step 2)" in result.stdout
    assert_like(out, reference.records)


def test_pipeline_fsdp_tensor_parallel_then_resume_as_pipeline_tensor_parallel(reference, tmp_path):
    """8 ranks, pp=2 x fsdp=2 x tp=2 (GPipe), checkpoints every 2 steps; the step-2 checkpoint
    then resumes on 4 ranks as pp=2 x tp=2 (1F1B) and steps 3 and 4 repeat."""
    run(tmp_path, 8, "--pp", "2", "--fsdp", "2", "--tp", "2", "--schedule", "gpipe", "--checkpoint-every", "2")
    assert_like(tmp_path, reference.records)
    out = resumable_copy(tmp_path, tmp_path / "resumed")
    run(out, 4, "--pp", "2", "--tp", "2", "--schedule", "1f1b", "--resume")
    assert_like(out, reference.records)


@pytest.mark.parametrize(
    "world,options,message",
    [
        (1, ["--dp", "2", "--pp", "2"], "need 4 processes, got 1; run torchrun --nproc-per-node 4"),
        (1, ["--schedule", "1f1b", "--stages-per-rank", "2"], "--schedule 1f1b runs one stage per rank"),
        (1, ["--batch-size", "60"], "--batch-size 60 is more than the 50 pairs"),
        (4, ["--dp", "4", "--batch-size", "6"], "--batch-size 6 must split evenly into the 4 data ranks"),
        (2, ["--pp", "2", "--microbatches", "3"], "--microbatches 3: each data rank's 8 sequences must split"),
        (4, ["--pp", "4", "--layers", "8", "--microbatches", "2"], "needs at least as many --microbatches"),
        (4, ["--tp", "4"], "--heads 2 must be a multiple of it"),
        (1, ["--layers", "3"], "--layers 3 does not divide into --blocks 2"),
        (1, ["--d-model", "15"], "the model: d_model = 15 is not divisible by n_heads = 2"),
        (1, ["--resume"], "--resume: no complete checkpoint in"),
    ],
)
def test_bad_arguments(tmp_path, capsys, monkeypatch, world, options, message):
    """Each error names what is wrong, before any process group starts (``world``: torchrun's
    WORLD_SIZE); under torchrun the first rank prints it and the others exit with the same status
    in silence (RANK, as torchrun sets it)."""
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_info:
        train.main([*TINY, "--out", str(tmp_path), *options])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not dist.is_initialized()
    monkeypatch.setenv("RANK", "1")  # the other ranks exit with the same status, silently
    with pytest.raises(SystemExit) as exit_info:
        train.main([*TINY, "--out", str(tmp_path), *options])
    assert exit_info.value.code == 2 and capsys.readouterr().err == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_graphs_need_a_gpu(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.main([*TINY, "--out", str(tmp_path), "--cuda-graphs"])
    assert exit_info.value.code == 2
    assert "--cuda-graphs needs a GPU" in capsys.readouterr().err


@pytest.mark.cuda
def test_cuda_graphs_train_like_eager(tmp_path):
    """``--cuda-graphs`` (forward and backward replayed from graphs) gives the eager run's losses and
    gradient norms."""
    eager, graphed = tmp_path / "eager", tmp_path / "graphed"
    run(eager, 1)
    result = run(graphed, 1, "--cuda-graphs")
    assert "final loss" in result.stdout
    assert_like(graphed, records(eager))


def test_resume_with_other_model_settings_names_them(reference, tmp_path, capsys):
    out = resumable_copy(reference.out, tmp_path)
    with pytest.raises(SystemExit):
        train.main([*TINY, "--out", str(out), "--resume", "--d-model", "32", "--heads", "4"])
    err = capsys.readouterr().err
    assert "holds a model with --d-model 16, --heads 2 where this run has --d-model 32, --heads 4" in err
    with pytest.raises(SystemExit):
        train.main([*TINY, "--out", str(out), "--resume", "--model", "full"])
    assert "holds a model with --model block where this run has --model full" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train.main([*TINY, "--out", str(out), "--resume", "--steps", "2"])
    assert "is at step 2, the run has 2 steps; raise --steps" in capsys.readouterr().err


def test_help_shows_the_defaults():
    text = train.make_parser().format_help()
    for option, default in [("--d-model", "128"), ("--lr", "0.003"), ("--schedule", "1f1b"), ("--out", "train_out")]:
        line = text[text.index(f"  {option}") :]
        assert f"(default: {default})" in " ".join(line[: line.index("\n  -")].split()), option
