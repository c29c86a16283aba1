"""grpo_kit.rewards: a case table per reward, the TRL calling convention, prefill, registry and spec parsing."""

from __future__ import annotations

import json
import math
import pickle
import re
from pathlib import Path

import pytest

from grpo_kit.errors import GrpoKitError
from grpo_kit.rewards import RANGES, REWARDS, reward_functions

GOOD = "<think>\nNatalia sold 48 / 2 = 24 clips in May.\n48 + 24 = 72\n</think>\n<answer>\n72\n</answer>"
GOLD = "72"
BUILT_IN = [
    "correctness",
    "format",
    "tag_count",
    "integer",
    "tag_progress",
    "format_rate",
    "semantic_entropy",
    "reflection_rate",
]
#: Metrics of a group or of the words used, not of the answer: no single best completion reaches their maximum.
GROUP_METRICS = ("semantic_entropy", "reflection_rate")


def run(name, completion, answer=GOLD, prefill=None):
    """Score one completion with reward ``name`` the way TRL calls it (keyword arguments, lists, extras)."""
    kwargs = {
        "prompts": ["question"],
        "completion_ids": [[1, 2, 3]],
        "trainer_state": None,
        "log_extra": lambda *a, **k: None,
        "log_metric": lambda *a, **k: None,
        "question": ["How many clips?"],
        "answer": [answer],
    }
    if prefill is not None:
        kwargs["prefill"] = [prefill]
    scores = REWARDS[name](completions=[completion], **kwargs)
    assert isinstance(scores, list) and len(scores) == 1 and isinstance(scores[0], float)
    return scores[0]


def score_all(completions, gold, names=BUILT_IN, prefill=""):
    """Each completion's score under each reward in ``names`` (one gold and prefill for all), plus their sum."""
    scores = [fn(completions, answer=gold, prefill=prefill) for fn in reward_functions(names)]
    rows = [dict(zip(names, values, strict=True)) for values in zip(*scores, strict=True)]
    return [{**row, "total": round(sum(row.values()), 6)} for row in rows]


# ----------------------------------------------------------------------------------------------- correctness


CORRECTNESS_CASES = [  # (completion, gold answer, expected score)
    (GOOD, "72", 2.0),
    ("<answer>72</answer>", "72", 2.0),
    ("<answer>72.0</answer>", "72", 2.0),
    ("<answer>$72</answer>", "72", 2.0),
    ("<answer>72 clips</answer>", "72", 2.0),
    ("<answer>\\boxed{72}</answer>", "72", 2.0),
    ("<answer>1,000</answer>", "1000", 2.0),
    ("<answer>$1,000.00</answer>", "1000", 2.0),
    ("<answer>-7</answer>", "-7", 2.0),
    ("<answer>\u22127</answer>", "-7", 2.0),
    ("<answer>0.5</answer>", "0.5", 2.0),
    ("<answer>\\frac{1}{2}</answer>", "0.5", 2.0),
    ("<answer>1/2</answer>", "0.5", 2.0),
    ("<answer>48 + 24 = 72</answer>", "72", 2.0),
    ("<answer>\n72\n</answer>\n<|im_end|>", "72", 2.0),
    ("<ANSWER>72</ANSWER>", "72", 2.0),
    ("<answer>71</answer> <answer>72</answer>", "72", 2.0),  # the last block counts
    ("<answer>72</answer> <answer>71</answer>", "72", 0.0),
    ("<answer>7</answer>", "-7", 0.0),
    ("<answer>-7</answer>", "7", 0.0),
    ("<answer>71</answer>", "72", 0.0),
    ("<answer>72.5</answer>", "72", 0.0),
    ("<answer></answer>", "72", 0.0),
    ("<answer>seventy-two</answer>", "72", 0.0),
    ("<answer>72", "72", 2.0),  # left open: a stripped </answer> stop string
    ("<answer>72<|im_end|>", "72", 2.0),
    ("<answer>71</answer><answer>72", "72", 2.0),
    ("<answer>72</answer><answer>71", "72", 0.0),
    ("72", "72", 0.0),  # untagged
    ("<think>72</think>", "72", 0.0),
    ("", "72", 0.0),
    ("<answer>nan</answer>", "72", 0.0),
    ("<answer>inf</answer>", "72", 0.0),
    (f"<answer>{10**400}</answer>", "72", 0.0),
    ("<answer>10**400</answer>", "400", 0.0),
    ("<answer>72</answer>", "", 0.0),
    ("<answer>72</answer>", None, 0.0),
    ("<answer>72</answer>" + "x" * 5000, "72", 2.0),  # text after the block does not count
    ("<think>48 + 24 = 72</think><answer>72</answer>" + " Let me check: 48 + 24 = 72." * 4_000, "72", 2.0),
    ("<answer>\n**72**\n</answer>", "72", 2.0),
    ("<answer>72 (= 48 + 24)</answer>", "72", 2.0),
    ("<answer>72, because 48 + 24</answer>", "72", 2.0),
    ("<answer>70 000</answer>", "70000", 2.0),
    ("<answer>70\u202f000</answer>", "70000", 2.0),
    ("<answer>72 or 73</answer>", "72", 0.0),
    ("<answer>72 or 73</answer>", "73", 0.0),
]


