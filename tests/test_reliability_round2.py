"""Reliability, issue 16: the defects a new user still hit (one regression test or more per numbered item).

1. NaN exports "verified"; 2. non-finite settings and adapters; 3. ``--resume`` of a finished run; 4. a lock per run
folder; 5. checkpoints without optimizer state; 6. tracebacks (torn adapters, adapters of another base, typed
``--set`` values). The broader table of faults lives in tests/test_faults.py.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from contextlib import closing

import pytest
import torch
from filelock import FileLock
from tiny_cli import SIGNAL, TINY_SETTINGS, recorded_values, tiny_recipe, tiny_train_args, varied

from grpo_kit.callbacks import TrainingRun
from grpo_kit.cli import main
from grpo_kit.config import load_recipe
from grpo_kit.errors import GrpoKitError
from grpo_kit.files import dumps_finite
from grpo_kit.runs import LOCK_NAME, PID_NAME, NumericsError, Run, latest_checkpoint, read_metrics
from grpo_kit.train import train

NAN, INF = float("nan"), float("inf")


def _cli_error(capsys, argv) -> str:
    code = main(argv)
    captured = capsys.readouterr()
    assert code == 2, f"exit {code}\nstdout: {captured.out[-2000:]}\nstderr: {captured.err[-2000:]}"
    assert "Traceback" not in captured.err + captured.out
    return captured.err


def _strict_json(text: str):
    """``json.loads`` that refuses NaN/Infinity, as every non-Python JSON reader does."""

    def refuse(token):
        raise ValueError(f"invalid JSON token {token}")

    return json.loads(text, parse_constant=refuse)


def _poison(adapter_dir, value=NAN):
    """Set one LoRA tensor of a saved adapter to ``value`` (what a diverged run leaves)."""
    from safetensors.torch import load_file, save_file

    path = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(str(path))
    name = sorted(n for n in tensors if "lora_B" in n)[0]
    tensors[name] = torch.full_like(tensors[name], value)
    save_file(tensors, str(path))
    return name


# ------------------------------------------------------------------------------------------------ 1. NaN exports


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_non_finite_exported_weights_fail_verification(bad, tmp_path):
    from grpo_kit.verify import check_tensors

    tuned, base = torch.randn(2, 5), torch.randn(2, 5)
    candidate = tuned.clone()
    candidate[0, 0] = bad
    with pytest.raises(GrpoKitError, match="NaN/inf.*Nothing was written"):
        check_tensors("merged16", [("w", candidate, tuned, base)], 2**-7, path=tmp_path, detail="test")


def test_nan_reference_fails_verification_even_when_the_export_matches_it(tmp_path):
    from grpo_kit.verify import check_tensors

    tuned = torch.full((2, 5), NAN)
    with pytest.raises(GrpoKitError, match="NaN/inf"):
        check_tensors("merged16", [("w", tuned.clone(), tuned, torch.randn(2, 5))], 2**-7, path=tmp_path, detail="test")


@pytest.mark.parametrize("fmt", ["lora", "merged16"])
def test_export_refuses_an_adapter_with_nan_weights(fmt, tiny_model_dir, make_adapter, tmp_path, capsys):
    adapter = make_adapter(tiny_model_dir, tmp_path / "run" / "adapter")
    tensor = _poison(adapter)
    before = (adapter / "adapter_model.safetensors").read_bytes()
    err = _cli_error(
        capsys,
        [
            "export",
            "--adapter",
            str(adapter),
            "--model",
            str(tiny_model_dir),
            "--format",
            fmt,
            "--out-dir",
            str(tmp_path / "exports"),
        ],
    )
    assert "NaN/inf weights" in err and tensor in err and "--set learning_rate=" in err
    assert not (tmp_path / "exports" / "run").exists()
    assert (adapter / "adapter_model.safetensors").read_bytes() == before  # nothing lost


def test_export_json_is_strict_json(tiny_model_dir, make_adapter, tmp_path):
    from grpo_kit.export import export

    adapter = make_adapter(tiny_model_dir, tmp_path / "run" / "adapter")
    export(adapter, "lora", base_model=str(tiny_model_dir), out_dir=tmp_path / "exports")
    info = _strict_json((tmp_path / "exports" / "run" / "export.json").read_text())
    assert info["formats"][0]["format"] == "lora" and math.isfinite(info["formats"][0]["max_abs_diff"])


def test_json_safe_writes_null_for_non_finite():
    assert _strict_json(dumps_finite({"a": NAN, "b": [INF, 1.0]})) == {"a": None, "b": [None, 1.0]}


# ------------------------------------------------------------------------------------------------ shared helpers


@pytest.fixture
def fake_run(fake_checkpoint):
    """``fake_run(run_dir, steps)``: a finished run folder (run.json, metrics 1..steps, checkpoints, adapter/)."""
    import shutil

    def make(run_dir, steps: int):
        run_dir.mkdir(parents=True)
        (run_dir / "run.json").write_text(json.dumps({"recipe": recorded_values(max_steps=steps), "data": "sample"}))
        (run_dir / "metrics.jsonl").write_text(
            "".join(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in range(1, steps + 1))
        )
        for step in range(1, steps + 1):
            fake_checkpoint(run_dir, step)
        shutil.copytree(run_dir / f"checkpoint-{steps}", run_dir / "adapter")
        return run_dir

    return make


def snapshot(folder) -> dict:
    """Every file under ``folder`` with its bytes: equal snapshots mean nothing was changed, added or removed (but
    the lock file, which stays once a run has locked the folder: the OS lock is on it, not in it)."""
    return {
        p.relative_to(folder).as_posix(): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name not in (LOCK_NAME, PID_NAME)
    }


TINY_CLI = tiny_train_args("sample")


# -------------------------------------------------------------------------------------------- 2. non-finite settings


@pytest.mark.parametrize(
    "argv",
    [
        ["--set", "temperature=inf"],
        ["--set", "learning_rate=-Infinity"],
        ["--set", "max_grad_norm=NaN"],
        ["--set", "epsilon=Infinity"],
    ],
)
def test_non_finite_settings_are_refused_before_any_weights_load(argv, tmp_path, capsys, no_model_load):
    err = _cli_error(capsys, ["train", *TINY_CLI, *argv, "--output", str(tmp_path / "run")])
    assert "finite" in err and ("inf" in err or "nan" in err)
    assert not (tmp_path / "run").exists()


def test_metrics_never_get_nan_or_infinity_tokens(tmp_path):
    from types import SimpleNamespace

    path = tmp_path / "metrics.jsonl"
    logger = TrainingRun(tmp_path)
    state = SimpleNamespace(is_world_process_zero=True, log_history=[])
    for step, loss in ((1, 0.5), (2, INF), (3, NAN)):  # as the Trainer logs: into log_history, then on_log
        state.log_history.append({"loss": loss, "learning_rate": INF, "step": step})
        logger.on_log(None, state, None, logs=state.log_history[-1])
    rows = [_strict_json(line) for line in path.read_text().splitlines()]
    assert [(row["step"], row["loss"], row["learning_rate"]) for row in rows] == [
        (1, 0.5, None),
        (2, None, None),
        (3, None, None),
    ]
    state.log_history = state.log_history[:2]  # resumed from checkpoint-2: the Trainer restores its log_history
    logger.on_log(None, state, None, logs=None)
    assert [_strict_json(line)["step"] for line in path.read_text().splitlines()] == [1, 2]


def test_a_nan_final_adapter_is_not_a_finished_run(tmp_path, tiny_model_dir, make_adapter):
    run_dir = tmp_path / "run"
    adapter = make_adapter(tiny_model_dir, run_dir / "adapter")
    Run(run_dir).check_saved_adapter(4)  # a finite adapter passes
    _poison(adapter, INF)
    with pytest.raises(NumericsError, match="final adapter.*NaN/inf.*damaged-adapter.old-"):
        Run(run_dir).check_saved_adapter(4)
    (aside,) = run_dir.glob("damaged-adapter.old-*")  # set aside, never deleted
    assert not adapter.exists() and (aside / "adapter_model.safetensors").is_file()


def test_an_exploded_adapter_is_neither_a_finished_run_nor_exported(tmp_path, tiny_model_dir, make_adapter, capsys):
    """lr 1e10 leaves finite weights of ~1e10 and a model that writes only end-of-text: not a result, not "verified"."""
    run_dir = tmp_path / "run"
    adapter = make_adapter(tiny_model_dir, run_dir / "adapter")
    tensor = _poison(adapter, 1.3e10)
    err = _cli_error(
        capsys,
        ["export", "--adapter", str(adapter), "--model", str(tiny_model_dir), "--out-dir", str(tmp_path / "exports")],
    )
    assert "weights beyond 1000" in err and tensor in err and not (tmp_path / "exports").exists()
    with pytest.raises(NumericsError, match="final adapter.*beyond 1000.*damaged-adapter.old-"):
        Run(run_dir).check_saved_adapter(1)


# ------------------------------------------------------------------------------------------------ 3. finished runs


def test_resume_of_a_finished_run_changes_nothing(tmp_path, capsys, no_model_load, fake_run):
    run_dir = fake_run(tmp_path / "run", 4)
    before = snapshot(run_dir)
    for extra in ([], ["--set", "max_steps=4"], ["--set", "max_steps=3"]):
        assert main(["train", *TINY_CLI, "--output", str(run_dir), "--resume", *extra]) == 0
        out = capsys.readouterr().out
        assert "already finished: step 4 of 4" in out and str(run_dir / "adapter") in out
        assert snapshot(run_dir) == before


def test_finished_run_without_its_adapter_gets_it_from_the_last_checkpoint(tmp_path, no_model_load, fake_run):
    import shutil

    run_dir = fake_run(tmp_path / "run", 2)
    shutil.rmtree(run_dir / "adapter")  # killed after the last checkpoint, before the adapter was written
    result = train(load_recipe("cpu", **TINY_SETTINGS, max_steps=2), data="sample", output_dir=run_dir, resume=True)
    assert result.already_finished and result.steps == 2
    assert (result.adapter_dir / "adapter_model.safetensors").read_bytes() == (
        run_dir / "checkpoint-2" / "adapter_model.safetensors"
    ).read_bytes()
    assert not (result.adapter_dir / "optimizer.pt").exists()


# ------------------------------------------------------------------------------------------------ 4. run folder lock


def hold_run_lock(run_dir):
    """Another process that takes ``run_dir``'s lock as ``train`` does, then sleeps (it holds the lock on return)."""
    code = (
        "import sys, time; from pathlib import Path; from grpo_kit import runs; "
        "run = runs.Run(Path(sys.argv[1])); run.lock(); print('locked', flush=True); time.sleep(600)"
    )
    process = subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "locked\n"
    return process


