"""Evaluation: scoring under both protocols, metrics and files, before/after, the CLI.

Models are the tiny random Llama."""

from __future__ import annotations

import json

import pytest

import grpo_kit.evaluate as evaluate_module
from grpo_kit.cli import main
from grpo_kit.data import load_gsm8k
from grpo_kit.errors import GrpoKitError
from grpo_kit.evaluate import EvalResult, compare, evaluate, evaluate_before_after, stop_token_ids
from grpo_kit.rewards import REWARDS

_score_row = evaluate_module._score_row
ROW_KEYS = {
    "question",
    "gold",
    "completion",
    "extracted_strict",
    "extracted_lenient",
    "correct_strict",
    "correct_lenient",
    "in_format",
    "completion_tokens",
}


@pytest.fixture(scope="module")
def questions():
    return load_gsm8k("sample", "test", limit=3, seed=0)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from grpo_kit.models import load_inference_model

    return load_inference_model(str(tiny_model_dir))


def test_strict_and_lenient_protocols_differ_as_documented():
    tagged = _score_row("<think>5 + 3 = 8</think>\n<answer>$8.00</answer>", "8")
    assert tagged == {
        "extracted_strict": "$8.00",
        "extracted_lenient": "8.00",
        "correct_strict": True,
        "correct_lenient": True,
        "in_format": True,
    }
    untagged = _score_row("5 + 3 = 8, so 8 apples.", "8")
    assert (untagged["correct_strict"], untagged["correct_lenient"], untagged["in_format"]) == (False, True, False)
    wrong_tag = _score_row("<think>x</think><answer>9</answer> but really 8", "8")
    assert (wrong_tag["correct_strict"], wrong_tag["correct_lenient"]) == (False, True)


def test_prefill_counts_as_part_of_the_answer():
    completion = "3 + 5 = 8\n</think>\n<answer>8</answer>"
    assert not _score_row(completion, "8")["in_format"]
    assert _score_row(completion, "8", prefill="<think>\n")["in_format"]


@pytest.mark.parametrize(
    "completion",
    [
        "<think>x</think><answer>1,000</answer>",
        "<answer>18 or 19</answer>",
        "<ANSWER>1000</ANSWER>",
        "<think>x</think><answer>1000",
        "the answer is 1000",
        "<answer>1e3</answer>",
        "<answer>one thousand</answer>",
    ],
)
def test_strict_accuracy_is_the_correctness_reward_and_format_the_format_reward(completion):
    correct = REWARDS["correctness"]([completion], answer=["1000"], prefill=[""])[0] > 0  # as TRL calls it
    in_format = REWARDS["format"]([completion], answer=["1000"], prefill=[""])[0] > 0
    row = _score_row(completion, "1000")
    assert (row["correct_strict"], row["in_format"]) == (correct, in_format)


def test_stop_token_ids_merge_the_generation_config_and_tokenizer_ends_once_each():
    from types import SimpleNamespace

    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[2, 7]))
    assert stop_token_ids(model, SimpleNamespace(eos_token_id=7)) == [2, 7]
    assert stop_token_ids(object(), SimpleNamespace(eos_token_id=5)) == [5]  # no generation config


@pytest.fixture
def with_model_defaults(tiny):
    """Give the tiny model decoding defaults of its own, as Hub models ship them (restored afterwards)."""
    config = tiny[0].generation_config
    saved = (config.repetition_penalty, config.no_repeat_ngram_size, config.top_k)

    def apply():
        config.repetition_penalty, config.no_repeat_ngram_size, config.top_k = 50.0, 1, 3

    yield apply
    config.repetition_penalty, config.no_repeat_ngram_size, config.top_k = saved