@pytest.mark.parametrize(("completion", "answer", "expected"), CORRECTNESS_CASES)
def test_correctness(completion, answer, expected):
    assert run("correctness", completion, answer) == expected


def notebook_cell(notebook: str, cell_id: str) -> dict:
    """The names a notebook's code cell defines, run on its own."""
    path = Path(__file__).resolve().parents[1] / "notebooks" / notebook
    cell = next(c for c in json.loads(path.read_text(encoding="utf-8"))["cells"] if c.get("id") == cell_id)
    namespace: dict = {}
    exec(compile("".join(cell["source"]), f"{notebook}:{cell_id}", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("prefill", ["", "<think>\n", "<answer>"])
def test_notebook_00s_correctness_reward_scores_the_case_table_as_the_built_in(prefill):
    """Notebook 00 shows the correctness reward as a `def` and trains with it: it must score as the package's."""
    cell = notebook_cell("00_train_grpo_colab.ipynb", "c12a")
    completions = [completion for completion, _, _ in CORRECTNESS_CASES]
    golds = [answer for _, answer, _ in CORRECTNESS_CASES]
    prefills = [prefill] * len(CORRECTNESS_CASES)
    built_in = REWARDS["correctness"](completions, answer=golds, prefill=prefills)
    if not prefill:  # the table's own expectations hold for the built-in as they are stated
        assert built_in == [expected for _, _, expected in CORRECTNESS_CASES]
    assert cell["correctness"](completions, answer=golds, prefill=prefills, trainer_state=None) == built_in
    messages = [[{"role": "assistant", "content": c}] for c in completions]  # conversational completions
    assert cell["correctness"](messages, answer=golds, prefill=prefills) == built_in


# How each reward treats the decided conventions (grpo_kit.answers docstring): rewards that read the answer accept
# any tag case and a final block left open; format rewards check the tags as written.
ANSWER_READERS = {"correctness": 2.0, "integer": 0.5}
FORMAT_JUDGES = ["format"]


@pytest.mark.parametrize(
    "completion",
    [
        "<THINK>\n48 + 24 = 72\n</THINK>\n<ANSWER>\n72\n</ANSWER>",  # uppercase tags
        "<think>\n48 + 24 = 72\n</think>\n<answer>\n72",  # stopped at a stripped "</answer>" stop string
        "<think>\n48 + 24 = 72\n</think>\n<answer>\n72\n<|im_end|>",
    ],
)
def test_answer_readers_accept_what_format_rewards_refuse(completion):
    for name, points in ANSWER_READERS.items():
        assert run(name, completion) == points, name
    for name in FORMAT_JUDGES:
        assert run(name, completion) == 0.0, name
    assert run("tag_count", completion) < run("tag_count", GOOD)


def test_long_trailing_text_keeps_correctness_and_costs_format_points():
    completion = GOOD + "\nTo double-check, 48 + 24 = 72 clips. " * 200
    assert run("correctness", completion) == 2.0 and run("format", completion) == 0.5
    assert run("tag_count", completion) == 0.75


def test_correctness_without_answer_column_scores_zero():
    assert REWARDS["correctness"](["<answer>72</answer>", "x"]) == [0.0, 0.0]


def test_correctness_accepts_numeric_gold():
    assert REWARDS["correctness"](["<answer>72</answer>"], answer=[72]) == [2.0]


@pytest.mark.parametrize(
    "bad",
    [
        "<think>no answer</think>",
        "<answer>71</answer>",
        "<answer></answer>",
        "",
        "<answer>" + "9" * 500 + "</answer>",
        "<answer>72 or 71</answer>",
        "<answer>nan</answer>",
    ],
)
def test_wrong_empty_missing_and_absurd_score_strictly_lower_than_correct(bad):
    correct = score_all([GOOD], GOLD)[0]
    other = score_all([bad], GOLD)[0]
    assert run("correctness", bad) < run("correctness", GOOD)
    assert other["total"] < correct["total"]


# ----------------------------------------------------------------------------------------------- format (soft)


FORMAT_CASES = [  # (completion, expected score of the soft format reward)
    (GOOD, 0.5),
    ("<think>a</think><answer>7</answer>", 0.5),
    ("<think>\nline 1\nline 2\nline 3\n</think>\n\n<answer>\n7\n</answer>", 0.5),
    ("  \n<think>a</think>  \n <answer>7</answer>", 0.5),
    ("<think>a</think><answer>7</answer> trailing words allowed", 0.5),
    ("<think></think><answer></answer>", 0.5),  # soft: empty blocks are still the shape
    ("<think>a</think> b </think><answer>7</answer>", 0.5),  # a later </think> hands over to the answer
    ("<think>a</think>" + " " * 10_000 + "<answer>7</answer>", 0.5),
    ("<think>a</think>\n<answer>7", 0.0),  # answer never closed
    ("<think>a</think> so <answer>7</answer>", 0.0),  # text between the blocks
    ("<think>a<answer>7</answer>", 0.0),  # think never closed
    ("Sure! <think>a</think><answer>7</answer>", 0.0),  # must start with the think block
    ("<answer>7</answer><think>a</think>", 0.0),
    ("<answer>7</answer>", 0.0),
    ("<THINK>a</THINK><ANSWER>7</ANSWER>", 0.0),  # tags are case-sensitive
    ("", 0.0),
]


@pytest.mark.parametrize(("completion", "expected"), FORMAT_CASES)
def test_format(completion, expected):
    assert run("format", completion) == expected


@pytest.mark.parametrize("prefill", ["", "<think>"])
def test_notebook_00s_format_reward_scores_the_case_table_as_the_built_in(prefill):
    """Notebook 00 trains with its own `soft_format` in place of the built-in `format`: they must score alike."""
    soft_format = notebook_cell("00_train_grpo_colab.ipynb", "c12a")["soft_format"]
    cases = [completion.removeprefix(prefill) for completion, _ in FORMAT_CASES if completion.startswith(prefill)]
    prefills = [prefill] * len(cases)
    assert REWARDS["format"](cases, prefill=prefills) == soft_format(cases, prefill=prefills)
    if not prefill:
        assert soft_format(cases, prefill=prefills) == [expected for _, expected in FORMAT_CASES]


def test_format_matches_multi_line_reasoning():
    # The widely copied Unsloth pattern r"<think>.*?</think>\s*<answer>.*?</answer>" has no DOTALL and misses this.
    multi_line = "<think>\nstep 1\nstep 2\n</think>\n<answer>\n7\n</answer>"
    assert run("format", multi_line) == 0.5


# ----------------------------------------------------------------------------------------------- tag_count


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        (GOOD, 1.0),
        ("<think>a</think><answer>7</answer>", 1.0),
        ("<think>a</think><answer>7</answer>\n<|im_end|>", 1.0),  # whitespace and EOS are not trailing text
        ("<think>a</think><answer>7</answer>" + "x" * 100, 0.9),
        ("<think>a</think><answer>7</answer>" + "x" * 100_000, 0.75),  # penalty capped at 0.25
        ("<think>a</think><answer>7", 0.75),
        ("<think>a</think>", 0.5),
        ("<think>", 0.25),
        ("<think><think></think><answer>7</answer>", 0.75),  # <think> twice earns nothing for it
        ("", 0.0),
        ("no tags", 0.0),
        ("</answer></answer>" + "x" * 1000, -0.25),  # the lower bound
    ],
)
def test_tag_count(completion, expected):
    assert run("tag_count", completion) == pytest.approx(expected)


