"""grpo_kit.data: gold parsing, the bundled sample, local files and their errors, prompts for GRPOTrainer."""

from __future__ import annotations

import ast
import json
import re
import warnings
from fractions import Fraction

import pytest

from grpo_kit import data
from grpo_kit.answers import extract_tagged_answer
from grpo_kit.data import (
    FEW_SHOT_EXAMPLES,
    SYSTEM_PROMPT,
    build_messages,
    extract_gsm8k_answer,
    format_for_grpo,
    load_gsm8k,
    make_arithmetic_dataset,
    render_prompt,
)
from grpo_kit.errors import GrpoKitError

GOOD = "Tom has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"


# ------------------------------------------------------------------------------------------------ gold parsing


@pytest.mark.parametrize(
    ("text", "gold"),
    [
        ("She has 1000 + 80 = <<1000+80=1080>>1080.\n#### 1,080", "1080"),
        ("#### -5", "-5"),
        ("#### 0.5", "0.5"),
        ("#### 72", "72"),
        ("#### 18.00", "18"),
        ("#### $18", "18"),
        ("#### -$5", "-5"),
        ("#### 1,234,567", "1234567"),
        ("#### 1 000", "1000"),  # thousands grouped by spaces, as a model's answer may group them (answers.GROUPED)
        ("#### 1\u202f234\u202f567", "1234567"),
        ("#### 3/4", "0.75"),
        ("x #### 1\nmore\n#### 2", "2"),  # the last #### wins
        ("####   42  \n", "42"),
    ],
)
def test_extract_gsm8k_answer(text, gold):
    assert extract_gsm8k_answer(text) == gold


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("The answer is 7.", "no '#### N'"),
        ("#### ", "nothing follows"),
        ("#### seven", "not a number"),
        ("#### 72 clips", "not a number"),
        ("#### 3 4", "not a number"),
        ("#### 1 0000", "not a number"),  # not thousands
        ("#### 1 000,000", "not a number"),  # one kind of separator per number
        ("#### --5", "not a number"),
    ],
)
def test_extract_gsm8k_answer_rejects(text, reason):
    with pytest.raises(ValueError, match=reason):
        extract_gsm8k_answer(text)


# ------------------------------------------------------------------------------------------------ bundled sample

_ANNOTATION = re.compile(r"<<([^=<>]+)=([^<>]+)>>(\S*)")


