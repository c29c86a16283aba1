"""The README.md model card written into every export: what it is, how it was trained, how well it does, how to load it.

Pure text in, text out: ``render_model_card(info)`` takes plain dicts (built by ``grpo_kit.export``), so the card can
be tested without a model.

>>> card = render_model_card({"name": "demo", "base_model": "embedded:smollm2-135m",
...     "formats": [{"format": "lora", "path": "lora", "max_abs_diff": 1e-6, "tolerance": 1e-4, "detail": "adapter"}]})
>>> "PeftModel.from_pretrained" in card and "1e-06" in card
True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

_EVAL_COLUMNS = (
    ("strict acc.", "accuracy_strict", True),
    ("lenient acc.", "accuracy_lenient", True),
    ("format rate", "format_rate", True),
    ("mean tokens", "mean_completion_tokens", False),
)


def _front_matter(info: Mapping[str, Any]) -> str:
    tags = ["grpo", "gsm8k", "grpo-kit"]
    formats = {item["format"] for item in info.get("formats", [])}
    if "lora" in formats:
        tags += ["peft", "lora"]
    if "gguf" in formats:
        tags.append("gguf")
    lines = ["---", "library_name: " + ("peft" if formats == {"lora"} else "transformers"), "tags:"]
    lines += [f"  - {tag}" for tag in tags]
    if info.get("base_model_hub"):
        lines.append(f"base_model: {info['base_model_hub']}")
    lines.append("---")
    return "\n".join(lines)


def _training_section(info: Mapping[str, Any]) -> list[str]:
    run = info.get("run") or {}
    from grpo_kit.recipes import flatten

    preset = flatten(run["recipe"]) if isinstance(run.get("recipe"), dict) else {}
    if not run:
        return ["## Training", "", "No `run.json` was found next to the adapter, so the training settings are unknown."]
    rewards = run.get("rewards") or [r[0] if isinstance(r, (list, tuple)) else r for r in preset.get("rewards", [])]
    rows = [
        ("preset", preset.get("name", "?")),
        ("data", run.get("data", "?")),
        ("rewards", ", ".join(map(str, rewards)) or "?"),
        ("steps", info.get("steps", preset.get("max_steps", "?"))),
        ("LoRA rank / alpha", f"{preset.get('lora_rank', '?')} / {preset.get('lora_alpha', '?')}"),
        ("group size G", preset.get("num_generations", "?")),
        ("learning rate", preset.get("learning_rate", "?")),
        ("prompt", f"few_shot={preset.get('few_shot', 0)}, prefill={preset.get('prefill', '')!r}"),
    ]
    overrides = run.get("overrides")
    if overrides:
        rows.append(("overrides", ", ".join(f"{k}={v}" for k, v in overrides.items())))
    versions = run.get("versions")
    if versions:
        rows.append(("versions", ", ".join(f"{k} {v}" for k, v in versions.items())))
    lines = ["## Training", "", "GRPO (TRL `GRPOTrainer`) with a LoRA adapter, trained with grpo-kit.", ""]
    lines += ["| setting | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    return lines


def _eval_section(evals: Mapping[str, Mapping[str, Any]] | None) -> list[str]:
    if not evals:
        return ["## Evaluation", "", "No evaluation was attached to this export (see `grpo-kit eval`)."]
    lines = ["## Evaluation", "", "| model | n | " + " | ".join(c for c, _, _ in _EVAL_COLUMNS) + " |"]
    lines.append("|---|---|" + "---|" * len(_EVAL_COLUMNS))
    protocols = []
    for name, metrics in evals.items():
        cells = []
        for _, key, percent in _EVAL_COLUMNS:
            value = metrics.get(key)
            cells.append("?" if value is None else (f"{100 * value:.1f} %" if percent else f"{value:.1f}"))
        lines.append(f"| {name} | {metrics.get('n', '?')} | " + " | ".join(cells) + " |")
        if metrics.get("protocol") and metrics["protocol"] not in protocols:
            protocols.append(metrics["protocol"])
    lines += ["", "Protocol: " + " / ".join(protocols) if protocols else "Protocol: not recorded."]
    lines += ["", "Strict and lenient extraction differ by many points on GSM8K; compare numbers only under the same protocol."]
    return lines


def _verification_section(formats: Sequence[Mapping[str, Any]]) -> list[str]:
    lines = [
        "## Verification",
        "",
        "Each file was loaded back after writing and its next-token logits on fixed prompts compared with the "
        "in-memory base + LoRA adapter in float32 (max absolute difference over all positions and the vocabulary).",
        "",
        "| format | file | stored as | max abs diff | limit | mean diff to tuned / to base | LoRA effect |",
        "|---|---|---|---|---|---|---|",
    ]
    for item in formats:
        lines.append(
            f"| {item['format']} | `{item['path']}` | {item.get('detail', '')} | {item['max_abs_diff']:.3g} | "
            f"{item['tolerance']:.3g} | {_num(item.get('mean_abs_diff'))} / {_num(item.get('mean_abs_diff_base'))} | "
            f"{_num(item.get('lora_effect'))} |"
        )
    notes = [item["note"] for item in formats if item.get("note")]
    lines += ["", "LoRA effect: the largest logit change the adapter makes on the same prompts. An export must stay "
              "within the limit of the tuned model and sit closer to it than to the base model."]
    return lines + [f"- {note}" for note in notes]


def _num(value: Any) -> str:
    return "?" if value is None or value != value else f"{value:.3g}"  # None or NaN


def _usage_section(info: Mapping[str, Any]) -> list[str]:
    base = info.get("base_model_hub") or info.get("base_model", "BASE_MODEL")
    where = info.get("repo") or f"exports/{info.get('name', 'NAME')}"
    lines = ["## How to load", ""]
    for item in info.get("formats", []):
        path = item["path"]
        if item["format"] == "lora":
            lines += [
                "LoRA adapter (PEFT, on top of the base model):", "", "```python",
                "from peft import PeftModel", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                f'base = AutoModelForCausalLM.from_pretrained("{base}")',
                f'model = PeftModel.from_pretrained(base, "{where}", subfolder="{path}")',
                f'tokenizer = AutoTokenizer.from_pretrained("{where}", subfolder="{path}")', "```", "",
                "vLLM with the adapter: `LLM(model=BASE, enable_lora=True)` and "
                f'`LoRARequest("grpo", 1, "{where}/{path}")` in `generate`.', "",
            ]
        elif item["format"] == "merged16":
            lines += [
                "Merged 16-bit model (transformers, vLLM, or llama.cpp's `convert_hf_to_gguf.py`):", "", "```python",
                "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
                f'model = AutoModelForCausalLM.from_pretrained("{where}", subfolder="{path}")',
                f'tokenizer = AutoTokenizer.from_pretrained("{where}", subfolder="{path}")', "```", "",
                f"vLLM: `vllm serve {where}/{path}`", "",
            ]
        elif item["format"] == "gguf":
            lines += [
                f"GGUF (`{path}`) with llama.cpp or Ollama:", "", "```bash",
                f"llama-cli -m {where}/{path} -cnv",
                f"ollama create {info.get('name', 'grpo-model')} -f {where}/gguf/Modelfile", "```", "",
            ]
    lines += [
        "Prompt it as in training: the system prompt asks for `<think> reasoning </think><answer> number </answer>` "
        "(`grpo_kit.data.SYSTEM_PROMPT`)."
    ]
    return lines


def render_model_card(info: Mapping[str, Any]) -> str:
    """Markdown model card from ``info``: name, base_model, base_model_note, run (run.json), steps, evals
    (name -> metrics dict with protocol), formats (dicts from ``ExportResult.to_dict``), repo."""
    lines = [_front_matter(info), "", f"# {info.get('name', 'grpo-kit export')}", ""]
    lines.append(f"GRPO fine-tune of **{info.get('base_model', '?')}** on GSM8K-style math word problems, made with grpo-kit.")
    if info.get("base_model_note"):
        lines += ["", info["base_model_note"]]
    lines.append("")
    lines += _training_section(info) + [""] + _eval_section(info.get("evals")) + [""]
    lines += _verification_section(info.get("formats", [])) + [""] + _usage_section(info)
    return "\n".join(lines) + "\n"
