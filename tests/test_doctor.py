"""The run doctor (``grpo_kit.doctor``): silent on the shipped recipes' normal runs (their measured logs), each broken
run's finding within its first steps (real short runs of the embedded model), ``grpo-kit doctor``, and Trackio."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tiny_cli import TINY_SETTINGS

from grpo_kit.config import load_recipe
from grpo_kit.doctor import PATIENCE, WINDOW, diagnose
from grpo_kit.errors import GrpoKitError
from grpo_kit.train import train

#: The vital signs of the shipped recipes' normal runs, as measured: (reward, frac_reward_zero_std,
#: completions/clipped_ratio, grad_norm, entropy) per logged step of ``grpo-kit train --preset cpu --data sample``
#: (make demo's training; its first 7 of 8 steps), 2026-12-01 on the 2-core machine; the rewards of README's demo.
NORMAL_RUNS = {
    "cpu on sample (make demo)": [
        (0.25, 0.0, 0.625, 0.4563, 1.5589),
        (0.125, 0.0, 0.875, 0.3056, 1.1151),
        (0.5625, 0.0, 0.5, 0.3515, 0.9346),
        (0.625, 0.0, 0.5, 0.5207, 1.2474),
        (0.9375, 0.0, 0.125, 0.4199, 0.6103),
        (0.5938, 0.0, 0.625, 0.4449, 1.0012),
        (1.0, 0.0, 0.0, 0.2562, 0.2218),
    ],
}

#: Three logged steps of a short run: a finding that needs PATIENCE steps in a row can show up.
SHORT = {**TINY_SETTINGS, "max_steps": PATIENCE, "save_steps": PATIENCE, "logging_steps": 1}


def _rows(table: list[tuple]) -> list[dict]:
    keys = ("reward", "frac_reward_zero_std", "completions/clipped_ratio", "grad_norm", "entropy")
    return [{"step": step, "loss": 0.0, **dict(zip(keys, row, strict=True))} for step, row in enumerate(table, 1)]


@pytest.mark.parametrize("run", list(NORMAL_RUNS))
def test_the_shipped_recipes_normal_runs_raise_no_warning(run):
    """Only the beta-0 note, at step 1: the demo runs' own logs are the calibration's evidence."""
    assert [(f["check"], f["step"]) for f in diagnose(_rows(NORMAL_RUNS[run]))] == [("beta-0", 1)]


def test_flat_reward_and_collapsing_entropy_are_found_where_they_start():
    flat = _rows([(0.5, 0.0, 0.5, 0.3, 1.0)] * (2 * WINDOW))
    assert [(f["check"], f["step"]) for f in diagnose(flat)] == [("beta-0", 1), ("flat", 2 * WINDOW)]
    rising = _rows([(0.1 * step, 0.0, 0.5, 0.3, 1.0) for step in range(2 * WINDOW)])
    assert [f["check"] for f in diagnose(rising)] == ["beta-0"]
    entropy = _rows([(0.5, 0.0, 0.5, 0.3, 1.5), (0.5, 0.0, 0.5, 0.3, 1.0)] + [(0.5, 0.0, 0.5, 0.3, 0.05)] * PATIENCE)
    assert [(f["check"], f["step"]) for f in diagnose(entropy, beta=0.04)] == [("entropy", 2 + PATIENCE)]


def test_the_doctor_says_during_training_what_the_replayed_history_shows_under_seed_grpo(tmp_path):
    """SEED-GRPO logs the scaled sum as TRL's ``reward`` and what the rewards gave as ``reward_unscaled``: the live
    doctor reads the history as ``metrics.jsonl`` has it (``reward`` the unscaled sum), as ``diagnose`` replays it.
    Here the scaled reward stays flat while the rewards given rise: no "flat" finding either way."""
    from types import SimpleNamespace

    from grpo_kit.doctor import Doctor
    from grpo_kit.runs import history_rows

    state = SimpleNamespace(is_world_process_zero=True, log_history=[], global_step=0, max_steps=2 * WINDOW)
    args = SimpleNamespace(beta=0.04, report_to=[])
    doctor = Doctor(tmp_path)
    for step in range(1, 2 * WINDOW + 1):
        logs = {"reward": 0.5, "reward_unscaled": 0.05 * step, "frac_reward_zero_std": 0.5, "grad_norm": 0.3}
        state.log_history.append({**logs, "step": step})
        state.global_step = step
        doctor.on_log(args, state, None, logs=logs)
    assert not (tmp_path / "doctor.jsonl").exists()  # nothing said while training
    assert diagnose(history_rows(state.log_history), beta=0.04) == []
    flat = [{**row, "reward_unscaled": 0.5} for row in state.log_history]  # the rewards given stay flat: said
    assert [f["check"] for f in diagnose(history_rows(flat), beta=0.04)] == ["flat"]


def _findings(run_dir) -> dict[str, int]:
    """``{check: step}`` of what the Doctor callback said during the run (``doctor.jsonl``)."""
    rows = [json.loads(line) for line in (run_dir / "doctor.jsonl").read_text().splitlines()]
    return {row["check"]: row["step"] for row in rows}


@pytest.mark.slow
def test_a_reward_that_scores_every_completion_alike_is_found_and_the_doctor_command_shows_the_run(tmp_path, capsys):
    """``format`` on 8-token completions: every one scores 0. Found at step PATIENCE, said while training; then the
    run learned nothing (train's old end-of-run check, now the doctor's), and ``grpo-kit doctor`` reads it back."""
    from grpo_kit.cli import main

    recipe = load_recipe("cpu", **SHORT, reward_funcs=["format"], reward_weights=[1.0])
    result = train(recipe, data="sample", output_dir=tmp_path / "run")
    said = _findings(tmp_path / "run")
    assert said["no-signal"] == PATIENCE and said["learned-nothing"] == PATIENCE
    assert result.failed and f"doctor: warning at step {PATIENCE}: every group scored alike" in capsys.readouterr().out
    assert "warning: the run learned nothing" in result.summary()
    assert main(["doctor", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "reward: 0.000 -> 0.000" in out and "frac_reward_zero_std: mean 1" in out
    assert f"--resume continues from checkpoint-{PATIENCE}" in out
    assert f"warning at step {PATIENCE}: every group scored alike" in out
    # Extended by a step: what the first PATIENCE steps showed is not said again.
    train(recipe.replace(max_steps=PATIENCE + 1), data="sample", output_dir=tmp_path / "run", resume=True)
    checks = [json.loads(line)["check"] for line in (tmp_path / "run" / "doctor.jsonl").read_text().splitlines()]
    assert sorted(checks) == sorted(set(checks)) and "doctor: " not in capsys.readouterr().out


@pytest.mark.slow
def test_a_completion_budget_too_short_for_any_answer_is_found_and_named_in_the_model_card(tmp_path):
    """8 new tokens after the '<think>' prefill: no completion reaches </answer>. The groups differ (SIGNAL), so the
    only warning is the budget's."""
    from grpo_kit.export import export

    recipe = load_recipe("cpu", **SHORT, reward_funcs=["tiny_cli:varied"], reward_weights=[1.0])
    result = train(recipe, data="sample", output_dir=tmp_path / "run")
    assert {f["check"]: f["step"] for f in result.findings if f["level"] == "warning"} == {"clipped": PATIENCE}
    assert _findings(tmp_path / "run") == {"beta-0": 1, "clipped": PATIENCE}
    export(tmp_path / "run" / "adapter", ("lora",), out_dir=tmp_path / "exports", name="card")
    card = (tmp_path / "exports" / "card" / "README.md").read_text()
    assert f"Run doctor (`grpo-kit doctor`): step {PATIENCE}: every completion was cut" in card


