"""Reliability, issue 7 parts 2, 3 and 5: odd data, bad settings, no network.

Each case goes through ``grpo-kit train``/``eval`` (``cli.main``) as a user would meet it and expects exit status 2,
a short message that names the problem and the fix, no traceback, and, for everything that can be known in
advance, no model loaded. Loader-level cases (every kind of bad row, lenient counting, duplicates, Parquet) live in
tests/test_data.py, and the table of single faults met through the CLI in tests/test_faults.py; these tests
check what those do not: every bad row through ``train``, ``--lenient``, too little data, planner warnings, offline.
"""

from __future__ import annotations

import json
import socket

import pytest

from grpo_kit.cli import main
from grpo_kit.config import load_recipe
from grpo_kit.data import check_dataset_size, load_gsm8k
from grpo_kit.errors import GrpoKitError
from grpo_kit.models import DeviceInfo
from grpo_kit.train import train

MAX_ERROR_LINES = 15
TINY_SET = ["--set", "per_device_train_batch_size=2", "--set", "max_completion_length=8", "--set", "few_shot=0"]


def _cli_error(capsys, argv) -> str:
    """Run the CLI, expect exit status 2 and a short, traceback-free message on stderr; return it."""
    code = main(argv)
    captured = capsys.readouterr()
    err = captured.err
    assert code == 2, f"exit {code}\nstdout: {captured.out[-2000:]}\nstderr: {err[-2000:]}"
    assert "grpo-kit: error: " in err
    assert "Traceback" not in err and "Traceback" not in captured.out
    assert err.count("\n") < MAX_ERROR_LINES, err  # progress bars redraw with \r: count real lines only
    return err[err.index("grpo-kit: error: ") :]


def _jsonl(path, lines: list[bytes]):
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


GOOD = json.dumps({"question": "Tom has 3 + 4 apples. How many?", "answer": "3 + 4 = 7\n#### 7"}).encode()


# ------------------------------------------------------------------------------------------------ bad data


@pytest.mark.parametrize(
    ("lines", "where", "reason"),
    [
        ([GOOD, GOOD.replace(b"question", b"prompt")], "row 2", "the question is empty or not text"),
        ([GOOD, b'{"question": "Q2?", "answer": "#### seven"}'], "row 2", "not a number"),
        ([GOOD, b'{"question": "Q2?", "answer": null}'], "row 2", "missing"),
        ([GOOD, b'{"question": "Q2?", "solution": "#### 2"}'], "row 2", "the answer is missing"),
    ],
)
def test_bad_rows_stop_train_with_file_and_row(tmp_path, capsys, no_model_load, lines, where, reason):
    path = _jsonl(tmp_path / "train.jsonl", lines)
    err = _cli_error(capsys, ["train", "--preset", "cpu", "--data", str(path), "--output", str(tmp_path / "run")])
    assert str(path) in err and where in err and reason in err
    assert "--lenient" in err  # the way out is named
    assert not (tmp_path / "run").exists()  # nothing was created for a run that cannot start


@pytest.mark.parametrize(
    "bad_line",
    [
        b'{"question": "Q?", "answer": "#### 1"',
        b'{"question": "caf\xe9?", "answer": "#### 2"}',
        json.dumps({"question": "Q2?", "answer": "#### 2"}).encode("utf-16"),
    ],
)
def test_a_file_that_does_not_parse_stops_train_naming_the_file_and_its_format(
    tmp_path, capsys, no_model_load, bad_line
):
    path = _jsonl(tmp_path / "train.jsonl", [GOOD, bad_line, GOOD])
    err = _cli_error(
        capsys, ["train", "--preset", "cpu", "--data", str(path), "--output", str(tmp_path / "run"), "--lenient"]
    )
    assert str(path) in err and "one JSON object per line" in err
    assert not (tmp_path / "run").exists()


