"""GPU proof: does every GPU tier really fit and run on its card? One command, any CUDA machine, no internet.

For each GPU tier preset (rtx-8gb, rtx-12gb, t4-16gb, l4-24gb, a100-40gb, a100-80gb) and each supported architecture
(Llama-3.1-8B, Qwen2.5-Math-7B, Qwen2.5-1.5B) it builds a random-initialised model of the exact shape from a config
written here (no download), with the embedded model's tokenizer, and runs the kit's real path -
``grpo_kit.train.train``: Unsloth 4-bit (or 16-bit, per tier) load, LoRA, a few GRPO steps with the tier's batch
shape - with every completion forced to full length (the worst case for memory) and the process's GPU memory capped
to the tier's card (``torch.cuda.set_per_process_memory_fraction``). Then the same steps with plain TRL + PEFT +
bitsandbytes (the kit's ``transformers`` backend, no Unsloth) for a speed and memory ratio, and an export round trip
(lora and merged16, verified by ``grpo_kit.export``) on the small shape.

Each run is its own subprocess (a CUDA OOM, or Unsloth's process-wide patching, must not touch the next run) with a
timeout; a failure becomes a row, never a crash. Results: ``<out>/gpu_proof.json`` and ``<out>/gpu_proof.md`` (a
table for docs/RESULTS.md with the date, GPU, driver and library versions).

    python benchmarks/gpu_proof.py --out gpu-proof-results            # everything the card can emulate
    python benchmarks/gpu_proof.py --tiers t4-16gb --archs qwen2.5-1.5b --steps 2 --skip-plain
    python benchmarks/gpu_proof.py --dry-run                          # the plan; no GPU, no Unsloth import

What it cannot prove: a capped H100 is not a T4. Memory peaks carry over (same allocator, same tensors), speeds do
not (other kernels, other bandwidth), and a T4 tier is run in fp16 on a card that has bf16. vLLM is off in every run
(it is optional and not in the offline bundle), so the numbers are for Unsloth/transformers generation.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if (ROOT / "grpo_kit").is_dir() and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a checkout; from the bundle the kit is installed

GIB = 2**30
TIERS = ("rtx-8gb", "rtx-12gb", "t4-16gb", "l4-24gb", "a100-40gb", "a100-80gb")
#: The export round trip runs on the small shape under the smallest tier.
EXPORT_ARCH, EXPORT_TIER = "qwen2.5-1.5b", "t4-16gb"
#: Where the proof finds the tokenizer when it is not given: the bundle's copy (docs/VRAM.md sets it).
TOKENIZER_ENV = "GRPO_KIT_TOKENIZER"
#: Nothing may reach the network: Hub look-ups fail fast, Unsloth's usage statistics stay off.
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "UNSLOTH_DISABLE_STATISTICS": "1",
}

# The shape fields of the real models' config.json, as published on the Hugging Face Hub:
#   meta-llama/Llama-3.1-8B, Qwen/Qwen2.5-Math-7B, Qwen/Qwen2.5-1.5B (the Instruct and unsloth/... variants the
#   presets name share these shapes). Cross-checked against public code that restates them: zyzshishui/slime
#   scripts/models/llama3.1-8B.sh (4096/14336/32 layers/8 KV groups/128256, rope 500000 x8) and oumi
#   configs/recipes/llama3_1/README.md; Qwen2.5-7B's linear shapes (3584 x 18944, KV 512) in public layer tables;
#   Qwen2.5-1.5B's 1536/8960/28/12/2/151936 with tied embeddings. tests/test_gpu_proof.py counts the parameters of
#   each built shape (meta device) against the published totals that grpo_kit.planner holds.
ARCHS: dict[str, dict] = {
    "llama-3.1-8b": {
        "model_type": "llama",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
    },
    "qwen2.5-math-7b": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "use_sliding_window": False,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
    },
    "qwen2.5-1.5b": {
        "model_type": "qwen2",
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "sliding_window": 131072,
        "use_sliding_window": False,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
    },
}
#: Real weights, not a random model: the embedded SmolLM2-135M-Instruct (the bundle's ``embedded`` set), converted by
#: the kit as on any machine. Its config is listed for the plan's parameter count.
REAL = "smollm2-135m"
ARCHS[REAL] = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
}
#: The published parameter counts (grpo_kit.planner's table), to show next to the built shape's own count.
RANDOM = tuple(arch for arch in ARCHS if arch != REAL)  # the shapes built with random weights
PUBLISHED = {
    "llama-3.1-8b": "LLAMA_31_8B",
    "qwen2.5-math-7b": "QWEN25_MATH_7B",
    "qwen2.5-1.5b": "QWEN25_15B",
    REAL: "SMOLLM2_135M",
}


# ----------------------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Run:
    """One subprocess: ``kit`` (Unsloth), ``plain`` (TRL + PEFT + bitsandbytes), ``export`` (round trip), ``learn``
    (``LEARN_RECIPE``'s learning set-up on the real weights, evaluated and exported; ``tier``: only its memory cap) or
    ``build`` (write the random model of ``arch`` once, before its first run)."""

    kind: str
    tier: str
    arch: str

    @property
    def name(self) -> str:
        return f"build-{self.arch}" if self.kind == "build" else f"{self.kind}-{self.tier}-{self.arch}"


#: The learn run: the real weights trained with this recipe's learning set-up (worked examples, the ``<think>``
#: prefill, the partial-credit ``tag_progress`` reward, its batch shape and lengths), loaded as the GPU path loads
#: (Unsloth, 4-bit, the card's precision); evaluated before and after by ``grpo-kit eval``'s protocol on
#: ``LEARN_QUESTIONS`` bundled held-out questions (``make demo``'s 16), then exported as lora and merged16 with
#: ``--check-answers`` on as many.
LEARN_RECIPE, LEARN_QUESTIONS = "cpu", 16
LEARN = Run("learn", "t4-16gb", REAL)
#: The most GRPO steps the learn run trains on the device (the time plan may allow more); on a CPU, the recipe's own.
LEARN_MAX_STEPS = 24

#: ``--profile device``: the machine this project is sometimes lent (10 minutes per command, 15 minutes of device
#: time in all, a cold machine after ~30 s idle). One device call per stage (``benchmarks/gpu_bundle.py calls``), each
#: within ``STAGE_SECONDS`` (``time_plan``), each independent of the others. Under the T4 tier's 14.7 GiB cap: GRPO
#: learning on the real weights; the 1.5B fallback, its export and the 8B's GRPO steps; the 8B's export under the cap
#: (Unsloth merges shard by shard where it is installed; checked weight by weight). Then the consumer tiers under
#: their 7.7 and 11.7 GiB caps.
STAGES = {
    1: (LEARN,),
    2: (
        Run("kit", "t4-16gb", "qwen2.5-1.5b"),
        Run("export", "t4-16gb", "qwen2.5-1.5b"),
        Run("kit", "t4-16gb", "llama-3.1-8b"),
    ),
    3: (Run("export", "t4-16gb", "llama-3.1-8b"),),
    4: (Run("kit", "rtx-8gb", "qwen2.5-1.5b"), Run("kit", "rtx-12gb", "llama-3.1-8b")),
}
STAGE_SECONDS = 480


def plan_runs(tiers=TIERS, archs=RANDOM, *, skip_plain: bool = False, export: bool = True) -> list[Run]:
    """Every run, in order: per tier and arch the kit run then its plain twin; the export round trip last.

    >>> [r.name for r in plan_runs(("t4-16gb",), ("qwen2.5-1.5b",))]
    ['kit-t4-16gb-qwen2.5-1.5b', 'plain-t4-16gb-qwen2.5-1.5b', 'export-t4-16gb-qwen2.5-1.5b']
    """
    runs = []
    for tier in tiers:
        for arch in archs:
            runs.append(Run("kit", tier, arch))
            if not skip_plain:
                runs.append(Run("plain", tier, arch))
    if export:
        runs.append(Run("export", EXPORT_TIER, EXPORT_ARCH))
    return runs


def proof_preset(
    run: Run, model_dir: str, steps: int | None, *, card_bf16: bool = True, plan_only: bool = True, gpu: bool = True
):
    """The run's recipe: the tier's (the learn run: ``LEARN_RECIPE``'s), the local model, vLLM off, ``steps`` steps
    (None: the recipe's own), the run's backend.

    A bf16 tier on a card without bf16 trains in fp16 (what ``auto_recipe`` does for such a card). The learn run loads
    as the GPU path does, in 4 bits and the card's precision; without a GPU (``gpu=False``, the CPU rehearsal) through
    transformers + PEFT in float32. ``plan_only``: the backend stays auto, since building a recipe imports its backend
    and the dry run plans Unsloth runs on a CPU.
    """
    from grpo_kit.config import load_recipe

    if run.kind == "learn":
        name, bf16 = LEARN_RECIPE, gpu and card_bf16
        changes = {"load_in_4bit": gpu, "bf16": bf16, "fp16": gpu and not bf16}
    else:
        tier = load_recipe(run.tier)
        name, bf16 = run.tier, tier.grpo.bf16 and card_bf16
        changes = {"bf16": bf16, "fp16": tier.grpo.fp16 or (tier.grpo.bf16 and not bf16)}
    if steps is not None:
        changes["max_steps"] = steps
    if plan_only:
        backend = "auto"
    elif run.kind == "plain" or (run.kind == "learn" and not gpu):
        backend = "transformers"
    else:
        backend = "unsloth"
    return load_recipe(
        name, model_name_or_path=model_dir, use_vllm=False, save_steps=10_000, backend=backend, **changes
    )


def run_steps(run: Run, steps: int, learn_steps: int | None) -> int | None:
    """GRPO steps of ``run``: an export's one, the learn run's ``learn_steps`` (None: its recipe's), else ``steps``."""
    return {"export": 1, "learn": learn_steps}.get(run.kind, steps)


def precision(recipe) -> str:
    """The recipe's training precision in one word (the plan's and the result rows' column)."""
    return "bf16" if recipe.grpo.bf16 else "fp16" if recipe.grpo.fp16 else "fp32"


def shape_params(arch: str) -> int:
    """Parameters of the model ``ARCHS[arch]`` builds, counted on the meta device (no memory, no download)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(build_config(arch))
    return sum(p.numel() for p in model.parameters())


def build_config(arch: str, tokenizer=None):
    """A transformers config of the real shape; token ids from ``tokenizer`` (all of them fit in the real vocab)."""
    from transformers import AutoConfig

    fields = dict(ARCHS[arch])
    model_type = fields.pop("model_type")
    if tokenizer is not None:
        fields.update(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        )
    return AutoConfig.for_model(model_type, **fields)


def planner_figures(run: Run, preset) -> dict:
    """The planner's estimate for the run as configured (vLLM off) and for its recipe as shipped (vLLM on), GiB."""
    from grpo_kit.config import load_recipe
    from grpo_kit.planner import ModelShape, estimate_vram

    shape = dataclasses.replace(ModelShape.from_config(ARCHS[run.arch]), name=run.arch)
    as_run = estimate_vram(preset, shape)
    shipped = estimate_vram(load_recipe(LEARN_RECIPE if run.kind == "learn" else run.tier), shape)
    return {
        "plan_gib": round(as_run.total_gib, 2),
        "plan_weights_gib": round(as_run.weights_gib, 2),
        "plan_logits_gib": round(as_run.logits_gib, 2),
        "plan_activations_gib": round(as_run.activations_gib, 2),
        "plan_shipped_with_vllm_gib": round(shipped.total_gib, 2),
    }


#: The time plan's figures, seconds on the lent H200 (2026-11-28, docs/gpu-proof-2026-11-28.json), per shape under the
#: T4 recipe (4 x 256 completion tokens a step): a kit run's time outside its steps (Unsloth's import, the load, the
#: trainer's set-up: wall - first step - second), its first step (the surplus over a later one is warm-up), a later
#: step, and what the export run adds to one step (lora, Unsloth's merged16 in a child process, both checked). A step is
#: scaled by the completion tokens it generates; a shape without figures is planned with the 1.5B's (for SmolLM2,
#: 11x smaller, an upper bound). A random shape's first run in a stage also builds it: call 1 of that day, 438 s, less
#: its three runs' 344 s, for two shapes.
H200 = {
    "qwen2.5-1.5b": {"outside": 46.0, "first": 48.6, "step": 12.9, "export": 49.9},
    "llama-3.1-8b": {"outside": 55.5, "first": 42.8, "step": 14.2, "export": 149.8},
}
BUILD_SECONDS = 47
#: The learn run's four evaluations on ``LEARN_QUESTIONS`` questions (base and base + adapter, then check-answers'
#: base + adapter and merged16), each a model load and greedy answers of 48 tokens: not measured on a GPU, an
#: allowance of 30 s each. The learn run keeps this, and the export's share (``learn_reserve``), for after training.
LEARN_EVAL_SECONDS = 120


def plan_seconds(run: Run, preset, steps: int) -> float:
    """The run's seconds on the lent H200 by the time plan (``H200``), its model's build not included."""
    from grpo_kit.config import load_recipe

    measured = H200.get(run.arch, H200[EXPORT_ARCH])
    reference = load_recipe(EXPORT_TIER).grpo
    scale = (preset.grpo.generation_batch_size * preset.grpo.max_completion_length) / (
        reference.generation_batch_size * reference.max_completion_length
    )
    seconds = measured["outside"] + measured["first"] - measured["step"] + steps * measured["step"] * scale
    if run.kind in ("export", "learn"):
        seconds += measured["export"]
    return seconds + (LEARN_EVAL_SECONDS if run.kind == "learn" else 0.0)


def learn_reserve() -> float:
    """Seconds the learn run keeps for its evaluations and export after training (``plan_seconds``' share of them)."""
    return H200[EXPORT_ARCH]["export"] + LEARN_EVAL_SECONDS


def device_learn_steps() -> int:
    """The learn run's steps on the device: as many as stage 1 allows by the time plan, at most ``LEARN_MAX_STEPS``."""
    preset = proof_preset(LEARN, REAL, 1)
    one, two = (plan_seconds(LEARN, preset, steps) for steps in (1, 2))
    others = sum(plan_seconds(r, proof_preset(r, r.arch, 2), 2) + BUILD_SECONDS for r in STAGES[1] if r != LEARN)
    return max(1, min(LEARN_MAX_STEPS, 1 + int((STAGE_SECONDS - others - one) // (two - one))))


def time_plan(plan: dict) -> dict[int, float]:
    """Each stage's planned seconds (``plan_seconds`` of its runs, and a build for each random shape it uses)."""
    rows = {row["run"]: row for row in plan["runs"]}
    return {
        stage: sum(rows[r.name]["plan_seconds"] for r in runs) + BUILD_SECONDS * len({r.arch for r in runs} - {REAL})
        for stage, runs in STAGES.items()
        if all(r.name in rows for r in runs)
    }


def describe_plan(runs: list[Run], steps: int, learn_steps: int | None = None) -> dict:
    """The plan as data: runs with recipe, learning set-up, batch shape, cap, planner figures and planned seconds;
    shapes with parameter counts; each stage's planned seconds when the runs are the device profile's."""
    from grpo_kit import planner
    from grpo_kit.config import load_recipe

    archs = sorted({r.arch for r in runs}, key=list(ARCHS).index)
    shapes = {}
    for arch in archs:
        published = getattr(planner, PUBLISHED[arch]).params
        shapes[arch] = {"params": shape_params(arch), "published_params": published, "config": ARCHS[arch]}
    rows = []
    for run in runs:
        tier = load_recipe(run.tier)
        preset = proof_preset(run, run.arch, run_steps(run, steps, learn_steps))
        learn = run.kind == "learn"
        rows.append(
            {
                "run": run.name,
                "kind": run.kind,
                "tier": run.tier,
                "arch": run.arch,
                "recipe": preset.name,
                "cap_gib": tier.kit.vram_gb,
                "precision": precision(preset),
                "load_in_4bit": preset.model.load_in_4bit,
                "batch": f"{preset.grpo.per_device_train_batch_size}x{preset.grpo.gradient_accumulation_steps}",
                "num_generations": preset.grpo.num_generations,
                "prompt_tokens": preset.kit.max_prompt_length,
                "completion_tokens": preset.grpo.max_completion_length,
                "steps": preset.grpo.max_steps,
                "few_shot": preset.kit.few_shot,
                "prefill": preset.kit.prefill,
                "rewards": [list(pair) for pair in preset.rewards],
                "full_length": not learn,  # completions forced to max_completion_length, padded prompts
                "data": "sample" if learn else "padded",
                "eval_questions": LEARN_QUESTIONS if learn else 0,
                "exports": ["lora", "merged16"] if run.kind in ("export", "learn") else [],
                "check_answers": LEARN_QUESTIONS if learn else 0,
                "plan_seconds": round(plan_seconds(run, preset, preset.grpo.max_steps), 1),
                **planner_figures(run, preset),
            }
        )
    plan = {"steps": steps, "shapes": shapes, "runs": rows}
    return {**plan, "stage_seconds": time_plan(plan)}


def format_plan(plan: dict) -> str:
    """The dry-run's printout: shapes, then one line per run (steps, recipe and planned seconds), then what the learn
    runs do."""
    lines = [
        "GPU proof plan (vLLM off; memory runs: random weights of the real shapes, completions at full length)",
        "",
    ]
    lines.append("shapes:")
    for arch, shape in plan["shapes"].items():
        c = shape["config"]
        lines.append(
            f"  {arch:<16} {shape['params'] / 1e9:.3f}B params (published {shape['published_params'] / 1e9:.3f}B): "
            f"{c['num_hidden_layers']} layers, hidden {c['hidden_size']}, MLP {c['intermediate_size']}, "
            f"heads {c['num_attention_heads']}/{c['num_key_value_heads']} KV, vocab {c['vocab_size']}"
        )
    lines += ["", f"runs ({len(plan['runs'])}):"]
    header = (
        f"  {'run':<34} {'recipe':>8} {'steps':>5} {'cap GiB':>7} {'prec':>5} {'4bit':>4} {'batch':>5} {'G':>3} "
        f"{'prompt+compl':>12} {'plan GiB':>8} {'shipped+vLLM':>12} {'plan s':>6}"
    )
    lines.append(header)
    for r in plan["runs"]:
        lines.append(
            f"  {r['run']:<34} {r['recipe']:>8} {r['steps']:>5} {r['cap_gib']:>7g} {r['precision']:>5} "
            f"{'yes' if r['load_in_4bit'] else 'no':>4} {r['batch']:>5} {r['num_generations']:>3} "
            f"{r['prompt_tokens']:>5}+{r['completion_tokens']:<6} {r['plan_gib']:>8.2f} "
            f"{r['plan_shipped_with_vllm_gib']:>12.2f} {r['plan_seconds']:>6.0f}"
        )
    for r in plan["runs"]:
        if r["kind"] == "learn":
            rewards = ", ".join(f"{name} {weight:g}" for name, weight in r["rewards"] if weight)
            lines.append(
                f"{r['run']}: the {r['recipe']} recipe's learning set-up on the bundled training questions "
                f"(few_shot {r['few_shot']}, prefill {r['prefill']!r}, rewards {rewards}); grpo-kit eval's protocol "
                f"before and after on {r['eval_questions']} bundled held-out questions; export "
                f"{' + '.join(r['exports'])} with --check-answers {r['check_answers']}"
            )
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------- results


#: Columns of the Markdown table: (key in a result row, header).
COLUMNS = (
    ("tier", "tier"),
    ("arch", "model shape"),
    ("kind", "path"),
    ("status", "result"),
    ("peak_allocated_gib", "peak alloc GiB"),
    ("peak_reserved_gib", "peak reserved GiB"),
    ("plan_gib", "planner GiB"),
    ("cap_gib", "cap GiB"),
    ("seconds_per_step", "s/step"),
    ("tokens_per_second", "compl tok/s"),
    ("mean_completion_tokens", "mean compl len"),
    ("note", "note"),
)


def format_cell(value) -> str:
    """A table cell: floats to 2 decimals, missing as '-', pipes escaped.

    >>> format_cell(3.14159), format_cell(None), format_cell("a|b")
    ('3.14', '-', 'a\\\\|b')
    """
    if value is None or value == "":
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def add_ratios(rows: list[dict]) -> list[dict]:
    """Give each ``plain`` row its Unsloth/plain ratios: speed (plain s/step ÷ kit s/step) and memory."""
    kit = {(r["tier"], r["arch"]): r for r in rows if r["kind"] == "kit"}
    out = []
    for row in rows:
        row = dict(row)
        twin = kit.get((row["tier"], row["arch"]))
        if row["kind"] == "plain" and twin and row.get("status") == twin.get("status") == "fitted":
            speed = _ratio(row.get("seconds_per_step"), twin.get("seconds_per_step"))
            memory = _ratio(twin.get("peak_reserved_gib"), row.get("peak_reserved_gib"))
            row["note"] = (
                f"Unsloth {speed:.2f}x faster, {memory:.2f}x the memory" if speed and memory else row.get("note")
            )
        out.append(row)
    return out


def _ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def markdown_table(result: dict) -> str:
    """The section to add to docs/RESULTS.md: the machine and versions, then one row per run."""
    env = result["environment"]
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items())
    lines = [
        f"GPU proof, {result['date']} on {env['gpu']} ({env['gpu_total_gib']:.1f} GiB, driver {env['driver']}, "
        f"CUDA {env['cuda']}); {versions}. Memory runs: {result['steps']} GRPO steps, completions forced to full "
        "length; vLLM off; memory capped to each tier's card.",
        "",
        "| " + " | ".join(h for _, h in COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
    ]
    for row in add_ratios(result["rows"]):
        lines.append("| " + " | ".join(format_cell(row.get(key)) for key, _ in COLUMNS) + " |")
    lines += [f"\n{learn_summary(row)}" for row in result["rows"] if row["kind"] == "learn"]
    lines += [
        f"\n{row['tier']} {row['arch']} export: {row['export_note']}"
        for row in result["rows"]
        if row.get("export_note")
    ]
    exports = [r for r in result["rows"] if r["kind"] == "export" and r.get("exports")]
    for row in exports:
        for item in row["exports"]:
            lines.append(
                f"\nExport {item['format']}: max |d| {item['max_abs_diff']:.2e} <= tolerance "
                f"{item['tolerance']:.2e} ({item['detail']})"
            )
    return "\n".join(lines) + "\n"


def learn_summary(row: dict) -> str:
    """A learn row in words: steps, reward, format rate and strict accuracy before -> after with the paired interval,
    the LoRA effect, each export's check, check-answers' two models, seconds per step and peak memory."""
    name = f"learn {row['tier']} {row['arch']}"
    if row.get("format_after") is None:
        return f"{name}: {row.get('status')} {row.get('note') or ''}".strip()
    pct = lambda x: f"{100 * x:.1f} %"  # noqa: E731
    low, high = row["strict_interval"]
    lines = [
        f"{name} ({row['precision']}, {'4-bit' if row['load_in_4bit'] else 'unquantized'} base): "
        f"{row['steps_done']} GRPO steps of {row['steps_planned']}, {format_cell(row['seconds_per_step'])} s/step "
        f"(median after the first), reward {format_cell(row['reward_first'])} -> {format_cell(row['reward_last'])}",
        f"format rate {pct(row['format_before'])} -> {pct(row['format_after'])}; strict accuracy "
        f"{pct(row['strict_before'])} -> {pct(row['strict_after'])}, change 95 % paired interval "
        f"[{100 * low:+.1f}, {100 * high:+.1f}] points (n={row['eval_n']}, grpo-kit eval's protocol)",
        f"LoRA effect {row['lora_effect']:.2e} (largest |scale * B @ A|)",
    ]
    lines += [
        f"export {item['format']}: verified, max |d| {item['max_abs_diff']:.2e} <= {item['tolerance']:.2e} "
        f"({item['detail']})"
        for item in row.get("exports") or ()
    ]
    if answers := row.get("answers"):
        said = "; ".join(
            f"{label} format {pct(m['format_rate'])}, strict {pct(m['accuracy_strict'])}"
            for label, m in answers.items()
        )
        lines.append(f"check-answers (n={next(iter(answers.values()))['n']}): {said}")
    peak = row.get("peak_reserved_gib") or row.get("peak_rss_gib")
    lines.append(f"peak memory {format_cell(peak)} GiB ({'CUDA reserved' if row.get('peak_reserved_gib') else 'RSS'})")
    return "\n".join(lines)


def environment() -> dict:
    """GPU name, driver, CUDA and library versions (a missing library reads 'not installed')."""
    import importlib.metadata

    import torch

    versions = {}
    for package in ("torch", "transformers", "trl", "peft", "unsloth", "unsloth_zoo", "bitsandbytes", "accelerate"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "not installed"
    cuda = torch.cuda.is_available()
    props = torch.cuda.get_device_properties(0) if cuda else None
    return {
        "gpu": props.name if props else "none",
        "gpu_total_gib": props.total_memory / GIB if props else 0.0,
        "capability": f"{props.major}.{props.minor}" if props else "",
        "driver": _driver_version(),
        "cuda": torch.version.cuda or "none",
        "python": platform.python_version(),
        "versions": versions,
    }


def _driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
        return out.stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


# ----------------------------------------------------------------------------------------------------- workers


def tokenizer_dir() -> Path:
    """The tokenizer the built models use: ``$GRPO_KIT_TOKENIZER`` (the bundle's copy) or the embedded model's."""
    if os.environ.get(TOKENIZER_ENV):
        return Path(os.environ[TOKENIZER_ENV])
    from grpo_kit.embedded import embedded_model_path

    return embedded_model_path()


def build_model(arch: str, folder: Path) -> dict:
    """Write a random-initialised ``arch`` model (16-bit safetensors + tokenizer) to ``folder``, once."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    done = folder / ".gpu-proof-built"
    if done.is_file():
        return json.loads(done.read_text())
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir())
    config = build_config(arch, tokenizer)
    from grpo_kit.models import detect_device

    dtype = torch.bfloat16 if detect_device().bf16 else torch.float16
    need = shape_params(arch) * 2 * 1.2
    device = "cuda" if torch.cuda.get_device_properties(0).total_memory > need else "cpu"  # init is fast on a GPU
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="4GB")
    tokenizer.save_pretrained(folder)
    info = {"arch": arch, "params": sum(p.numel() for p in model.parameters()), "dtype": str(dtype)}
    done.write_text(json.dumps(info))
    return info


def full_length_dataset(preset, tokenizer, rows: int = 64):
    """Questions padded so the rendered prompt is just under ``max_prompt_length`` tokens (the worst case)."""
    from datasets import Dataset

    from grpo_kit.data import format_for_grpo
    from grpo_kit.errors import GrpoKitError

    def dataset(words: int):
        filler = " ".join(["apples"] * words)
        questions = [f"Question {i}: a farmer counts {filler}. How many are there?" for i in range(rows)]
        return Dataset.from_dict({"question": questions, "answer": ["42"] * rows, "solution": ["#### 42"] * rows})

    def fits(words: int) -> bool:
        try:
            _, dropped = format_for_grpo(  # the last row: its question number has the most digits
                dataset(words).select([rows - 1]),
                tokenizer,
                few_shot=preset.kit.few_shot,
                prefill=preset.kit.prefill,
                max_prompt_tokens=preset.kit.max_prompt_length,
            )
        except GrpoKitError:  # raised when every prompt is too long: here, the one probe row
            return False
        return dropped == 0

    low, high = 0, preset.kit.max_prompt_length  # the most filler words that still fit
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return dataset(low)


def distinct_words(completions, **kwargs) -> list[float]:
    """The export runs' extra reward: distinct words per completion / 100, which varies within a group of random text.

    >>> distinct_words([[{"role": "assistant", "content": "a b a"}], [{"role": "assistant", "content": "c"}]])
    [0.02, 0.01]
    """
    from grpo_kit.rewards import completion_text

    return [len(set(completion_text(c).split())) / 100 for c in completions]


def make_timer(stop_at: float | None = None):
    """A callback that records each optimizer step's wall time (synchronised on a GPU, so its work is counted) and,
    given ``stop_at`` (a ``time.time()``), ends training when the next step (the median so far) would end after it."""
    import torch
    from transformers import TrainerCallback

    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self._start = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            sync()
            self._start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            sync()
            self.times.append(time.perf_counter() - self._start)
            if stop_at is not None and time.time() + median_step(self.times) > stop_at:
                control.should_training_stop = True

    return StepTimer()


def median_step(times: list[float]) -> float | None:
    """Seconds per step: the median after the first step (it also warms up kernels and the allocator).

    >>> median_step([30.0, 2.0, 3.0, 2.5]), median_step([30.0]), median_step([])
    (2.5, 30.0, None)
    """
    later = times[1:] or times
    return sorted(later)[len(later) // 2] if later else None


def cap_memory(cap_gib: float) -> float:
    """Limit this process to ``cap_gib`` of GPU 0 (the tier's card); returns the fraction set."""
    import torch

    total = torch.cuda.get_device_properties(0).total_memory / GIB
    fraction = min(1.0, cap_gib / total)
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    return fraction


def cap_children(fraction: float) -> bool:
    """Give processes this one starts (the export's Unsloth child) the same cap, through PyTorch's allocator setting
    ``per_process_memory_fraction`` (newer PyTorch releases read it); True when a probe child reports the cap."""
    setting = f"per_process_memory_fraction:{fraction:.4f}"
    env = {
        **os.environ,
        "PYTORCH_CUDA_ALLOC_CONF": ",".join(filter(None, (os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), setting))),
    }
    probe = "import torch; torch.empty(1, device='cuda'); print(torch.cuda.get_per_process_memory_fraction(0))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120)
    capped = done.returncode == 0 and abs(float(done.stdout.strip() or 1) - fraction) < 1e-3
    if capped:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = env["PYTORCH_CUDA_ALLOC_CONF"]
    return capped


def run_worker(spec: dict) -> dict:
    """Inside the subprocess: build (cached), cap, train (and export, or evaluate and export); return the result row.
    Without a GPU only the learn run can run (the CPU rehearsal): uncapped, its peak memory the process's RSS."""
    import resource

    import torch

    from grpo_kit.config import load_recipe
    from grpo_kit.models import detect_device, prepare_backend

    run = Run(spec["kind"], spec["tier"], spec["arch"])
    model_dir = Path(spec["models"]) / run.arch
    if run.arch == REAL:  # converted from the GGUF once, as the kit does on any machine
        from grpo_kit.embedded import embedded_model_path

        model_dir = embedded_model_path()
    if run.kind == "build":  # its own process, so nothing of the building stays in a measured one
        return {"status": "built", **(build_model(run.arch, model_dir) if run.arch != REAL else {"arch": REAL})}
    gpu = torch.cuda.is_available()
    preset = proof_preset(run, str(model_dir), spec["steps"], card_bf16=detect_device().bf16, plan_only=False, gpu=gpu)
    prepare_backend(preset.kit.backend)  # Unsloth runs: imported before the tokenizer/timer import transformers
    row = {"precision": precision(preset), "load_in_4bit": preset.model.load_in_4bit}
    if gpu:
        row["cap_fraction"] = cap_memory(load_recipe(run.tier).kit.vram_gb)
        if run.kind in ("export", "learn"):  # the export's Unsloth child (the T4/L4 route) must see the tier's card
            row["children_capped"] = cap_children(row["cap_fraction"])
        torch.cuda.reset_peak_memory_stats()
    try:
        row.update(_learn(run, preset, spec) if run.kind == "learn" else _train_and_measure(run, preset, spec))
        row["status"] = "fitted"
    except torch.OutOfMemoryError as error:
        row.update(status="OOM", note=str(error).splitlines()[0][:200])
    except Exception as error:  # noqa: BLE001 - every failure is a row, with its reason
        oom = "out of memory" in str(error).lower()
        row.update(
            status="OOM" if oom else "error",
            note=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}" if str(error) else type(error).__name__,
            traceback=traceback.format_exc()[-4000:],
        )
    if gpu:
        row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        row["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    row["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
    return row


def step_figures(result, timer, preset) -> dict:
    """A training's steps, their seconds and its completion tokens per second, from the timer and the run's log."""
    per_step = median_step(timer.times)
    lengths = [h["completions/mean_length"] for h in result.history if "completions/mean_length" in h]
    mean_len = sum(lengths) / len(lengths) if lengths else None
    return {
        "steps_done": result.steps,
        "step_seconds": timer.times,
        "seconds_per_step": per_step,
        "first_step_seconds": timer.times[0] if timer.times else None,
        "mean_completion_tokens": mean_len,
        "tokens_per_second": (preset.grpo.generation_batch_size * mean_len / per_step)
        if per_step and mean_len
        else None,
    }


def _train_and_measure(run: Run, preset, spec: dict) -> dict:
    from grpo_kit.models import load_tokenizer
    from grpo_kit.train import train

    timer = make_timer()
    out = Path(spec["out"]) / "runs" / run.name
    if run.kind == "export":
        # A random model scores 0 on every reward: zero advantages, zero gradient, LoRA B stays 0 and the merge
        # equals the base (the 2026-11-28 proof). A reward that varies within each group and one full-size step
        # (no warm-up, lr 1e-2) give the adapter an effect above bf16's storage noise, so the weight check tests
        # the merge itself.
        preset = preset.replace(
            reward_funcs=[*preset.kit.reward_funcs, "gpu_proof:distinct_words"],
            reward_weights=[*(w for _, w in preset.rewards), 1.0],
            learning_rate=1e-2,
            warmup_steps=0,
        )
    preset = preset.replace(
        # min_new_tokens masks EOS until the budget is used: every completion is max_completion_length long.
        generation_kwargs={"min_new_tokens": preset.grpo.max_completion_length},
        save_strategy="no",
        report_to="none",
    )
    result = train(
        preset,
        dataset=full_length_dataset(preset, load_tokenizer(preset.model.model_name_or_path)),
        output_dir=out,
        callbacks=(timer,),
    )
    row = step_figures(result, timer, preset)
    if run.kind == "export":
        _free_gpu()  # the trainer and its optimizer state are gone; give their memory back before the reload
        from grpo_kit.verify import lora_effect

        if lora_effect(result.adapter_dir):
            row["exports"] = _export(result.adapter_dir, out, base_model=preset.model.model_name_or_path)[0]
        else:  # random weights earn no reward, so the LoRA never moves: export refuses such an adapter
            row["export_note"] = "not exported: the LoRA changes nothing (every lora_B 0; no reward signal)"
    return row


def _learn(run: Run, preset, spec: dict) -> dict:
    """The learn run, as ``make demo`` types it but in one process: ``grpo-kit train --data sample`` (stopped early
    when the next step would leave less than ``learn_reserve()`` before the run's deadline), ``grpo-kit eval --compare``
    on ``spec["questions"]`` held-out questions, ``grpo-kit export --format lora,merged16 --check-answers N``."""
    from grpo_kit import runs
    from grpo_kit.data import load_gsm8k
    from grpo_kit.evaluate import evaluate_before_after
    from grpo_kit.stats import paired_difference
    from grpo_kit.train import train
    from grpo_kit.verify import lora_effect

    out = Path(spec["out"]) / "runs" / run.name
    timer = make_timer(stop_at=spec["deadline"] - learn_reserve() if spec.get("deadline") else None)
    started = time.time()
    result = train(
        preset.replace(save_strategy="no", report_to="none"), data="sample", output_dir=out, callbacks=(timer,)
    )
    row = {
        **step_figures(result, timer, preset),
        "steps_planned": preset.grpo.max_steps,
        "train_seconds": time.time() - started,
        "reward_first": result.reward_first,
        "reward_last": result.reward_last,
        "findings": [finding["check"] for finding in result.findings],  # the run doctor's (doctor.diagnose)
    }
    _free_gpu()

    # --- grpo-kit eval --compare: the same held-out questions, base (adapter disabled) then base + adapter
    started = time.time()
    trained = runs.Run.of(result.adapter_dir)
    base_model, prompt = trained.base_model, trained.prompt  # the training prompt, from the run's run.json
    questions = load_gsm8k("sample", split="test", limit=spec["questions"])
    length = preset.grpo.max_completion_length  # make demo's --max-new-tokens 48, as in training
    before, after = evaluate_before_after(
        base_model, result.adapter_dir, questions, max_new_tokens=length, batch_size=16, progress=False, **prompt
    )
    change = paired_difference(*([r["correct_strict"] for r in res.rows] for res in (before, after)))
    row.update(
        eval_seconds=time.time() - started,
        eval_n=before.n,
        eval_protocol=before.protocol,
        format_before=before.format_rate,
        format_after=after.format_rate,
        strict_before=before.accuracy_strict,
        strict_after=after.accuracy_strict,
        strict_interval=change.interval,
        lora_effect=lora_effect(result.adapter_dir),
    )
    _free_gpu()

    # --- grpo-kit export --format lora,merged16 --check-answers N: weight by weight, then merged16's answers
    started = time.time()
    row["exports"], row["answers"] = _export(result.adapter_dir, out, answers=spec["questions"])
    row["export_seconds"] = time.time() - started
    row["note"] = (
        f"format {100 * before.format_rate:.1f} % -> {100 * after.format_rate:.1f} %; LoRA effect "
        f"{row['lora_effect']:.2e}; {' + '.join(e['format'] for e in row['exports'])} verified"
    )
    return row


def _free_gpu() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _export(adapter_dir: Path, out: Path, *, base_model: str | None = None, answers: int = 0):
    """``grpo_kit.export``'s lora + merged16 (``answers``: its check-answers on that many questions): the verified
    exports as rows, and the two models' answers it recorded in export.json (None without ``answers``)."""
    from grpo_kit.export import export

    results = export(
        adapter_dir,
        ("lora", "merged16"),
        base_model=base_model,
        out_dir=out / "exports",
        overwrite=True,
        answers=answers,
    )
    recorded = json.loads((results[0].path.parent / "export.json").read_text())
    return [r.to_dict() for r in results], recorded["answers"]


def worker_main(spec_path: str) -> int:
    """``--worker SPEC.json``: one run; its row goes to SPEC's ``result`` path even when the run fails."""
    os.environ.update(OFFLINE_ENV)
    spec = json.loads(Path(spec_path).read_text())
    try:
        row = run_worker(spec)
    except Exception as error:  # noqa: BLE001 - the build or the import failed: still a row
        row = {
            "status": "error",
            "note": f"{type(error).__name__}: {error}"[:300],
            "traceback": traceback.format_exc()[-4000:],
        }
    Path(spec["result"]).write_text(json.dumps(row, default=str, indent=2))
    return 0


# ----------------------------------------------------------------------------------------------------- driver


def run_one(run: Run, args, plan_row: dict, deadline: float) -> dict:
    """Run ``run`` in a fresh Python process with a timeout; a crash, timeout or skip is still a row."""
    row = {"kind": run.kind, "tier": run.tier, "arch": run.arch, **plan_row}
    left = deadline - time.time()
    if left < 60:
        return {**row, "status": "skipped", "note": "--time-budget used up"}
    spec_dir = args.out / "specs"
    spec_dir.mkdir(parents=True, exist_ok=True)
    timeout = min(args.run_timeout, left)
    spec = {
        "kind": run.kind,
        "tier": run.tier,
        "arch": run.arch,
        "steps": run_steps(run, args.steps, getattr(args, "learn_steps", None)),
        "questions": getattr(args, "questions", LEARN_QUESTIONS),
        "deadline": time.time() + timeout,  # the learn run stops training in time to evaluate and export
        "out": str(args.out),
        "models": str(args.models or args.out / "models"),
        "result": str(spec_dir / f"{run.name}.result.json"),
    }
    spec_path = spec_dir / f"{run.name}.json"
    spec_path.write_text(json.dumps(spec))
    shutil.rmtree(args.out / "runs" / run.name, ignore_errors=True)  # train() refuses a used run folder
    Path(spec["result"]).unlink(missing_ok=True)
    log = args.out / "logs" / f"{run.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    try:
        with open(log, "w") as handle:
            done = subprocess.run(
                [sys.executable, __file__, "--worker", str(spec_path)],
                stdout=handle,
                stderr=subprocess.STDOUT,
                timeout=timeout,
                env={**os.environ, **OFFLINE_ENV},
            )
        code = done.returncode
    except subprocess.TimeoutExpired:
        return {
            **row,
            "status": "timeout",
            "note": f"no result in {timeout:.0f} s",
            "log": str(log),
        }
    row["wall_seconds"] = time.time() - start
    row["log"] = str(log)
    result = Path(spec["result"])
    if not result.is_file():  # killed hard (e.g. a CUDA fault or the kernel's OOM killer)
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] if log.is_file() else []
        return {**row, "status": "crashed", "note": f"exit {code}: {' '.join(tail)[:200]}"}
    return {**row, **json.loads(result.read_text())}


#: Plan figures copied into each result row.
PLAN_KEYS = ("cap_gib", "plan_gib", "plan_shipped_with_vllm_gib")


def can_emulate(tier_gib: float, card_gib: float) -> bool:
    """A tier can be emulated on a card at least as large (the cap only takes memory away)."""
    return card_gib >= tier_gib


def drive(args, runs: list[Run], plan: dict) -> dict:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("No CUDA GPU here. Use --dry-run to see the plan, or run this on a CUDA machine.")
    env = environment()
    result = {"date": datetime.date.today().isoformat(), "environment": env, "steps": args.steps, "rows": []}
    deadline = time.time() + args.time_budget
    by_name = {r["run"]: r for r in plan["runs"]}
    built: dict[str, dict] = {}
    for run in runs:
        plan_row = {k: by_name[run.name][k] for k in PLAN_KEYS}
        if run.arch not in built and can_emulate(plan_row["cap_gib"], env["gpu_total_gib"]):
            print(f"[gpu-proof] building a random {run.arch} ...", flush=True)
            built[run.arch] = run_one(Run("build", "-", run.arch), args, {}, deadline)
        if not can_emulate(plan_row["cap_gib"], env["gpu_total_gib"]):
            row = {
                **plan_row,
                "kind": run.kind,
                "tier": run.tier,
                "arch": run.arch,
                "status": "skipped",
                "note": f"card has {env['gpu_total_gib']:.1f} GiB < tier {plan_row['cap_gib']:g} GiB",
            }
        elif built[run.arch].get("status") != "built":
            row = {
                **plan_row,
                "kind": run.kind,
                "tier": run.tier,
                "arch": run.arch,
                "status": "error",
                "note": f"building the model failed: {built[run.arch].get('note', '')}"[:300],
            }
        else:
            print(f"[gpu-proof] {run.name} ...", flush=True)
            row = run_one(run, args, plan_row, deadline)
        print(f"[gpu-proof] {run.name}: {row['status']} {row.get('note', '')}", flush=True)
        result["rows"].append(row)
        write_results(result, args.out)  # after every run: a killed proof keeps what it measured
    return result


def write_results(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_proof.json").write_text(json.dumps(result, indent=2, default=str))
    (out / "gpu_proof.md").write_text(markdown_table(result))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiers", default=",".join(TIERS), help=f"comma-separated (default: {','.join(TIERS)})")
    parser.add_argument(
        "--archs",
        default=",".join(RANDOM),
        help=f"comma-separated (default: {','.join(RANDOM)}; {REAL}: the embedded model's real weights)",
    )
    parser.add_argument(
        "--steps", type=int, default=3, help="GRPO steps per run (default 3; s/step is the median after the first)"
    )
    parser.add_argument("--skip-plain", action="store_true", help="no plain TRL + PEFT + bitsandbytes twin runs")
    parser.add_argument("--skip-export", action="store_true", help="no export round trip")
    parser.add_argument(
        "--out",
        type=Path,
        help="results folder (default gpu-proof-results; with --dry-run: where plan.json goes, none without it)",
    )
    parser.add_argument("--models", type=Path, help="where the built models go (default OUT/models; ~35 GB)")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit (no GPU needed)")
    parser.add_argument(
        "--time-budget",
        type=float,
        default=6 * 3600,
        help="seconds for the whole proof; runs that would start later are recorded as skipped (default 6 h)",
    )
    parser.add_argument("--run-timeout", type=float, default=3600, help="seconds per run (default 1 h)")
    parser.add_argument(
        "--profile",
        choices=("full", "device"),
        default="full",
        help="device: the lent machine's stages (STAGES), one device call each; sets --steps 2 and the time limits",
    )
    parser.add_argument("--stage", type=int, choices=sorted(STAGES), help="with --profile device: the stage to run")
    parser.add_argument(
        "--rehearse",
        choices=("learn",),
        help="learn: the device's learn run on this machine, in its worker as on the device, without CUDA "
        "(transformers + PEFT, float32); prints what it shows (default --out gpu-proof-rehearsal)",
    )
    parser.add_argument(
        "--learn-steps",
        type=int,
        help=f"the learn run's GRPO steps (default: --profile device as many as stage 1 allows, at most "
        f"{LEARN_MAX_STEPS}; else the {LEARN_RECIPE} recipe's)",
    )
    parser.add_argument(
        "--questions",
        type=int,
        default=LEARN_QUESTIONS,
        help=f"the learn run's held-out questions, for eval and for check-answers (default {LEARN_QUESTIONS})",
    )
    parser.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="join the gpu_proof.json of several stages into OUT/gpu_proof.json and .md",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.tiers = _choices(args.tiers, TIERS, "--tiers")
    args.archs = _choices(args.archs, tuple(ARCHS), "--archs")
    if min(args.steps, args.learn_steps or 1, args.questions) < 1:
        parser.error("--steps, --learn-steps and --questions must be at least 1")
    if args.profile == "device":
        if args.stage is None and not args.dry_run:
            parser.error(f"--profile device runs one stage per call: --stage {' or '.join(map(str, STAGES))}")
        args.steps, args.time_budget, args.run_timeout = 2, STAGE_SECONDS, STAGE_SECONDS
        args.learn_steps = args.learn_steps or device_learn_steps()
    return args


def rehearse(args) -> int:
    """``--rehearse learn``: the learn run here, through ``run_one`` and its worker as on the device, with CUDA hidden
    (so transformers + PEFT in float32); writes OUT/gpu_proof.json and .md and prints the row in words. Exit 1 unless
    it ran to the end."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch is imported here; the worker inherits it
    args.out = args.out or Path("gpu-proof-rehearsal")
    started = time.time()
    plan = describe_plan([LEARN], args.steps, args.learn_steps)
    row = run_one(LEARN, args, {k: plan["runs"][0][k] for k in PLAN_KEYS}, started + args.time_budget)
    result = {"date": datetime.date.today().isoformat(), "environment": environment(), "steps": args.steps}
    write_results({**result, "rows": [row]}, args.out)
    print(learn_summary(row))
    print(f"[gpu-proof] rehearsal: {time.time() - started:.0f} s wall; wrote {args.out / 'gpu_proof.json'}")
    return 0 if row["status"] == "fitted" else 1


def _choices(text: str, valid: tuple, flag: str) -> tuple:
    chosen = tuple(x.strip() for x in text.split(",") if x.strip())
    bad = [x for x in chosen if x not in valid]
    if bad or not chosen:
        raise SystemExit(f"{flag}: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(valid)}.")
    return chosen


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker_main(args.worker)
    if args.merge:
        results = [json.loads(path.read_text()) for path in args.merge]
        result = {**results[0], "rows": [row for one in results for row in one["rows"]]}
        write_results(result, args.out or Path("gpu-proof-results"))
        print(markdown_table(result))
        return 0
    if args.rehearse:
        return rehearse(args)
    if args.profile == "device":
        runs = [run for stage in ([args.stage] if args.stage else STAGES) for run in STAGES[stage]]
    else:
        runs = plan_runs(args.tiers, args.archs, skip_plain=args.skip_plain, export=not args.skip_export)
    plan = describe_plan(runs, args.steps, args.learn_steps)
    if args.dry_run:
        print(format_plan(plan))
        if args.profile == "device":
            for stage, stage_runs in STAGES.items():
                print(
                    f"stage {stage} (one device call, at most {STAGE_SECONDS} s; planned "
                    f"{plan['stage_seconds'][stage]:.0f} s): " + ", ".join(run.name for run in stage_runs)
                )
            print(f"{REAL}: the embedded model's real weights; the others random weights of the real shapes")
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "plan.json").write_text(json.dumps(plan, indent=2))
        return 0
    args.out = args.out or Path("gpu-proof-results")
    result = drive(args, runs, plan)
    print(markdown_table(result))
    print(f"[gpu-proof] wrote {args.out / 'gpu_proof.json'} and {args.out / 'gpu_proof.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