# ----------------------------------------------------------------------------------------------- integer


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<answer>72</answer>", 0.5),
        ("<answer>\n72\n</answer>", 0.5),
        ("<answer>-7</answer>", 0.5),
        ("<answer>\u22127</answer>", 0.5),
        ("<answer>0</answer>", 0.5),
        ("<answer>1,000</answer>", 0.5),
        ("<answer>1,000,000</answer>", 0.5),
        ("<answer>70 000</answer>", 0.5),
        ("<answer>70\u2009000</answer>", 0.5),
        ("<answer>70 0000</answer>", 0.0),
        ("<answer>70,000 000</answer>", 0.0),
        ("<answer>3.5</answer>", 0.0),
        ("<answer>72.0</answer>", 0.0),
        ("<answer>72 clips</answer>", 0.0),
        ("<answer>$72</answer>", 0.0),
        ("<answer>1,00</answer>", 0.0),
        ("<answer>+7</answer>", 0.0),
        ("<answer>- 7</answer>", 0.0),
        ("<answer>" + "9" * 500 + "</answer>", 0.0),  # absurd
        ("<answer></answer>", 0.0),
        ("<answer>seven</answer>", 0.0),
        ("72", 0.0),
        ("", 0.0),
    ],
)
def test_integer(completion, expected):
    assert run("integer", completion) == expected


