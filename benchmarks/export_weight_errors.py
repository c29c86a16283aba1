"""Worst per-tensor error of the weight-by-weight export checks on the embedded model, against their limits.

    .venv/bin/python benchmarks/export_weight_errors.py [--std 0.05]

A random LoRA (B ~ N(0, std), r=4, alpha=8, all projections) on the embedded SmolLM2-135M is merged with PEFT and
written as bf16 safetensors and as GGUF f16 / q8_0 (the CPU writer); each is checked with
``grpo_kit.export.check_weights``, and its worst ``max |d|`` is printed beside that tensor's limit.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--std", type=float, default=0.05)
    args = parser.parse_args()

    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_kit.export import check_weights
    from grpo_kit.gguf import write_gguf
    from grpo_kit.models import embedded_model_path

    base = Path(embedded_model_path())
    work = Path(tempfile.mkdtemp(prefix="export-weights-"))
    torch.manual_seed(0)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, args.std)
    lora.save_pretrained(work / "adapter")
    merged = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(work / "adapter")).merge_and_unload()
    tokenizer = AutoTokenizer.from_pretrained(base)
    results = []
    for gguf_type in ("f16", "q8_0"):
        path = write_gguf(merged, tokenizer, work / f"m-{gguf_type}.gguf", gguf_type)
        results.append(check_weights("gguf", path, base, work / "adapter", gguf_type))
    merged.to(torch.bfloat16).save_pretrained(work / "merged16")
    results.append(check_weights("merged16", work / "merged16", base, work / "adapter", "bfloat16"))
    for r in results:
        print(f"{r.detail}\n    worst max|d| {r.max_abs_diff:.4g} (that tensor's limit {r.tolerance:.4g}); mean |d| to "
              f"base+LoRA {r.mean_abs_diff:.2e} vs to base {r.mean_abs_diff_base:.2e}")


if __name__ == "__main__":
    main()