def _exact(expression: str) -> Fraction:
    """Evaluate + - * / on decimal literals exactly (no float rounding)."""

    def walk(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
            left, right = walk(node.left), walk(node.right)
            ops = {ast.Add: lambda: left + right, ast.Sub: lambda: left - right, ast.Mult: lambda: left * right}
            return ops[type(node.op)]() if type(node.op) in ops else left / right
        raise ValueError(f"unexpected expression {expression!r}")

    return walk(ast.parse(expression, mode="eval").body)


def _check_solution(solution: str, gold: str) -> None:
    """Every <<expr=result>> is right, the text after it repeats the result, and the gold is the last result."""
    annotations = _ANNOTATION.findall(solution)
    assert annotations, solution
    for expression, result, after in annotations:
        assert _exact(expression) == Fraction(result), (expression, result)
        assert after.startswith(result), (expression, after)
    assert Fraction(gold) == Fraction(annotations[-1][1]), solution


@pytest.fixture(scope="module")
def sample():
    return {split: load_gsm8k("sample", split) for split in ("train", "test")}


def test_sample_sizes_and_columns(sample):
    assert len(sample["train"]) >= 45 and len(sample["test"]) >= 20
    for ds in sample.values():
        assert ds.column_names == ["question", "answer", "solution"]


def test_sample_has_no_duplicates_and_splits_are_disjoint(sample):
    train, test = sample["train"]["question"], sample["test"]["question"]
    assert len(set(train)) == len(train) and len(set(test)) == len(test)
    assert not set(train) & set(test)
    few_shot_questions = {question for question, _ in FEW_SHOT_EXAMPLES}
    assert not few_shot_questions & (set(train) | set(test))


def test_sample_arithmetic_is_right(sample):
    for ds in sample.values():
        for row in ds:
            assert row["answer"] == extract_gsm8k_answer(row["solution"])
            _check_solution(row["solution"], row["answer"])


def test_sample_covers_negative_decimal_and_thousands(sample):
    rows = [row for ds in sample.values() for row in ds]
    assert any(row["answer"].startswith("-") for row in rows)
    assert any("." in row["answer"] for row in rows)
    assert any(re.search(r"#### -?\d{1,3},\d{3}", row["solution"]) for row in rows)
    steps = {len(_ANNOTATION.findall(row["solution"])) for row in rows}
    assert {1, 2, 3, 4} <= steps


def test_annotation_checker_catches_a_wrong_step():
    with pytest.raises(AssertionError):
        _check_solution("3 * 4 = <<3*4=13>>13\n#### 13", "13")
    with pytest.raises(AssertionError):
        _check_solution("3 * 4 = <<3*4=12>>12\n#### 11", "11")


def test_sample_loads_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a skipped row or a duplicate in the bundled sample would raise here
        ds = load_gsm8k("sample", "train")
    assert "bundled sample" in ds.info.description


def test_sample_unknown_split():
    with pytest.raises(GrpoKitError, match="'train' and 'test'"):
        load_gsm8k("sample", "validation")


# ------------------------------------------------------------------------------------------------ limit / shuffle


def test_limit_is_a_seeded_shuffle(sample):
    full = sample["train"]["question"]
    a = load_gsm8k("sample", "train", limit=10, seed=0)["question"]
    b = load_gsm8k("sample", "train", limit=10, seed=0)["question"]
    c = load_gsm8k("sample", "train", limit=10, seed=1)["question"]
    assert a == b and a != c and set(a) <= set(full) and len(a) == 10
    assert a != full[:10]  # shuffled, not the file's head
    assert load_gsm8k("sample", "train")["question"] == full  # no limit: file order
    assert len(load_gsm8k("sample", "train", limit=10_000)) == len(full)


def test_limit_must_be_positive():
    with pytest.raises(GrpoKitError, match="positive"):
        load_gsm8k("sample", "train", limit=0)


# ------------------------------------------------------------------------------------------------ local files

ROWS = [
    {"question": "What is 3 + 4?", "answer": GOOD},
    {"question": "A loss of 1,500?", "answer": "Loss.\n#### -1,500"},
    {"question": "Plain number?", "answer": "1,200"},
    {"question": "Numeric field?", "answer": 42},
    {"question": "Float field?", "answer": 2.5, "extra": "ignored"},
]
EXPECTED = ["7", "-1500", "1200", "42", "2.5"]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def _write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {key: [row.get(key) for row in rows] for key in rows[0]}
    pq.write_table(pa.table(columns), path)
    return path


def test_load_jsonl(tmp_path):
    path = _write_jsonl(tmp_path / "train.jsonl", ROWS)
    ds = load_gsm8k(str(path))
    assert ds.column_names == ["question", "answer", "solution"]
    assert ds["answer"] == EXPECTED
    assert ds["solution"][0] == GOOD and ds["solution"][2] == "#### 1200"
    # trailing blank lines are fine (the json loader refuses them only when text and number answers are mixed)
    text_only = _write_jsonl(tmp_path / "text.jsonl", ROWS[:3])
    text_only.write_text(text_only.read_text() + "\n\n")
    assert load_gsm8k(str(text_only))["answer"] == EXPECTED[:3]


def test_load_json_array_and_json_lines(tmp_path):
    array = tmp_path / "a.json"
    array.write_text(json.dumps(ROWS))
    lines = _write_jsonl(tmp_path / "c.json", ROWS)
    for path in (array, lines):
        assert load_gsm8k(str(path))["answer"] == EXPECTED


def test_json_object_wrapping_the_rows_is_refused_with_the_columns_found(tmp_path):
    wrapped = tmp_path / "b.json"
    wrapped.write_text(json.dumps({"data": ROWS}))
    with pytest.raises(GrpoKitError, match=r"missing column\(s\) \['question', 'answer'\]; found \['data'\]"):
        load_gsm8k(str(wrapped))


def test_load_parquet(tmp_path):
    rows = [{"question": row["question"], "answer": str(row["answer"])} for row in ROWS]
    path = _write_parquet(tmp_path / "train.parquet", rows)
    assert load_gsm8k(str(path))["answer"] == EXPECTED


def _bad_jsonl(tmp_path, bad_line: bytes):
    path = tmp_path / "bad.jsonl"
    good = json.dumps({"question": "Fine?", "answer": GOOD}).encode()
    path.write_bytes(
        good + b"\n" + json.dumps({"question": "Also fine?", "answer": "#### 1"}).encode() + b"\n" + bad_line
    )
    return path


@pytest.mark.parametrize(
    ("bad_line", "reason"),
    [
        (json.dumps({"answer": GOOD}).encode(), "question is empty or not text"),  # the loader fills it with null
        (json.dumps({"question": "Q?"}).encode(), "answer is missing"),
        (json.dumps({"question": "Q?", "answer": "#### many"}).encode(), "not a number"),
        (json.dumps({"question": "Q?", "answer": "The answer is 5."}).encode(), "neither a number"),
        (
            json.dumps({"question": "Q?", "answer": " "}).encode(),
            "neither a number nor a GSM8K text ending in '#### N': ''",
        ),
        (json.dumps({"question": "Q?", "answer": None}).encode(), "missing"),
        (json.dumps({"question": "Q?", "answer": True}).encode(), "boolean"),
        (json.dumps({"question": "", "answer": GOOD}).encode(), "question is empty"),
    ],
)
def test_bad_jsonl_row_names_file_and_row(tmp_path, bad_line, reason):
    path = _bad_jsonl(tmp_path, bad_line)
    with pytest.raises(GrpoKitError) as info:
        load_gsm8k(str(path))
    message = str(info.value)
    assert str(path) in message and "row 3" in message and reason in message
    assert "lenient=True" in message
    # lenient: the bad line is skipped, counted, reported and warned about
    with pytest.warns(UserWarning, match="skipped 1 bad row") as caught:
        ds = load_gsm8k(str(path), lenient=True)
    note = str(caught[0].message)
    assert len(ds) == 2 and "kept 2 of 3 rows" in note
    assert note.split("First notes: ")[1].startswith("row 3:") and reason in note


@pytest.mark.parametrize(
    "bad_line",
    [
        json.dumps(["Q?", GOOD]).encode(),
        b'{"question": "Q?", "answer": ',
        b'{"question": "caf\xe9?", "answer": "#### 1"}',
    ],
)
def test_unparsable_jsonl_line_fails_the_file_with_the_fix(tmp_path, bad_line):
    """A line the json loader cannot parse (not an object, cut off, not UTF-8) fails the whole file, lenient too."""
    path = _bad_jsonl(tmp_path, bad_line)
    for lenient in (False, True):
        with pytest.raises(GrpoKitError) as info:
            load_gsm8k(str(path), lenient=lenient)
        assert str(path) in str(info.value) and "one JSON object per line" in str(info.value)


def test_lenient_load_gsm8k_warns_and_keeps_good_rows(tmp_path):
    rows = [{"question": f"Q{i}?", "answer": "#### x" if i % 2 else f"#### {i}"} for i in range(10)]
    path = _write_jsonl(tmp_path / "half.jsonl", rows)
    with pytest.warns(UserWarning) as caught:
        ds = load_gsm8k(str(path), lenient=True)
    assert ds["answer"] == ["0", "2", "4", "6", "8"]
    text = str(caught[0].message)
    assert "skipped 5 bad row" in text and "row 2" in text
    # one note per skipped row, up to the cap
    assert len(text.split("First notes: ")[1].split("; ")) == data.MAX_REASONS


def test_all_rows_bad_is_an_error_even_when_lenient(tmp_path):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"question": "Q?", "answer": "no number"}])
    with pytest.raises(GrpoKitError, match="no usable rows"):
        load_gsm8k(str(path), lenient=True)