# ----------------------------------------------------------------------------------------------- tag_progress


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>a</think><answer>7</answer>", 1.0),
        ("a</think>\n<answer>7</answer>", 1.0),  # <think> is not scored (it is prefilled in the CPU recipe)
        ("a</think> so the answer: <answer>7</answer>", 1.0),  # "followed by": anywhere after </think>
        ("a</think><answer>7", 0.5),
        ("a</think>", 0.25),
        ("<answer>7</answer>", 0.5),  # tags present but no </think> before them
        ("<answer>7</answer></think>", 0.75),
        ("a</think></think><answer>7</answer>", 0.75),  # </think> twice earns nothing for it
        ("a</think><answer>7</answer><answer>8</answer>", 0.5),
        ("", 0.0),
        ("just words", 0.0),
    ],
)
def test_tag_progress(completion, expected):
    assert run("tag_progress", completion) == expected


def test_tag_progress_gives_partial_steps_a_ladder():
    ladder = ["a", "a</think>", "a</think><answer>7", "a</think><answer>7</answer>"]
    scores = REWARDS["tag_progress"](ladder, prefill=["<think>\n"] * len(ladder))
    assert scores == sorted(scores) and len(set(scores)) == len(ladder)


# ----------------------------------------------------------------------------------------------- calling convention

SAMPLES = [
    GOOD,
    "<think>a</think><answer>71</answer> extra",
    "a</think><answer>72</answer>",
    "<answer>-7</answer>",
    "",
    "<think>" * 50,
]