@pytest.fixture
def other_process(tmp_path):
    process = hold_run_lock(tmp_path / "run")
    yield process
    process.kill()
    process.wait()


def test_second_process_on_a_run_folder_is_refused_with_the_first_ones_pid(
    tmp_path, capsys, other_process, no_model_load, fake_checkpoint
):
    run_dir = tmp_path / "run"
    err = _cli_error(capsys, ["train", *TINY_CLI, "--output", str(run_dir)])
    assert f"PID {other_process.pid}" in err and "another --output" in err
    assert (run_dir / PID_NAME).read_text() == str(other_process.pid)  # the other run's lock is left alone

    fake_checkpoint(run_dir, 1)  # a --resume while it runs is refused the same way
    err = _cli_error(capsys, ["train", *TINY_CLI, "--output", str(run_dir), "--resume"])
    assert f"PID {other_process.pid}" in err


def test_lock_of_a_killed_process_does_not_block_and_the_lock_is_released(tmp_path, monkeypatch):
    import grpo_kit.models as models

    run_dir = tmp_path / "run"
    killed = hold_run_lock(run_dir)
    killed.kill()  # SIGKILL: no cleanup of its own ran; the OS dropped its lock
    killed.wait()
    seen = []

    def stop_at_load(*args, **kwargs):  # the run got past the lock: record who holds it, then stop
        seen.append((run_dir / PID_NAME).read_text())
        raise GrpoKitError("stop here")

    monkeypatch.setattr(models, "load_model", stop_at_load)
    for _ in range(2):  # the second time: a notebook running its cell again after the error
        with pytest.raises(GrpoKitError, match="stop here"):
            train(load_recipe("cpu"), data="sample", output_dir=run_dir)
    assert seen == [str(os.getpid())] * 2
    with FileLock(run_dir / LOCK_NAME, blocking=False):  # free: released when train() ended, even by an error
        pass


