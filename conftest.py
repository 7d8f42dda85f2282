"""Repository-wide pytest setup: the ``--benchmark`` switch for the benchmark suite."""

import pytest


def pytest_addoption(parser):
    parser.addoption(
        "--benchmark",
        action="store_true",
        default=False,
        help="run the pytest-benchmark suite under benchmarks/ (skipped otherwise)",
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--benchmark"):
        return
    skip = pytest.mark.skip(reason="benchmark suite: run with `pytest --benchmark`")
    for item in items:
        if "benchmark_suite" in item.keywords:
            item.add_marker(skip)
