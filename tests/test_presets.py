"""Presets: every tier is a valid TRL batch, fits its card per the planner, and auto_preset picks sensibly."""

from __future__ import annotations

import dataclasses
import doctest
import json

import pytest

import grpo_kit.presets as presets_module
from grpo_kit.cli import main
from grpo_kit.errors import GrpoKitError
from grpo_kit.models import EMBEDDED_ID
from grpo_kit.planner import estimate_vram
from grpo_kit.presets import (
    FALLBACK_MODEL_4BIT,
    PRESETS,
    auto_preset,
    get_preset,
    presets_json,
    presets_table,
)
from grpo_kit.runtime import DeviceInfo

GPU_PRESETS = [p for p in PRESETS.values() if p.vram_gb > 0]
TIERS = {"cpu", "t4-16gb", "l4-24gb", "a100-40gb", "a100-80gb"}


def test_the_documented_tiers_exist():
    assert TIERS <= set(PRESETS)
    assert all(name == preset.name for name, preset in PRESETS.items())


@pytest.mark.parametrize("preset", PRESETS.values(), ids=list(PRESETS))
def test_batch_rule_holds_and_trl_accepts_the_batch_shape(preset, tmp_path):
    from trl import GRPOConfig

    assert preset.generation_batch_size % preset.num_generations == 0
    assert preset.prompts_per_step >= 1
    config = GRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=preset.per_device_train_batch_size,
        gradient_accumulation_steps=preset.gradient_accumulation_steps,
        num_generations=preset.num_generations,
        use_cpu=True,
        bf16=False,
        report_to="none",
    )
    assert config.generation_batch_size == preset.generation_batch_size


@pytest.mark.parametrize("preset", PRESETS.values(), ids=list(PRESETS))
def test_preset_is_a_complete_consistent_recipe(preset):
    from grpo_kit.rewards import REWARDS

    assert preset.max_prompt_length + preset.max_completion_length <= preset.max_seq_length
    assert set(preset.lora_targets) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert preset.rewards and all(name in REWARDS for name, _ in preset.rewards)
    assert preset.seed == 3407
    assert len(preset.description) > 200, "each preset explains who it is for and why"
    assert 0 < preset.warmup_steps < 1 or preset.warmup_steps == 0


@pytest.mark.parametrize("preset", GPU_PRESETS, ids=[p.name for p in GPU_PRESETS])
def test_gpu_presets_fit_their_card_and_use_8bit_paged_adam(preset):
    estimate = estimate_vram(preset)
    assert estimate.fits(preset.vram_gb), estimate.format()
    assert preset.optim == "paged_adamw_8bit"
    assert preset.gradient_checkpointing and preset.use_vllm
    if preset.load_in_4bit:
        assert preset.model.startswith("unsloth/") and preset.model.endswith("-bnb-4bit")
    # vLLM's share must hold the (shared) weights plus one generation batch of KV cache.
    assert estimate.vllm_share_gib - estimate.weights_gib >= estimate.kv_needed_gib


def test_t4_is_fp16_4bit_llama_with_batch_1_accumulation_4():
    t4 = get_preset("t4-16gb")
    assert t4.precision == "fp16"  # a T4 (sm75) has no bf16
    assert "Llama-3.1-8B-Instruct" in t4.model and t4.load_in_4bit
    assert (t4.per_device_train_batch_size, t4.gradient_accumulation_steps, t4.num_generations) == (1, 4, 4)
    assert 0 < t4.vllm_gpu_memory_utilization <= 0.7
    assert estimate_vram(t4, card_gb=14.7).total_gib <= 14.7
    assert "ONE question" in t4.description  # the batch arithmetic is stated honestly


def test_larger_tiers_use_bf16_and_more_generations():
    for name in ("l4-24gb", "a100-40gb", "a100-80gb"):
        preset = get_preset(name)
        assert preset.precision == "bf16"
        assert preset.num_generations > get_preset("t4-16gb").num_generations
        assert preset.max_completion_length >= get_preset("t4-16gb").max_completion_length


def test_cpu_preset_is_the_measured_recipe():
    cpu = get_preset("cpu")
    assert cpu.model == EMBEDDED_ID
    assert cpu.precision == "fp32" and not cpu.gradient_checkpointing
    assert not cpu.load_in_4bit and not cpu.use_vllm and cpu.optim == "adamw_torch"
    assert (cpu.lora_rank, cpu.lora_alpha, cpu.learning_rate) == (16, 32, 5e-4)
    assert (cpu.num_generations, cpu.generation_batch_size, cpu.max_completion_length) == (8, 8, 48)
    assert cpu.temperature == 1.0 and cpu.beta == 0.0
    assert cpu.few_shot == 3 and cpu.prefill == "<think>\n"
    assert cpu.rewards[0][0] == "tag_progress"
    assert cpu.max_steps == 8  # measured: reward 0.31 (steps 1-3) -> 0.83 (steps 6-8); the demo takes ~8 min


def test_get_preset_overrides_return_a_new_validated_preset():
    changed = get_preset("cpu", max_steps=3, learning_rate=1e-3, lora_targets=["q_proj", "v_proj"])
    assert (changed.max_steps, changed.learning_rate) == (3, 1e-3)
    assert changed.lora_targets == ("q_proj", "v_proj")  # lists become tuples
    assert PRESETS["cpu"].max_steps != 3  # the registry is untouched
    assert hash(changed)  # frozen and hashable


def test_get_preset_model_swaps_only_the_model():
    base = get_preset("t4-16gb")
    swapped = get_preset("t4-16gb", model=FALLBACK_MODEL_4BIT)
    assert swapped.model == FALLBACK_MODEL_4BIT
    assert dataclasses.replace(swapped, model=base.model) == base