# ------------------------------------------------------------------------------------------------ 5./6. checkpoints


@pytest.mark.parametrize("missing", ["optimizer.pt", "scheduler.pt"])
def test_checkpoint_without_optimizer_state_is_incomplete(missing, tmp_path, fake_checkpoint):
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 3, skip=[missing])
    assert latest_checkpoint(tmp_path).name == "checkpoint-2"
    with (
        pytest.warns(UserWarning, match=f"checkpoint-3: no {missing}.*Resuming from"),
        closing(Run.open(tmp_path, resume=True)) as run,
    ):
        assert run.checkpoint == str(tmp_path / "checkpoint-2")
    (aside,) = tmp_path.glob("damaged-checkpoint-3.old-*")
    assert (aside / "adapter_model.safetensors").is_file()  # kept, not deleted


def test_deepspeed_checkpoint_keeps_its_optimizer_in_global_step_folder(tmp_path, fake_checkpoint):
    folder = fake_checkpoint(tmp_path, 5, skip=["optimizer.pt", "scheduler.pt"])
    (folder / "global_step5").mkdir()
    assert latest_checkpoint(tmp_path) == folder


def test_truncated_adapter_in_the_latest_checkpoint_falls_back_and_is_set_aside(tmp_path, fake_checkpoint):
    fake_checkpoint(tmp_path, 2)
    weights = fake_checkpoint(tmp_path, 3) / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 7])
    assert latest_checkpoint(tmp_path).name == "checkpoint-2"
    with pytest.warns(UserWarning, match="checkpoint-3: .*cannot be read.*moved to damaged-"):
        with closing(Run.open(tmp_path, resume=True, is_main=True)) as run:
            assert run.checkpoint == str(tmp_path / "checkpoint-2")
    (aside,) = tmp_path.glob("damaged-checkpoint-3.old-*")
    assert (aside / "adapter_model.safetensors").read_bytes() == data[: len(data) - 7]


