"""The demo (the main job) end to end on a few epochs."""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys

import pytest

from attnres_kernels import demo


def test_demo_runs_and_writes_its_report(tmp_path, capsys):
    # A narrow model (d=32, 2 heads) keeps the 48-step greedy decoding of three models cheap; the
    # depth structure (6 layers, 3 blocks) is the default one.
    summary = demo.run(["--epochs", "2", "--out", str(tmp_path), "--seed", "3", "--d-model", "32", "--heads", "2"])
    printed = capsys.readouterr().out
    for heading in (
        "Parameters",
        "Training loss",
        "First epoch reaching the loss",
        "Time and accuracy",
        "Example translations",
    ):
        assert heading in printed
    assert set(summary["models"]) == {"Standard", "Block", "Full"}
    assert summary["config"]["resolved_backend"] == "cpu"
    for result in summary["models"].values():
        assert len(result["losses"]) == 2 and 0 <= result["exact_match"] <= 50
        assert len(result["translations"]) == 50
    # 6 layers → 13 sites; Full's output site reads 13 sources, Block's reads 4 (3 blocks + partial).
    assert len(summary["depth_weights"]["Full"]) == 13 and len(summary["depth_weights"]["Full"][-1]) == 13
    assert len(summary["depth_weights"]["Block"]) == 13 and len(summary["depth_weights"]["Block"][-1]) == 4
    for path in ("loss_curves.png", "depth_attention.png"):
        assert (tmp_path / path).stat().st_size > 1000
    assert json.loads((tmp_path / "results.json").read_text(encoding="utf-8"))["config"]["epochs"] == 2


def test_models_train_in_alternation_epoch_by_epoch(tmp_path, monkeypatch):
    """Every epoch trains each model once before the next epoch starts (turn order reversed every
    other epoch), so that the printed time ratios compare epochs run in the same stretch of time."""
    calls = []
    train_epoch = demo.train_epoch

    def recording_train_epoch(run, *args):
        calls.append((run.result.name, len(run.result.losses)))
        train_epoch(run, *args)

    monkeypatch.setattr(demo, "train_epoch", recording_train_epoch)
    size = ["--d-model", "16", "--heads", "2", "--layers", "2", "--blocks", "1"]
    summary = demo.run(["--epochs", "3", "--out", str(tmp_path), *size])
    forward, backward = ["Standard", "Block", "Full"], ["Full", "Block", "Standard"]
    expected = [(name, epoch) for epoch, order in enumerate([forward, backward, forward]) for name in order]
    assert calls == expected
    for result in summary["models"].values():
        assert len(result["losses"]) == 3 and result["train_seconds"] > 0


def test_tokenizer_round_trip_and_batch_targets():
    pairs = demo.load_pairs()
    assert len(pairs) == 50
    tok = demo.CharTokenizer([t for p in pairs for t in p])
    for zh, en in pairs:
        assert tok.decode(tok.encode(zh)) == zh and tok.decode(tok.encode(en)) == en
    x, y = demo.make_batch(pairs[:3], tok)
    for i, (_, en) in enumerate(pairs[:3]):
        # Targets cover exactly the English characters plus <eos>.
        assert int((y[i] != -100).sum()) == len(en) + 1
        assert tok.decode(y[i][y[i] != -100].tolist()) == en


def test_installed_console_script_exits_zero(tmp_path):
    """The ``attnres-demo`` entry point of an installed package trains, plots and exits
    with status 0, printing the tables (not the results dict) on stdout."""
    try:
        dist = importlib.metadata.distribution("attnres_kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("attnres_kernels is not installed as a distribution (in-place build)")
    assert any(ep.name == "attnres-demo" for ep in dist.entry_points)
    script = shutil.which("attnres-demo", path=os.path.dirname(sys.executable))
    assert script is not None, "the attnres-demo console script is not installed next to the interpreter"
    result = subprocess.run(
        [script, "--epochs", "1", "--models", "Standard", "--d-model", "32", "--heads", "2", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Time and accuracy" in result.stdout
    assert "'models'" not in result.stdout + result.stderr  # no dump of the results dict
    assert (tmp_path / "results.json").exists() and (tmp_path / "loss_curves.png").exists()