def test_lenient_train_skips_and_counts_bad_rows(tmp_path, monkeypatch):
    """With --lenient the bad rows are skipped with a counted warning and training goes on to the model load."""
    import grpo_kit.models as models

    class Loaded(Exception):
        pass

    def stop_at_model_load(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(models, "load_model", stop_at_model_load)
    good = [json.dumps({"question": f"Q{i}?", "answer": f"#### {i}"}).encode() for i in range(4)]
    bad = [b'{"question": "Q8?", "solution": "#### 8"}', b'{"question": "Q9?", "answer": "x"}']
    path = _jsonl(tmp_path / "train.jsonl", [*good, bad[0], good[0], bad[1]])
    with pytest.warns(UserWarning, match=r"kept 4 of 7 rows; skipped 2 bad row\(s\), dropped 1 duplicate") as caught:
        with pytest.raises(Loaded):
            main(["train", "--preset", "cpu", "--data", str(path), "--output", str(tmp_path / "run"), "--lenient"])
    assert "row 5" in str(caught[0].message)


def test_windows_files_with_bom_and_crlf_load(tmp_path):
    path = tmp_path / "excel.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + GOOD + b"\r\n" + GOOD.replace(b"Tom", b"Ann") + b"\r\n")
    assert load_gsm8k(str(path))["answer"] == ["7", "7"]
    array = tmp_path / "excel.json"
    array.write_bytes(b"\xef\xbb\xbf[" + GOOD + b"]")
    assert load_gsm8k(str(array))["answer"] == ["7"]


# ------------------------------------------------------------------------------------------------ too little data


def _config(tmp_path, **changes):
    return load_recipe("cpu", output_dir=str(tmp_path), **changes).grpo


def test_too_few_prompts_for_one_step_is_refused(tmp_path):
    config = _config(tmp_path, num_generations=2, per_device_train_batch_size=4, gradient_accumulation_steps=2)
    check_dataset_size(4, config, source="x.jsonl")  # 4 x 2 / 2 = 4 prompts per step: just enough
    with pytest.raises(GrpoKitError) as info:
        check_dataset_size(3, config, source="x.jsonl")
    message = str(info.value)
    assert "'x.jsonl' has 3 usable prompt(s)" in message and "needs 4 distinct prompts" in message
    assert "0 steps" in message and "--data sample" in message and "per_device_train_batch_size" in message


def test_too_little_data_counts_the_batch_as_trl_does_with_steps_per_generation(tmp_path):
    """TRL's generation batch is batch x steps_per_generation (accumulation only by default): 1 x 4 / 4 = 1 prompt."""
    config = load_recipe(
        "t4-16gb", output_dir=str(tmp_path), gradient_accumulation_steps=3, steps_per_generation=4
    ).grpo
    check_dataset_size(1, config, source="one.jsonl")
    config = load_recipe("t4-16gb", output_dir=str(tmp_path), steps_per_generation=8).grpo
    with pytest.raises(
        GrpoKitError,
        match=r"needs 2 distinct prompts \(generation batch 8 = per_device_train_batch_size "
        r"1 x steps_per_generation 8, in groups of num_generations=4\)",
    ):
        check_dataset_size(1, config, source="one.jsonl")


def test_long_prompts_dropped_are_counted(tmp_path):
    config = _config(tmp_path, num_generations=2, per_device_train_batch_size=2)
    with pytest.warns(UserWarning, match=r"2 prompt\(s\) longer than max_prompt_length=512 tokens were left out"):
        check_dataset_size(5, config, source="big.jsonl", filtered=2, max_prompt_tokens=512)
    with pytest.raises(GrpoKitError, match="after dropping 7 prompt.* raise --set max_prompt_length"):
        check_dataset_size(0, config, source="big.jsonl", filtered=7, max_prompt_tokens=512)


@pytest.mark.slow
def test_gigantic_prompts_are_dropped_and_a_set_left_too_small_is_refused(tiny_model_dir, tmp_path, monkeypatch):
    import trl

    monkeypatch.setattr(trl, "GRPOTrainer", lambda *a, **k: pytest.fail("TRL trainer built for unusable data"))
    huge = "How many apples? " + "apple " * 40_000  # ~240k characters, tens of thousands of tokens
    rows = [{"question": "Short one?", "answer": "#### 1"}] + [
        {"question": f"{i} {huge}", "answer": f"#### {i}"} for i in range(3)
    ]
    path = tmp_path / "huge.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    recipe = load_recipe(
        "cpu",
        model_name_or_path=str(tiny_model_dir),
        num_generations=2,
        per_device_train_batch_size=4,
        few_shot=0,
        max_completion_length=8,
    )
    with pytest.raises(GrpoKitError) as info:
        train(recipe, data=str(path), output_dir=tmp_path / "run")
    message = str(info.value)
    assert "has 1 usable prompt(s) after dropping 3 prompt(s) longer than max_prompt_length=512" in message
    assert "max_prompt_length" in message and str(path) in message