def test_duplicates_are_dropped_with_a_note(tmp_path):
    rows = [
        {"question": "Same?", "answer": "#### 1"},
        {"question": "Other?", "answer": "#### 2"},
        {"question": "Same?", "answer": "#### 1"},
        {"question": " Same? ", "answer": "#### 9"},
    ]
    path = _write_jsonl(tmp_path / "dups.jsonl", rows)
    with pytest.warns(UserWarning, match="dropped 2 duplicate") as caught:
        ds = load_gsm8k(str(path))
    assert ds["question"] == ["Same?", "Other?"] and ds["answer"] == ["1", "2"]
    notes = str(caught[0].message).split("First notes: ")[1].split("; ")
    assert "row 3: duplicate of the question at row 1" in notes[0]
    assert "DIFFERENT answer" in notes[1]


@pytest.mark.parametrize(
    ("name", "content", "reason"),
    [
        ("empty.jsonl", b"", "is empty"),
        ("blank.jsonl", b"\n  \n", "is empty"),
        ("empty.json", b"", "is empty"),
        ("broken.json", b'[\n{"question": "Q?",\n "answer": }\n]', "a JSON array of objects"),
        ("string.json", b'"Q? #### 1"', "a JSON array of objects"),
        ("latin1.json", b'[{"question": "caf\xe9", "answer": "#### 1"}]', "saved as UTF-8"),
        ("rows.json", json.dumps([{"question": "Q?", "answer": GOOD}, {"question": "Q2?"}]).encode(), "row 2"),
        ("table.tsv", b"question\tanswer\n", "unsupported file type"),
        ("broken.parquet", b"not parquet at all", "a Parquet table"),
    ],
)
def test_bad_files_name_the_file(tmp_path, name, content, reason):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(GrpoKitError) as info:
        load_gsm8k(str(path))
    assert str(path) in str(info.value) and reason in str(info.value)


