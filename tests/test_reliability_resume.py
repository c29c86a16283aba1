"""Reliability, issue 7 part 1: a training process killed with SIGKILL (a Colab disconnect) loses nothing.

The real CLI trains in a subprocess and is SIGKILLed once a checkpoint is on disk. A kill *during* a checkpoint
write is then reproduced exactly as the Trainer would leave it (it writes ``trainer_state.json`` last): one folder
without the state file, one with a torn one, plus a torn last line in ``metrics.jsonl``. ``--resume`` must pick the
last complete checkpoint, continue at the right global step and leave a metrics history 1..N without gaps or
duplicates.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from filelock import FileLock
from tiny_cli import SIGNAL, recorded_values, tiny_train_args

from grpo_kit.cli import main
from grpo_kit.runs import LOCK_NAME, checkpoint_step, latest_checkpoint, read_metrics

#: A tiny CPU run: 2 completions of 8 tokens per step, a checkpoint every step.
TINY = tiny_train_args("arithmetic", **SIGNAL, save_steps=1, logging_steps=1)
KILL_AFTER_STEP = 2
START_TIMEOUT_S = 300


def _env() -> dict:
    env = dict(os.environ)
    env.update(GRPO_KIT_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(__file__), env.get("PYTHONPATH")]))  # tiny_cli
    return env


def _train_until_killed(model_dir, run_dir) -> int:
    """Start a long CLI run, SIGKILL it once a complete checkpoint >= KILL_AFTER_STEP exists; return that step."""
    cmd = [
        sys.executable,
        "-m",
        "grpo_kit",
        "train",
        *TINY,
        "--set",
        f"model_name_or_path={model_dir}",
        "--set",
        "max_steps=1000",
        "--output",
        str(run_dir),
    ]
    log = open(run_dir.parent / "killed-run.log", "wb")  # noqa: SIM115 - closed below, after the kill
    process = subprocess.Popen(cmd, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and process.poll() is None:
            checkpoint = latest_checkpoint(run_dir) if run_dir.is_dir() else None
            if checkpoint is not None and checkpoint_step(checkpoint) >= KILL_AFTER_STEP:
                break
            time.sleep(0.05)
        assert process.poll() is None, f"the run ended before it was killed:\n{_tail(run_dir)}"
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()
    assert process.returncode == -signal.SIGKILL
    checkpoint = latest_checkpoint(run_dir)
    assert checkpoint is not None, _tail(run_dir)
    return checkpoint_step(checkpoint)


def _tail(run_dir) -> str:
    path = run_dir.parent / "killed-run.log"
    return path.read_text(errors="replace")[-3000:] if path.is_file() else "(no log)"


def _half_written(run_dir, last: int) -> None:
    """What a kill during the next two checkpoint writes leaves: no state file, then a torn one; a torn metrics line."""
    source = run_dir / f"checkpoint-{last}"
    for step, damage in ((last + 1, "missing"), (last + 2, "torn")):
        folder = run_dir / f"checkpoint-{step}"
        if folder.exists():  # the real kill already left a partial folder here: keep it as it is
            continue
        shutil.copytree(source, folder)
        state = folder / "trainer_state.json"
        if damage == "missing":
            state.unlink()
        else:
            text = state.read_text(encoding="utf-8").replace(f'"global_step": {last}', f'"global_step": {step}')
            state.write_text(text[: len(text) // 2], encoding="utf-8")
    with open(run_dir / "metrics.jsonl", "a", encoding="utf-8") as handle:
        handle.write(f'{{"step": {last + 3}, "rew')


@pytest.mark.slow
def test_sigkilled_run_resumes_from_the_last_complete_checkpoint(tiny_model_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    last = _train_until_killed(tiny_model_dir, run_dir)
    assert not (run_dir / "adapter").exists()  # killed: no final adapter was written
    before = [row for row in read_metrics(run_dir / "metrics.jsonl") if row["step"] <= last]
    assert [row["step"] for row in before] == list(range(1, last + 1))

    _half_written(run_dir, last)
    assert latest_checkpoint(run_dir).name == f"checkpoint-{last}"  # neither half-written folder is picked

    target = last + 2
    code = main(
        [
            "train",
            *TINY,
            "--set",
            f"model_name_or_path={tiny_model_dir}",
            "--set",
            f"max_steps={target}",
            "--output",
            str(run_dir),
            "--resume",
        ]
    )
    assert code == 0, capsys.readouterr().err[-3000:]
    assert f"steps: {target}" in capsys.readouterr().out

    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == list(range(1, target + 1))  # continuous, no duplicates
    assert rows[:last] == before  # the history of the killed run is kept as it was
    for step in (last + 1, target):  # the half-written folders were rewritten by the resumed run
        state = json.loads((run_dir / f"checkpoint-{step}" / "trainer_state.json").read_text())
        assert state["global_step"] == step
    assert [entry["step"] for entry in state["log_history"] if "loss" in entry] == list(range(1, target + 1))
    assert latest_checkpoint(run_dir).name == f"checkpoint-{target}"
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_a_run_stopped_before_its_first_checkpoint_restarts_with_resume(tiny_model_dir, tmp_path, capsys):
    """Killed before any checkpoint (a disconnect in the first minutes): ``--resume`` starts again in the same folder;
    what the first attempt left is set aside with the reason, not deleted, and no command sends the user elsewhere."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "reward": 0.5}\n')
    recorded = recorded_values(**SIGNAL, model_name_or_path=tiny_model_dir)
    (run_dir / "run.json").write_text(json.dumps({"recipe": recorded, "data": "arithmetic"}))
    (run_dir / "checkpoint-1").mkdir()  # killed while saving: no trainer_state.json
    argv = [
        "train",
        *TINY,
        "--set",
        f"model_name_or_path={tiny_model_dir}",
        "--set",
        "max_steps=1",
        "--output",
        str(run_dir),
    ]
    assert main(argv) == 2 and "--resume" in capsys.readouterr().err  # a new run is not written over it
    with pytest.warns(
        UserWarning, match=r"no complete checkpoint .*checkpoint-1: no trainer_state.json.*attempt\.old-"
    ):
        assert main([*argv, "--resume"]) == 0
    assert "steps: 1" in capsys.readouterr().out
    (aside,) = run_dir.glob("attempt.old-*")
    assert (aside / "metrics.jsonl").read_text() == '{"step": 1, "reward": 0.5}\n'  # the first attempt, kept
    assert any(aside.glob("damaged-checkpoint-1.old-*"))
    assert [row["step"] for row in read_metrics(run_dir / "metrics.jsonl")] == [1]
    assert (run_dir / "adapter" / "adapter_model.safetensors").is_file()