@pytest.mark.parametrize("name", BUILT_IN)
def test_conversational_and_plain_completions_score_the_same(name):
    plain = REWARDS[name](SAMPLES, answer=[GOLD] * len(SAMPLES))
    chat = [[{"role": "assistant", "content": text}] for text in SAMPLES]
    assert REWARDS[name](chat, answer=[GOLD] * len(SAMPLES)) == plain
    # several messages: the last one is the completion
    longer = [
        [{"role": "assistant", "content": "ignored <answer>72</answer>"}, {"role": "assistant", "content": t}]
        for t in SAMPLES
    ]
    assert REWARDS[name](longer, answer=[GOLD] * len(SAMPLES)) == plain


@pytest.mark.parametrize("name", BUILT_IN)
def test_odd_completion_objects_score_like_empty_text(name):
    odd = [None, [], [{"role": "assistant"}], [{"role": "assistant", "content": None}], 42, {"content": 7}]
    empty = REWARDS[name]([""] * len(odd), answer=[GOLD] * len(odd))
    assert REWARDS[name](odd, answer=[GOLD] * len(odd)) == empty


def test_multimodal_content_parts_are_joined():
    parts = [
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "<answer>"}, {"type": "text", "text": "72</answer>"}],
        }
    ]
    assert REWARDS["correctness"]([parts], answer=[GOLD]) == [2.0]


@pytest.mark.parametrize(
    ("name", "completion", "without", "with_prefill"),
    [
        ("format", "reasoning\n</think>\n<answer>72</answer>", 0.0, 0.5),
        ("tag_count", "reasoning\n</think>\n<answer>72</answer>", 0.75, 1.0),
        ("correctness", "reasoning</think><answer>72</answer>", 2.0, 2.0),
        ("tag_progress", "reasoning</think><answer>72</answer>", 1.0, 1.0),
    ],
)
def test_prefill_is_prepended_before_scoring(name, completion, without, with_prefill):
    assert run(name, completion) == without
    assert run(name, completion, prefill="<think>\n") == with_prefill
    assert run(name, completion, prefill="") == without


def test_prefill_written_again_counts_twice():
    assert run("tag_count", "<think>\na</think><answer>7</answer>", prefill="<think>\n") == 0.75


def test_prefill_as_single_string_and_short_list():
    texts = ["a</think><answer>7</answer>", "b</think><answer>8</answer>"]
    assert REWARDS["format"](texts, prefill="<think>") == [0.5, 0.5]
    assert REWARDS["format"](texts, prefill=["<think>"]) == [0.5, 0.0]  # missing entries mean no prefill
    assert REWARDS["format"](texts, prefill=[None, 3]) == [0.0, 0.0]


@pytest.mark.parametrize("name", BUILT_IN)
def test_one_float_per_completion_and_empty_batch(name):
    assert REWARDS[name]([]) == []
    scores = REWARDS[name](SAMPLES * 3, answer=[GOLD] * 18, prefill=["<think>\n"] * 18)
    assert len(scores) == 18 and all(isinstance(s, float) and math.isfinite(s) for s in scores)


# ----------------------------------------------------------------------------------------------- registry and table


def test_registry_names():
    assert list(RANGES) == BUILT_IN and BUILT_IN == list(REWARDS)[: len(BUILT_IN)]
    for name in BUILT_IN:
        fn = REWARDS[name]
        assert fn.__name__ == name  # TRL logs rewards/<__name__>/mean
        assert pickle.loads(pickle.dumps(fn)) is fn  # TRL/accelerate may pickle reward functions


@pytest.mark.parametrize("name", BUILT_IN)
def test_scores_stay_within_the_documented_range(name):
    low, high = RANGES[name]
    texts = SAMPLES + ["</answer>" * 3 + "junk" * 1000, "<think>a</think><answer>7</answer>" + "x" * 10_000]
    scores = REWARDS[name](texts, answer=[GOLD] * len(texts))
    assert all(low <= s <= high for s in scores)


