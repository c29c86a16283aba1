"""Reliability, issue 7 part 7: NaN/inf in the loss, the gradients, a reward or the weights stops the run with the step.

TRL alone trains on: it reads a NaN reward as "not applicable" (nansum, advantages nan_to_num) and transformers
hides a NaN loss from the logs. These tests break each number on purpose and expect ``NumericsError``.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from tiny_cli import tiny_recipe, varied

from grpo_kit.callbacks import (
    GuardedReward,
    NumericsGuard,
    TrainingRun,
    check_rewards,
    guard_rewards,
    is_finite_number,
    non_finite,
)
from grpo_kit.config import load_recipe
from grpo_kit.errors import GrpoKitError
from grpo_kit.models import load_tokenizer
from grpo_kit.rewards import completion_text
from grpo_kit.runs import NumericsError, read_metrics
from grpo_kit.train import train

NAN, INF = float("nan"), float("inf")


def _state(step):
    return SimpleNamespace(global_step=step)


def _args(fp16=False):
    return SimpleNamespace(fp16=fp16)


# ------------------------------------------------------------------------------------------------ unit


def test_non_finite_checks_loss_grad_norm_and_every_reward():
    logs = {
        "loss": 0.1,
        "grad_norm": INF,
        "reward": 0.5,
        "rewards/correctness/mean": NAN,
        "rewards/format/std": NAN,
        "learning_rate": NAN,
        "epoch": 1.0,
    }
    assert [name for name, _ in non_finite(logs)] == ["grad_norm", "reward/correctness"]
    assert non_finite({"loss": 0.0, "reward": -1.5, "rewards/x/mean": 2}) == []


@pytest.mark.parametrize("metric", ["loss", "reward", "rewards/correctness/mean"])
@pytest.mark.parametrize("value", [NAN, INF, -INF])
def test_guard_raises_on_the_first_bad_log_with_step_and_metric(metric, value, tmp_path):
    guard = NumericsGuard(run_dir=tmp_path)
    guard.on_log(_args(), _state(6), None, logs={"loss": 0.2, "reward": 0.1})  # a healthy step passes
    with pytest.raises(NumericsError) as info:
        guard.on_log(_args(), _state(7), None, logs={"loss": 0.2, "reward": 0.1, metric: value})
    error = info.value
    assert isinstance(error, GrpoKitError)  # the CLI prints it without a traceback, exit status 2
    assert error.step == 7 and error.metric == metric.replace("rewards/", "reward/").replace("/mean", "")
    assert "at step 7" in str(error) and error.metric in str(error)
    assert "No complete checkpoint" in str(error)  # and says whether there is one to resume from


def test_guard_points_at_the_last_complete_checkpoint(tmp_path, fake_checkpoint):
    fake_checkpoint(tmp_path, 4)
    (tmp_path / "checkpoint-5").mkdir()  # half-written: not offered
    with pytest.raises(NumericsError) as info:
        NumericsGuard(tmp_path).on_log(_args(), _state(5), None, logs={"loss": NAN})
    message = str(info.value)
    assert "checkpoint-4" in message and "checkpoint-5" not in message and "--resume" in message
    assert "learning rate" in message  # the fix is spelled out


def test_grad_norm_patience_under_fp16_loss_scaling():
    # fp16's loss scaler skips steps with inf gradients on purpose (transformers logs the unscaled norm, inf; the loss
    # stays finite): at the start, while its 2**16 scale halves, up to 16 in a row are normal, not a failure.
    guard = NumericsGuard()
    for step in range(1, 17):
        guard.on_log(_args(fp16=True), _state(step), None, logs={"loss": 0.1, "grad_norm": INF})
    with pytest.raises(NumericsError, match="grad_norm is inf at step 17"):  # at scale 1 an overflow is real
        guard.on_log(_args(fp16=True), _state(17), None, logs={"loss": 0.1, "grad_norm": INF})
    guard = NumericsGuard()
    guard.on_log(_args(fp16=True), _state(1), None, logs={"grad_norm": INF})
    guard.on_log(_args(fp16=True), _state(2), None, logs={"grad_norm": INF})
    guard.on_log(_args(fp16=True), _state(3), None, logs={"grad_norm": 1.0})  # the scale has settled
    guard.on_log(_args(fp16=True), _state(4), None, logs={"grad_norm": NAN})
    guard.on_log(_args(fp16=True), _state(5), None, logs={"grad_norm": NAN})
    with pytest.raises(NumericsError, match="grad_norm is nan at step 6"):
        guard.on_log(_args(fp16=True), _state(6), None, logs={"grad_norm": NAN})
    with pytest.raises(NumericsError, match="at step 1"):  # fp32/bf16: no scaler, the first one is fatal
        NumericsGuard().on_log(_args(), _state(1), None, logs={"grad_norm": INF})


def test_checked_reward_passes_finite_and_none_and_rejects_nan_inf():
    def mixed(completions, **kwargs):
        return kwargs["values"]

    checked = GuardedReward(mixed)
    assert checked.__name__ == "mixed"  # TRL logs rewards/<__name__>/mean
    assert checked(["a", "b", "c"], values=[1, 0.5, None]) == [1, 0.5, None]  # None = "not applicable" in TRL
    with pytest.raises(NumericsError) as info:
        checked(completions=["ok", "bad one"], values=[0.0, INF], trainer_state=_state(11))
    assert info.value.step == 12 and info.value.metric == "reward/mixed"
    assert "completion 1" in str(info.value) and "'bad one'" in str(info.value)
    assert [is_finite_number(v) for v in (1, 2.5, NAN, -INF, None, "1")] == [True, True, False, False, False, False]


def test_a_nan_reward_on_the_test_call_before_loading_says_so_not_a_training_step(embedded_dir):
    def nan_for_empty(completions, **kwargs):
        return [NAN if not completion_text(c) else 0.0 for c in completions]

    with pytest.raises(NumericsError, match="reward/nan_for_empty is nan on a test call before any weights loaded"):
        check_rewards([nan_for_empty], {"prompt": "What is 2 + 2?", "answer": "4"}, load_tokenizer(str(embedded_dir)))


def test_guard_rewards_wraps_plain_functions_only():
    import torch

    async def remote(completions, **kwargs):
        return [0.0 for _ in completions]

    def plain(completions, **kwargs):
        return [0.0 for _ in completions]

    module = torch.nn.Linear(1, 1)
    wrapped = guard_rewards([plain, remote, module])
    assert isinstance(wrapped[0], GuardedReward) and wrapped[1] is remote and wrapped[2] is module
    assert guard_rewards(wrapped)[0] is wrapped[0]  # not wrapped twice


def test_a_reward_that_raises_is_named_with_its_step_and_traceback_file(tmp_path):
    def broken(completions, **kwargs):
        raise ValueError("cannot parse 'x'")

    with pytest.raises(GrpoKitError) as info:
        GuardedReward(broken, tmp_path)(completions=["some text"], trainer_state=_state(3))
    message = str(info.value)
    assert "'broken' raised ValueError: cannot parse 'x' at step 4" in message and "'some text'" in message
    assert f"Full traceback: {tmp_path / 'reward-error.txt'}" in message
    assert (
        "cannot parse" in (tmp_path / "reward-error.txt").read_text()
        and "Traceback" in (tmp_path / "reward-error.txt").read_text()
    )


def _training(run_dir, step) -> TrainingRun:
    """A run whose trainer is at ``step`` (its state, as the run's callback keeps it once training began)."""
    run = TrainingRun(run_dir)
    run.state = _state(step)
    return run


def test_sampling_errors_from_broken_weights_become_numerics_errors(tmp_path):
    with pytest.raises(NumericsError, match="at step 9") as info:
        with _training(tmp_path, 8):
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(RuntimeError, match="unrelated"):  # other errors keep their traceback
        with _training(tmp_path, 8):
            raise RuntimeError("unrelated")


def test_gpu_out_of_memory_mid_run_names_the_fixes_and_the_checkpoint(tmp_path, fake_checkpoint):
    import torch

    fake_checkpoint(tmp_path, 20)
    with pytest.raises(GrpoKitError) as info:
        with _training(tmp_path, 23):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    message = str(info.value)
    assert not isinstance(info.value, NumericsError)
    assert "out of memory at step 24" in message and "Tried to allocate 2.00 GiB" in message
    assert "max_completion_length" in message and "presets --plan" in message
    assert "checkpoint-20" in message and "--resume" in message
    with pytest.raises(GrpoKitError, match="out of memory before the first step \\(loading the model"):
        with TrainingRun(tmp_path):  # no trainer state yet: the model or the trainer was loading
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 16.00 GiB")


def test_nan_losses_reach_the_logs():
    # transformers' default logging_nan_inf_filter would replace a NaN loss by the running mean before any callback.
    assert load_recipe("cpu").grpo.logging_nan_inf_filter is False


# ------------------------------------------------------------------------------------------------ real runs


def nan_after_first_step(completions, trainer_state=None, **kwargs):
    """Healthy on step 1, then NaN for one completion per batch (TRL's nanmean would hide it in the logged mean)."""
    broken = trainer_state is not None and trainer_state.global_step >= 1
    return [NAN if broken and i == 1 else 0.1 * i for i in range(len(completions))]


@pytest.mark.slow
def test_nan_reward_stops_the_run_at_its_step(tiny_model_dir, tmp_path, monkeypatch):
    from grpo_kit.rewards import REWARDS

    monkeypatch.setitem(REWARDS, "nan_after_first_step", nan_after_first_step)
    run_dir = tmp_path / "run"
    with pytest.raises(NumericsError) as info:
        train(
            tiny_recipe(tiny_model_dir, max_steps=3, reward_funcs=["nan_after_first_step"], reward_weights=[1]),
            data="arithmetic",
            output_dir=run_dir,
        )
    assert info.value.step == 2 and info.value.metric == "reward/nan_after_first_step"
    assert "checkpoint-1" in str(info.value)  # the last good checkpoint, to resume from
    assert [row["step"] for row in read_metrics(run_dir / "metrics.jsonl")] == [1]
    assert not (run_dir / "checkpoint-2").exists() and not (run_dir / "adapter").exists()


@pytest.mark.slow
def test_nan_loss_stops_the_run(tiny_model_dir, tmp_path):
    """NaN in the training forward pass only (generation runs without grad and stays healthy)."""
    import torch
    from transformers import TrainerCallback

    class PoisonLoss(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            norm = model.get_base_model().model.norm
            norm.register_forward_hook(lambda module, inputs, out: out * NAN if torch.is_grad_enabled() else out)

    run_dir = tmp_path / "run"
    with pytest.raises(NumericsError) as info:
        train(
            tiny_recipe(tiny_model_dir, max_steps=3, reward_funcs=[varied], reward_weights=[1]),
            data="arithmetic",
            output_dir=run_dir,
            callbacks=(PoisonLoss(),),
        )
    assert info.value.step == 1 and info.value.metric == "loss" and math.isnan(info.value.value)
    assert not (run_dir / "checkpoint-1").exists()  # raised before the step's checkpoint: nothing broken is saved
    assert "No complete checkpoint" in str(info.value)


@pytest.mark.slow
def test_exploding_weights_are_reported_not_a_sampling_traceback(tiny_model_dir, tmp_path, monkeypatch):
    """lr 1e30 without clipping: step 1 blows the weights up, step 2's generation then samples from NaN."""
    from grpo_kit import config

    monkeypatch.delitem(
        config.MEANT_VALUES, "learning_rate"
    )  # the recipe check refuses such a rate: here it must get through
    run_dir = tmp_path / "run"
    recipe = tiny_recipe(
        tiny_model_dir, max_steps=3, reward_funcs=[varied], reward_weights=[1], learning_rate=1e30, max_grad_norm=0.0
    )
    with pytest.raises(NumericsError) as info:
        train(recipe, data="arithmetic", output_dir=run_dir)
    assert info.value.step == 2
    message = str(info.value)
    assert "at step 2" in message and "learning rate" in message
    # step 1's update already broke the weights: checkpoint-1 is named as unusable, and --resume starts from step 0
    assert "No complete checkpoint in" in message and "(checkpoint-1 cannot be resumed from)" in message
    assert "from step 0" in message
