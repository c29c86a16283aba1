"""The GPU proof's CPU-side parts: the dry-run plan, result rows and their Markdown, and the offline bundle's packing.

The proof itself needs a CUDA GPU and has not run here; what runs here is everything around it: the plan
(``--dry-run`` in a subprocess, with Unsloth and bitsandbytes made unimportable), the shapes' parameter counts against
the published models, a failing run becoming a row, the table, and the bundle's split/rejoin/install path.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tarfile
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


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """``gpu_proof.py --dry-run`` in a fresh process where importing unsloth or bitsandbytes raises."""
    tmp = tmp_path_factory.mktemp("dry")
    poison = tmp / "poison"
    for name in ("unsloth", "bitsandbytes", "unsloth_zoo"):
        (poison / name).mkdir(parents=True)
        (poison / name / "__init__.py").write_text(f"raise ImportError('the dry run imported {name}')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(poison), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    done = subprocess.run(
        [sys.executable, str(PROOF), "--dry-run", "--out", str(tmp / "out")],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, json.loads((tmp / "out" / "plan.json").read_text())


def test_dry_run_plans_every_tier_and_arch_with_its_twin_and_the_export(dry_run):
    stdout, plan = dry_run
    runs = {(r["kind"], r["tier"], r["arch"]) for r in plan["runs"]}
    for tier in proof.TIERS:
        for arch in ("llama-3.1-8b", "qwen2.5-math-7b", "qwen2.5-1.5b"):
            assert ("kit", tier, arch) in runs and ("plain", tier, arch) in runs
    assert ("export", "t4-16gb", "qwen2.5-1.5b") in runs
    assert len(plan["runs"]) == 4 * 3 * 2 + 1
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
    [("llama-3.1-8b", planner.LLAMA_31_8B), ("qwen2.5-math-7b", planner.QWEN25_MATH_7B), ("qwen2.5-1.5b", planner.QWEN25_15B)],
)
def test_built_shapes_count_the_real_models_parameters(dry_run, arch, published):
    _, plan = dry_run
    counted = plan["shapes"][arch]["params"]  # from_config on the meta device, in the dry-run process
    assert abs(counted - published.params) / published.params < 0.005, (counted, published.params)
    config = plan["shapes"][arch]["config"]
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (
        published.hidden, published.layers, published.vocab,
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
    env = {"gpu": "NVIDIA H100 80GB HBM3", "gpu_total_gib": 79.1, "driver": "580.1", "cuda": "13.0",
           "versions": {"torch": "2.11.0", "unsloth": "2026.10.7"}}
    rows = [
        {"kind": "kit", "tier": "t4-16gb", "arch": "qwen2.5-1.5b", "status": "fitted", "peak_allocated_gib": 5.0,
         "peak_reserved_gib": 6.0, "plan_gib": 3.61, "cap_gib": 14.7, "seconds_per_step": 10.0,
         "tokens_per_second": 204.8, "mean_completion_tokens": 512.0},
        {"kind": "plain", "tier": "t4-16gb", "arch": "qwen2.5-1.5b", "status": "fitted", "peak_allocated_gib": 9.0,
         "peak_reserved_gib": 12.0, "plan_gib": 3.61, "cap_gib": 14.7, "seconds_per_step": 25.0},
        {"kind": "kit", "tier": "t4-16gb", "arch": "llama-3.1-8b", "status": "OOM", "peak_allocated_gib": 14.6,
         "cap_gib": 14.7, "plan_gib": 8.38, "note": "CUDA out of memory. Tried to allocate 1.95 GiB"},
        {"kind": "export", "tier": "t4-16gb", "arch": "qwen2.5-1.5b", "status": "fitted", "exports": [
            {"format": "merged16", "max_abs_diff": 0.01, "tolerance": 0.05, "detail": "bfloat16 reload"}]},
    ]
    return {"date": "2026-11-23", "environment": env, "steps": 3, "rows": rows}


def test_markdown_table_names_the_machine_and_has_one_row_per_run():
    text = proof.markdown_table(_fake_result())
    assert "2026-11-23 on NVIDIA H100 80GB HBM3" in text and "driver 580.1" in text and "unsloth 2026.10.7" in text
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + 4  # header + rows
    assert all(line.count(" | ") == len(proof.COLUMNS) - 1 for line in table)
    assert "Export merged16: max |dlogit| 1.00e-02 <= tolerance 5.00e-02" in text


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
    from grpo_kit.models import embedded_model_path, load_tokenizer

    tokenizer = load_tokenizer(str(embedded_model_path()))
    preset = load_recipe(tier)
    rows = proof.full_length_dataset(preset, tokenizer, rows=4)
    formatted, dropped = format_for_grpo(rows, tokenizer, few_shot=preset.kit.few_shot, prefill=preset.kit.prefill,
                                         max_prompt_tokens=preset.kit.max_prompt_length)
    assert dropped == 0 and len(formatted) == 4
    text = tokenizer.apply_chat_template(formatted[0]["prompt"], add_generation_prompt=True, tokenize=False)
    tokens = len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert preset.kit.max_prompt_length - 8 <= tokens <= preset.kit.max_prompt_length


def _args(tmp_path, **kw):
    return SimpleNamespace(out=tmp_path, models=tmp_path / "models", steps=1, run_timeout=600, **kw)


def test_a_run_that_fails_in_its_subprocess_becomes_an_error_row(tmp_path):
    run = proof.Run("kit", "t4-16gb", "qwen2.5-1.5b")
    plan_row = {"kind": "kit", "tier": "t4-16gb", "arch": "qwen2.5-1.5b", "cap_gib": 14.7, "plan_gib": 3.6,
                "plan_shipped_with_vllm_gib": 11.9}
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
    plan_row = {"kind": "kit", "tier": "t4-16gb", "arch": "qwen2.5-1.5b", "cap_gib": 14.7, "plan_gib": 3.6,
                "plan_shipped_with_vllm_gib": 11.9}
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

    monkeypatch.setattr(proof, "environment", lambda: {"gpu": "fake 24 GB", "gpu_total_gib": 22.5, "driver": "x",
                                                       "cuda": "13.0", "versions": {}})
    monkeypatch.setattr(proof, "run_one", fake_run_one)
    runs = proof.plan_runs(("l4-24gb", "a100-40gb"), ("qwen2.5-1.5b", "qwen2.5-math-7b"), skip_plain=True)
    plan = proof.describe_plan(runs, 1)  # recipes parse on this CPU; the driver below believes in a GPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    result = proof.drive(_args(tmp_path, time_budget=3600), runs, plan)
    assert calls == ["build-qwen2.5-1.5b", "kit-l4-24gb-qwen2.5-1.5b", "build-qwen2.5-math-7b",
                     "export-t4-16gb-qwen2.5-1.5b"]
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


def test_install_script_rejoins_checks_unpacks_and_installs_offline(tmp_path):
    payload = tmp_path / "payload"
    (payload / "wheels").mkdir(parents=True)
    wheel = payload / "wheels" / "demo-1.0-py3-none-any.whl"
    wheel.write_bytes(os.urandom(3000))  # incompressible: several parts
    (payload / "gpu_proof.py").write_text("print('proof')\n")
    out = tmp_path / "bundle"
    parts = bundle.pack_bundle(payload, out, part_bytes=2048)
    assert len(parts) >= 3 and all(size <= 2048 for size in parts.values())
    fake_python = tmp_path / "python3"
    fake_python.write_text(f'#!/bin/sh\necho "$@" > {tmp_path / "pip-args"}\n')
    fake_python.chmod(0o755)
    done = subprocess.run(["bash", str(out / "install.sh")], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": str(fake_python)}, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (out / "payload" / "wheels" / wheel.name).read_bytes() == wheel.read_bytes()
    pip_args = (tmp_path / "pip-args").read_text()
    assert "--no-index" in pip_args and "--no-deps" in pip_args and wheel.name in pip_args
    assert "gpu_proof.py" in done.stdout


def test_install_script_stops_on_a_damaged_part(tmp_path):
    payload = tmp_path / "payload"
    (payload / "wheels").mkdir(parents=True)
    (payload / "wheels" / "demo-1.0-py3-none-any.whl").write_bytes(os.urandom(3000))
    out = tmp_path / "bundle"
    first = sorted(bundle.pack_bundle(payload, out, part_bytes=2048))[0]
    damaged = bytearray((out / first).read_bytes())
    damaged[100] ^= 0xFF
    (out / first).write_bytes(bytes(damaged))
    done = subprocess.run(["bash", str(out / "install.sh")], capture_output=True, text=True,
                          env={**os.environ, "PYTHON": "false"}, timeout=120)
    assert done.returncode != 0 and "FAILED" in done.stdout + done.stderr
    assert not (out / "payload").exists()


def _fake_wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return path


def test_resolve_follows_requirements_and_leaves_out_what_the_image_has(tmp_path, monkeypatch):
    index = tmp_path / "index"
    index.mkdir()
    _fake_wheel(index, "toplib", "1.0", ["midlib>=2", "torch>=2", 'winlib; sys_platform == "win32"',
                                        'extralib; extra == "docs"', "xformers"])
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


def test_bundle_tar_holds_the_payload_paths_install_sh_expects(tmp_path):
    payload = tmp_path / "payload"
    (payload / "tokenizer").mkdir(parents=True)
    (payload / "tokenizer" / "tokenizer.json").write_text("{}")
    out = tmp_path / "bundle"
    parts = [out / name for name in bundle.pack_bundle(payload, out, part_bytes=10**6)]
    with tarfile.open(bundle.join_parts(parts, tmp_path / "joined.tar")) as tar:
        assert "./tokenizer/tokenizer.json" in tar.getnames()
    assert "payload/tokenizer" in (out / "install.sh").read_text()