def test_the_best_completion_reaches_every_upper_bound():
    best = score_all([GOOD], GOLD)[0]
    for name, (_, high) in RANGES.items():
        assert best[name] == (0.0 if name in GROUP_METRICS else high), name
    assert score_all(["</answer></answer>" + "x" * 1000], GOLD)[0]["tag_count"] == RANGES["tag_count"][0]


def test_format_rate_is_the_share_in_format():
    texts = [GOOD, "<answer>72</answer>", "a</think><answer>7</answer>"]
    assert REWARDS["format_rate"](texts, prefill=["", "", "<think>"]) == [1.0, 0.0, 1.0]


# ----------------------------------------------------------------------------------------------- what a group says


def answer(text: str) -> str:
    return f"<think>\nsome working\n</think>\n<answer>{text}</answer>"


@pytest.mark.parametrize(
    ("answers", "expected"),
    [
        (["12", "12", "$12", "14"], -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) / math.log(4)),  # {12: 3, 14: 1}
        (["1,000", "1000", "1 000", "1000.0"], 0.0),  # one number, written four ways
        (["1", "2", "3", "4"], 1.0),
        (["seven", "no idea", "7", "7"], -(2 * 0.25 * math.log(0.25) + 0.5 * math.log(0.5)) / math.log(4)),
        (["?", "??", "???", "????"], 1.0),  # every unreadable answer is a cluster of its own
        (["12"], 0.0),  # a group of one: nothing to disagree with
    ],
)
def test_semantic_entropy_of_a_group_by_hand(answers, expected):
    scores = REWARDS["semantic_entropy"]([answer(a) for a in answers], prompts=["q"] * len(answers))
    assert scores == pytest.approx([expected] * len(answers), abs=1e-12)


def test_semantic_entropy_takes_each_prompts_completions_as_its_group():
    texts = [answer(a) for a in ("5", "5", "5", "6", "8", "9")]
    scores = REWARDS["semantic_entropy"](texts, prompts=["q1"] * 4 + ["q2"] * 2)
    h = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) / math.log(4)
    assert scores == pytest.approx([h] * 4 + [1.0] * 2)
    chat = [[{"role": "user", "content": "q"}]] * 2  # conversational prompts, as TRL passes them
    assert REWARDS["semantic_entropy"]([answer("1"), answer("2")], prompts=chat) == [1.0, 1.0]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>3 + 4 = 7. Wait, let me check: 3 + 4 = 7.</think><answer>7</answer>", 1.0),
        ("<think>7. Actually it is 8.</think><answer>8</answer>", 1.0),
        ("I will double-check this.", 1.0),
        ("<think>3 + 4 = 7</think><answer>7</answer>", 0.0),
        ("await the awaited result; overweight", 0.0),  # whole words only
    ],
)
def test_reflection_rate_finds_answers_that_check_themselves(text, expected):
    assert REWARDS["reflection_rate"]([text]) == [expected]


def test_seed_grpo_scales_each_groups_advantages_by_its_semantic_entropy():
    """SEED-GRPO as a reward-side transform: with scale_rewards none, TRL's advantages of the scaled rewards are the
    paper's A_i / (1 + alpha * H) for the trained rewards; a metric (weight 0) is left as it is."""
    import torch

    from grpo_kit.config import load_recipe
    from grpo_kit.rewards import seed_grpo

    recipe = load_recipe("cpu-answers", seed_grpo_alpha=2.0, scale_rewards="none")
    funcs = seed_grpo(reward_functions(recipe.reward_funcs), recipe)
    # the names TRL logs: the scaled score of a trained reward under its own name, a metric's as it is
    assert [fn.__name__ for fn in funcs] == ["seed_grpo/correctness", *recipe.kit.reward_funcs[1:]]
    texts, golds = [answer(a) for a in ("7", "7", "8", "9", "7", "7", "7", "7")], ["7"] * 8
    prompts = ["q1"] * 4 + ["q2"] * 4
    plain = torch.tensor(REWARDS["correctness"](texts, answer=golds)).view(2, 4)  # [[2, 2, 0, 0], [2, 2, 2, 2]]
    scaled = torch.tensor(funcs[0](texts, answer=golds, prompts=prompts)).view(2, 4)
    h = torch.tensor(REWARDS["semantic_entropy"](texts, prompts=prompts)).view(2, 4)[:, :1]  # (groups, 1)
    # TRL 1.15 with scale_rewards="none": advantages = rewards - group mean
    advantage = lambda r: r - r.mean(dim=1, keepdim=True)  # noqa: E731
    assert torch.allclose(advantage(scaled), advantage(plain) / (1 + 2.0 * h))
    assert h[0, 0] > 0 and h[1, 0] == 0  # the unsure group learns less, the sure one as much as before
    assert funcs[1] is REWARDS["format_rate"]
    off = load_recipe("cpu-answers")  # seed_grpo_alpha 0: the rewards as they are
    assert seed_grpo(reward_functions(off.reward_funcs), off) == [REWARDS[name] for name in off.kit.reward_funcs]