def test_missing_file_says_what_is_accepted(tmp_path):
    with pytest.raises(GrpoKitError) as info:
        load_gsm8k(str(tmp_path / "nope.jsonl"))
    message = str(info.value)
    assert "not found" in message and "nope.jsonl" in message
    assert all(fmt in message for fmt in (".jsonl", ".json", ".parquet", "sample"))


def test_parquet_missing_column_and_bad_row(tmp_path):
    no_answer = _write_parquet(tmp_path / "no_answer.parquet", [{"question": "Q?", "gold": "#### 1"}])
    with pytest.raises(GrpoKitError, match=r"missing column\(s\) \['answer'\]") as info:
        load_gsm8k(str(no_answer))
    assert str(no_answer) in str(info.value)
    bad_row = _write_parquet(
        tmp_path / "bad_row.parquet", [{"question": "Q1?", "answer": GOOD}, {"question": "Q2?", "answer": "#### ?"}]
    )
    with pytest.raises(GrpoKitError, match="row 2") as info:
        load_gsm8k(str(bad_row))
    assert str(bad_row) in str(info.value)
    with pytest.warns(UserWarning):
        assert load_gsm8k(str(bad_row), lenient=True)["answer"] == ["7"]


def test_numeric_answer_fields_are_exact(tmp_path):
    rows = [{"question": "a", "answer": 12345678901234567}, {"question": "c", "answer": -3}]  # int64: exact
    assert load_gsm8k(str(_write_jsonl(tmp_path / "i.jsonl", rows)))["answer"] == ["12345678901234567", "-3"]
    rows = [{"question": "b", "answer": 0.1}, {"question": "d", "answer": 2}]
    assert load_gsm8k(str(_write_jsonl(tmp_path / "f.jsonl", rows)))["answer"] == ["0.1", "2"]
    # beyond int64 the reader rounds through a float: refused (text is exact), never a silently different gold
    big = _write_jsonl(tmp_path / "big.jsonl", [{"question": "a", "answer": 12345678901234567891}])
    with pytest.raises(GrpoKitError, match="row 1: the answer .* too large to be read exactly.*write it as text"):
        load_gsm8k(str(big))
    assert load_gsm8k(str(_write_jsonl(tmp_path / "t.jsonl", [{"question": "a", "answer": "12345678901234567891"}])))[
        "answer"
    ] == ["12345678901234567891"]
    path = tmp_path / "nan.jsonl"
    path.write_text('{"question": "d", "answer": NaN}\n')
    with pytest.raises(GrpoKitError, match="row 1: the answer nan is not a finite number"):
        load_gsm8k(str(path))


# ------------------------------------------------------------------------------------------------ Hub


def test_unreachable_hub_gives_a_short_actionable_error(monkeypatch, tmp_path):
    import datasets
    import huggingface_hub

    # conftest sets HF_HUB_OFFLINE/HF_DATASETS_OFFLINE; empty caches make sure a cached copy cannot answer.
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert datasets.config.HF_HUB_OFFLINE
    with pytest.raises(GrpoKitError) as info:
        load_gsm8k("gsm8k", "train")
    message = str(info.value)
    assert "openai/gsm8k" in message and "--data sample" in message and ".jsonl" in message
    assert isinstance(info.value.__cause__, OSError)


