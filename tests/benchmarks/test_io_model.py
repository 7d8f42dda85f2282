"""benchmarks/io_model.py runs and counts what each schedule's kernels must move."""

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("cuda_emulation")


def _load_script():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "io_model.py"
    spec = importlib.util.spec_from_file_location("io_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_io_model_counts_each_schedules_rows():
    """2 layers (4 sublayers + the output site), one layer per block, 2 tokens: the forward
    rows per token, counted from the sites' reads by hand (in units of d per sublayer)."""
    io_model = _load_script()
    report, results = io_model.run([8, 16], layers=2, layers_per_block=1, tokens=2)
    rows = {name: by_d[8][0].rows / (2 * 4 * 8 * 4) for name, by_d in results.items()}
    # Full per site: site k reads k + 1 sources and writes 1 row: Σ_{k<5} (k + 2) = 20.
    assert rows["Full, per site"] == 20 / 4
    # Block per site: reads 1, 2 | 2, 3 | out 3 blocks + partial, + 1 write each = 16 (the partial
    # sums are PyTorch adds, not counted).
    assert rows["Block, per site"] == 16 / 4
    # Two-phase Block: phase 1 of block 0 reads 1 and writes 2 rows, of block 1 reads 2 and writes 3
    # (its sites and the output site); Block steps (3 rows in, 2 out; 2 in without a partial): the
    # MLP sites 4 + 4 and the output site 5. Each block's first site takes its phase-1 row as is,
    # and the sum that a commit needs is a PyTorch add (not counted).
    assert rows["Block, two-phase"] == (3 + 5 + 4 + 4 + 5) / 4
    assert results["Block, two-phase"][8][0].rows_by_kernel["block_step_fwd"] == 13 * 2 * 8 * 4
    for by_d in results.values():  # rows scale with d
        assert by_d[16][0].rows == 2 * by_d[8][0].rows and by_d[16][1].rows == 2 * by_d[8][1].rows
    assert "| Block, two-phase |" in report