def test_only_the_main_process_sets_damaged_checkpoints_aside(tmp_path, fake_checkpoint):
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 3, state=False)
    with pytest.warns(UserWarning, match="checkpoint-3: no trainer_state.json"):
        assert Run.open(tmp_path, resume=True, is_main=False).checkpoint == str(tmp_path / "checkpoint-2")
    assert (tmp_path / "checkpoint-3").is_dir() and not (tmp_path / LOCK_NAME).exists()


# ------------------------------------------------------------------------------------------------ 6. typed --set


@pytest.mark.parametrize(
    ("pair", "expected"),
    [
        ("num_generations=abc", "num_generations: invalid int value: 'abc'"),
        ("learning_rate=nan", "learning_rate is nan; every number must be finite"),
        ("epsilon_high=big", "epsilon_high: invalid float value: 'big'"),
        ("temperature=[1]", "temperature expects one value, got [1]"),
    ],
)
def test_typed_set_values_are_checked_before_any_weights_load(pair, expected, tmp_path, capsys, no_model_load):
    err = _cli_error(capsys, ["train", *TINY_CLI, "--set", pair, "--output", str(tmp_path / "run")])
    assert expected in err
    assert not (tmp_path / "run").exists()


def test_typed_set_values_are_converted_to_the_field_type():
    from grpo_kit.config import parse_set

    changes = parse_set(["max_steps=3", "learning_rate=1e-4", "beta=0", "lr_scheduler_type=constant", "use_vllm=false"])
    config = load_recipe("cpu", **changes).grpo
    got = {k: getattr(config, k) for k in ("max_steps", "learning_rate", "beta", "lr_scheduler_type", "use_vllm")}
    assert got == {
        "max_steps": 3,
        "learning_rate": 1e-4,
        "beta": 0.0,
        "lr_scheduler_type": "constant",
        "use_vllm": False,
    }
    assert type(got["max_steps"]) is int and type(got["beta"]) is float


# ------------------------------------------------------------------------------------------------ real tiny runs

REAL = tiny_train_args("arithmetic", **SIGNAL, save_steps=1, logging_steps=1)


@pytest.mark.slow
def test_real_finished_run_resumes_to_nothing_and_a_larger_max_steps_continues(tiny_model_dir, tmp_path, capsys):
    run_dir = tmp_path / "run"
    base = ["train", *REAL, "--set", f"model_name_or_path={tiny_model_dir}", "--output", str(run_dir)]
    assert main([*base, "--set", "max_steps=2"]) == 0
    capsys.readouterr()
    before = snapshot(run_dir)
    assert main([*base, "--resume"]) == 0  # the run.json max_steps (2) is the target
    assert "already finished: step 2 of 2" in capsys.readouterr().out
    assert snapshot(run_dir) == before  # no checkpoint-3, no metrics row, adapter untouched
    assert main([*base, "--resume", "--set", "max_steps=3"]) == 0
    assert [row["step"] for row in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3]
    assert latest_checkpoint(run_dir).name == "checkpoint-3"


@pytest.mark.slow
def test_real_run_whose_last_update_breaks_the_weights_is_not_done(tiny_model_dir, tmp_path):
    """The last update overflows the weights (as an inf learning rate does): its loss was logged before the update,
    so the NumericsGuard sees nothing, and only the check of the saved adapter stops the run being called done."""
    from transformers import TrainerCallback

    class OverflowLastUpdate(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == state.max_steps:
                with torch.no_grad():
                    next(p for n, p in model.named_parameters() if "lora_B" in n).fill_(INF)

    run_dir = tmp_path / "run"
    recipe = tiny_recipe(tiny_model_dir, reward_funcs=[varied], reward_weights=[1.0])
    with pytest.raises(NumericsError, match="final adapter.*damaged-adapter.old-") as info:
        train(recipe, data="arithmetic", output_dir=run_dir, callbacks=(OverflowLastUpdate(),))
    assert info.value.step == 2 and info.value.metric == "the final adapter"
    assert not (run_dir / "adapter").exists() and len(list(run_dir.glob("damaged-adapter.old-*"))) == 1
    assert [row["step"] for row in read_metrics(run_dir / "metrics.jsonl")] == [1, 2]
