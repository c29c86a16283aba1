"""Checking a merged16 or GGUF export weight by weight, for bases too large to load for the logit check.

On a T4 or L4 a 7-8B model fits in GPU memory only in 4 bit, so base+adapter cannot be loaded in 16 bit to compare
logits (``grpo_kit.machinery.export_checks``). There, Unsloth's savers write merged16 and GGUF layer by layer from the
16-bit base shards, and this module checks what they wrote one tensor at a time, never holding more than one
tensor of each file in memory:

- **merged16**: every tensor of the base checkpoint is present with its shape; a tensor the LoRA targets equals
  ``W + scale * B @ A`` (computed here in float32 from the base shard and the adapter) within the storage dtype's
  rounding, and sits closer to it than to ``W`` whenever the LoRA's change is larger than that rounding; every
  other tensor equals the base's.
- **GGUF**: the token embedding, the final norm and every tensor of the first and the last block are dequantized
  (gguf-py) and compared the same way (llama's q/k rows permuted as llama.cpp stores them).

Limits are relative to the tensor's largest ``|value|`` (``WEIGHT_TOLERANCES``). What is compared is written into
the result's ``detail``: weights, not logits, so a wrong tokenizer or chat template would not show here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

from grpo_kit.errors import GrpoKitError
from grpo_kit.machinery.export_checks import MIN_EFFECT_TO_NOISE, ExportResult

#: Largest allowed ``max |export - expected|`` as a fraction of ``max |expected|`` per tensor. 16-bit storage rounds
#: each value by at most 2^-8 (bf16) / 2^-11 (fp16) of itself; q8_0 by 1/254 of its 32-value block's max. The k-quant
#: bounds follow from their 4-/5-bit grids (1/30, 1/62 of a block's range) with room for the 6-bit block scales;
#: they are NOT measured (the k-quants come from llama.cpp on a GPU).
WEIGHT_TOLERANCES = {
    "float32": 1e-6,
    "bfloat16": 2**-7,
    "float16": 2**-9,
    "gguf:f32": 1e-6,
    "gguf:f16": 2**-7,
    "gguf:q8_0": 0.02,
    "gguf:q5_k_m": 0.08,
    "gguf:q4_k_m": 0.15,
}


def base_too_big_for_gpu(base_path: str) -> Path | None:
    """The local folder of the 16-bit base when it is too large to load twice over for the logit check on this
    GPU (weights x 1.2 > free memory); None on CPU or when it fits. A Hub id is downloaded first (the merge needs
    its shards anyway, and the Hub cache keeps one copy)."""
    import torch

    if not torch.cuda.is_available():
        return None
    import importlib.util

    folder = local_base(base_path)  # pragma: no cover - UNTESTED ON A GPU from here
    size, free = sum(p.stat().st_size for p in folder.glob("*.safetensors")), torch.cuda.mem_get_info()[0]
    if size * 1.2 <= free:
        return None
    if importlib.util.find_spec("unsloth") is None:
        raise GrpoKitError(
            f"The 16-bit base {base_path} ({size / 2**30:.1f} GiB) does not fit in this GPU's free memory "
            f"({free / 2**30:.1f} GiB), and without Unsloth it cannot be merged shard by shard. Install Unsloth "
            "(`pip install unsloth`, as the Colab notebook does), or export --format lora."
        )
    return folder


def local_base(base_path: str) -> Path:
    """``base_path`` itself when it is a folder, else its Hub snapshot (config, tokenizer, safetensors only)."""
    if Path(base_path).is_dir():
        return Path(base_path)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(base_path, allow_patterns=["*.json", "*.safetensors", "tokenizer*"]))


def place_and_check(written: dict, staging: Path, name: str, base_dir: Path, adapter_dir: Path, tokenizer) -> list:
    """Move Unsloth's merged16 folder and GGUF files (``{kind: (paths, dtype)}``) into ``staging`` and check each."""
    import shutil

    from grpo_kit.machinery.gguf_export import write_modelfile
    from grpo_kit.machinery.unsloth_gguf import move_gguf_files

    results, files = [], []
    for kind, (found, _) in written.items():
        if kind == "merged16":
            folder = Path(shutil.move(str(found[0]), staging / "merged16"))
            results.append(check_merged_weights(folder, base_dir, adapter_dir, storage_dtype(folder)))
        else:
            files.append(move_gguf_files(found, staging / "gguf", f"{name}-{kind}")[0])
            results.append(check_gguf_weights(files[-1], base_dir, adapter_dir, kind))
    if files:
        write_modelfile(staging / "gguf", files, tokenizer)
    return results


def tensor_files(folder: Path) -> dict[str, Path]:
    """``{tensor name: safetensors file}`` of a checkpoint folder (sharded or not)."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return {name: folder / file for name, file in weight_map.items()}
    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            found.update({name: path for name in handle.keys()})
    if not found:
        raise GrpoKitError(f"{folder} holds no .safetensors weights to compare.")
    return found


def storage_dtype(folder: Path) -> str:
    """The least precise float dtype among a checkpoint's tensors (``"bfloat16"``, ``"float16"`` or ``"float32"``)."""
    from safetensors import safe_open

    names = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
    found = set()
    for path in set(tensor_files(folder).values()):
        with safe_open(str(path), framework="pt") as handle:
            found |= {names.get(handle.get_slice(key).get_dtype(), "float32") for key in handle.keys()}
    return max(found, key=WEIGHT_TOLERANCES.__getitem__)


def read_tensor(files: dict[str, Path], name: str):
    from safetensors import safe_open

    with safe_open(str(files[name]), framework="pt") as handle:
        return handle.get_tensor(name)


@dataclass(frozen=True)
class LoraDelta:
    """One module's LoRA change ``scale * B @ A``, kept as its rank-r factors until ``tensor()`` is asked for (the
    full deltas of an 8B model would not fit in a Colab's RAM at once)."""

    b: Any  # (out, r)
    a: Any  # (r, in)
    scale: float
    transposed: bool = False  # fan_in_fan_out layers store (in, out)

    @property
    def shape(self) -> tuple[int, int]:
        out, inp = self.b.shape[0], self.a.shape[1]
        return (inp, out) if self.transposed else (out, inp)

    def tensor(self):
        delta = self.scale * (self.b.float() @ self.a.float())  # (out, r) @ (r, in) -> (out, in)
        return delta.T if self.transposed else delta


def lora_deltas(adapter_dir: Path) -> dict[str, LoraDelta]:
    """``{base tensor name: LoraDelta}`` for each module the adapter changes."""
    from safetensors.torch import load_file

    config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    if config.get("use_dora") or config.get("rank_pattern") or config.get("alpha_pattern"):
        raise GrpoKitError("The weight check handles plain LoRA only (no DoRA, rank_pattern or alpha_pattern); "
                           "export on a GPU where the 16-bit base fits, or with --format lora.")
    rank, alpha = config["r"], config["lora_alpha"]
    scale = alpha / rank**0.5 if config.get("use_rslora") else alpha / rank
    weights = load_file(str(adapter_dir / "adapter_model.safetensors"))
    return {
        f"{key.split('.lora_A.')[0].removeprefix('base_model.model.')}.weight":
            LoraDelta(weights[key.replace(".lora_A.", ".lora_B.")], a, scale, bool(config.get("fan_in_fan_out")))
        for key, a in weights.items() if ".lora_A." in key
    }


