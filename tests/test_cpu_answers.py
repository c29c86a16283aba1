"""The CPU recipe that teaches answers: the arithmetic held-out split, the cpu-answers preset's wiring, the interval
statistics, and the benchmark's curve and verdict (benchmarks/bench_cpu_answers.py)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from grpo_kit.config import load_recipe
from grpo_kit.data import arithmetic_key, load_gsm8k, make_arithmetic_dataset
from grpo_kit.errors import GrpoKitError
from grpo_kit.stats import mcnemar_exact, paired_difference, wilson

_BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_cpu_answers.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_cpu_answers", _BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------------ held-out split


def test_held_out_split_repeats_no_training_calculation():
    train, test = load_gsm8k("arithmetic", "train"), load_gsm8k("arithmetic", "test")
    assert (len(train), len(test)) == (256, 200)
    assert not {arithmetic_key(s) for s in train["solution"]} & {arithmetic_key(s) for s in test["solution"]}
    assert all("\n" not in s.split("####")[0].strip() for s in test["solution"])


def test_excluded_calculations_do_not_come_back():
    first = make_arithmetic_dataset(50, seed=0)
    again = make_arithmetic_dataset(50, seed=0, exclude=first["solution"])
    assert not set(map(arithmetic_key, first["solution"])) & set(map(arithmetic_key, again["solution"]))


# ------------------------------------------------------------------------------------------------ preset wiring


@pytest.mark.slow
def test_cpu_answers_recipe_runs_one_step_on_arithmetic(tiny_model_dir, tmp_path):
    from grpo_kit.runs import read_metrics
    from grpo_kit.train import train

    preset = load_recipe(
        "cpu-answers", model_name_or_path=str(tiny_model_dir), max_steps=1, save_steps=1, max_completion_length=8
    )
    result = train(preset, data="arithmetic", output_dir=tmp_path / "run")
    assert result.steps == 1
    info = json.loads((result.run_dir / "run.json").read_text())
    assert info["data"] == "arithmetic"
    assert info["reward_names"] == ["correctness", "format_rate", "semantic_entropy", "reflection_rate"]
    row = read_metrics(result.metrics_path)[0]
    assert "reward/correctness" in row
    assert (result.adapter_dir / "adapter_config.json").is_file()


# ------------------------------------------------------------------------------------------------ statistics


def test_wilson_matches_the_published_value_and_stays_in_0_1():
    low, high = wilson(20, 100)
    assert (round(low, 4), round(high, 4)) == (0.1334, 0.2888)
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == pytest.approx(1.0)


def test_paired_interval_matches_newcombe_worked_example():
    # Newcombe (1998), Stat. Med. 17:2635, table II example: a=12 both, b=9, c=2, d=21; method 10 gives
    # 0.1591 (0.0112 to 0.2954).
    first = [True] * 12 + [True] * 9 + [False] * 2 + [False] * 21
    second = [True] * 12 + [False] * 9 + [True] * 2 + [False] * 21
    change = paired_difference(second, first)
    assert round(change.difference, 4) == 0.1591
    assert (round(change.interval[0], 4), round(change.interval[1], 4)) == (0.0112, 0.2954)
    assert (change.gained, change.lost) == (9, 2)


def test_no_change_is_not_significant_and_a_big_gain_is():
    same = [True, False] * 50
    assert not paired_difference(same, same).significant
    assert paired_difference(same, same).p_value == 1.0
    gained = paired_difference([False] * 100, [True] * 30 + [False] * 70)
    assert gained.significant and gained.interval[0] > 0.15


def test_mcnemar_is_symmetric_and_exact():
    assert mcnemar_exact(2, 12) == mcnemar_exact(12, 2)
    assert mcnemar_exact(0, 5) == pytest.approx(2 / 32)


def test_paired_difference_refuses_unpaired_results():
    with pytest.raises(GrpoKitError, match="same held-out set"):
        paired_difference([True, False], [True])


# ------------------------------------------------------------------------------------------------ benchmark


def test_curve_is_the_share_of_right_samples_per_step(bench):
    history = [
        {"step": 1, "reward/correctness": 0.5, "frac_reward_zero_std": 0.5},
        {"step": 2, "loss": 0.1},
        {"step": 3, "reward/correctness": 1.0, "frac_reward_zero_std": 0.25},
    ]
    assert bench.correctness_curve(history) == [(1, 0.25, 0.5), (3, 0.5, 0.25)]


def test_curve_png_is_written(bench, tmp_path):
    path = bench.plot_curve([(1, 0.1, 0.5), (2, 0.3, 0.25)], tmp_path / "c.png", before=0.2, after=0.4)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_verdict_needs_the_gain_the_interval_and_the_time(bench):
    big = paired_difference([False] * 100, [True] * 30 + [False] * 70)
    assert "met (" in bench.verdict(big, seconds=600)
    assert "NOT met" in bench.verdict(big, seconds=1200)
    small = paired_difference([False] * 100, [True] * 5 + [False] * 95)
    assert "NOT met" in bench.verdict(small, seconds=600)


def test_time_budget_stops_before_a_step_that_would_overrun(bench):
    from types import SimpleNamespace

    ticks = iter([0.0, 100.0, 200.0, 300.0])
    budget = bench.time_budget(350, clock=lambda: next(ticks))
    control = SimpleNamespace(should_training_stop=False)
    budget.on_train_begin(None, None, control)
    budget.on_step_end(None, SimpleNamespace(global_step=1), control)  # 100 s done, 200 s after the next: go on
    assert not control.should_training_stop
    budget.on_step_end(None, SimpleNamespace(global_step=2), control)  # 200 s done, the next ends at 300: go on
    assert not control.should_training_stop
    budget.on_step_end(None, SimpleNamespace(global_step=3), control)  # 300 s done, the next would end at 400
    assert control.should_training_stop