def test_generate_ignores_the_models_own_decoding_defaults(tiny, with_model_defaults):
    """transformers fills unset decoding settings from model.generation_config; the protocol must not move with it."""
    model, tokenizer = tiny
    prompts = evaluate_module.build_prompts(["What is 2 + 3?", "Name a fruit."], tokenizer)
    plain = evaluate_module.generate(model, tokenizer, prompts, max_new_tokens=8, progress=False)
    with_model_defaults()
    assert evaluate_module.generate(model, tokenizer, prompts, max_new_tokens=8, progress=False) == plain


def test_evaluate_scores_generations_with_prefill(tiny, questions, monkeypatch):
    """Scoring wiring without model noise: generation replaced by fixed completions (one right, one wrong, one
    untagged)."""
    golds = list(questions["answer"])
    canned = [f"ok\n</think>\n<answer>{golds[0]}</answer>", "ok\n</think>\n<answer>-1</answer>", f"it is {golds[2]}"]
    seen = {}

    def fake_generate(model, tokenizer, prompts, **kwargs):
        seen["prompts"] = prompts
        return [[(text, 5)] for text in canned]

    monkeypatch.setattr(evaluate_module, "generate", fake_generate)
    model, tokenizer = tiny
    result = evaluate(model, tokenizer, questions, prefill="<think>\n", few_shot=1, progress=False)
    assert all(p.endswith("<|im_start|>assistant\n<think>\n") for p in seen["prompts"])
    assert seen["prompts"][0].count("<|im_start|>user") == 2  # one worked example + the question
    assert result.accuracy_strict == pytest.approx(1 / 3)
    assert result.accuracy_lenient == pytest.approx(2 / 3)
    assert result.format_rate == pytest.approx(2 / 3)
    assert result.mean_completion_tokens == 5
    assert "few_shot=1" in result.protocol and "'<think>\\n'" in result.protocol


def test_evaluate_rejects_bad_input(tiny, questions):
    model, tokenizer = tiny
    with pytest.raises(GrpoKitError, match="'answer'"):
        evaluate(model, tokenizer, questions.remove_columns("answer"), progress=False)


def test_save_writes_metrics_and_rows_beside_them(tmp_path):
    rows = ({"question": "q", "gold": "1", "completion": "1", "extracted_strict": None, "correct_strict": False},)
    result = EvalResult(0.0, 1.0, 0.0, 1.0, n=1, seed=3, protocol="p", rows=rows)
    path = result.save(tmp_path / "out" / "eval.json")
    data = json.loads(path.read_text())
    assert data["accuracy_lenient"] == 1.0 and data["protocol"] == "p" and "rows" not in data
    assert EvalResult(**data, rows=rows) == result
    assert [json.loads(line) for line in (tmp_path / "out" / "eval.jsonl").read_text().splitlines()] == list(rows)
    assert result.save(path) == path  # its own earlier files: written again


