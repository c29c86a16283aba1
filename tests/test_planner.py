"""The VRAM planner, the device check and `grpo-kit presets`: shapes against real models, estimates that move the way
memory does, refusals and warnings that name the fix, the tier auto_recipe picks."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest

from grpo_kit.config import load_recipe
from grpo_kit.embedded import EMBEDDED_ID
from grpo_kit.errors import GrpoKitError
from grpo_kit.models import DeviceInfo
from grpo_kit.planner import (
    KNOWN_SHAPES,
    LLAMA_31_8B,
    QWEN25_15B,
    SMOLLM2_135M,
    VLLM_OVERHEAD_GIB,
    ModelShape,
    auto_recipe,
    check_device,
    cli_presets,
    estimate_vram,
    lora_param_count,
    shape_for,
)

T4 = DeviceInfo("cuda", "Tesla T4", 14.7, False)
CPU = DeviceInfo("cpu", "cpu", 0.0, False)


def _as_config(shape: ModelShape) -> dict:
    return {
        "num_hidden_layers": shape.layers,
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "vocab_size": shape.vocab,
        "tie_word_embeddings": shape.tied_embeddings,
    }


# ------------------------------------------------------------------------------------------------ model shapes


@pytest.mark.parametrize("shape", KNOWN_SHAPES.values(), ids=list(KNOWN_SHAPES))
def test_known_shapes_agree_with_their_published_parameter_counts(shape):
    counted = ModelShape.from_config(_as_config(shape)).params
    assert counted == pytest.approx(shape.params, rel=0.01)  # Qwen2's q/k/v biases are the only difference


def test_shapes_offline_come_from_the_table_for_the_shipped_models():
    for model, name in [
        ("unsloth/Meta-Llama-3.1-8B-Instruct-bnb-4bit", "Llama-3.1-8B"),
        ("unsloth/Qwen2.5-Math-7B-Instruct", "Qwen2.5-Math-7B"),
        ("unsloth/Qwen2.5-1.5B-Instruct", "Qwen2.5-1.5B"),
        (EMBEDDED_ID, "SmolLM2-135M"),
    ]:
        assert shape_for(model).name == name
    assert shape_for("someone/unknown-7b") is None  # offline (conftest): nothing to read, nothing guessed


def test_a_local_transformers_config_is_preferred(tmp_path):
    from transformers import Qwen2Config

    Qwen2Config(**_as_config(QWEN25_15B)).save_pretrained(tmp_path / "qwen2.5-1.5b-custom")
    shape = shape_for(str(tmp_path / "qwen2.5-1.5b-custom"))
    assert shape.hidden == QWEN25_15B.hidden and shape.name.endswith("qwen2.5-1.5b-custom")  # read, not the table's


def test_from_config_counts_a_real_llama_exactly():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=500,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    shape = ModelShape.from_config(config)
    assert (shape.layers, shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.vocab) == (
        3,
        64,
        96,
        4,
        2,
        500,
    )
    assert shape.params == sum(p.numel() for p in LlamaForCausalLM(config).parameters())


def test_from_config_on_a_tied_qwen2_config():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=400,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    shape = ModelShape.from_config(config)
    assert shape.tied_embeddings and shape.dim("kv") == 24
    assert shape.params == pytest.approx(sum(p.numel() for p in Qwen2ForCausalLM(config).parameters()), rel=0.01)


def test_from_config_without_a_shape_is_explained():
    with pytest.raises(GrpoKitError, match="hidden_size"):
        ModelShape.from_config({"model_type": "bert"})


def test_lora_count_matches_peft():
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(0)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=8, target_modules=targets))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    shape = ModelShape.from_config(config)
    assert lora_param_count(shape, 8, targets) == trainable == lora_param_count(shape, 8, "all-linear")
    with pytest.raises(GrpoKitError, match="LoRA target"):
        lora_param_count(LLAMA_31_8B, 8, ["qkv_proj"])


# ------------------------------------------------------------------------------------------------ the estimate


def test_weights_shrink_with_bits():
    w32 = estimate_vram(load_recipe("a100-80gb", bf16=False), LLAMA_31_8B).weights_gib
    w16 = estimate_vram(load_recipe("a100-80gb"), LLAMA_31_8B).weights_gib
    w4 = estimate_vram(load_recipe("a100-80gb", load_in_4bit=True), LLAMA_31_8B).weights_gib
    assert w4 < w16 < w32 and w16 == pytest.approx(LLAMA_31_8B.params * 2 / 2**30)
    assert 5.0 < w4 < 5.8  # Unsloth's bnb-4bit Llama-3.1-8B checkpoint is 5.7 GB on disk


@pytest.mark.parametrize("name", ["t4-16gb", "l4-24gb", "a100-80gb"])
def test_total_grows_with_completion_length(name):
    totals = [
        estimate_vram(load_recipe(name, max_completion_length=n, max_seq_length=256 + n)).total_gib
        for n in (128, 256, 512, 1024)
    ]
    assert totals == sorted(totals) and len(set(totals)) == len(totals)


def test_more_generations_cost_kv_cache_and_with_a_bigger_micro_batch_more_memory():
    kv = [
        estimate_vram(load_recipe("t4-16gb", num_generations=g, gradient_accumulation_steps=g)).kv_needed_gib
        for g in (2, 4, 8)
    ]
    assert kv == sorted(kv) and len(set(kv)) == 3
    # Unsloth-style batch = G: every completion of a group in one micro-batch, so activations and logits grow.
    totals = [
        estimate_vram(
            load_recipe("t4-16gb", num_generations=g, per_device_train_batch_size=g, gradient_accumulation_steps=1)
        ).total_gib
        for g in (2, 4, 8)
    ]
    assert totals == sorted(totals) and len(set(totals)) == 3


def test_checkpointing_and_8bit_adam_save_memory():
    t4 = load_recipe("t4-16gb")
    with_ckpt, without = (estimate_vram(t4.replace(gradient_checkpointing=g)) for g in (True, False))
    assert with_ckpt.activations_gib < without.activations_gib / 5
    adam8, adam32 = (estimate_vram(t4.replace(optim=o)) for o in ("paged_adamw_8bit", "adamw_torch"))
    assert adam8.lora_gib < adam32.lora_gib
    assert adam32.lora_gib == pytest.approx(adam32.lora_params * 16 / 2**30)


def test_logits_scale_with_the_vocabulary():
    t4 = load_recipe("t4-16gb")
    llama = estimate_vram(t4, LLAMA_31_8B)
    assert llama.logits_gib == pytest.approx(t4.grpo.max_completion_length * 128256 * 8 / 2**30)
    assert estimate_vram(t4, SMOLLM2_135M).logits_gib < llama.logits_gib


def test_vllm_share_counts_the_weights_once_unless_trl_loads_a_second_copy():
    shared = estimate_vram(load_recipe("t4-16gb"))
    separate = estimate_vram(load_recipe("t4-16gb", backend="transformers"))  # TRL's own colocated vLLM
    assert shared.vllm_share_gib == pytest.approx(0.6 * 14.7)
    assert shared.vllm_gib == pytest.approx(shared.vllm_share_gib - shared.weights_gib)
    assert separate.total_gib == pytest.approx(shared.total_gib + shared.weights_gib)
    assert not separate.fits()  # no room for a second copy on a T4
    assert estimate_vram(load_recipe("t4-16gb", use_vllm=False)).vllm_gib == 0


def test_vllm_server_mode_frees_the_training_card():
    colocated = estimate_vram(load_recipe("a100-80gb"))
    server = estimate_vram(load_recipe("a100-80gb", vllm_mode="server"))
    assert colocated.vllm_gib > 0 and server.vllm_gib == 0
    assert server.total_gib == pytest.approx(colocated.total_gib - colocated.vllm_gib - VLLM_OVERHEAD_GIB, abs=0.01)


def test_the_cpu_recipe_is_planned_as_ram():
    estimate = estimate_vram(load_recipe("cpu"))
    assert estimate.weight_bits == 32 and estimate.overhead_gib == 0 and estimate.vllm_gib == 0
    assert estimate.model == "SmolLM2-135M"


def test_estimate_format_and_fits():
    estimate = estimate_vram(load_recipe("t4-16gb"))
    text = estimate.format()
    assert f"{estimate.total_gib:6.2f}" in text and "fits in 14.7 GiB" in text
    no_vllm = estimate_vram(load_recipe("t4-16gb", use_vllm=False))  # (vLLM's share grows with the card)
    assert (
        estimate.fits()
        and not estimate_vram(load_recipe("t4-16gb", use_vllm=False), card_gb=no_vllm.total_gib - 0.01).fits()
    )
    parts = ("weights_gib", "lora_gib", "activations_gib", "logits_gib", "vllm_gib", "overhead_gib")
    assert estimate.total_gib == pytest.approx(sum(getattr(estimate, p) for p in parts))


def test_an_unknown_model_is_explained():
    with pytest.raises(GrpoKitError, match="from_config"):
        estimate_vram(load_recipe("t4-16gb", model_name_or_path="someone/unknown-7b"))


# ------------------------------------------------------------------------------------------------ check_device


def _warnings_of(recipe, device) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_device(recipe, device)
    return [str(w.message) for w in caught]


def test_check_device_is_quiet_when_it_fits():
    assert _warnings_of(load_recipe("t4-16gb"), T4) == []
    assert _warnings_of(load_recipe("cpu"), CPU) == []
    assert _warnings_of(load_recipe("t4-16gb", model_name_or_path="someone/unknown-7b"), T4) == []  # nothing to check


@pytest.mark.parametrize("name, setting", [("t4-16gb", "vLLM"), ("a100-80gb", "bf16"), ("cpu", "fp16")])
def test_gpu_only_settings_on_a_cpu_are_refused_with_the_fix(name, setting):
    recipe = load_recipe(name, fp16=True, bf16=False) if setting == "fp16" else load_recipe(name)
    with pytest.raises(GrpoKitError, match="--preset cpu") as caught:
        check_device(recipe, CPU)
    assert setting in str(caught.value)


def test_4bit_weights_run_on_a_cpu():  # bitsandbytes' CPU backend (tests/test_4bit.py trains with it)
    check_device(load_recipe("cpu-4bit"), CPU)
    check_device(load_recipe("cpu", load_in_4bit=True), CPU)


def test_bf16_on_a_gpu_without_bf16_is_refused_with_the_fix():
    with pytest.raises(GrpoKitError, match="Tesla T4 has no bf16.*fp16=true.*t4-16gb"):
        check_device(load_recipe("l4-24gb"), T4)
    fixed = load_recipe("l4-24gb").replace(bf16=False, fp16=True)  # the fix the message names is accepted
    assert not any("bf16" in w for w in _warnings_of(fixed, DeviceInfo("cuda", "V100", 31.7, False)))


def test_too_little_memory_warns_with_the_fixes():
    (message,) = _warnings_of(load_recipe("a100-80gb"), DeviceInfo("cuda", "RTX 3070", 7.8, True))
    assert message.startswith("VRAM planner:") and "needs about" in message and "RTX 3070 has 7.8 GiB" in message
    for fix in ("smaller preset", "max_completion_length", "vllm_gpu_memory_utilization", "4-bit"):
        assert fix in message
    (starved,) = _warnings_of(load_recipe("t4-16gb", vllm_gpu_memory_utilization=0.35), T4)
    assert "KV cache" in starved
    # A share too small for the KV cache is the server's business in server mode, not this card's.
    assert (
        _warnings_of(
            load_recipe(
                "t4-16gb",
                vllm_gpu_memory_utilization=0.35,
                vllm_mode="server",
                load_in_4bit=False,
                model_name_or_path="unsloth/Qwen2.5-1.5B-Instruct",
            ),
            T4,
        )
        == []
    )


# ------------------------------------------------------------------------------------------------ auto_recipe


@pytest.mark.parametrize(
    "device, expected",
    [
        (CPU, "cpu"),
        (DeviceInfo("cuda", "NVIDIA GeForce RTX 4060", 7.75, True), "rtx-8gb"),
        (DeviceInfo("cuda", "NVIDIA GeForce RTX 3060", 11.76, True), "rtx-12gb"),
        (DeviceInfo("cuda", "NVIDIA GeForce RTX 4080", 15.7, True), "rtx-12gb"),  # 16 GB with bf16: not the fp16 T4's
        (DeviceInfo("cuda", "Tesla T4", 14.74, False), "t4-16gb"),
        (DeviceInfo("cuda", "Quadro RTX 5000", 15.7, False), "t4-16gb"),  # no bf16: never a bf16 consumer tier
        (DeviceInfo("cuda", "NVIDIA L4", 22.0, True), "l4-24gb"),
        (DeviceInfo("cuda", "Tesla V100-SXM2-32GB", 31.7, False), "t4-16gb"),  # 32 GiB but no bf16: the fp16 tier
        (DeviceInfo("cuda", "NVIDIA A100-SXM4-40GB", 39.4, True), "a100-40gb"),
        (DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", 79.1, True), "a100-80gb"),
    ],
)
def test_auto_recipe_picks_the_largest_tier_the_card_runs_as_shipped(device, expected):
    name, why = auto_recipe(device)
    assert name == expected and "\n" not in why
    recipe = load_recipe(name)
    check_device(recipe, device)  # what it picks is never refused on that device
    if device.kind == "cuda":
        assert estimate_vram(recipe, card_gb=device.vram_gb).fits()


def test_a_card_below_every_tier_is_told_which_smaller_model_to_use():
    name, why = auto_recipe(DeviceInfo("cuda", "GeForce GTX 1660 Ti", 5.8, False))  # no bf16: the T4's fp16 tier
    assert name == "t4-16gb" and "model_name_or_path=unsloth/Qwen2.5-1.5B-Instruct-bnb-4bit" in why
    smaller = load_recipe(name, model_name_or_path="unsloth/Qwen2.5-1.5B-Instruct-bnb-4bit")
    assert estimate_vram(smaller, card_gb=5.8).total_gib < estimate_vram(load_recipe(name), card_gb=5.8).total_gib


def test_a_bf16_card_below_the_8gb_tier_gets_its_small_model_and_the_plan_for_the_card():
    laptop = DeviceInfo("cuda", "RTX 3060 Laptop", 5.8, True)
    name, why = auto_recipe(laptop)
    plan = estimate_vram(load_recipe(name), card_gb=laptop.vram_gb)
    assert name == "rtx-8gb" and f"its 1.5B model plans ~{plan.total_gib:.1f} GiB here" in why and plan.fits()


# ------------------------------------------------------------------------------------------------ grpo-kit presets


def _presets(capsys, **args) -> str:
    assert cli_presets(SimpleNamespace(**{"plan": None, **args})) == 0
    return capsys.readouterr().out


def test_presets_table_lists_every_recipe_with_its_plan(capsys):
    from grpo_kit.config import recipe_names

    lines = _presets(capsys).splitlines()
    for name in recipe_names():
        row = next(line for line in lines if line.split()[0] == name)
        assert row.split()[-1] == f"{estimate_vram(load_recipe(name)).total_gib:.1f}"


def test_presets_plan(capsys):
    out = _presets(capsys, plan="t4-16gb")
    assert out.startswith("t4-16gb: ") and "VRAM plan for Llama-3.1-8B" in out and "fits in 14.7 GiB" in out


def test_presets_into_a_closed_pipe_has_no_traceback():
    """`grpo-kit presets | head -1`: the reader is gone before the table is written."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write now fails with EPIPE (Python ignores SIGPIPE, so BrokenPipeError)
    proc = subprocess.run(
        [sys.executable, "-m", "grpo_kit", "presets"], stdout=write_end, stderr=subprocess.PIPE, text=True, timeout=120
    )
    os.close(write_end)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr
