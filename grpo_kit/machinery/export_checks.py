"""How ``grpo_kit.export`` proves an export: reload it the way a user would and compare its logits with base+adapter.

Before anything is written, base+adapter is loaded in float32 and its logits on a few fixed prompts are recorded,
with the adapter on ("tuned") and off ("base"). After writing, each export is loaded back (PEFT on a fresh base /
``AutoModelForCausalLM`` / transformers' GGUF reader) and must

1. match the tuned logits: ``max |Δ| <= atol + rtol * max |tuned logit|`` (``TOLERANCES``, per storage type), and
2. sit closer to the tuned model than to the base (mean ``|Δ|``), whenever the adapter's mean effect on the logits
   is at least ``MIN_EFFECT_TO_NOISE`` times the export's own storage noise (mean ``|Δ|`` to tuned). This is what
   catches "the merged model silently ignores the LoRA", even when a bf16/q8_0 rounding error is larger than the
   adapter's largest single change. Below that ratio the adapter is lost in the noise and a note says so.

A failed check raises ``GrpoKitError``. On CUDA (UNTESTED ON CPU) the reference is loaded in 16-bit and upcast to
float32 when it fits twice in GPU memory; otherwise the check runs in 16-bit with tolerances times
``HALF_PRECISION_FACTOR``. A base too large for the GPU in 16-bit is checked weight by weight instead
(``grpo_kit.machinery.export_weights``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_kit.errors import GrpoKitError

#: (atol, rtol) for ``max |Δlogit| <= atol + rtol * max |tuned logit|``, per storage type. Measured on SmolLM2-135M
#: (max logit 28-43): bf16 storage 0.21-0.27 (rtol 0.5-1 %), fp16 0.05 (0.2 %), GGUF f16 0.04-0.05 (0.1-0.2 %),
#: GGUF q8_0 1.0-1.7 (2.4-6 %); a reloaded LoRA is bit-identical. The limits leave a 2.5-10x margin on those.
#: The k-quants come only from Unsloth's llama.cpp (GPU) and were NOT measured: their limits come from the nearest types
#: gguf-py can write on CPU, on the embedded model (itself dequantized from Q4_1): Q4_0 38 % and Q4_1 13 % of the max
#: logit, Q5_0 16 %. llama.cpp's k-quants are more accurate than Q4_0/Q5_0 at the same width, so these are loose
#: bounds that still catch a broken file (wrong tensor order gives errors of the logit scale itself).
TOLERANCES = {
    "lora": (1e-4, 1e-5),
    "merged16:float32": (1e-4, 1e-5),
    "merged16:bfloat16": (1e-3, 0.03),
    "merged16:float16": (1e-3, 0.01),
    "gguf:f32": (1e-4, 1e-4),
    "gguf:f16": (1e-3, 0.01),
    "gguf:q8_0": (1e-2, 0.15),
    "gguf:q5_k_m": (1e-2, 0.3),
    "gguf:q4_k_m": (1e-2, 0.5),
}
#: The closer-to-tuned-than-to-base check runs when mean |tuned - base| >= this x mean |export - tuned|.
MIN_EFFECT_TO_NOISE = 0.25
#: Extra factor on the tolerances when the reference itself runs in 16-bit (large models on a GPU).
HALF_PRECISION_FACTOR = 3.0
PROBE_QUESTIONS = (
    "A baker makes 12 loaves in the morning and 15 in the afternoon. She sells 20. How many loaves are left?",
    "Tom reads 23 pages a day for 6 days. How many pages does he read?",
)
PROBE_PLAIN = "The sum of 17 and 25 is"


@dataclass(frozen=True)
class ExportResult:
    """One verified export. ``path`` is the folder (lora, merged16) or the ``.gguf`` file.

    ``max_abs_diff``: max |Δ logit| against the tuned float32 reference; ``tolerance``: the limit it had to meet;
    ``mean_abs_diff`` / ``mean_abs_diff_base``: mean |Δ logit| to the tuned model / to the base model;
    ``lora_effect``: max |Δ logit| between tuned and base on the same prompts (the size of what was verified).
    """

    format: str
    path: Path
    detail: str
    max_abs_diff: float
    tolerance: float
    mean_abs_diff: float
    lora_effect: float
    mean_abs_diff_base: float = float("nan")
    note: str = ""
    hub_url: str | None = None

    def to_dict(self, relative_to: Path | None = None) -> dict:
        out = dataclasses.asdict(self)
        out["path"] = str(self.path.relative_to(relative_to) if relative_to else self.path)
        return out

    def __str__(self) -> str:
        return (
            f"{self.format:<8} {self.path}  verified: max |dlogit| {self.max_abs_diff:.2e} <= {self.tolerance:.2e} "
            f"({self.detail}; LoRA effect {self.lora_effect:.2e})"
        )


@dataclass(frozen=True)
class Reference:
    """Float32 logits of base+adapter (``tuned``) and of the base alone, one ``(seq, vocab)`` tensor per prompt."""

    prompts: tuple[tuple[int, ...], ...]
    tuned: tuple
    base: tuple
    device: str = "cpu"
    dtype: str = "float32"

    @property
    def scale(self) -> float:
        return max(float(t.abs().max()) for t in self.tuned)

    @property
    def lora_effect(self) -> float:
        return max(float((t - b).abs().max()) for t, b in zip(self.tuned, self.base, strict=True))

    @property
    def mean_effect(self) -> float:
        return sum(float((t - b).abs().mean()) for t, b in zip(self.tuned, self.base, strict=True)) / len(self.tuned)


def probe_prompts(tokenizer) -> tuple[tuple[int, ...], ...]:
    """Token ids of the fixed verification prompts: chat-formatted questions (one with a ``<think>`` prefill) + plain text."""
    from grpo_kit.data import build_messages, render_prompt

    texts = []
    if getattr(tokenizer, "chat_template", None):
        texts.append(render_prompt(build_messages(PROBE_QUESTIONS[0]), tokenizer))
        texts.append(render_prompt(build_messages(PROBE_QUESTIONS[1]), tokenizer, "<think>\n"))
    else:
        texts += list(PROBE_QUESTIONS)
    texts.append(PROBE_PLAIN)
    return tuple(tuple(tokenizer(text)["input_ids"]) for text in texts)


def model_logits(model, prompts: Sequence[Sequence[int]]) -> tuple:
    """Float32 CPU logits ``(seq, vocab)`` of ``model`` for each prompt, run one prompt at a time (no padding)."""
    import torch

    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for ids in prompts:
            logits = model(input_ids=torch.tensor([list(ids)], device=device)).logits[0]
            out.append(logits.float().cpu())
    return tuple(out)


def all_finite(logits: Sequence) -> bool:
    """True when every tensor in ``logits`` is free of NaN and ±inf."""
    import torch

    return all(bool(torch.isfinite(t).all()) for t in logits)


def tolerance_for(key: str, reference: Reference) -> float:
    """The limit for ``key`` (a ``TOLERANCES`` key) given the reference's logit scale."""
    atol, rtol = TOLERANCES[key]
    factor = HALF_PRECISION_FACTOR if reference.dtype != "float32" else 1.0
    return factor * (atol + rtol * reference.scale)


