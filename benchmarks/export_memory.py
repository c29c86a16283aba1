"""Host memory of the export's weight check on Llama-3.1-8B's largest tensors: does it fit next to a free Colab's RAM?

Writes, in a temporary folder, a base with the 8B's 128256 x 4096 embedding and one 14336 x 4096 MLP weight (random,
bfloat16), a rank-32 LoRA on that MLP weight, and their correct merge (bfloat16); then, in a fresh process, runs the
kit's check (``grpo_kit.verify.check_weights``, as ``grpo-kit export --format merged16`` does) and prints its time and
peak resident memory. The last line is ``peak_rss_over_baseline_gib=X``: the process's peak RSS minus its RSS just
before the check (the imports). A free Colab VM has ~12.7 GB of RAM in all.

    .venv/bin/python benchmarks/export_memory.py
    .venv/bin/python benchmarks/export_memory.py --layers 2   # a whole export instead (below)

``--layers N``: a model of Llama-3.1-8B's shapes with N of its 32 decoder layers (the real vocabulary, random
weights, saved in bfloat16) and a random rank-32 LoRA on every projection, exported as ``lora,merged16`` through
``grpo_kit.export.export`` on the CPU (PEFT's float32 merge, then the check): disk written, peak RSS, time, and the
per-layer figures scaled to 32 layers.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GIB = 2**30
EMBEDDING = (128256, 4096)  # Llama-3.1-8B: vocabulary x hidden
MLP = (14336, 4096)  # Llama-3.1-8B: up_proj, intermediate x hidden
RANK = 32


def write_models(root: Path) -> None:
    """base/, adapter/ and merged/ under ``root`` (about 2.2 GB of files)."""
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    names = {"embed": "model.embed_tokens.weight", "mlp": "model.layers.0.mlp.up_proj.weight"}
    base = {
        names["embed"]: (torch.randn(EMBEDDING) * 0.02).to(torch.bfloat16),
        names["mlp"]: (torch.randn(MLP) * 0.02).to(torch.bfloat16),
    }
    lora_a, lora_b = torch.randn(RANK, MLP[1]) * 0.01, torch.randn(MLP[0], RANK) * 0.01
    prefix = "base_model.model.model.layers.0.mlp.up_proj"
    for folder in ("base", "adapter", "merged"):
        (root / folder).mkdir()
    save_file(base, str(root / "base" / "model.safetensors"), metadata={"format": "pt"})
    save_file(
        {f"{prefix}.lora_A.weight": lora_a, f"{prefix}.lora_B.weight": lora_b},
        str(root / "adapter" / "adapter_model.safetensors"),
        metadata={"format": "pt"},
    )
    (root / "adapter" / "adapter_config.json").write_text(
        json.dumps({"r": RANK, "lora_alpha": RANK, "target_modules": ["up_proj"], "peft_type": "LORA"})
    )
    merged = dict(base)
    merged[names["mlp"]] = (base[names["mlp"]].float() + lora_b @ lora_a).to(torch.bfloat16)  # alpha / r = 1
    save_file(merged, str(root / "merged" / "model.safetensors"), metadata={"format": "pt"})


def memory_gib(field: str) -> float:
    """``VmRSS`` (now) or ``VmHWM`` (the peak) of this process from /proc, in GiB. Not ``ru_maxrss``: a child
    process starts with its parent's at the fork, and the parent held the tensors it wrote."""
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith(f"{field}:"))
    return kib / 2**20


def check(root: Path) -> None:
    """In its own process: the check, its time and its peak RSS over the RSS before it."""
    from grpo_kit.verify import check_weights

    baseline = memory_gib("VmRSS")
    start = time.perf_counter()
    result = check_weights("merged16", root / "merged", root / "base", root / "adapter", "bfloat16")
    peak = memory_gib("VmHWM")
    print(
        f"check: {result.detail}; max |d| {result.max_abs_diff:.2e} <= {result.tolerance:.2e}; LoRA effect "
        f"{result.lora_effect:.2e}; {time.perf_counter() - start:.1f} s"
    )
    print(f"rss before the check {baseline:.2f} GiB, peak {peak:.2f} GiB")
    print(f"peak_rss_over_baseline_gib={peak - baseline:.2f}")


def write_layers(root: Path, layers: int) -> None:
    """root/base (Llama-3.1-8B's shapes, ``layers`` decoder layers, bfloat16, the embedded model's tokenizer) and
    root/run/adapter (a rank-32 LoRA on every projection, B random so the merge changes the weights)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from grpo_kit.embedded import embedded_model_path

    config = LlamaConfig(
        vocab_size=EMBEDDING[0],
        hidden_size=EMBEDDING[1],
        intermediate_size=MLP[0],
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.02)
    model.save_pretrained(root / "base")
    AutoTokenizer.from_pretrained(embedded_model_path()).save_pretrained(root / "base")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft = get_peft_model(model, LoraConfig(r=RANK, lora_alpha=RANK, target_modules=targets))
    for name, param in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.01)
    peft.save_pretrained(root / "run" / "adapter")
    (root / "run" / "run.json").write_text(json.dumps({"recipe": {"model_name_or_path": str(root / "base")}}))


def export_whole(root: Path, layers: int) -> None:
    """In its own process: ``export(lora, merged16)``, its disk, peak RSS and time, and 32 layers by scaling."""
    from grpo_kit.export import export

    baseline, start = memory_gib("VmRSS"), time.perf_counter()
    export(root / "run" / "adapter", ("lora", "merged16"), out_dir=root / "exports", name="x")
    seconds, peak = time.perf_counter() - start, memory_gib("VmHWM")
    written = {
        f.name: sum(p.stat().st_size for p in f.rglob("*") if p.is_file())
        for f in (root / "exports" / "x").iterdir()
        if f.is_dir()
    }
    sizes = ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in written.items())
    print(
        f"{layers} layers: export lora,merged16 in {seconds:.0f} s; written {sizes}; "
        f"peak RSS {peak:.2f} GiB ({peak - baseline:.2f} over the {baseline:.2f} before)"
    )


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--check":
        check(Path(sys.argv[2]))
        return 0
    if len(sys.argv) == 4 and sys.argv[1] == "--export":
        export_whole(Path(sys.argv[2]), int(sys.argv[3]))
        return 0
    if len(sys.argv) == 3 and sys.argv[1] == "--layers":
        with tempfile.TemporaryDirectory() as tmp:
            write_layers(Path(tmp), int(sys.argv[2]))
            return subprocess.run([sys.executable, __file__, "--export", tmp, sys.argv[2]]).returncode
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        write_models(Path(tmp))
        print(
            f"wrote the 8B-shaped embedding {EMBEDDING} and MLP weight {MLP} (bfloat16), a rank-{RANK} LoRA and "
            f"their merge in {time.perf_counter() - start:.0f} s"
        )
        return subprocess.run([sys.executable, __file__, "--check", tmp]).returncode


if __name__ == "__main__":
    sys.exit(main())