# ------------------------------------------------------------------------------------------------ bad settings


def test_bf16_on_a_t4_is_refused_through_train(tmp_path, monkeypatch, no_model_load):
    import grpo_kit.models as models

    monkeypatch.setattr(models, "detect_device", lambda: DeviceInfo("cuda", "Tesla T4", 14.7, bf16=False))
    with pytest.raises(GrpoKitError, match="no bf16.*--set bf16=false --set fp16=true.*t4-16gb"):
        train(load_recipe("l4-24gb"), data="sample", output_dir=tmp_path / "run")


def test_vram_planner_warns_with_the_fix_before_loading(tmp_path, monkeypatch):
    import grpo_kit.models as models

    class Loaded(Exception):
        pass

    def stop_at_model_load(*args, **kwargs):
        raise Loaded

    # An 8 GB bf16 card asked to run the A100-80GB recipe (8B bf16 weights, 64 completions of 1024 tokens).
    monkeypatch.setattr(models, "detect_device", lambda: DeviceInfo("cuda", "RTX 3070", 7.8, bf16=True))
    monkeypatch.setattr(models, "load_tokenizer", stop_at_model_load)  # the first thing read from the model's repo
    with pytest.warns(UserWarning, match="VRAM planner") as caught, pytest.raises(Loaded):  # warned, then loading
        train(load_recipe("a100-80gb"), data="sample", output_dir=tmp_path / "run")
    message = str(caught[0].message)
    assert "needs about" in message and "7.8 GiB" in message and "Try:" in message and "smaller preset" in message


# ------------------------------------------------------------------------------------------------ offline


@pytest.fixture
def empty_hub_cache(monkeypatch, tmp_path):
    """Offline (conftest sets HF_HUB_OFFLINE) with empty caches, so nothing cached on this machine can answer."""
    import datasets
    import huggingface_hub

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert datasets.config.HF_HUB_OFFLINE and huggingface_hub.constants.HF_HUB_OFFLINE


def test_offline_eval_of_a_hub_model_says_how_to_use_the_embedded_one(capsys, empty_hub_cache):
    err = _cli_error(capsys, ["eval", "--model", "Qwen/Qwen2.5-1.5B-Instruct", "--data", "sample", "--limit", "1"])
    assert "Qwen/Qwen2.5-1.5B-Instruct" in err and "--model embedded" in err


@pytest.fixture
def no_network(monkeypatch):
    """A machine with no network at all, and offline mode NOT switched on: any Hub call would try, and fail here."""
    import datasets
    import huggingface_hub

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args[:2]}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)


@pytest.mark.slow
def test_embedded_model_and_bundled_sample_need_no_network(embedded_dir, no_network):
    import torch

    from grpo_kit.data import build_messages, render_prompt
    from grpo_kit.models import load_inference_model

    test_rows = load_gsm8k("sample", "test")  # the refused sockets would raise on any download
    assert len(load_gsm8k("sample", "train")) and len(test_rows) and len(load_gsm8k("arithmetic", "train"))
    model, tokenizer = load_inference_model("embedded")
    ids = tokenizer(render_prompt(build_messages(test_rows[0]["question"]), tokenizer), return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == ids["input_ids"].shape[1] + 3