@pytest.mark.parametrize(
    ("name", "content", "refusal"),
    [
        ("eval.jsonl", '{"question": "q", "answer": "#### 1"}\n', "would overwrite .*eval.jsonl, which grpo-kit eval"),
        ("eval.json", '{"mine": true}', "would overwrite .*eval.json, which grpo-kit eval"),
        ("eval.json", "not json at all", "would overwrite"),
    ],
)
def test_save_never_writes_over_a_file_it_did_not_write(tmp_path, name, content, refusal):
    (tmp_path / name).write_text(content)
    result = EvalResult(0.0, 0.0, 0.0, 1.0, n=1, seed=0, protocol="p", rows=({"question": "q", "extracted_strict": 1},))
    with pytest.raises(GrpoKitError, match=refusal):
        result.save(tmp_path / "eval.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == [name] and (tmp_path / name).read_text() == content


def test_compare_table_shows_both_protocols():
    base = EvalResult(0.02, 0.10, 0.0, 120.0, n=50, seed=0, protocol="same")
    tuned = EvalResult(0.08, 0.12, 0.9, 60.0, n=50, seed=0, protocol="same")
    table = compare(base, tuned)
    assert "accuracy (strict)          2.0 %       8.0 %     +6.0" in table
    assert "accuracy (lenient)        10.0 %      12.0 %     +2.0" in table
    assert "format rate                0.0 %      90.0 %    +90.0" in table
    assert "protocol: same" in table
    assert "paired" not in table  # no rows: nothing to pair


def test_compare_pairs_the_same_questions_and_tests_the_change():
    def result(right):
        rows = tuple({"question": f"q{i}", "correct_strict": r} for i, r in enumerate(right))
        return EvalResult(sum(right) / len(right), 0.0, 0.0, 1.0, n=len(right), seed=0, protocol="p", rows=rows)

    table = compare(result([False] * 80 + [True] * 20), result([False] * 60 + [True] * 40))
    assert "change +20.0 points" in table and "zero is outside it" in table
    assert "McNemar exact: 20 questions gained, 0 lost" in table
    unchanged = compare(result([True, False] * 10), result([True, False] * 10))
    assert "zero is NOT outside it" in unchanged and "p = 1" in unchanged


@pytest.mark.slow
def test_evaluate_tiny_model_returns_well_formed_metrics(tiny, questions):
    model, tokenizer = tiny
    result = evaluate(model, tokenizer, questions, max_new_tokens=6, batch_size=2, progress=False)
    assert result.n == 3 and len(result.rows) == 3
    for key in ("accuracy_strict", "accuracy_lenient", "format_rate"):
        assert 0.0 <= getattr(result, key) <= 1.0
    assert 1 <= result.mean_completion_tokens <= 6
    for row, gold in zip(result.rows, questions["answer"], strict=True):
        assert ROW_KEYS <= set(row) and row["gold"] == gold and 1 <= row["completion_tokens"] <= 6
    assert "strict" in result.protocol and "lenient" in result.protocol
    again = evaluate(model, tokenizer, questions, max_new_tokens=6, batch_size=3, progress=False)
    assert [r["completion"] for r in again.rows] == [r["completion"] for r in result.rows]  # greedy, batch-independent


@pytest.mark.slow
def test_before_after_uses_the_adapter(tiny_model_dir, questions, tmp_path, make_adapter):
    adapter = make_adapter(tiny_model_dir, tmp_path / "adapter", std=0.5, targets=["q_proj", "v_proj", "up_proj"])
    base, tuned = evaluate_before_after(str(tiny_model_dir), adapter, questions, max_new_tokens=8, progress=False)
    assert (base.label, tuned.label) == ("base", "tuned") and base.n == tuned.n == 3
    assert [r["question"] for r in base.rows] == [r["question"] for r in tuned.rows]
    assert [r["completion"] for r in base.rows] != [r["completion"] for r in tuned.rows]


@pytest.mark.slow
def test_cli_eval_writes_json_and_rows(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "eval.json"
    code = main(
        [
            "eval",
            "--model",
            str(tiny_model_dir),
            "--data",
            "sample",
            "--limit",
            "2",
            "--max-new-tokens",
            "4",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert "strict" in printed and "lenient" in printed and "protocol:" in printed
    data = json.loads(out.read_text())
    assert data["n"] == 2 and data["seed"] == 0
    assert len(out.with_suffix(".jsonl").read_text().splitlines()) == 2


@pytest.mark.slow
def test_cli_eval_compare(tiny_model_dir, tmp_path, capsys, make_adapter):
    adapter = make_adapter(tiny_model_dir, tmp_path / "adapter", targets=["q_proj", "v_proj", "up_proj"])
    out = tmp_path / "eval.json"
    assert (
        main(
            [
                "eval",
                "--model",
                str(tiny_model_dir),
                "--adapter",
                str(adapter),
                "--compare",
                "--data",
                "sample",
                "--limit",
                "2",
                "--max-new-tokens",
                "4",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert "accuracy (strict)" in capsys.readouterr().out
    assert out.is_file() and (tmp_path / "eval-base.json").is_file()
    assert main(["eval", "--model", str(tiny_model_dir), "--compare", "--data", "sample"]) == 2
