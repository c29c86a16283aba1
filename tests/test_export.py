"""Exports: every CPU format is read back and matches base + adapter weight by weight; broken exports fail loudly.

The adapter is made here with PEFT on the tiny random Llama (``tiny_model_dir``), with the LoRA B matrices set to
non-zero random values: a fresh LoRA has B = 0 and changes nothing, so it could not catch an export that drops it.
"""

from __future__ import annotations

import json

import pytest
from peft.tuners.tuners_utils import BaseTuner

import grpo_kit.export as export_module
import grpo_kit.gguf_files as gguf_module
from grpo_kit.cli import main
from grpo_kit.errors import GrpoKitError
from grpo_kit.evaluate import EvalResult
from grpo_kit.export import export, push_folder
from grpo_kit.runs import Run
from grpo_kit.verify import ExportResult, check_tensors, lora_effect

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FAKE_TOKEN = "hf_FAKEtoken0123456789abcdefSECRET"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_model_dir, make_adapter):
    """A run folder like train writes: run.json, metrics.jsonl, adapter/."""
    run = tmp_path_factory.mktemp("run")
    make_adapter(tiny_model_dir, run / "adapter")
    info = {  # as grpo_kit.runs.Run.record writes it: the recipe's flat values
        "recipe": {
            "name": "cpu",
            "model_name_or_path": str(tiny_model_dir),
            "lora_r": 4,
            "lora_alpha": 8,
            "few_shot": 1,
            "prefill": "<think>\n",
            "num_generations": 4,
            "learning_rate": 5e-4,
            "max_steps": 12,
            "max_completion_length": 16,
        },
        "data": "sample",
        "reward_names": ["tag_progress", "correctness"],
        "versions": {"trl": "1.15.0"},
    }
    (run / "run.json").write_text(json.dumps(info))
    (run / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, "reward": 0.1 * s}) for s in range(1, 8)))
    return run


def _files(folder):
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def test_parse_formats_and_names(run_dir, tmp_path):
    with pytest.raises(GrpoKitError, match="lora, merged16, gguf"):
        export(run_dir / "adapter", "lora, merged_4bit", out_dir=tmp_path / "exports")
    assert not (tmp_path / "exports").exists()
    assert gguf_module.parse_names("Q8_0, f16,q8_0", gguf_module.GGUF_TYPES, "GGUF type(s)") == ["q8_0", "f16"]
    with pytest.raises(GrpoKitError, match="q3_k_s.*q4_k_m"):
        export(run_dir / "adapter", "gguf", gguf_type="q3_k_s", out_dir=tmp_path / "exports")
    assert not (tmp_path / "exports").exists()
    assert Run.of(tmp_path / "my-run" / "adapter").name == "my-run"
    assert Run.of(tmp_path / "my-run" / "checkpoint-40").name == "my-run-checkpoint-40"


def test_lora_effect_is_how_far_merging_moves_a_weight(tmp_path, tiny_model_dir, make_adapter):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    assert lora_effect(make_adapter(tiny_model_dir, tmp_path / "untrained", std=0.0)) == 0.0  # every lora_B 0
    adapter = make_adapter(tiny_model_dir, tmp_path / "trained")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    base = {name: weight.clone() for name, weight in base.items()}
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(adapter))
    moved = max(float((w - base[n]).abs().max()) for n, w in merged.merge_and_unload().state_dict().items())
    assert moved > 0 and lora_effect(adapter) == pytest.approx(moved, rel=1e-4)


def test_a_runs_evaluations_are_what_it_saved(tmp_path):
    result = EvalResult(0.25, 0.5, 0.75, 30.0, n=4, seed=0, protocol="p")
    run = tmp_path / "run"  # what the run saved in eval/ (demo, notebooks 00 and 04)
    result.save(run / "eval" / "after.json")
    for adapter in (run / "adapter", tmp_path / "elsewhere" / "adapter"):
        adapter.mkdir(parents=True)
    assert Run.of(run / "adapter").evaluations == {"after": result.to_dict()}
    assert Run.of(tmp_path / "elsewhere" / "adapter").evaluations == {}


