"""The VRAM planner: known shapes, monotonic in what should cost memory, and from_config on real configs."""

from __future__ import annotations

import json

import pytest

from grpo_kit.errors import GrpoKitError
from grpo_kit.machinery.embedded import EMBEDDED_ID
from grpo_kit.machinery.planner import (
    KNOWN_SHAPES,
    LLAMA_31_8B,
    QWEN25_15B,
    QWEN25_MATH_7B,
    SMOLLM2_135M,
    VLLM_OVERHEAD_GIB,
    ModelShape,
    check_fits,
    estimate_vram,
    estimate_vram_for,
    lora_param_count,
    shape_for,
)
from grpo_kit.machinery.runtime import DeviceInfo
from grpo_kit.recipes import load_recipe

T4 = DeviceInfo("cuda", "Tesla T4", 14.7, False)


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


@pytest.mark.parametrize("shape", KNOWN_SHAPES.values(), ids=list(KNOWN_SHAPES))
def test_known_shapes_agree_with_their_published_parameter_counts(shape):
    counted = ModelShape.from_config(_as_config(shape)).params
    assert counted == pytest.approx(shape.params, rel=0.01)  # Qwen2's q/k/v biases are the only difference


def test_known_shapes_match_model_ids():
    assert shape_for("unsloth/Meta-Llama-3.1-8B-Instruct-bnb-4bit") is LLAMA_31_8B
    assert shape_for("unsloth/Meta-Llama-3.1-8B-Instruct") is LLAMA_31_8B
    assert shape_for("unsloth/Qwen2.5-Math-7B-Instruct-bnb-4bit") is QWEN25_MATH_7B
    assert shape_for("unsloth/Qwen2.5-1.5B-Instruct") is QWEN25_15B
    assert shape_for(EMBEDDED_ID) is SMOLLM2_135M
    assert shape_for("HuggingFaceTB/SmolLM2-135M-Instruct") is SMOLLM2_135M
    assert shape_for("someone/unknown-7b") is None


def test_shape_for_reads_a_local_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(_as_config(QWEN25_15B)))
    assert shape_for(str(tmp_path)).hidden == QWEN25_15B.hidden


def test_from_config_counts_a_real_llama_exactly():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=500, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    shape = ModelShape.from_config(config)
    assert (shape.layers, shape.hidden, shape.intermediate, shape.heads, shape.kv_heads, shape.vocab) == (
        3, 64, 96, 4, 2, 500,
    )  # fmt: skip
    assert shape.params == sum(p.numel() for p in LlamaForCausalLM(config).parameters())


def test_from_config_on_a_tied_qwen2_config():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=400, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    shape = ModelShape.from_config(config)
    assert shape.tied_embeddings and shape.kv_dim == 24
    real = sum(p.numel() for p in Qwen2ForCausalLM(config).parameters())
    assert shape.params == pytest.approx(real, rel=0.01)


def test_from_config_without_a_shape_is_explained():
    with pytest.raises(GrpoKitError, match="hidden_size"):
        ModelShape.from_config({"model_type": "bert"})


def test_lora_count_matches_peft():
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    torch.manual_seed(0)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=8, target_modules=list(targets)))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert lora_param_count(ModelShape.from_config(config), 8, targets) == trainable


def test_weights_shrink_with_bits():
    common = dict(card_gib=80, per_device_batch=1, prompt_tokens=256, completion_tokens=256, lora_rank=16)
    w4, w16, w32 = (estimate_vram_for(LLAMA_31_8B, bits=b, **common).weights_gib for b in (4, 16, 32))
    assert w4 < w16 < w32
    assert w16 == pytest.approx(LLAMA_31_8B.params * 2 / 2**30)
    assert 5.0 < w4 < 5.8  # Unsloth's bnb-4bit Llama-3.1-8B checkpoint is 5.7 GB on disk
    with pytest.raises(GrpoKitError):
        estimate_vram_for(LLAMA_31_8B, bits=8, **common)


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
    with_ckpt, without = (estimate_vram(t4.with_overrides(gradient_checkpointing=g)) for g in (True, False))
    assert with_ckpt.activations_gib < without.activations_gib / 5
    adam8, adam32 = (estimate_vram(t4.with_overrides(optim=o)) for o in ("paged_adamw_8bit", "adamw_torch"))
    assert adam8.lora_gib < adam32.lora_gib
    assert adam32.lora_gib == pytest.approx(adam32.lora_params * 16 / 2**30)


