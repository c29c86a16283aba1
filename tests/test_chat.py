"""``grpo-kit chat``: a user's own question answered by base + adapter, with the prompt the run trained on."""

from __future__ import annotations

import json

import pytest

from grpo_kit.cli import main
from grpo_kit.evaluate import _base_and_prompt, ask, build_prompts, generate
from grpo_kit.models import load_inference_model
from grpo_kit.runs import Run


@pytest.fixture
def run_adapter(tmp_path, tiny_model_dir, make_adapter):
    """A run folder as ``grpo-kit train`` leaves it: ``adapter/`` plus ``run.json`` with the recipe's prompt."""
    run = tmp_path / "run"
    make_adapter(tiny_model_dir, run / "adapter")
    (run / "run.json").write_text(
        json.dumps({"recipe": {"model_name_or_path": str(tiny_model_dir), "few_shot": 1, "prefill": "<think>\n"}})
    )
    return run / "adapter"


def test_chat_answers_with_the_adapter_and_the_runs_prompt(run_adapter, tiny_model_dir, capsys):
    base, settings = Run.of(run_adapter).base_model, Run.of(run_adapter).prompt
    assert (base, settings) == (str(tiny_model_dir), {"few_shot": 1, "prefill": "<think>\n", "system_prompt": None})
    model, tokenizer = load_inference_model(base, run_adapter)
    reply = ask(model, tokenizer, "What is 2 + 3?", max_new_tokens=6, **settings)
    prompt = build_prompts(["What is 2 + 3?"], tokenizer, **settings)[0]
    expected = generate(model, tokenizer, [prompt], max_new_tokens=6, progress=False)[0][0][0]
    assert reply == "<think>\n" + expected
    printed = capsys.readouterr().out
    assert printed.startswith("<think>\n") and expected.strip()[:5] in printed


def test_chat_cli_takes_the_question_as_arguments(run_adapter, capsys):
    assert main(["chat", "--adapter", str(run_adapter), "--max-new-tokens", "4", "How", "many", "apples?"]) == 0
    assert capsys.readouterr().out.startswith("<think>\n")


def test_chat_cli_without_a_question_names_the_usage(capsys):
    assert main(["chat"]) == 2
    err = capsys.readouterr().err
    assert 'grpo-kit chat "What is 17 + 25?"' in err and "notebook" in err and "Traceback" not in err


def test_without_a_run_record_the_base_comes_from_the_adapter(tmp_path, tiny_model_dir, make_adapter):
    adapter = make_adapter(tiny_model_dir, tmp_path / "adapter")
    assert Run.of(adapter).base_model == str(tiny_model_dir) and Run.of(adapter).prompt is None
    plain = {"few_shot": 0, "prefill": "", "system_prompt": None}
    assert _base_and_prompt(None, str(adapter)) == (str(tiny_model_dir), plain)  # what eval and chat use
    assert _base_and_prompt("other", str(adapter))[0] == "other" and _base_and_prompt(None, None)[0] == "embedded"


def test_chat_refuses_a_folder_that_is_not_an_adapter(tmp_path, capsys):
    assert main(["chat", "--adapter", str(tmp_path), "--model", "embedded", "hi"]) == 2
    assert "not a LoRA adapter folder" in capsys.readouterr().err
