"""Answer-agreement curriculum and zero-variance filtering: pure measurements, ordering, files, sampling, training."""

from __future__ import annotations

import json
import math
import random

import pytest

from grpo_kit.curriculum import (
    Curriculum,
    PromptScore,
    answer_clusters,
    answer_entropy,
    final_number,
    is_zero_variance,
    read_scores,
    score_dataset,
    write_scores,
)
from grpo_kit.errors import GrpoKitError

# ------------------------------------------------------------------------------------------------ measurements


@pytest.mark.parametrize(
    ("texts", "expected"),
    [
        (["<answer>18</answer>", "<answer>18.00</answer>", "<answer>$18</answer>"], ["18", "18", "18"]),
        (["<answer>seven</answer> but 7", "no number", "1,080 apples"], ["7", None, "1080"]),
        (["<answer>3</answer> then 4"], ["3"]),  # the answer block wins over a later number
    ],
)
def test_final_number_prefers_the_answer_block(texts, expected):
    assert [final_number(t) for t in texts] == expected


def test_entropy_is_shannon_entropy_of_cluster_shares():
    answers = ["1", "2", "1", None, "3", "1"]
    shares = [3 / 6, 1 / 6, 1 / 6, 1 / 6]  # clusters 1, 2, None, 3
    assert answer_clusters(answers) == [("1", 3), ("2", 1), ("3", 1), (None, 1)]
    assert answer_clusters([None, None]) == [(None, 1), (None, 1)]  # two non-answers are not one agreed answer
    assert answer_entropy(answers) == pytest.approx(-sum(p * math.log(p) for p in shares))
    assert answer_entropy(["4"] * 8) == 0.0
    assert answer_entropy([str(i) for i in range(8)]) == pytest.approx(math.log(8))  # the maximum for M=8


def test_agreement_and_correctness_are_different_things():
    confidently_wrong = PromptScore("q", "5", ("6", "6", "6", "6"), (0.0, 0.0, 0.0, 0.0))
    assert confidently_wrong.entropy == 0.0 and confidently_wrong.accuracy == 0.0
    assert confidently_wrong.zero_variance  # and it teaches nothing


def _trl_frac_zero_std(rewards: list[float], num_generations: int) -> float:
    """frac_reward_zero_std exactly as TRL 1.15's GRPOTrainer computes it (scale_rewards='group')."""
    import torch
    from trl.trainer.utils import nanstd

    tensor = torch.tensor(rewards, dtype=torch.float32)
    std = nanstd(tensor.view(-1, num_generations), dim=1).repeat_interleave(num_generations, dim=0)
    return torch.isclose(std, torch.zeros_like(std)).float().mean().item()


def test_zero_variance_is_what_trl_counts_in_frac_reward_zero_std():
    rng = random.Random(0)
    for _ in range(200):
        g = rng.choice([2, 3, 4, 8])
        groups = rng.randint(1, 6)
        rewards = []
        for _ in range(groups):
            if rng.random() < 0.4:
                rewards += [rng.choice([0.0, 0.25, 1.0, 2.5])] * g  # a flat group
            else:
                rewards += [rng.choice([0.0, 0.25, 0.5, 1.0, 2.0]) for _ in range(g)]  # may still tie by chance
        flat = [is_zero_variance(rewards[i : i + g]) for i in range(0, len(rewards), g)]
        assert sum(flat) / len(flat) == pytest.approx(_trl_frac_zero_std(rewards, g)), rewards


def test_zero_variance_matches_torch_isclose_tolerance():
    assert is_zero_variance([1.0, 1.0 + 1e-12])  # below TRL's isclose tolerance: counted as flat, as TRL does
    assert not is_zero_variance([1.0, 1.0 + 1e-6])
    assert not is_zero_variance([0.5])  # one reward is no group


def test_unscorable_rewards_are_left_out_of_the_std_as_trl_nanstd_does():
    nan = math.nan
    assert is_zero_variance([1.0, nan, 1.0]) and not is_zero_variance([1.0, nan, 2.0])
    assert not is_zero_variance([nan, nan, nan]) and not is_zero_variance([1.0, nan])
    assert _trl_frac_zero_std([1.0, nan, 1.0, 0.0, 2.0, 0.0], 3) == 0.5  # TRL: the first group is flat too


# ------------------------------------------------------------------------------------------------ ordering


def _score(question, answers, rewards=(0.0, 1.0), gold="1"):
    return PromptScore(question, gold, tuple(answers), tuple(rewards))


