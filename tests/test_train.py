"""Trainer wiring: config building, metrics, checkpoints, and real (tiny) GRPO runs on CPU."""

from __future__ import annotations

import json

import pytest
from tiny_cli import tiny_recipe

from grpo_kit.config import load_recipe
from grpo_kit.doctor import reward_first_last
from grpo_kit.errors import GrpoKitError
from grpo_kit.runs import Run, latest_checkpoint, read_metrics
from grpo_kit.train import run_folder, train


def test_cpu_config_turns_off_gpu_defaults():
    config = load_recipe("cpu").grpo
    assert config.use_cpu is True
    assert config.bf16 is False and config.fp16 is False  # TRL 1.x turns bf16 on by default: that breaks CPUs
    assert config.gradient_checkpointing is False
    assert config.reward_weights[-1] == 0.0  # the format_rate metric never shapes the loss


def test_bf16_on_a_cpu_is_refused_before_anything_is_written(tmp_path, no_model_load):
    with pytest.raises(GrpoKitError, match="bf16"):
        train(load_recipe("cpu", bf16=True), data="sample", output_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_output_dir_in_a_recipe_is_the_run_folder_and_a_second_one_is_refused(tmp_path, no_model_load):
    recipe = load_recipe("cpu", output_dir=str(tmp_path / "mine"))
    assert run_folder(recipe) == tmp_path / "mine"
    assert run_folder(recipe, tmp_path / "mine") == tmp_path / "mine"
    with pytest.raises(GrpoKitError, match="keep one of them"):
        train(recipe, data="sample", output_dir=tmp_path / "other")


def test_latest_checkpoint_skips_half_written(tmp_path, fake_checkpoint):
    fake_checkpoint(tmp_path, 2)
    fake_checkpoint(tmp_path, 10)
    fake_checkpoint(tmp_path, 12, state=False)  # killed while writing
    (tmp_path / "checkpoint-14").mkdir()  # killed right after mkdir
    assert latest_checkpoint(tmp_path).name == "checkpoint-10"
    (tmp_path / "checkpoint-10" / "trainer_state.json").write_text("{trunc")  # torn state file
    assert latest_checkpoint(tmp_path).name == "checkpoint-2"


def test_latest_checkpoint_none_when_empty(tmp_path):
    assert latest_checkpoint(tmp_path) is None


def test_a_resumed_runs_metrics_are_its_checkpoints_history(tmp_path):
    from types import SimpleNamespace

    from grpo_kit.callbacks import TrainingRun

    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward": s / 10}) + "\n" for s in range(1, 6)) + '{"step": 6, "rew')
    assert [row["step"] for row in read_metrics(path)] == [1, 2, 3, 4, 5]  # a killed run's torn last line: ignored
    restored = [{"rewards/correctness/mean": s / 10, "step": s} for s in range(1, 4)]  # checkpoint-3's log_history
    TrainingRun(tmp_path).on_log(None, SimpleNamespace(is_world_process_zero=True, log_history=restored), None)
    assert read_metrics(path) == [{"step": s, "reward/correctness": s / 10} for s in range(1, 4)]


def test_reward_first_last_uses_windows():
    rows = [{"reward": r} for r in (0.0, 0.0, 0.5, 1.0, 1.0, 1.0)]
    assert reward_first_last(rows, window=2) == (0.0, 1.0)
    assert reward_first_last([]) == (None, None)


#: The log of ``train --preset cpu --data sample --set max_steps=2 --set learning_rate=0.9`` (issue 37): step 2 gave
#: only cut-off garbage while every weight stayed small.
COLLAPSED = [
    {"step": 1, "reward": 0.25, "completions/clipped_ratio": 0.625, "grad_norm": 0.4563, "loss": 0.0803},
    {"step": 2, "reward": 0.0, "completions/clipped_ratio": 1.0, "grad_norm": 0.0, "loss": 0.0},
]


@pytest.mark.parametrize(
    ("first_clipped", "warned"),
    [(0.625, True), (1.0, False)],  # 1.0: a budget too short for any answer from the first step, no collapse
)
def test_a_run_whose_log_shows_a_collapse_ends_with_a_warning(tmp_path, first_clipped, warned):
    from grpo_kit.train import _result

    rows = [{**COLLAPSED[0], "completions/clipped_ratio": first_clipped}, COLLAPSED[1]]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    summary = _result(Run(tmp_path), tmp_path / "adapter", 2, 1.0).summary()
    assert ("warning: the run collapsed: at step 2 the reward fell from 0.250 to 0" in summary) is warned
    assert ("lower --set learning_rate" in summary) is warned


@pytest.mark.parametrize("resume", [False, True])
def test_a_folder_that_holds_no_run_is_refused_as_it_is(tmp_path, resume):
    """The user's own folder (``--output .``): not offered --resume, not trained in with it, no file moved, and no
    lock files left behind."""
    (tmp_path / "keep.txt").write_text("user data")
    with pytest.raises(GrpoKitError, match="not a grpo-kit run folder .*keep.txt.*Choose another --output") as refused:
        train(load_recipe("cpu"), data="sample", output_dir=tmp_path, resume=resume)
    assert "Use --resume" not in str(refused.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]
    assert (tmp_path / "keep.txt").read_text() == "user data"


def test_a_run_folder_is_not_overwritten(tmp_path, fake_checkpoint):
    fake_checkpoint(tmp_path, 1)
    with pytest.raises(GrpoKitError, match="already has files. Use --resume"):
        train(load_recipe("cpu"), data="sample", output_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]  # no lock files either


def test_resume_without_a_run_folder_is_explained(tmp_path):
    with pytest.raises(GrpoKitError, match="there is no run folder"):
        train(load_recipe("cpu"), data="sample", output_dir=tmp_path / "missing", resume=True)


def toy_length(completions, **kwargs):
    """Reward = completion length in characters / 100: random text always varies, so every group has variance."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [len(text) / 100 for text in texts]


@pytest.mark.slow
def test_two_step_run_changes_lora_weights_and_writes_adapter(tiny_model_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file

    from grpo_kit.rewards import REWARDS

    monkeypatch.setitem(REWARDS, "toy_length", toy_length)
    recipe = tiny_recipe(tiny_model_dir, reward_funcs=["toy_length", "format_rate"], reward_weights=[1.0, 0.0])
    result = train(recipe, data="arithmetic", output_dir=tmp_path / "run")
    assert result.steps == 2
    assert (result.adapter_dir / "adapter_config.json").is_file()
    weights = load_file(result.adapter_dir / "adapter_model.safetensors")
    lora_b = [t for name, t in weights.items() if "lora_B" in name]
    assert lora_b, "adapter has no LoRA B matrices"
    # LoRA B starts at exactly zero: a non-zero entry proves the optimizer updated the adapter.
    assert any(t.abs().max() > 0 for t in lora_b)
    rows = read_metrics(result.metrics_path)
    assert [row["step"] for row in rows] == [1, 2]
    assert {"reward", "format_rate", "reward/toy_length", "frac_reward_zero_std"} <= set(rows[0])
    run_info = json.loads((result.run_dir / "run.json").read_text())
    assert run_info["reward_names"] == ["toy_length", "format_rate"]


def test_the_recipes_seed_decides_the_lora_initialisation(tiny_model_dir):
    import torch

    from grpo_kit.models import load_model

    def lora_a(recipe):
        return [p.detach().clone() for n, p in load_model(recipe)[0].named_parameters() if "lora_A" in n]

    recipe = load_recipe("cpu", model_name_or_path=str(tiny_model_dir))
    first = lora_a(recipe)
    torch.rand(1000)  # what ran before (a notebook's earlier cells, an evaluation) must not change it
    assert all(torch.equal(a, b) for a, b in zip(first, lora_a(recipe), strict=True))
    assert not any(torch.equal(a, b) for a, b in zip(first, lora_a(recipe.replace(seed=1)), strict=True))


def test_a_reward_function_passed_directly_trains(tiny_model_dir, tmp_path):
    """A reward written by the learner (in a notebook cell, say) is passed as a function, no registry involved."""
    recipe = tiny_recipe(tiny_model_dir, max_steps=1, reward_funcs=[toy_length], reward_weights=[2.0])
    result = train(recipe, data="arithmetic", output_dir=tmp_path / "run")
    rows = read_metrics(result.metrics_path)
    assert "reward/toy_length" in rows[0]
    recorded = json.loads((result.run_dir / "run.json").read_text())["recipe"]
    assert recorded["reward_funcs"] == ["toy_length"] and recorded["reward_weights"] == [2.0]


class Scorer:
    """A reward as a callable object (state in ``self``)."""

    def __call__(self, completions, **kwargs):
        return toy_length(completions)


def test_lambdas_nested_functions_partials_and_callable_objects_are_rewards(tiny_model_dir, tmp_path):
    """Every form of Python function TRL calls trains, named in TRL's logs and run.json as TRL names it; a resume from
    Python with the same functions is the same run."""
    import functools

    def nested(completions, **kwargs):
        return toy_length(completions)

    def scaled(completions, scale, **kwargs):
        return [scale * score for score in toy_length(completions)]

    rewards = [lambda completions, **kwargs: toy_length(completions), nested, functools.partial(scaled, scale=2.0)]
    recipe = tiny_recipe(tiny_model_dir, max_steps=1, reward_funcs=[*rewards, Scorer()], reward_weights=[1, 1, 1, 1])
    assert recipe.kit.reward_funcs == ["<lambda>", "nested", "scaled", "Scorer"]
    result = train(recipe, data="arithmetic", output_dir=tmp_path / "run")
    assert {"reward/<lambda>", "reward/nested", "reward/scaled", "reward/Scorer"} <= set(
        read_metrics(result.metrics_path)[0]
    )
    info = json.loads((result.run_dir / "run.json").read_text())
    assert info["reward_names"] == info["recipe"]["reward_funcs"] == ["<lambda>", "nested", "scaled", "Scorer"]
    assert train(recipe, data="arithmetic", output_dir=result.run_dir, resume=True).already_finished
    with pytest.raises(GrpoKitError, match="'<lambda>' is named twice.*give each a name of its own"):
        train(
            recipe.replace(reward_funcs=[rewards[0], lambda completions, **kwargs: [0.0]], reward_weights=[1, 1]),
            data="arithmetic",
            output_dir=tmp_path / "twins",
        )


def test_a_run_of_python_rewards_resumes_from_python_not_the_command_line(tmp_path, capsys):
    from grpo_kit.cli import main

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text(json.dumps({"recipe": {"reward_funcs": ["<lambda>"]}, "reward_names": ["<lambda>"]}))
    assert main(["train", "--output", str(run), "--resume"]) == 2
    assert "unknown reward '<lambda>'" in (err := capsys.readouterr().err) and "passed again itself" in err
    assert sorted(p.name for p in run.iterdir()) == ["run.json"]


@pytest.mark.slow
def test_resume_continues_at_the_right_step(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    preset = tiny_recipe(tiny_model_dir, max_steps=2)
    train(preset, data="arithmetic", output_dir=run_dir)
    assert latest_checkpoint(run_dir).name == "checkpoint-2"
    resumed = train(tiny_recipe(tiny_model_dir, max_steps=3), data="arithmetic", output_dir=run_dir, resume=True)
    assert resumed.steps == 3
    assert [row["step"] for row in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3]
    assert latest_checkpoint(run_dir).name == "checkpoint-3"


def test_cli_unknown_preset_is_a_clear_error(capsys):
    from grpo_kit.cli import main

    assert main(["train", "--preset", "no-such-tier", "--data", "sample"]) == 2
    err = capsys.readouterr().err
    assert "no-such-tier" in err and "cpu" in err


def test_cli_help_lists_commands(capsys):
    from grpo_kit.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("train", "eval", "export", "presets", "chat"):
        assert command in out


def test_gpu_preset_on_cpu_is_refused_before_any_weights_load(tmp_path, monkeypatch):
    import grpo_kit.models as models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("model loaded before the check"))
    with pytest.raises(GrpoKitError, match="--preset cpu"):
        train(load_recipe("t4-16gb"), data="sample", output_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()  # nothing written either


def test_bf16_on_a_t4_is_refused_with_the_fix():
    from grpo_kit.models import DeviceInfo
    from grpo_kit.planner import check_device

    t4 = DeviceInfo(kind="cuda", name="Tesla T4", vram_gb=14.7, bf16=False)
    with pytest.raises(GrpoKitError, match="fp16"):
        check_device(load_recipe("l4-24gb"), t4)
    check_device(load_recipe("t4-16gb"), t4)  # the T4 recipe itself is fine