def check_logits(fmt: str, key: str, candidate: Sequence, reference: Reference, *, path: Path, detail: str) -> ExportResult:
    """Compare an export's logits with the reference; ``GrpoKitError`` when it fails either check (module docstring).

    NaN compares false with everything, so each check passes only when its numbers are finite *and* within limits.
    """
    bad = [name for name, logits in (("the export", candidate), ("the reference (base+adapter)", reference.tuned),
                                     ("the base", reference.base)) if not all_finite(logits)]
    if bad:
        raise GrpoKitError(_verification_failed(fmt, detail, [f"the logits of {' and '.join(bad)} contain NaN/inf"]))
    diffs = [(c - t).abs() for c, t in zip(candidate, reference.tuned, strict=True)]
    max_abs = max(float(d.max()) for d in diffs)
    mean_tuned = sum(float(d.mean()) for d in diffs) / len(diffs)
    mean_base = sum(float((c - b).abs().mean()) for c, b in zip(candidate, reference.base, strict=True)) / len(diffs)
    limit = tolerance_for(key, reference)
    effect, mean_effect = reference.lora_effect, reference.mean_effect
    problems = []
    if not max_abs <= limit:
        problems.append(f"max |dlogit| {max_abs:.3g} exceeds the limit {limit:.3g}")
    note = ""
    if effect == 0.0:
        note = f"{fmt}: the adapter changes no logit at all (LoRA B weights still zero?); check that training ran."
    elif mean_effect >= MIN_EFFECT_TO_NOISE * mean_tuned:
        if not mean_tuned < mean_base:
            problems.append(
                f"it is closer to the base model than to base+adapter (mean |dlogit| {mean_tuned:.3g} vs {mean_base:.3g}): "
                "the LoRA weights are missing from it"
            )
    else:
        note = (f"{fmt}: the adapter's mean effect on the logits ({mean_effect:.3g}) is lost in this format's storage "
                f"noise ({mean_tuned:.3g}); the check cannot tell a merged LoRA from a missing one.")
    if problems:
        raise GrpoKitError(_verification_failed(fmt, detail, problems))
    return ExportResult(fmt, path, detail, max_abs, limit, mean_tuned, effect, mean_base, note)


