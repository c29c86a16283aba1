"""Worst per-tensor error of the weight-by-weight export checks on the embedded model, against their limits.

    .venv/bin/python benchmarks/export_weight_errors.py [--std 0.05]

A random LoRA (B ~ N(0, std), r=4, alpha=8, all projections) on the embedded SmolLM2-135M is merged with PEFT and
stored as bf16 and fp16 safetensors (checked with ``grpo_kit.verify.check_weights``), and each merged matrix is
rounded through GGUF's q8_0 (gguf-py's reference quantizer, llama.cpp's block format), whose worst error is printed
beside ``grpo_kit.gguf_files.WEIGHT_RTOL``'s limit.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--std", type=float, default=0.05)
    args = parser.parse_args()

    import gguf
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    from grpo_kit.embedded import embedded_model_path
    from grpo_kit.gguf_files import WEIGHT_RTOL
    from grpo_kit.verify import check_weights

    base = Path(embedded_model_path())
    work = Path(tempfile.mkdtemp(prefix="export-weights-"))
    torch.manual_seed(0)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base), LoraConfig(r=4, lora_alpha=8, target_modules=targets)
    )
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, args.std)
    lora.save_pretrained(work / "adapter")
    merged = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base), str(work / "adapter")
    ).merge_and_unload()
    worst = 0.0  # q8_0: max |d| / max |w| over the 2-D matrices (the ones q8_0 stores)
    for tensor in merged.state_dict().values():
        if tensor.ndim == 2 and tensor.shape[-1] % 32 == 0:
            w = tensor.float().numpy()
            back = gguf.quants.dequantize(
                gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0), gguf.GGMLQuantizationType.Q8_0
            )
            worst = max(worst, float(abs(back - w).max() / abs(w).max()))
    print(f"q8_0: worst max|d| / max|w| {worst:.4g} (limit {WEIGHT_RTOL['q8_0']:.4g})")
    for dtype in ("bfloat16", "float16"):
        copy.deepcopy(merged).to(getattr(torch, dtype)).save_pretrained(work / dtype)
        r = check_weights("merged16", work / dtype, base, work / "adapter", dtype)
        print(
            f"{r.detail}\n    worst max|d| {r.max_abs_diff:.4g} (that tensor's limit {r.tolerance:.4g}); mean |d| to "
            f"base+LoRA {r.mean_abs_diff:.2e} vs to base {r.mean_abs_diff_base:.2e}"
        )


if __name__ == "__main__":
    main()
