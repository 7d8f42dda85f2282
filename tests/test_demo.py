"""The demo (the main job) end to end on a few epochs."""

import json

from attnres_kernels import demo


def test_demo_runs_and_writes_its_report(tmp_path, capsys):
    summary = demo.main(["--epochs", "2", "--out", str(tmp_path), "--seed", "3"])
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