def test_entropy_order_puts_consistent_questions_first_ties_in_data_order_and_unscored_last(tmp_path):
    path = write_scores(
        tmp_path / "s.jsonl",
        [
            _score("a", ["1", "2", "3", "4"]),  # ln 4
            _score("c", ["1", "1", "1", "1"]),  # 0
            _score("d", ["1", "1", "2", "2"]),  # ln 2
            _score("e", ["5", "5", "6", "6"]),  # ln 2, after d in the data
        ],
    )
    ordered, _ = Curriculum(str(path)).apply(_dataset(["a", "unscored", "c", "d", "e"]))
    assert ordered["question"] == ["c", "d", "e", "a", "unscored"]


def test_zero_variance_keep_and_drop(tmp_path):
    path = write_scores(tmp_path / "s.jsonl", [_score("flat", ["1", "2"], (1.0, 1.0)), _score("ok", ["1", "2"])])
    kept, report = Curriculum(str(path)).apply(_dataset(["flat", "ok", "unscored"]))
    assert kept["question"] == ["flat", "ok", "unscored"] and report["zero_variance_questions"] == 1
    dropped, report = Curriculum(str(path), drop_zero_variance=True).apply(_dataset(["flat", "ok", "unscored"]))
    assert dropped["question"] == ["ok", "unscored"] and report["zero_variance_questions"] == 1


# ------------------------------------------------------------------------------------------------ files and apply


def test_scores_round_trip_and_bad_rows_name_the_line(tmp_path):
    scores = [_score("q1", ["1", None], (0.5, 0.5)), _score("q2", ["3", "3"], (0.0, 2.0), gold=None)]
    path = write_scores(tmp_path / "s.jsonl", scores)
    assert read_scores(path) == {"q1": scores[0], "q2": scores[1]}
    row = json.loads(path.read_text().splitlines()[0])
    assert row["zero_variance"] is True and row["clusters"] == [["1", 1], [None, 1]]
    path.write_text(path.read_text() + '{"question": "q3"}\n')
    with pytest.raises(GrpoKitError, match=r"s\.jsonl:3"):
        read_scores(path)
    path.write_text(path.read_text().splitlines()[0] + "\n[1, 2]\n")  # JSON, but not a row
    with pytest.raises(GrpoKitError, match=r"s\.jsonl:2"):
        read_scores(path)


@pytest.mark.parametrize("make", ["missing", "binary", "folder", "empty"])
def test_a_scores_file_that_cannot_be_read_is_one_clear_error(tmp_path, make):
    path = tmp_path / "scores.jsonl"
    if make == "binary":
        path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe" * 10)
    elif make == "folder":
        path.mkdir()
    elif make == "empty":
        path.write_text("\n\n")
    with pytest.raises(GrpoKitError, match="grpo-kit curriculum") as caught:
        Curriculum(str(path)).apply(_dataset(["q"]))
    assert str(path) in str(caught.value) and "\n" not in str(caught.value)


def _dataset(questions):
    from datasets import Dataset

    return Dataset.from_dict({"question": questions, "answer": ["1"] * len(questions)})


def test_curriculum_apply_orders_filters_and_reports(tmp_path):
    path = write_scores(
        tmp_path / "s.jsonl",
        [
            _score("hard", ["1", "2", "3", "4"], (0.0, 2.0, 0.0, 0.0)),
            _score("easy", ["1", "1", "1", "1"], (2.0, 2.0, 2.0, 2.0)),
            _score("medium", ["1", "1", "2", "2"], (2.0, 2.0, 0.0, 0.0)),
        ],
    )
    dataset = _dataset(["hard", "unscored", "easy", "medium"])
    ordered, report = Curriculum(str(path)).apply(dataset)
    assert ordered["question"] == ["easy", "medium", "hard", "unscored"]
    dropped, report = Curriculum(str(path), drop_zero_variance=True).apply(dataset)
    assert dropped["question"] == ["medium", "hard", "unscored"]
    assert report["zero_variance_questions"] == 1 and report["kept"] == 3 and report["scored"] == 3


class _Stop(Exception):
    pass


@pytest.mark.parametrize(("recipe_sets", "expected"), [({}, False), ({"shuffle_dataset": True}, True)])
def test_train_turns_trl_shuffling_off_unless_the_recipe_set_it(tmp_path, monkeypatch, recipe_sets, expected):
    """TRL must not undo the curriculum's order; a value the recipe set is never overwritten."""
    from grpo_kit import planner
    from grpo_kit.config import load_recipe
    from grpo_kit.train import train

    seen = []

    def stop(recipe, device):  # the first check that sees the final recipe; stop before any data or weights load
        seen.append(recipe.grpo.shuffle_dataset)
        raise _Stop

    monkeypatch.setattr(planner, "check_device", stop)
    with pytest.raises(_Stop):
        train(
            load_recipe("cpu", **recipe_sets),
            dataset=_dataset(["q"]),
            output_dir=tmp_path / "run",
            curriculum=Curriculum("s.jsonl"),
        )
    assert seen == [expected]