@pytest.mark.slow
def test_a_learning_rate_that_wrecks_the_model_is_found_within_its_first_steps(tmp_path):
    """The cpu recipe at learning_rate 0.9 (issue 37's collapse): the model stops answering. The first update wrecks
    it, so the collapse shows in the second step's log (on 32 new tokens as on 48): two steps are the run."""
    recipe = load_recipe("cpu", max_steps=2, save_steps=2, learning_rate=0.9, max_completion_length=32)
    result = train(recipe, data="sample", output_dir=tmp_path / "run")
    said = _findings(tmp_path / "run")
    assert said["collapsed"] == 2 and result.failed


def test_report_to_trackio_without_trackio_is_refused_with_the_install_line(monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "trackio" else find_spec(name))
    with pytest.raises(GrpoKitError, match=r"pip install trackio==0\.43\.0"):
        load_recipe("cpu", report_to="trackio")


def test_a_run_reports_to_trackio_offline_with_its_metrics_completions_and_the_doctors_alerts(tmp_path, tiny_model_dir):
    """2 steps with report_to trackio (its store in a temporary folder, no network): the metrics, TRL's completions
    table and the doctor's note and warning come back through Trackio's own API, under the run folder's name."""
    pytest.importorskip("trackio")
    from tiny_cli import tiny_train_args

    env = {**os.environ, "TRACKIO_DIR": str(tmp_path / "trackio"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": os.getcwd()}
    env.pop("TRACKIO_WEBHOOK_URL", None)
    args = tiny_train_args("sample", model_name_or_path=tiny_model_dir, max_steps=2, report_to="trackio")
    train = subprocess.run(
        [sys.executable, "-m", "grpo_kit", "train", *args, "--output", str(tmp_path / "my-run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert train.returncode == 1, train.stderr[-2000:]  # the random model's completions all score 0: learned nothing
    read = (
        "import json, trackio\nfrom trackio.sqlite_storage import SQLiteStorage\n"
        "runs = [run.name for run in trackio.Api().runs('huggingface')]\n"
        "logs = SQLiteStorage.get_logs('huggingface', runs[0])\n"
        "alerts = trackio.Api().alerts('huggingface', run=runs[0])\n"
        "print(json.dumps({'runs': runs, 'logs': logs, 'alerts': alerts}, default=str))\n"
    )
    store = json.loads(subprocess.run([sys.executable, "-c", read], env=env, capture_output=True, check=True).stdout)
    assert store["runs"] == ["my-run"]
    steps = [row for row in store["logs"] if "train/reward" in row]
    assert [row["train/global_step"] for row in steps] == [1, 2]
    assert any(row.get("completions", {}).get("_type") == "trackio.table" for row in store["logs"])
    assert sorted(alert["title"] for alert in store["alerts"]) == ["beta-0 at step 1", "learned-nothing at step 2"]
