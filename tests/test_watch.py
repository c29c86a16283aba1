"""Watching GRPO learn: wrapped rewards keep their names, TRL's table of sampled completions, the zero-variance
curve."""

from __future__ import annotations

from grpo_kit.callbacks import guard_rewards


def tagged(completions, **kwargs):
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if "<answer>" in text else 0.0 for text in texts]


def length(completions, **kwargs):
    return [len(c) / 10 for c in completions]


def test_wrapped_rewards_keep_names_and_results():
    wrapped = guard_rewards([tagged, length])
    assert [fn.__name__ for fn in wrapped] == ["tagged", "length"]  # TRL logs rewards/<name>/mean
    batch = ["<think>a</think><answer>4</answer>", "no tags", "<answer>5</answer>", "x"]
    kwargs = {"prompts": ["p"] * 4, "completions": batch, "question": ["Q1", "Q1", "Q2", "Q2"]}
    assert [fn(**kwargs) for fn in wrapped] == [tagged(batch), length(batch)]


def test_reward_models_and_async_rewards_pass_unwrapped():
    import torch

    async def remote(completions, **kwargs):
        return [0.0 for _ in completions]

    module = torch.nn.Linear(1, 1)
    wrapped = guard_rewards([tagged, remote, module])
    assert wrapped[0] is not tagged and wrapped[1] is remote and wrapped[2] is module


def test_train_shows_completions(tiny_model_dir, tmp_path, capsys, monkeypatch):
    from tiny_cli import tiny_recipe

    from grpo_kit.rewards import REWARDS
    from grpo_kit.train import train

    monkeypatch.setitem(REWARDS, "toy_length", length)
    monkeypatch.setenv("COLUMNS", "200")  # rich's width off a terminal: the reward columns' names fit
    recipe = tiny_recipe(
        tiny_model_dir,
        max_steps=1,
        reward_funcs=["toy_length", "format_rate"],
        reward_weights=[1.0, 0.0],
        log_completions=True,
        num_completions_to_print=2,
    )
    train(recipe, data="arithmetic", output_dir=tmp_path / "run")
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "Advantage" in line)  # TRL's table: a column per reward
    assert "Step 1" in out and "┃ length ┃" in header and "┃ format_rate ┃" in header


def test_zero_variance_share_is_plotted():
    from grpo_kit.plots import metrics_figure  # helper H's plotting module

    rows = [
        {"step": 1, "reward": 0.1, "frac_reward_zero_std": 1.0, "semantic_entropy": 0.9, "reflection_rate": 0.0},
        {"step": 2, "reward": 0.5, "frac_reward_zero_std": 0.25, "semantic_entropy": 0.4, "reflection_rate": 0.125},
    ]
    fig = metrics_figure(rows)
    groups = fig.axes[2]
    assert groups.get_title() == "What the groups say"
    assert [list(line.get_ydata()) for line in groups.lines] == [[1.0, 0.25], [0.9, 0.4], [0.0, 0.125]]
    legend = [text.get_text() for text in groups.get_legend().get_texts()]  # three lines on one scale: named
    assert legend == [
        "groups with equal rewards",
        "semantic entropy (answers disagree)",
        'answers that re-check ("wait")',
    ]