def test_curriculum_for_other_data_or_nothing_left_is_explained(tmp_path):
    path = write_scores(tmp_path / "s.jsonl", [_score("flat", ["1", "1"], (1.0, 1.0))])
    with pytest.raises(GrpoKitError, match="other data"):
        Curriculum(str(path)).apply(_dataset(["something else"]))
    with pytest.raises(GrpoKitError, match="nothing to train on"):
        Curriculum(str(path), drop_zero_variance=True).apply(_dataset(["flat"]))


def test_cli_zero_variance_without_scores_is_a_clear_error(capsys):
    from grpo_kit.cli import main

    assert main(["train", "--preset", "cpu", "--data", "sample", "--zero-variance", "drop"]) == 2
    assert "--curriculum scores.jsonl" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ scoring


def test_rewards_are_summed_like_trl(monkeypatch):
    """Weighted sum over the functions that returned a number; a completion no function scores is NaN (TRL)."""
    from datasets import Dataset

    from grpo_kit.rewards import REWARDS

    dataset = Dataset.from_dict({"prompt": ["p"], "question": ["q"], "answer": ["1"], "prefill": [""]})

    def first(completions, **kwargs):
        return [1.0, None, None]

    def second(completions, **kwargs):
        return [0.5, 0.5, None]

    monkeypatch.setitem(REWARDS, "first", first)
    monkeypatch.setitem(REWARDS, "second", second)
    (score,) = score_dataset(dataset, [["a", "b", "c"]], rewards=[("first", 2.0), ("second", 1.0)])
    assert score.rewards[:2] == (2.5, 0.5) and math.isnan(score.rewards[2])
    assert score.reward_spec == "first:2,second:1"


def _constructed_case():
    """8 prompts; for the 'stuck' ones every sample is the same text (so the same reward), the others vary."""
    from datasets import Dataset

    questions = [f"stuck {i}" if i % 2 else f"open {i}" for i in range(8)]
    dataset = Dataset.from_dict(
        {"prompt": questions, "question": questions, "answer": ["4"] * 8, "prefill": ["<think>\n"] * 8}
    )

    def sampler(rows, samples):
        rng = random.Random(len(rows))
        out = []
        for prompt in rows["prompt"]:
            if prompt.startswith("stuck"):
                out.append(["</think><answer>9</answer>"] * samples)
            else:
                out.append(
                    [rng.choice(["</think><answer>4</answer>", "no answer", "</think> 4"]) for _ in range(samples)]
                )
                out[-1][0] = "</think><answer>4</answer>"  # make sure the group is not flat by chance
                out[-1][1] = "no answer"
        return out

    return dataset, sampler


def test_score_dataset_reads_answers_with_the_prefill_and_scores_with_the_run_rewards():
    dataset, sampler = _constructed_case()
    scores = score_dataset(dataset, sampler(dataset, 4), rewards=[("tag_progress", 1.0), ("correctness", 0.25)])
    stuck = scores[1]
    assert stuck.answers == ("9",) * 4 and stuck.zero_variance and stuck.entropy == 0.0 and stuck.accuracy == 0.0
    assert stuck.rewards == (1.0,) * 4  # tag_progress counts the prefilled <think> as written
    assert stuck.reward_spec == "tag_progress:1,correctness:0.25"
    assert not any(score.zero_variance for score in scores[0::2])


def test_dropping_zero_variance_prompts_removes_zero_std_groups(tmp_path):
    """The constructed case: half the prompts are stuck. Filtering with the scores leaves no flat group."""
    dataset, sampler = _constructed_case()
    spec = [("tag_progress", 1.0), ("correctness", 0.25)]
    path = write_scores(tmp_path / "s.jsonl", score_dataset(dataset, sampler(dataset, 4), rewards=spec))

    def zero_std_share(rows):  # one fresh "training" pass: G=4 samples per prompt, scored, TRL's metric
        fresh = score_dataset(rows, sampler(rows, 4), rewards=spec)
        return _trl_frac_zero_std([r for score in fresh for r in score.rewards], num_generations=4)

    before = zero_std_share(dataset)
    filtered, report = Curriculum(str(path), drop_zero_variance=True).apply(dataset)
    after = zero_std_share(filtered)
    assert before == 0.5 and after == 0.0
    assert report["zero_variance_questions"] == 4 and len(filtered) == 4


# ------------------------------------------------------------------------------------------------ with a model


@pytest.mark.slow
def test_sampled_answers_are_m_per_prompt_seeded_whatever_the_models_decoding_defaults(tiny_model_dir):
    """``grpo-kit curriculum`` samples through ``evaluate.generate``: M samples per prompt, the same for the same seed,
    whatever decoding defaults the model ships with."""
    from grpo_kit.evaluate import generate
    from grpo_kit.models import load_inference_model

    model, tokenizer = load_inference_model(str(tiny_model_dir))
    options = dict(max_new_tokens=6, batch_size=2, num_samples=3, temperature=0.9, seed=3, progress=False)
    first = [[text for text, _ in group] for group in generate(model, tokenizer, ["Hello", "Hi"], **options)]
    assert [len(group) for group in first] == [3, 3] and len(set(first[0])) > 1  # sampled, not greedy
    model.generation_config.num_beams, model.generation_config.typical_p = 2, 0.5  # a model's own defaults
    assert [[text for text, _ in group] for group in generate(model, tokenizer, ["Hello", "Hi"], **options)] == first