def test_compare_rules(tmp_path):
    """Within the limit and closer to base + LoRA passes; the base (LoRA missing) fails; a no-op adapter is noted."""
    import torch

    torch.manual_seed(0)
    base = torch.randn(5, 50) * 10
    tuned = base + torch.randn(5, 50)
    noisy = tuned + 0.01 * torch.randn(5, 50)
    ok = check_tensors("merged16", [("w", noisy, tuned, base)], 2**-7, path=tmp_path, detail="d")
    assert ok.max_abs_diff <= ok.tolerance and ok.lora_effect > ok.tolerance and ok.note == ""
    with pytest.raises(GrpoKitError, match="LoRA weights are missing"):
        check_tensors("merged16", [("w", base, tuned, base)], 0.5, path=tmp_path, detail="d")
    with pytest.raises(GrpoKitError, match="exceeds the limit"):
        check_tensors("lora", [("w", noisy, tuned, base)], 0.0, path=tmp_path, detail="d")
    with pytest.raises(GrpoKitError, match="w is missing"):
        check_tensors("gguf", [("w", None, tuned, base)], 0.1, path=tmp_path, detail="d")
    assert "changes nothing" in check_tensors("lora", [("w", base, base, base)], 0.0, path=tmp_path, detail="d").note


@pytest.mark.slow
def test_every_cpu_format_round_trips(run_dir, tmp_path):
    results = export(run_dir / "adapter", ("lora", "merged16"), out_dir=tmp_path, name="all")
    target = tmp_path / "all"
    assert [r.format for r in results] == ["lora", "merged16"]
    by_format = {r.format: r for r in results}
    for result in results:
        assert result.path.exists() and target in result.path.parents
        assert 0 <= result.max_abs_diff <= result.tolerance
        assert result.lora_effect > result.tolerance  # the check really could see a missing LoRA
        assert result.mean_abs_diff < result.mean_abs_diff_base  # closer to base+adapter than to the base
    assert by_format["lora"].max_abs_diff == by_format["lora"].tolerance == 0  # the adapter, bit for bit
    # both report the adapter's effect on the model's weights, not the size of a LoRA factor
    assert by_format["lora"].lora_effect == pytest.approx(by_format["merged16"].lora_effect, rel=1e-4)
    files = _files(target)
    assert "lora/adapter_model.safetensors" in files and "merged16/model.safetensors" in files
    assert not any(f.endswith(".bin") for f in files)
    config = json.loads((target / "merged16" / "config.json").read_text())
    assert config["dtype"] == "bfloat16"  # float32 base stored as bf16 (documented choice)
    card = (target / "README.md").read_text()
    assert "| recipe | cpu |" in card and "| steps | 7 |" in card and "tag_progress" in card
    assert f"{by_format['merged16'].max_abs_diff:.3g}" in card
    recorded = json.loads((target / "export.json").read_text())
    assert [f["format"] for f in recorded["formats"]] == ["lora", "merged16"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind


def test_an_export_carries_the_training_prompt_where_eval_and_chat_find_it(run_dir, tmp_path, monkeypatch, capsys):
    """The run trained with one worked example and the prefill "<think>\\n": each exported folder records them, so
    `grpo-kit eval --model <merged16>` and `--adapter <lora>` prompt as in training, and other code can (model card)."""
    import grpo_kit.evaluate as evaluate
    from grpo_kit.data import build_messages

    export(run_dir / "adapter", ("lora", "merged16"), out_dir=tmp_path, name="x")
    trained = {"few_shot": 1, "prefill": "<think>\n", "system_prompt": None}
    for folder in ("lora", "merged16"):
        record = json.loads((tmp_path / "x" / folder / "prompt.json").read_text())
        assert {key: record[key] for key in trained} == trained and record["reply_starts_with"] == "<think>\n"
        assert record["messages_before_question"] == build_messages("q", few_shot=1)[:-1]  # system + 1 example
    assert evaluate._base_and_prompt(str(tmp_path / "x" / "merged16"), None)[1] == trained
    assert evaluate._base_and_prompt(None, str(tmp_path / "x" / "lora"))[1] == trained
    assert "prompt.json" in (tmp_path / "x" / "README.md").read_text()

    seen = []
    monkeypatch.setattr("grpo_kit.models.load_inference_model", lambda base, adapter: (base, adapter))
    monkeypatch.setattr(
        evaluate,
        "evaluate",
        lambda model, tokenizer, dataset, **kw: (
            seen.append(kw) or EvalResult(0.0, 0.0, 1.0, 1.0, n=1, seed=0, protocol="p")
        ),
    )
    main(["eval", "--model", str(tmp_path / "x" / "merged16"), "--data", "sample", "--limit", "2"])
    assert (seen[0]["few_shot"], seen[0]["prefill"]) == (1, "<think>\n")
    assert "few_shot=1, prefill='<think>\\n'" in capsys.readouterr().out


@pytest.mark.slow
def test_an_export_can_compare_the_merged_models_answers_with_base_plus_adapter(run_dir, tmp_path, capsys):
    """`grpo-kit export --format merged16 --check-answers 2`: both models answer the same 2 bundled questions under
    the training prompt; the numbers go to export.json, the model card and the output."""
    assert (
        main(
            [
                "export",
                "--adapter",
                str(run_dir / "adapter"),
                "--format",
                "merged16",
                "--out-dir",
                str(tmp_path),
                "--name",
                "a",
                "--check-answers",
                "2",
            ]
        )
        == 0
    )
    answers = json.loads((tmp_path / "a" / "export.json").read_text())["answers"]
    assert list(answers) == ["base + adapter", "merged16"] and {m["n"] for m in answers.values()} == {2}
    assert all("few_shot=1, prefill='<think>\\n'" in m["protocol"] for m in answers.values())  # the run's prompt
    assert "| merged16 | 2 |" in (tmp_path / "a" / "README.md").read_text()
    assert "answers of merged16: format" in capsys.readouterr().out
    assert main(["export", "--adapter", str(run_dir / "adapter"), "--check-answers", "-1"]) == 2
    assert "--check-answers takes a number" in capsys.readouterr().err


def test_merge_that_drops_the_lora_fails_verification(run_dir, tmp_path, monkeypatch):
    """The classic bug: the merged model is just the base. Verification must refuse it and write nothing."""

    def base_only(tuner, *args, **kwargs):
        return tuner.unload()  # removes the LoRA layers without merging them

    monkeypatch.setattr(BaseTuner, "merge_and_unload", base_only)
    with pytest.raises(GrpoKitError, match="merged16.*(exceeds|LoRA weights are missing)"):
        export(run_dir / "adapter", ("merged16",), out_dir=tmp_path, name="broken")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_overwrite_guard_and_failed_overwrite_keeps_the_old_export(run_dir, tmp_path, monkeypatch):
    export(run_dir / "adapter", ("lora",), out_dir=tmp_path, name="x")
    before = _files(tmp_path / "x")
    with pytest.raises(GrpoKitError, match="--overwrite"):
        export(run_dir / "adapter", ("lora",), out_dir=tmp_path, name="x")

    monkeypatch.setattr(BaseTuner, "merge_and_unload", lambda tuner, *args, **kwargs: tuner.unload())
    with pytest.raises(GrpoKitError, match="verification failed"):
        export(run_dir / "adapter", ("merged16",), out_dir=tmp_path, name="x", overwrite=True)
    assert _files(tmp_path / "x") == before  # the verified old export survived the failed replacement
    monkeypatch.undo()

    results = export(run_dir / "adapter", ("merged16",), out_dir=tmp_path, name="x", overwrite=True)
    assert results[0].format == "merged16"
    assert "merged16/model.safetensors" in _files(tmp_path / "x") and "lora/adapter_config.json" not in _files(
        tmp_path / "x"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["x"]


@pytest.mark.slow
def test_interrupted_export_leaves_no_folder_that_looks_complete(run_dir, tmp_path, monkeypatch):
    real_save = export_module._write_merged16

    def crash_midway(*args):
        real_save(*args)  # the weights are on disk...
        raise KeyboardInterrupt  # ...and then the user presses Ctrl-C

    monkeypatch.setattr(export_module, "_write_merged16", crash_midway)
    with pytest.raises(KeyboardInterrupt):
        export(run_dir / "adapter", ("lora", "merged16"), out_dir=tmp_path, name="cut")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_model_card_has_the_eval_numbers_the_run_saved(run_dir, tmp_path):
    import shutil

    run = shutil.copytree(run_dir, tmp_path / "run")
    EvalResult(0.012, 0.034, 0.0, 61.0, n=50, seed=0, protocol="bundled sample, strict/lenient").save(
        run / "eval" / "before.json"
    )
    EvalResult(0.187, 0.243, 0.96, 44.0, n=50, seed=0, protocol="bundled sample, strict/lenient").save(
        run / "eval" / "after.json"
    )
    export(run / "adapter", ("lora",), out_dir=tmp_path, name="card")
    card = (tmp_path / "card" / "README.md").read_text()
    assert "| before | 50 | 1.2 % | 3.4 % | 0.0 % | 61.0 |" in card
    assert "| after | 50 | 18.7 % | 24.3 % | 96.0 % | 44.0 |" in card
    assert "Protocol: bundled sample, strict/lenient" in card
    assert f'model = PeftModel.from_pretrained(base, "{tmp_path}/card/lora")' in card


@pytest.mark.slow
def test_hub_token_never_leaks(run_dir, tmp_path, monkeypatch, capsys):
    from huggingface_hub import HfApi

    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    calls = []

    def create_repo(api, repo_id, exist_ok=False):
        calls.append(("create", repo_id, api.token))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(api, repo_id, folder_path, commit_message):
        calls.append(("upload", repo_id, folder_path, api.token))

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    export(run_dir / "adapter", ("lora",), out_dir=tmp_path, name="pushed", push_to_hub="me/grpo-test", print_fn=print)
    assert calls == [
        ("create", "me/grpo-test", FAKE_TOKEN),
        ("upload", "me/grpo-test", tmp_path / "pushed", FAKE_TOKEN),
    ]
    captured = capsys.readouterr()
    assert f"uploaded {tmp_path / 'pushed'} to https://huggingface.co/me/grpo-test" in captured.out
    assert FAKE_TOKEN not in captured.out + captured.err
    for path in (tmp_path / "pushed").rglob("*"):
        if path.is_file():
            assert FAKE_TOKEN.encode() not in path.read_bytes(), path

    def failing_upload(api, repo_id, folder_path, commit_message):
        raise RuntimeError(f"401 Unauthorized for token {api.token}")

    monkeypatch.setattr(HfApi, "upload_folder", failing_upload)
    with pytest.raises(GrpoKitError) as error:
        push_folder(tmp_path / "pushed", "me/grpo-test")
    assert FAKE_TOKEN not in str(error.value) and "***" in str(error.value)

    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(tmp_path / "no-token"))  # no `hf auth login`
    with pytest.raises(GrpoKitError, match="HF_TOKEN"):
        push_folder(tmp_path / "pushed", "me/grpo-test")


@pytest.mark.slow
def test_cli_export_refuses_to_overwrite(run_dir, tmp_path, capsys):
    args = ["export", "--adapter", str(run_dir / "adapter"), "--out-dir", str(tmp_path), "--name", "cli"]
    assert main(args) == 0
    assert "verified" in capsys.readouterr().out
    assert main(args) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main([*args, "--overwrite"]) == 0


def test_an_export_that_would_not_fit_on_the_disk_is_refused_before_anything_loads(run_dir, tmp_path, monkeypatch):
    """An 8B merged16 is 16 GB and a Colab disk holds ~75 GB: the sizes are checked before minutes of merging."""
    import shutil

    import grpo_kit.colab as colab

    monkeypatch.setattr(colab.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12, 1000))
    monkeypatch.setattr(export_module, "_write_merged16", lambda *a: pytest.fail("a model was merged"))
    with pytest.raises(
        GrpoKitError,
        match=r"Not enough space for the export tiny: merged16 .*Nothing was written\. "
        r"The biggest item is merged16 .*--format lora alone",
    ):
        export(run_dir / "adapter", ("merged16",), out_dir=tmp_path / "exports", name="tiny")
    assert not any((tmp_path / "exports").iterdir())
    export_module.check_space(str(run_dir / "adapter"), tmp_path, "small", ("lora",), [])  # MBs