def test_seed_grpo_needs_unscaled_rewards():
    from grpo_kit.config import load_recipe
    from grpo_kit.errors import GrpoKitError

    with pytest.raises(GrpoKitError, match="seed_grpo_alpha needs scale_rewards: none"):
        load_recipe("cpu-answers", seed_grpo_alpha=1.0)  # the recipe divides by the group's std
    with pytest.raises(GrpoKitError, match="seed_grpo_alpha=-1.0 cannot be meant"):
        load_recipe("cpu-answers", seed_grpo_alpha=-1, scale_rewards="none")


# ----------------------------------------------------------------------------------------------- reward_functions


def test_reward_functions_by_name():
    names = ["correctness", "integer", "format", "tag_count", "format_rate"]
    assert reward_functions(names) == [REWARDS[n] for n in names]


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["correctness", "bogus"], "cannot import module 'bogus'"),  # a recipe refuses it earlier (test_recipes)
        (["format", "format"], "named twice"),
        ([], "a list of names"),
        ("correctness,format", "a list of names"),
        (["no_such_module_xyz:fn"], "cannot import module 'no_such_module_xyz'"),
        (["json:no_such_function"], "has no function 'no_such_function'"),
        (["json:__doc__"], "is not a Python reward function"),
        (["os:system"], "builtins and classes cannot be rewards"),  # a recipe cannot call a shell command
        (["collections:Counter"], "builtins and classes cannot be rewards"),
    ],
)
def test_reward_functions_errors(names, message):
    with pytest.raises(GrpoKitError, match=re.escape(message)):
        reward_functions(names)


# ----------------------------------------------------------------------------------------------- scoring a batch


def test_each_reward_scores_each_completion():
    rows = score_all([GOOD, "<answer>71</answer>"], [GOLD, GOLD], names=["correctness", "format"])
    assert rows == [
        {"correctness": 2.0, "format": 0.5, "total": 2.5},
        {"correctness": 0.0, "format": 0.0, "total": 0.0},
    ]


def test_every_reward_takes_one_gold_and_one_prefill_for_all_completions():
    rows = score_all(["a</think><answer>72</answer>"], GOLD, prefill="<think>")
    assert set(rows[0]) == set(BUILT_IN) | {"total"}
    assert rows[0]["format"] == 0.5 and rows[0]["correctness"] == 2.0
    assert rows[0]["total"] == pytest.approx(sum(v for k, v in rows[0].items() if k != "total"))


def test_a_reward_from_a_module_beside_you_is_imported(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(
        "def brevity(completions, **kwargs):\n    return [-len(c) / 100 for c in completions]\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in __import__("sys").path if p not in ("", str(tmp_path))])
    correctness, brevity = reward_functions(["correctness", "my_rewards_mod:brevity"])
    assert correctness is REWARDS["correctness"]
    assert brevity(["abcd"]) == [-0.04] and brevity.__name__ == "brevity"
