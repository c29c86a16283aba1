"""Watching GRPO learn: sampled completions with their reward scores, and the zero-variance curve."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from grpo_kit.callbacks import CompletionSamples, guard_rewards


def tagged(completions, **kwargs):
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [1.0 if "<answer>" in text else 0.0 for text in texts]


def length(completions, **kwargs):
    return [len(c) / 10 for c in completions]


def test_wrapped_rewards_keep_names_and_results_and_record_the_batch():
    samples = CompletionSamples(every=1, rows=2)
    wrapped = guard_rewards([tagged, length], samples=samples)
    assert [fn.__name__ for fn in wrapped] == ["tagged", "length"]
    batch = ["<think>a</think><answer>4</answer>", "no tags", "<answer>5</answer>", "x"]
    kwargs = {"prompts": ["p"] * 4, "completions": batch, "question": ["Q1", "Q1", "Q2", "Q2"]}
    assert [fn(**kwargs) for fn in wrapped] == [tagged(batch), length(batch)]
    rows = samples.rows()
    assert [row["question"] for row in rows] == ["Q1", "Q2"]  # spread over the batch: both questions show
    assert rows[1] == {"question": "Q2", "completion": "<answer>5</answer>", "tagged": 1.0, "length": 1.8}


def test_a_new_batch_replaces_the_old_scores():
    samples = CompletionSamples(every=1)
    first, second = guard_rewards([tagged, length], samples=samples)
    first(completions=["<answer>1</answer>"], question=["old"])
    second(completions=["<answer>1</answer>"], question=["old"])
    first(completions=["plain"], question=["new"])  # next generation batch: a different list
    assert samples.rows() == [{"question": "new", "completion": "plain", "tagged": 0.0}]


@pytest.mark.parametrize("step, printed", [(4, True), (5, False)])
def test_table_printed_every_n_steps(step, printed):
    out: list[str] = []
    samples = CompletionSamples(every=2, printer=out.append)
    (fn,) = guard_rewards([tagged], samples=samples)
    fn(completions=[[{"role": "assistant", "content": "2+2\n</think>\n<answer>4</answer>"}]], question=["2+2?"])
    state = SimpleNamespace(global_step=step, is_world_process_zero=True)
    samples.on_step_end(None, state, None)
    assert bool(out) is printed
    if printed:
        assert "step 4" in out[0] and "Q: 2+2?" in out[0] and "</think>⏎<answer>4</answer>" in out[0]
        assert "tagged=1" in out[0]


def test_reward_models_and_async_rewards_pass_unrecorded():
    import torch

    async def remote(completions, **kwargs):
        return [0.0 for _ in completions]

    module = torch.nn.Linear(1, 1)
    wrapped = guard_rewards([tagged, remote, module], samples=CompletionSamples(every=1))
    assert wrapped[0] is not tagged and wrapped[1] is remote and wrapped[2] is module


def test_train_shows_completions(tiny_model_dir, tmp_path, capsys, monkeypatch):
    from grpo_kit.config import load_recipe
    from grpo_kit.rewards import REWARDS
    from grpo_kit.train import train

    monkeypatch.setitem(REWARDS, "toy_length", length)
    recipe = load_recipe("cpu", model_name_or_path=str(tiny_model_dir), max_steps=1, num_generations=2,
                         per_device_train_batch_size=2, gradient_accumulation_steps=1, max_completion_length=8,
                         save_steps=1, few_shot=0, reward_funcs=["toy_length", "format_rate"], reward_weights=[1.0, 0.0])
    train(recipe, data="arithmetic", output_dir=tmp_path / "run", show_completions=1)
    out = capsys.readouterr().out
    assert "step 1: sampled completions and their rewards" in out
    assert "length=" in out and "format_rate=" in out


def test_zero_variance_share_is_plotted():
    from grpo_kit.plots import metrics_figure  # helper H's plotting module

    rows = [{"step": 1, "reward": 0.1, "frac_reward_zero_std": 1.0}, {"step": 2, "reward": 0.5, "frac_reward_zero_std": 0.25}]
    fig = metrics_figure(rows)
    zero = fig.axes[2]
    assert zero.get_title() == "Groups that teach nothing"
    assert list(zero.lines[0].get_ydata()) == [1.0, 0.25]


def test_first_vs_last_table_puts_the_first_and_last_steps_side_by_side():
    from grpo_kit.demo import first_vs_last_table

    table = first_vs_last_table([{"step": 1, "reward": 0.1, "format_rate": 0.0},
                                 {"step": 2, "reward": 0.9, "format_rate": 1.0}], window=1)
    assert table.splitlines() == ["metric         first 1 steps   last 1 steps",
                                  "reward                 0.100          0.900",
                                  "format_rate            0.000          1.000"]