class _Tally:
    """Running figures over the tensors compared; ``problems`` names the first few that failed."""

    def __init__(self, rtol: float):
        self.rtol, self.count, self.with_lora = rtol, 0, 0
        self.worst, self.effect, self.to_tuned, self.to_base = 0.0, 0.0, [], []
        self.problems: list[str] = []

    def add(self, name: str, got, expected, base=None, delta=None) -> None:
        import torch

        self.count += 1
        got, expected = got.float(), expected.float()
        if got.shape != expected.shape:
            self.problems.append(f"{name} has shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
            return
        if not bool(torch.isfinite(got).all()):
            self.problems.append(f"{name} contains NaN/inf")
            return
        error = float((got - expected).abs().max()) / max(float(expected.abs().max()), 1e-12)
        self.worst = max(self.worst, error)
        if not error <= self.rtol:
            self.problems.append(f"{name}: max |d| is {error:.3g} of its largest value (limit {self.rtol:.3g})")
        if delta is not None:
            self.with_lora += 1
            self.effect = max(self.effect, float(delta.abs().max()))
            self.to_tuned.append(float((got - expected).abs().mean()))
            self.to_base.append(float((got - base.float()).abs().mean()))
            if float(delta.abs().mean()) >= MIN_EFFECT_TO_NOISE * self.to_tuned[-1] and not self.to_tuned[-1] < self.to_base[-1]:
                self.problems.append(f"{name} is closer to the base weight than to base + LoRA: the LoRA is missing")

    def result(self, fmt: str, path: Path, detail: str) -> ExportResult:
        if self.problems:
            raise GrpoKitError(
                f"Export verification failed for {fmt} ({detail}): " + "; ".join(self.problems[:5]) + ". Nothing was "
                "written to the export folder. Keep the adapter (--format lora) and report the message."
            )
        note = "" if self.with_lora else f"{fmt}: no tensor the adapter changes was compared."
        return ExportResult(fmt, path, detail, self.worst, self.rtol, fmean(self.to_tuned or [0.0]), self.effect,
                            fmean(self.to_base or [0.0]), note)


def expected_tensors(base_dir: Path, adapter_dir: Path, names=None) -> Iterator[tuple[str, object, object, object]]:
    """``(name, expected, base, delta or None)`` for each base tensor (or each of ``names``), one at a time."""
    files, deltas = tensor_files(base_dir), lora_deltas(adapter_dir)
    missing = set(deltas) - set(files)
    if missing:
        raise GrpoKitError(f"The adapter changes {sorted(missing)[:3]}, which the base {base_dir} does not have: "
                           "is --model the base the adapter was trained on?")
    for name in names if names is not None else files:
        base = read_tensor(files, name)
        delta = deltas[name].tensor() if name in deltas else None
        yield name, base.float() + delta if delta is not None else base, base, delta


def check_merged_weights(folder: Path, base_dir: Path, adapter_dir: Path, dtype_name: str) -> ExportResult:
    """Every tensor of ``folder`` (merged16) against the base + LoRA; ``GrpoKitError`` on any mismatch."""
    merged = tensor_files(folder)
    tally = _Tally(WEIGHT_TOLERANCES[dtype_name])
    for name, expected, base, delta in expected_tensors(base_dir, adapter_dir):
        if name not in merged:
            if name != "lm_head.weight":  # a tied head may be left out; its embedding is compared
                tally.problems.append(f"{name} is missing")
            continue
        tally.add(name, read_tensor(merged, name), expected, base, delta)
    return tally.result("merged16", folder, f"{tally.count} tensors compared with base + LoRA, {tally.with_lora} "
                                            f"changed by it, {dtype_name} safetensors (weights, not logits)")


def check_gguf_weights(path: Path, base_dir: Path, adapter_dir: Path, gguf_type: str) -> ExportResult:
    """The embedding, final norm and first and last block of a GGUF file against the base + LoRA."""
    import gguf
    import torch

    from grpo_kit.machinery.gguf_export import permute_rotary

    config = json.loads((base_dir / "config.json").read_text(encoding="utf-8"))
    reader = gguf.GGUFReader(str(path))
    arch_name = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name), None)
    if arch is None:
        raise GrpoKitError(f"{path.name} declares architecture '{arch_name}', unknown to this gguf library.")
    last = config["num_hidden_layers"] - 1
    name_map = gguf.get_tensor_name_map(arch, config["num_hidden_layers"])
    stored = {t.name: t for t in reader.tensors}
    wanted = {}
    for hf_name in tensor_files(base_dir):
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        keep = gguf_name in {"token_embd.weight", "output_norm.weight"} or (gguf_name or "").startswith(
            ("blk.0.", f"blk.{last}."))
        if keep:
            wanted[hf_name] = gguf_name
    tally = _Tally(WEIGHT_TOLERANCES[f"gguf:{gguf_type}"])
    for name, expected, base, delta in expected_tensors(base_dir, adapter_dir, wanted):
        tensor = stored.get(wanted[name])
        if tensor is None:
            tally.problems.append(f"{wanted[name]} ({name}) is missing")
            continue
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if values.size != expected.numel():
            tally.problems.append(f"{wanted[name]} holds {values.size} values, {name} has {expected.numel()}")
            continue
        got = torch.from_numpy(values.copy()).reshape(expected.shape)
        if arch_name == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            expected, base = (torch.from_numpy(permute_rotary(t.float().numpy(), heads)) for t in (expected, base))
            delta = None if delta is None else torch.from_numpy(permute_rotary(delta.numpy(), heads))
        tally.add(name, got, expected, base, delta)
    return tally.result("gguf", path, f"GGUF {gguf_type}: embedding, final norm and blocks 0 and {last} "
                                      f"({tally.count} tensors, {tally.with_lora} changed by the LoRA) compared "
                                      "with base + LoRA (weights, not logits)")