def test_logits_scale_with_the_vocabulary():
    common = dict(bits=4, card_gib=15, per_device_batch=1, prompt_tokens=256, completion_tokens=512, lora_rank=16)
    llama = estimate_vram_for(LLAMA_31_8B, **common)
    assert llama.logits_gib == pytest.approx(512 * 128256 * 8 / 2**30)
    assert estimate_vram_for(SMOLLM2_135M, **common).logits_gib < llama.logits_gib


def test_vllm_share_counts_the_weights_once_unless_told_otherwise():
    t4 = load_recipe("t4-16gb")
    shared = estimate_vram(t4)
    separate = estimate_vram(t4, shared_weights=False)
    assert shared.vllm_share_gib == pytest.approx(0.6 * 14.7)
    assert shared.vllm_gib == pytest.approx(shared.vllm_share_gib - shared.weights_gib)
    assert separate.total_gib == pytest.approx(shared.total_gib + shared.weights_gib)
    assert not separate.fits()  # TRL's own colocated vLLM would load a second copy: no room on a T4
    assert estimate_vram(t4.with_overrides(use_vllm=False)).vllm_gib == 0


def test_estimate_format_and_fits():
    estimate = estimate_vram(load_recipe("t4-16gb"))
    text = estimate.format()
    assert "total" in text and f"{estimate.total_gib:6.2f}" in text and "fits in 14.7 GiB" in text
    assert estimate.fits() and estimate.fits(14.7) and not estimate.fits(estimate.total_gib - 0.01)
    assert estimate.total_gib == pytest.approx(
        estimate.weights_gib + estimate.lora_gib + estimate.activations_gib + estimate.logits_gib
        + estimate.vllm_gib + estimate.overhead_gib
    )  # fmt: skip


def test_unknown_model_and_unknown_target_are_explained():
    with pytest.raises(GrpoKitError, match="from_config"):
        estimate_vram(load_recipe("t4-16gb", model="someone/unknown-7b"))
    with pytest.raises(GrpoKitError, match="LoRA target"):
        lora_param_count(LLAMA_31_8B, 8, ("qkv_proj",))


def test_check_fits_is_quiet_when_it_fits():
    assert check_fits(load_recipe("t4-16gb"), T4) is None
    assert check_fits(load_recipe("cpu"), DeviceInfo("cpu", "cpu", 0.0, False)) is None
    assert check_fits(load_recipe("t4-16gb", model="someone/unknown-7b"), T4) is None  # nothing to check against


def test_check_fits_says_what_to_do():
    message = check_fits(load_recipe("a100-80gb"), T4)
    assert message and "Tesla T4" in message
    for fix in ("smaller preset", "max_completion_length", "generations", "vllm_gpu_memory_utilization"):
        assert fix in message
    starved = check_fits(load_recipe("t4-16gb", vllm_gpu_memory_utilization=0.35), T4)
    assert starved and "KV cache" in starved
    no_gpu = check_fits(load_recipe("t4-16gb"), DeviceInfo("cpu", "cpu", 0.0, False))
    assert no_gpu and "--preset cpu" in no_gpu


def test_vllm_server_mode_frees_the_training_card():
    colocated = estimate_vram(load_recipe("a100-80gb"))
    server = estimate_vram(load_recipe("a100-80gb", vllm_mode="server"))
    assert colocated.vllm_gib > 0 and server.vllm_gib == 0
    assert server.total_gib == pytest.approx(colocated.total_gib - colocated.vllm_gib - VLLM_OVERHEAD_GIB, abs=0.01)
    # A share too small for the KV cache is the server's business then, not this card's.
    starved = load_recipe("t4-16gb", vllm_gpu_memory_utilization=0.35)
    assert "KV cache" in check_fits(starved, T4)
    assert check_fits(starved.with_overrides(vllm_mode="server"), T4) is None


def test_transformers_backend_counts_a_second_copy_of_the_weights_for_vllm():
    unsloth = estimate_vram(load_recipe("a100-80gb"))
    plain = estimate_vram(load_recipe("a100-80gb", backend="transformers"))
    assert plain.vllm_gib == pytest.approx(unsloth.vllm_gib + unsloth.weights_gib, abs=0.01)
