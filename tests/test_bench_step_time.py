"""The step-time benchmark's verdict: ratio of medians over interleaved runs (benchmarks/bench_step_time.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_step_time.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_step_time", _PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_one_slow_step_does_not_move_the_verdict(bench):
    steady = {"kit": [10.0, 10.1, 9.9, 10.0, 10.2, 10.0], "plain": [10.0, 10.0, 10.1, 9.9, 10.0, 10.1]}
    assert "1.000 (target <= 1.02): met" in bench.verdict(steady)
    steady["kit"][2] = 60.0  # one step hit by a background job: a mean would say 1.83
    assert "= 1.005 (target <= 1.02): met" in bench.verdict(steady)


def test_a_slower_kit_fails_the_target(bench):
    report = bench.verdict({"kit": [11.0] * 6, "plain": [10.0] * 6})
    assert "ratio of medians kit/plain = 1.100" in report and "NOT met" in report


def test_runs_are_interleaved_and_balanced(bench):
    order = bench.run_order(4)
    assert order.count("kit") == order.count("plain") == 4
    assert order[:4] == ["kit", "plain", "plain", "kit"]