def test_hub_dataset_errors_are_wrapped(monkeypatch):
    import datasets
    from datasets.exceptions import DatasetNotFoundError

    def missing(*args, **kwargs):
        raise DatasetNotFoundError("Dataset 'openai/gsm8k' doesn't exist on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", missing)
    with pytest.raises(GrpoKitError, match="bundled sample"):
        load_gsm8k("gsm8k", "test")
    with pytest.raises(GrpoKitError, match="'train' and 'test'"):
        load_gsm8k("gsm8k", "validation")


def test_hub_rows_are_validated_like_files(monkeypatch):
    import datasets

    rows = [{"question": "Q1?", "answer": GOOD}, {"question": "Q2?", "answer": "#### 1,080"}]
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: datasets.Dataset.from_list(rows))
    assert load_gsm8k("gsm8k", "train")["answer"] == ["7", "1080"]


# ------------------------------------------------------------------------------------------------ messages


def test_build_messages_structure():
    assert build_messages("Q?") == [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Q?"}]
    messages = build_messages("Q?", few_shot=len(FEW_SHOT_EXAMPLES))
    assert [m["role"] for m in messages] == ["system"] + ["user", "assistant"] * len(FEW_SHOT_EXAMPLES) + ["user"]
    assert [m["content"] for m in messages[1:-1:2]] == [q for q, _ in FEW_SHOT_EXAMPLES]
    assert messages[-1]["content"] == "Q?"
    assert build_messages("Q?", system_prompt="")[0] == {"role": "user", "content": "Q?"}
    assert build_messages("Q?", system_prompt="Be brief.")[0]["content"] == "Be brief."
    assert build_messages("Q?", system_prompt=None) == build_messages("Q?")  # None: the kit's prompt (recipes' default)


@pytest.mark.parametrize("few_shot", [-1, len(FEW_SHOT_EXAMPLES) + 1])
def test_build_messages_rejects_bad_few_shot(few_shot):
    with pytest.raises(GrpoKitError, match="few_shot must be between 0"):
        build_messages("Q?", few_shot=few_shot)


def test_the_format_the_system_prompt_shows_is_the_one_the_rewards_pay_for():
    from grpo_kit.rewards import REWARDS

    shown = SYSTEM_PROMPT.split("Use exactly this format:\n", 1)[1]
    assert REWARDS["format"]([shown]) == [0.5] and REWARDS["tag_count"]([shown]) == [1.0]


_STEP = re.compile(r"(-?\d+(?:\.\d+)?(?: [-+*/] -?\d+(?:\.\d+)?)+) = (-?\d+(?:\.\d+)?)")


def test_few_shot_examples_are_in_the_rewarded_format_and_correct():
    """What the model imitates: the exact format, every calculation right, the answer the last result."""
    from grpo_kit.rewards import REWARDS

    for _, reply in FEW_SHOT_EXAMPLES:
        # format: think block, then the answer block; tag_count 1.0: each tag once, nothing after </answer>.
        assert REWARDS["format"]([reply]) == [0.5] and REWARDS["tag_count"]([reply]) == [1.0], reply
        steps = _STEP.findall(reply)
        assert steps, reply
        for expression, result in steps:
            assert _exact(expression) == Fraction(result), (expression, result)
        assert Fraction(extract_tagged_answer(reply)) == Fraction(steps[-1][1]), reply


# ------------------------------------------------------------------------------------------------ format_for_grpo


def test_format_conversational_needs_no_tokenizer(sample):
    ds, dropped = format_for_grpo(sample["test"], few_shot=1)
    assert dropped == 0 and len(ds) == len(sample["test"])
    assert ds.column_names == ["prompt", "answer", "question", "prefill"]
    row = ds[0]
    assert row["prompt"] == build_messages(row["question"], few_shot=1)
    assert row["answer"] == sample["test"][0]["answer"] and row["prefill"] == ""


def test_format_errors_without_tokenizer(sample):
    with pytest.raises(GrpoKitError, match="needs the tokenizer"):
        format_for_grpo(sample["test"], prefill="<think>\n")
    with pytest.raises(GrpoKitError, match="needs the tokenizer"):
        format_for_grpo(sample["test"], max_prompt_tokens=100)
    with pytest.raises(GrpoKitError, match="missing"):
        format_for_grpo(sample["test"].remove_columns("answer"))


@pytest.fixture(scope="module")
def tokenizer(embedded_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_dir)


def test_format_prefill_is_one_rendered_string(sample, tokenizer):
    ds, dropped = format_for_grpo(sample["test"], tokenizer, few_shot=1, prefill="<think>\n")
    assert dropped == 0 and ds.column_names == ["prompt", "answer", "question", "prefill"]
    row = ds[0]
    messages = build_messages(row["question"], few_shot=1)
    assert isinstance(row["prompt"], str) and row["prefill"] == "<think>\n"
    assert row["prompt"].endswith("<|im_start|>assistant\n<think>\n")
    assert row["prompt"].count("<|im_start|>system") == 1  # not templated twice
    # TRL 1.15 tokenizes a string prompt with processing_class(text=...): the ids must be the template's + prefill's.
    template_ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    template_ids = template_ids["input_ids"]
    trl_ids = tokenizer(text=[row["prompt"]])["input_ids"][0]
    assert trl_ids[: len(template_ids)] == template_ids
    assert tokenizer.decode(trl_ids[len(template_ids) :]) == "<think>\n"


def _bos_adding_tokenizer():
    """A Llama-3-like tokenizer: adds <s> to plain text AND its chat template starts with {{ bos_token }}."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", chat_template=template
    )


def test_render_prompt_avoids_a_double_bos():
    tokenizer = _bos_adding_tokenizer()
    messages = build_messages("How many?", system_prompt="S")
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True).startswith("<s>")
    prompt = render_prompt(messages, tokenizer, "<think>")
    assert not prompt.startswith("<s>") and prompt.endswith("[assistant] <think>")
    assert tokenizer(prompt)["input_ids"].count(tokenizer.bos_token_id) == 1


def test_render_prompt_keeps_template_when_tokenizer_adds_nothing(tokenizer):
    messages = build_messages("Q?")
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert render_prompt(messages, tokenizer, "<think>\n") == rendered + "<think>\n"


@pytest.mark.parametrize("prefill", ["", "<think>\n"])
def test_format_filters_long_prompts_and_counts_them(tokenizer, prefill):
    rows = {
        "question": ["Short?", "Also short?", "Long? " + "very " * 200, "Tiny?"],
        "answer": ["1", "2", "3", "4"],
    }
    from datasets import Dataset

    short_len = len(
        tokenizer.apply_chat_template(
            build_messages("Also short?"), tokenize=True, add_generation_prompt=True, return_dict=True
        )["input_ids"]
    )
    budget = short_len + 20  # fits the short questions (plus a prefill), not the long one
    ds, dropped = format_for_grpo(Dataset.from_dict(rows), tokenizer, prefill=prefill, max_prompt_tokens=budget)
    assert dropped == 1 and ds["answer"] == ["1", "2", "4"]
    with pytest.raises(GrpoKitError, match=r"All 4 prompts.*--set few_shot=0") as info:
        format_for_grpo(Dataset.from_dict(rows), tokenizer, prefill=prefill, max_prompt_tokens=10)
    suggested = int(re.search(r"--set max_prompt_length=(\d+)", str(info.value)).group(1))
    ds, dropped = format_for_grpo(Dataset.from_dict(rows), tokenizer, prefill=prefill, max_prompt_tokens=suggested)
    assert dropped == 0 and len(ds) == 4  # the suggested budget is the one that keeps every prompt


# ------------------------------------------------------------------------------------------------ arithmetic


def test_arithmetic_is_deterministic_and_correct():
    a, b, c = make_arithmetic_dataset(40, seed=3), make_arithmetic_dataset(40, seed=3), make_arithmetic_dataset(40, 4)
    assert a.to_list() == b.to_list() and a.to_list() != c.to_list()
    assert len(a) == 40 and len(set(a["question"])) == 40
    assert a.column_names == ["question", "answer", "solution"]
    for row in a:
        assert extract_gsm8k_answer(row["solution"]) == row["answer"]
        _check_solution(row["solution"], row["answer"])
        assert len(_ANNOTATION.findall(row["solution"])) == 1  # one-step problems only
        assert all(int(n) < 1000 for n in re.findall(r"\d+", row["question"]))


def test_arithmetic_is_labelled_synthetic():
    assert "not GSM8K" in make_arithmetic_dataset(2).info.description
    assert "not GSM8K" in load_gsm8k("arithmetic", "train").info.description


def test_arithmetic_splits_are_disjoint():
    train, test = load_gsm8k("arithmetic", "train"), load_gsm8k("arithmetic", "test")
    assert len(train) == data.ARITHMETIC_SIZES["train"] and len(test) == data.ARITHMETIC_SIZES["test"]
    assert not set(train["question"]) & set(test["question"])