@pytest.mark.slow
def test_cli_curriculum_writes_scores_next_to_the_data(tiny_model_dir, tmp_path, capsys):
    from grpo_kit.cli import main
    from grpo_kit.data import make_arithmetic_dataset

    data = tmp_path / "train.jsonl"
    rows = make_arithmetic_dataset(3, seed=0).to_list()
    data.write_text("".join(json.dumps({"question": r["question"], "answer": r["answer"]}) + "\n" for r in rows))
    argv = [
        "curriculum",
        "--data",
        str(data),
        "--set",
        f"model_name_or_path={tiny_model_dir}",
        "--samples",
        "2",
        "--set",
        "max_completion_length=6",
    ]
    assert main(argv) == 0
    scores = read_scores(tmp_path / "train.curriculum.jsonl")
    assert set(scores) == {r["question"] for r in rows}
    assert all(len(s.answers) == 2 and len(s.rewards) == 2 for s in scores.values())
    summary = json.loads(capsys.readouterr().out.splitlines()[0])
    assert summary["questions"] == 3 and 0.0 <= summary["frac_zero_variance"] <= 1.0


def _char_code_reward_for(flat_questions):
    seen: list[list[str]] = []

    def toy(completions, question=None, **kwargs):
        """0 for the 'flat' questions; otherwise a number that random completions practically never share."""
        seen.append(list(question))
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [0.0 if q in flat_questions else sum(map(ord, t)) / 1000 for q, t in zip(question, texts, strict=True)]

    return toy, seen


@pytest.mark.slow
def test_training_with_zero_variance_drop_lowers_trl_zero_std_share(tiny_model_dir, tmp_path, monkeypatch):
    """Real TRL runs: half the questions can only ever score 0. Dropping them (from scores) removes the flat groups
    TRL reports, and the curriculum order is the order TRL trains on."""
    from grpo_kit.config import load_recipe
    from grpo_kit.data import make_arithmetic_dataset
    from grpo_kit.files import read_metrics
    from grpo_kit.rewards import REWARDS
    from grpo_kit.train import train

    dataset = make_arithmetic_dataset(8, seed=0)
    questions = dataset["question"]
    flat = set(questions[::2])
    toy, seen = _char_code_reward_for(flat)
    monkeypatch.setitem(REWARDS, "toy", toy)
    scores = [
        PromptScore(
            q,
            "1",
            tuple(["1"] * (i + 1) + ["2"] * (3 - i)) if i < 3 else ("1", "2", "3", "4"),
            (0.0,) * 4 if q in flat else (0.1, 0.2, 0.3, 0.4),
            "toy:1",
        )
        for i, q in enumerate(questions)
    ]
    path = write_scores(tmp_path / "scores.jsonl", scores)
    recipe = load_recipe(
        "cpu",
        model_name_or_path=str(tiny_model_dir),
        max_steps=3,
        num_generations=2,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        max_completion_length=8,
        few_shot=0,
        save_steps=10,
        logging_steps=1,
        reward_funcs=["toy"],
        reward_weights=[1.0],
    )
    baseline = train(recipe, dataset=dataset, output_dir=tmp_path / "base")
    seen.clear()
    filtered = train(
        recipe, dataset=dataset, output_dir=tmp_path / "drop", curriculum=Curriculum(str(path), drop_zero_variance=True)
    )
    before = [row["frac_reward_zero_std"] for row in read_metrics(baseline.metrics_path)]
    after = [row["frac_reward_zero_std"] for row in read_metrics(filtered.metrics_path)]
    assert sum(before) > 0 and after == [0.0, 0.0, 0.0]  # measured: before [0.5, 0.0, 0.5]
    kept = [q for q in sorted(questions, key=lambda q: scores[questions.index(q)].entropy) if q not in flat]
    assert len(seen[0]) == 3  # the kit's own check: the reward called on three made-up completions before any load
    assert seen[1] == [kept[0]] * 2 + [kept[1]] * 2  # step 1 trains the two lowest-entropy kept questions
    run_info = json.loads((filtered.run_dir / "run.json").read_text())
    assert run_info["curriculum"]["zero_variance_questions"] == 4 and run_info["curriculum"]["kept"] == 4
    assert run_info["recipe"].get("shuffle_dataset") is False  # the curriculum's one GRPOConfig change, recorded