def test_unknown_preset_lists_the_valid_names():
    with pytest.raises(GrpoKitError) as error:
        get_preset("t4")
    message = str(error.value)
    assert all(name in message for name in PRESETS)


def test_unknown_field_lists_valid_fields_and_suggests_one():
    with pytest.raises(GrpoKitError) as error:
        get_preset("cpu", learnin_rate=1e-3)
    message = str(error.value)
    assert "learnin_rate" in message and "learning_rate" in message and "num_generations" in message


def test_batch_rule_violation_names_the_fix():
    with pytest.raises(GrpoKitError, match=r"gradient_accumulation_steps=4") as error:
        get_preset("t4-16gb", gradient_accumulation_steps=3)
    assert "num_generations (4)" in str(error.value)
    with pytest.raises(GrpoKitError, match="divisors of 4"):
        get_preset("t4-16gb", num_generations=8, gradient_accumulation_steps=1, per_device_train_batch_size=4)


def test_other_invalid_values_are_explained():
    with pytest.raises(GrpoKitError, match="max_seq_length"):
        get_preset("t4-16gb", max_completion_length=4096)
    with pytest.raises(GrpoKitError, match="at least 2"):
        get_preset("cpu", num_generations=1, per_device_train_batch_size=1)
    with pytest.raises(GrpoKitError, match="precision"):
        get_preset("cpu", precision="fp8")
    with pytest.raises(GrpoKitError, match="fraction"):
        get_preset("t4-16gb", vllm_gpu_memory_utilization=1.5)


@pytest.mark.parametrize(
    ("device", "expected", "precision"),
    [
        (DeviceInfo("cpu", "cpu", 0.0, False), "cpu", "fp32"),
        (DeviceInfo("cuda", "Tesla T4", 14.74, False), "t4-16gb", "fp16"),
        (DeviceInfo("cuda", "Tesla T4", 14.7, False), "t4-16gb", "fp16"),
        (DeviceInfo("cuda", "NVIDIA L4", 22.0, True), "l4-24gb", "bf16"),
        (DeviceInfo("cuda", "NVIDIA A100-SXM4-40GB", 39.39, True), "a100-40gb", "bf16"),
        (DeviceInfo("cuda", "NVIDIA A100-SXM4-80GB", 79.15, True), "a100-80gb", "bf16"),
        (DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", 79.1, True), "a100-80gb", "bf16"),
        (DeviceInfo("cuda", "Tesla V100-SXM2-32GB", 31.7, False), "l4-24gb", "fp16"),
    ],
)
def test_auto_preset_picks_the_tier(device, expected, precision):
    preset, reason = auto_preset(device)
    assert preset.name == expected
    assert preset.precision == precision
    assert expected in reason and "\n" not in reason
    if device.kind == "cuda":
        assert device.name in reason and f"{device.vram_gb:.1f} GiB" in reason
        assert "Warning" not in reason  # every tier fits the cards it is picked for


def test_auto_preset_on_a_small_gpu_uses_the_fallback_model():
    preset, reason = auto_preset(DeviceInfo("cuda", "NVIDIA GeForce RTX 3060", 11.6, True))
    assert preset.name == "t4-16gb" and preset.model == FALLBACK_MODEL_4BIT
    assert "fallback" in reason and "Warning" not in reason


def test_presets_json_has_the_documented_fields():
    rows = presets_json()
    assert [row["name"] for row in rows] == list(PRESETS)
    required = {
        "name", "vram_gb", "model", "per_device_train_batch_size", "gradient_accumulation_steps", "num_generations",
        "max_completion_length", "lora_rank", "load_in_4bit", "estimate_gib",
    }  # fmt: skip
    for row in rows:
        assert required <= set(row)
        assert row["generation_batch_size"] % row["num_generations"] == 0
    t4 = next(row for row in rows if row["name"] == "t4-16gb")
    assert 0 < t4["estimate_gib"] <= 14.7
    assert json.loads(json.dumps(rows)) == rows


def test_presets_table_is_aligned_and_lists_every_tier():
    table = presets_table()
    lines = table.splitlines()
    assert len(lines) == len(PRESETS) + 1
    assert all(line.split()[0] in PRESETS for line in lines[1:])
    column = lines[0].index("model")
    assert all(line[column - 2 : column] == "  " for line in lines)  # columns line up


def test_cli_presets_json_lists_the_tiers(capsys):
    assert main(["presets", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert TIERS <= {row["name"] for row in rows}


def test_cli_presets_table_and_plan(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in PRESETS)
    assert main(["presets", "--plan", "t4-16gb"]) == 0
    out = capsys.readouterr().out
    assert "weights (4-bit)" in out and "fits in 14.7 GiB" in out


def test_cli_plan_with_a_local_model_folder(tmp_path, capsys):
    config = {"num_hidden_layers": 28, "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
              "num_key_value_heads": 4, "vocab_size": 152064, "model_type": "qwen2"}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["presets", "--plan", "a100-40gb", "--model", str(tmp_path)]) == 0
    assert "weights (16-bit)" in capsys.readouterr().out


def test_cli_presets_errors_exit_2(capsys):
    assert main(["presets", "--plan", "no-such-tier"]) == 2
    assert "Valid presets" in capsys.readouterr().err
    assert main(["presets", "--model", "x"]) == 2
    assert "--plan" in capsys.readouterr().err


def test_docstring_examples_run():
    assert doctest.testmod(presets_module).failed == 0
