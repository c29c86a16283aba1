"""The 4-bit half of the GPU path, run for real on a CPU: bitsandbytes' NF4 kernels (no stand-in), the embedded
model's pre-quantized copy, GRPO on 4-bit weights, and exports of the adapter it trained."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes", reason="the cpu extra installs bitsandbytes")

LENGTH_REWARD = """
def longer(completions, **kwargs):  # varies within every group, so a single step moves the LoRA
    return [len(c[0]["content"] if isinstance(c, list) else c) / 40 for c in completions]
"""


@pytest.fixture(scope="module")
def nf4_dir(embedded_dir):
    from grpo_kit.embedded import EMBEDDED_4BIT_ID
    from grpo_kit.models import resolve_model_id

    return Path(resolve_model_id(EMBEDDED_4BIT_ID))


def projections(model):
    """The q and down projections' own layers (under PEFT: each LoRA wrapper's ``base_layer``)."""
    named = model.named_modules()
    return [getattr(m, "base_layer", m) for name, m in named if name.endswith(("q_proj", "down_proj"))]


def test_the_pre_quantized_copy_keeps_its_stored_config_and_the_kit_computes_in_the_runs_dtype(nf4_dir):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from grpo_kit.models import load_inference_model

    stored = json.loads((nf4_dir / "config.json").read_text())["quantization_config"]
    assert stored["bnb_4bit_quant_type"] == "nf4" and stored["bnb_4bit_compute_dtype"] == "bfloat16"
    # What transformers does with a pre-quantized checkpoint (Unsloth's -bnb-4bit ids): the stored config wins over
    # the one passed in, compute dtype included
    asked = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(nf4_dir, quantization_config=asked, dtype=torch.float32)
    assert {m.compute_dtype for m in projections(plain)} == {torch.bfloat16}
    model, _ = load_inference_model(str(nf4_dir))
    layers = projections(model)
    assert len(layers) == 60 and all(isinstance(m, bnb.nn.Linear4bit) for m in layers)
    assert {m.compute_dtype for m in layers} == {torch.float32}  # the kit's run dtype on a CPU


@pytest.mark.slow
def test_a_4bit_grpo_step_trains_the_lora_on_linear4bit_layers_and_its_exports_verify(nf4_dir, tmp_path, monkeypatch):
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    from grpo_kit.config import load_recipe
    from grpo_kit.export import export
    from grpo_kit.train import train

    (tmp_path / "length_reward.py").write_text(LENGTH_REWARD)
    monkeypatch.chdir(tmp_path)
    seen = {}

    class Look(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kwargs):
            seen["layers"] = projections(model)

    recipe = load_recipe(
        "cpu-4bit",
        max_steps=1,
        save_steps=1,
        max_completion_length=16,
        num_generations=4,
        per_device_train_batch_size=4,
        few_shot=0,
        reward_funcs=["length_reward:longer"],
        reward_weights=[1.0],
    )
    result = train(recipe, data="arithmetic", output_dir=tmp_path / "run", callbacks=(Look(),))
    assert result.steps == 1
    assert len(seen["layers"]) == 60 and all(isinstance(m, bnb.nn.Linear4bit) for m in seen["layers"])
    assert {m.compute_dtype for m in seen["layers"]} == {torch.float32}
    lora_b = [w for k, w in load_file(result.adapter_dir / "adapter_model.safetensors").items() if "lora_B" in k]
    assert max(w.abs().max().item() for w in lora_b) > 0  # one step on 4-bit weights moved the adapter

    # The adapter alone keeps the NF4 base it was trained on ...
    (lora,) = export(result.adapter_dir, ("lora",), out_dir=tmp_path / "exports", name="adapter")
    assert (
        lora.lora_effect > 0
        and json.loads((lora.path.parent / "export.json").read_text())["base_model"] == "embedded:smollm2-135m-bnb-4bit"
    )
    # ... merged16 merges it into the 16-bit original (PEFT's merge into Linear4bit would re-quantize it)
    (merged,) = export(result.adapter_dir, ("merged16",), out_dir=tmp_path / "exports", name="merged")
    config = json.loads((merged.path / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16" and merged.lora_effect > 0
    assert json.loads((merged.path.parent / "export.json").read_text())["base_model"] == "embedded:smollm2-135m"


def test_4bit_without_bitsandbytes_is_one_line_naming_the_package(monkeypatch, tmp_path, capsys):
    import transformers.quantizers.quantizer_bnb_4bit as quantizer

    from grpo_kit.cli import main

    monkeypatch.setattr(quantizer, "is_bitsandbytes_available", lambda: False)  # as on a machine without it
    assert main(["train", "--preset", "cpu-4bit", "--data", "sample", "--output", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "requires bitsandbytes" in err and "pip install" in err and "Traceback" not in err