def test_the_space_check_counts_every_file_of_the_notebooks_8b_export_once():
    """Notebook 00's default on a T4 (lora, merged16, q4_k_m GGUF of Llama-3.1-8B, by Unsloth): one 16-bit merge (the
    GGUF is converted from merged16), llama.cpp's 16-bit GGUF before quantizing, and the 16-bit base the weight check
    reads, downloaded unless cached. Without merged16, Unsloth's own merge is counted instead."""
    from grpo_kit.planner import LLAMA_31_8B

    model = "unsloth/Meta-Llama-3.1-8B-Instruct"
    sizes = export_module.export_sizes(model, ("lora", "merged16", "gguf"), ["q4_k_m"])
    half = 2 * LLAMA_31_8B.params
    assert sorted(sizes.values()) == sorted([half, int(0.61 * LLAMA_31_8B.params), half, half])
    assert sum(sizes.values()) < 55e9  # 53.1 GB: the second merge (16 GB) of before is gone
    alone = export_module.export_sizes(model, ("gguf",), ["q4_k_m"])
    assert "merged16" not in alone and sum(alone.values()) == sum(sizes.values())  # Unsloth's merge, removed after
    assert export_module.export_sizes(model, ("lora",), []) == {}


def test_an_export_result_is_a_json_row_with_its_path_relative_or_whole(tmp_path):
    """export.json, notebook 05's table and the GPU proof's rows all come from ``ExportResult.to_dict``."""

    result = ExportResult("lora", tmp_path / "x" / "lora", "PEFT adapter", 0.0, 5e-4, 0.0, 2.5)
    assert json.loads(json.dumps(result.to_dict(relative_to=tmp_path / "x")))["path"] == "lora"
    assert result.to_dict()["path"] == str(tmp_path / "x" / "lora") and result.to_dict()["format"] == "lora"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("trained_on", "formats"),
    [
        ("tiny", ("lora", "merged16")),
        ("embedded:smollm2-135m", ("lora",)),
        ("embedded:smollm2-135m-bnb-4bit", ("lora", "merged16")),  # the lora on its NF4 base, merged16 from the 16-bit
    ],
)
def test_the_model_cards_loading_code_runs_as_written(
    trained_on, formats, tiny_model_dir, make_adapter, tmp_path, monkeypatch
):
    """Issue 37: the card named ``embedded:...`` (transformers cannot load it), and a 4-bit run's 16-bit original
    while its adapter_config.json named the bnb-4bit base. The card's code is run as a user would paste it."""
    from peft import PeftModel

    from grpo_kit.models import resolve_model_id

    if "4bit" in trained_on:
        pytest.importorskip("bitsandbytes", reason="the cpu extra installs bitsandbytes")
    base_dir = tiny_model_dir if trained_on == "tiny" else resolve_model_id(trained_on)
    monkeypatch.chdir(tmp_path)
    make_adapter(base_dir, tmp_path / "run" / "adapter")
    (tmp_path / "run" / "run.json").write_text(
        json.dumps({"recipe": {"model_name_or_path": str(tiny_model_dir if trained_on == "tiny" else trained_on)}})
    )
    export(tmp_path / "run" / "adapter", formats, name="card")  # out_dir: exports/, as the CLI's default

    card = (tmp_path / "exports" / "card" / "README.md").read_text()
    code = card.split("## How to load\n\n```python\n", 1)[1].split("```", 1)[0]
    namespace = {}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the card's own code, run as written
    recorded = json.loads((tmp_path / "exports" / "card" / "lora" / "adapter_config.json").read_text())
    assert namespace["base"].name_or_path == recorded["base_model_name_or_path"] == str(base_dir)  # one base
    assert isinstance(namespace["model"], PeftModel)
    assert getattr(namespace["base"], "is_loaded_in_4bit", False) is ("4bit" in trained_on)
    if "merged16" in formats:
        assert namespace["merged"].config.architectures and not hasattr(
            namespace["merged"].config, "quantization_config"
        )