def test_resume_of_a_folder_that_does_not_exist_is_refused(tmp_path, capsys):
    code = main(["train", *TINY, "--output", str(tmp_path / "nowhere"), "--resume"])
    assert code == 2 and "there is no run folder" in capsys.readouterr().err
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.slow
def test_extending_a_finished_run_continues_the_schedule_for_the_new_max_steps(tiny_model_dir, tmp_path):
    """TROUBLESHOOTING section 1: an extended run's learning rates are those of a run planned for the new max_steps
    from the start (linear decay from 5e-4, the cpu recipe's): 2 steps, then to 3, then to 6; no added step trains at
    rate 0."""
    run_dir = tmp_path / "run"
    argv = ["train", *TINY, "--set", f"model_name_or_path={tiny_model_dir}", "--output", str(run_dir)]
    for max_steps, resume in ((2, []), (3, ["--resume"]), (6, ["--resume"])):
        assert main([*argv, "--set", f"max_steps={max_steps}", *resume]) == 0
    rates = [row["learning_rate"] for row in read_metrics(run_dir / "metrics.jsonl")]
    expected = [5e-4, 2.5e-4, 5e-4 * (1 - 2 / 3), 5e-4 * (1 - 3 / 6), 5e-4 * (1 - 4 / 6), 5e-4 * (1 - 5 / 6)]
    assert rates == pytest.approx(expected)
    assert json.loads((run_dir / "run.json").read_text())["resumed_from_step"] == 3


@pytest.mark.slow
def test_sigterm_stops_a_run_like_ctrl_c_and_releases_the_lock(tiny_model_dir, tmp_path):
    """SIGTERM is what Colab and job schedulers send: one line, exit 143, the lock gone, the run resumable."""
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "grpo_kit",
        "train",
        *TINY,
        "--set",
        f"model_name_or_path={tiny_model_dir}",
        "--set",
        "max_steps=1000",
        "--output",
        str(run_dir),
    ]
    process = subprocess.Popen(cmd, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while (
        time.monotonic() < deadline and process.poll() is None and not (run_dir.is_dir() and latest_checkpoint(run_dir))
    ):
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 143, err[-2000:]
    assert "grpo-kit: stopped by SIGTERM" in err and "Traceback" not in err
    with FileLock(run_dir / LOCK_NAME, blocking=False):  # released (and by the OS had the process been killed)
        assert latest_checkpoint(run_dir) is not None


@pytest.mark.slow
def test_a_full_disk_at_a_checkpoint_keeps_the_one_before_for_resume(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """The disk fills while checkpoint-2 is written (torch.save's zip writer raises, as it does on a full disk): one
    line naming what is intact and what to free, the partial checkpoint removed, and --resume continues from 1."""
    import torch

    run_dir, real_save = tmp_path / "run", torch.save

    def full_at_step_2(obj, path, *args, **kwargs):
        if "checkpoint-2" in str(path):
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1536 vs 1474")
        return real_save(obj, path, *args, **kwargs)

    argv = [
        "train",
        *TINY,
        "--set",
        f"model_name_or_path={tiny_model_dir}",
        "--set",
        "max_steps=3",
        "--output",
        str(run_dir),
    ]
    monkeypatch.setattr(torch, "save", full_at_step_2)
    assert main(argv) == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if "grpo-kit: error: " in line]
    assert "Traceback" not in err and line.endswith("--resume to continue from checkpoint-1."), err
    assert "step 2" in line and "checkpoint-1 is complete" in line and "Free disk space" in line
    assert not (run_dir / "checkpoint-2").exists() and latest_checkpoint(run_dir).name == "checkpoint-1"

    monkeypatch.setattr(torch, "save", real_save)  # space freed
    assert main([*argv, "--resume"]) == 0 and "steps: 3" in capsys.readouterr().out
    assert [row["step"] for row in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3]
    assert latest_checkpoint(run_dir).name == "checkpoint-3"