def _verification_failed(fmt: str, detail: str, problems: list[str]) -> str:
    return (
        f"Export verification failed for {fmt} ({detail}): " + "; ".join(problems) + ". Nothing was written to the "
        "export folder. This is a bug in the export path or a corrupt adapter; re-run with --format lora to keep the "
        "adapter itself, and report the message."
    )


def load_reference(base_model: str, adapter_dir: Path):
    """``(peft_model, tokenizer, Reference)``: base+adapter and its logits with the adapter on and off.

    CPU: float32. CUDA (UNTESTED ON CPU): loaded in 16-bit onto the GPU, upcast to float32 when it fits twice in
    GPU memory; otherwise the whole check runs in 16-bit with tolerances times ``HALF_PRECISION_FACTOR``.
    """
    import torch

    if torch.cuda.is_available():
        model, tokenizer, dtype_name = _load_tuned_cuda(base_model, adapter_dir)
        device = "cuda"
    else:
        from grpo_kit.models import load_inference_model

        model, tokenizer = load_inference_model(base_model, adapter_dir)
        device, dtype_name = "cpu", "float32"
    prompts = probe_prompts(tokenizer)
    tuned = model_logits(model, prompts)
    with model.disable_adapter():
        base = model_logits(model, prompts)
    return model, tokenizer, Reference(prompts, tuned, base, device=device, dtype=dtype_name)


def _load_tuned_cuda(base_model: str, adapter_dir: Path):  # pragma: no cover - UNTESTED ON CPU
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from grpo_kit.machinery.runtime import half_dtype_name
    from grpo_kit.models import load_tokenizer

    half = getattr(torch, half_dtype_name())
    try:
        base = AutoModelForCausalLM.from_pretrained(base_model, dtype=half, device_map="cuda")
        model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    except torch.cuda.OutOfMemoryError:
        raise GrpoKitError(
            f"The 16-bit base {base_model} does not fit in GPU memory, so the export cannot be verified here. Keep the "
            "adapter itself (it is in the run folder), or export on a GPU with more memory (an 8B model needs ~17 GB)."
        ) from None
    params = sum(p.numel() for p in model.parameters())
    quantized = getattr(base, "hf_quantizer", None) is not None  # a 4-bit base (lora-only export) stays as trained
    if not quantized and params * 4 * 2 < torch.cuda.mem_get_info()[0]:
        return model.float(), load_tokenizer(base_model), "float32"
    return model, load_tokenizer(base_model), str(half).replace("torch.", "")


def _reload_kwargs(reference: Reference) -> dict:
    """``from_pretrained`` kwargs that put a reloaded export on the reference's device and dtype."""
    import torch

    kwargs: dict[str, Any] = {"dtype": getattr(torch, reference.dtype)}
    if reference.device != "cpu":
        kwargs["device_map"] = reference.device
    return kwargs


def _release(*objects) -> None:
    import gc

    del objects
    gc.collect()


def verify_lora(folder: Path, base_path: str, reference: Reference) -> ExportResult:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, **_reload_kwargs(reference))
    model = PeftModel.from_pretrained(base, str(folder)).eval()
    logits = model_logits(model, reference.prompts)
    _release(model, base)
    return check_logits("lora", "lora", logits, reference, path=folder, detail=f"PEFT adapter, checked in {reference.dtype}")


def verify_merged16(folder: Path, reference: Reference, dtype_name: str) -> ExportResult:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, **_reload_kwargs(reference)).eval()
    logits = model_logits(model, reference.prompts)
    _release(model)
    return check_logits("merged16", f"merged16:{dtype_name}", logits, reference, path=folder,
                        detail=f"merged {dtype_name} safetensors")


def verify_gguf(path: Path, reference: Reference, gguf_type: str, merge_dtype: str = "float32") -> ExportResult:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **_reload_kwargs(reference)).eval()
    logits = model_logits(model, reference.prompts)
    _release(model)
    detail = f"GGUF {gguf_type}" + (f", merged in {merge_dtype} by Unsloth" if merge_dtype != "float32" else "")
    return check_logits("gguf", gguf_tolerance_key(gguf_type, merge_dtype), logits, reference, path=path, detail=detail)


def gguf_tolerance_key(gguf_type: str, merge_dtype: str = "float32") -> str:
    """The ``TOLERANCES`` key a GGUF file is checked with: its type's, or the merge dtype's when that rounds more.

    Unsloth merges in 16-bit before converting, so an ``f16`` file made from a bf16 merge carries bf16 rounding.

    >>> gguf_tolerance_key("f16", "bfloat16"), gguf_tolerance_key("q8_0", "bfloat16"), gguf_tolerance_key("f16")
    ('merged16:bfloat16', 'gguf:q8_0', 'gguf:f16')
    """
    return max((f"gguf:{gguf_type}", f"merged16:{merge_dtype}"), key=lambda key: TOLERANCES[key][1])
