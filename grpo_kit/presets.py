"""VRAM-tier presets: one frozen, explained GRPO recipe per kind of machine, and ``auto_preset()`` to pick one.

A ``Preset`` holds every number a run needs (model, LoRA, batch shape, optimizer, GRPO knobs, rewards, prompt
style). ``grpo_kit.train`` maps its fields onto TRL's ``GRPOConfig``; ``grpo_kit.models.load_model`` reads the
model/LoRA/vLLM fields. Presets are plain data: change one with ``get_preset(name, field=value)``.

TRL's batch rule, which every preset satisfies (checked when a preset is built)::

    generation batch = per_device_train_batch_size × num_processes × gradient_accumulation_steps
    generation batch % num_generations == 0      (whole groups of G completions per prompt)

so ``generation batch / num_generations`` questions are trained on per optimizer step. The built-in presets are
planned for one GPU; under ``accelerate launch`` the check uses the launch's process count (``$WORLD_SIZE``).

>>> p = get_preset("t4-16gb")
>>> p.per_device_train_batch_size * p.gradient_accumulation_steps // p.num_generations  # questions per step
1
>>> get_preset("cpu", max_steps=4).max_steps
4
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
from dataclasses import dataclass

from grpo_kit.errors import GrpoKitError
from grpo_kit.models import EMBEDDED_ID
from grpo_kit.planner import check_fits, estimate_vram, shape_for

#: LoRA on every attention and MLP projection (what Unsloth's GRPO notebooks and the CPU measurement use).
ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: The documented fallback model when the tier's model is too big: 1.5B parameters, GSM8K 73 % (8-shot CoT).
FALLBACK_MODEL = "unsloth/Qwen2.5-1.5B-Instruct"
#: The same model pre-quantised to 4 bits, for presets with ``load_in_4bit`` (vLLM loads it as it is).
FALLBACK_MODEL_4BIT = "unsloth/Qwen2.5-1.5B-Instruct-bnb-4bit"
PRECISIONS = ("fp16", "bf16", "fp32")
#: Where vLLM generates (``Preset.vllm_mode``): in the training process, or in a ``trl vllm-serve`` server.
VLLM_MODES = ("colocate", "server")
#: How the policy is loaded (``Preset.backend``); ``grpo_kit.models.resolve_backend`` turns ``auto`` into one of the
#: other two for the machine and launch at hand.
BACKENDS = ("auto", "unsloth", "transformers")
#: A card is given a tier when it reports at least this fraction of the tier's ``vram_gb`` (rounding, ECC).
TIER_TOLERANCE = 0.97
#: GRPO loss variants by name (``Preset.loss_type``, ``grpo-kit train --loss-type``): the GRPOConfig fields each sets
#: and what it changes. ``OTHER_TRL_LOSS_TYPES`` go to TRL's ``loss_type`` unchanged.
LOSS_VARIANTS: dict[str, tuple[dict, str]] = {
    "grpo": (
        {"loss_type": "grpo"},
        "original GRPO: token losses averaged per completion, then over completions (length-biased: short right "
        "answers and long wrong ones are favoured)",
    ),
    "dr_grpo": (
        {"loss_type": "dr_grpo"},
        "Dr. GRPO: token losses summed and divided by a constant (max_completion_length): no length bias (the "
        "paper also drops std scaling: --set scale_rewards=none)",
    ),
    "dapo": (
        {"loss_type": "dapo"},
        "DAPO, TRL's default: token losses averaged over every token of the whole accumulated batch",
    ),
    "bnpo": (
        {"loss_type": "bnpo"},
        "BNPO: token losses averaged over the tokens of each micro-batch (= grpo at per-device batch 1)",
    ),
    "gspo": (
        {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4},
        "GSPO: one importance ratio per completion (mean token log-ratio) clipped at 3e-4/4e-4; differs from "
        "grpo only when batches are reused (num_iterations > 1 or steps_per_generation > accumulation)",
    ),
}


#: The other loss types TRL 1.15 implements (see its GRPOConfig docs); usable by name, without a kit explanation.
OTHER_TRL_LOSS_TYPES = ("cispo", "sapo", "luspo", "vespo")


def loss_variant_config(name: str) -> dict:
    """GRPOConfig fields for a loss variant name (TRL only rejects an unknown one at the first loss, after loading).

    >>> loss_variant_config("gspo")["importance_sampling_level"], loss_variant_config("cispo")
    ('sequence', {'loss_type': 'cispo'})
    """
    if name in LOSS_VARIANTS:
        return dict(LOSS_VARIANTS[name][0])
    if name in OTHER_TRL_LOSS_TYPES:
        return {"loss_type": name}
    raise GrpoKitError(
        f"Unknown loss type {name!r}. Use one of {', '.join(LOSS_VARIANTS)} (grpo-kit train --loss-type NAME) or "
        f"TRL's {', '.join(OTHER_TRL_LOSS_TYPES)}."
    )


#: Annotations of scalar preset fields (strings: this module uses postponed annotations) and how to name them.
_SCALAR_TYPES = {"int": "an integer", "float": "a number", "bool": "true or false", "str": "text"}


def _is_kind(value, kind: str) -> bool:
    """``value`` fits the annotation ``kind``; an int is a fine float, a bool is not a number."""
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, {"int": int, "bool": bool, "str": str}[kind]) and (kind == "bool" or not isinstance(value, bool))


@dataclass(frozen=True)
class Preset:
    """One complete recipe. Field names follow TRL's ``GRPOConfig`` where one exists.

    ``vram_gb`` is the memory (GiB) that PyTorch reports on the tier's card: a 16 GB T4 shows 14.7 GiB. 0 = CPU.
    ``max_prompt_length``: the data code filters out longer prompts (TRL 1.x has no such field).
    ``warmup_steps`` below 1 is a fraction of ``max_steps`` (TRL 1.x removed ``warmup_ratio``).
    ``rewards``: ``(name, weight)`` pairs, names from ``grpo_kit.rewards.REWARDS``.
    ``few_shot``: worked examples shown as earlier chat turns. ``prefill``: text the assistant's turn starts with.
    ``vllm_mode``: with ``use_vllm``, ``colocate`` (vLLM in the training process; with Unsloth it shares the weights)
    or ``server`` (generation on another GPU, in a server started with ``trl vllm-serve``; ``vllm_server_base_url``,
    default ``http://localhost:8000``).
    ``backend``: ``unsloth`` (GPU, one process or DDP), ``transformers`` (plain transformers + PEFT: the CPU path, and
    the GPU path under DeepSpeed ZeRO-3, which Unsloth does not support) or ``auto`` (the first that applies).
    """

    name: str
    vram_gb: float
    description: str
    model: str
    load_in_4bit: bool
    max_seq_length: int
    max_prompt_length: int
    max_completion_length: int
    lora_rank: int
    lora_alpha: int
    lora_targets: tuple[str, ...]
    num_generations: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int
    optim: str
    precision: str
    learning_rate: float
    lr_scheduler_type: str
    warmup_steps: float
    weight_decay: float
    max_grad_norm: float
    beta: float
    loss_type: str
    scale_rewards: str
    temperature: float
    mask_truncated_completions: bool
    use_vllm: bool
    vllm_gpu_memory_utilization: float
    gradient_checkpointing: bool
    max_steps: int
    save_steps: int
    logging_steps: int
    rewards: tuple[tuple[str, float], ...]
    few_shot: int
    prefill: str
    seed: int
    vllm_mode: str = "colocate"
    vllm_server_base_url: str = ""
    backend: str = "auto"

    def __post_init__(self) -> None:
        # Lists from JSON or keyword overrides become tuples, so presets stay hashable and immutable.
        object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        object.__setattr__(self, "rewards", tuple((str(n), float(w)) for n, w in self.rewards))
        self.validate()

    @property
    def generation_batch_size(self) -> int:
        """Completions generated per optimizer step on one GPU: per-device batch × gradient accumulation."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps

    @property
    def vllm_colocated(self) -> bool:
        """vLLM generates inside the training process, on the training GPU (``use_vllm`` and ``colocate``)."""
        return self.use_vllm and self.vllm_mode == "colocate"

    @property
    def vllm_server(self) -> bool:
        """Generation happens in a separate vLLM server (``use_vllm`` and ``server``)."""
        return self.use_vllm and self.vllm_mode == "server"

    @property
    def prompts_per_step(self) -> int:
        """Questions per optimizer step: the generation batch split into groups of ``num_generations``."""
        return self.generation_batch_size // self.num_generations

    def validate(self) -> None:
        """Raise ``GrpoKitError`` naming the fix when the numbers cannot work together."""
        where = f"Preset '{self.name}'"
        bad = [(f.name, v) for f in dataclasses.fields(self)
               if isinstance(v := getattr(self, f.name), float) and not math.isfinite(v)]
        if bad:  # ``> 0`` accepts inf, and NaN fails every comparison silently: refuse both by name
            name, value = bad[0]
            raise GrpoKitError(
                f"{where}: {name} is {value}; every number in a recipe must be finite. Pass a finite number "
                f"(--set {name}=N; the learning rate also with --learning-rate, e.g. 5e-4)."
            )
        wrong = [(f.name, f.type, v) for f in dataclasses.fields(self)
                 if f.type in _SCALAR_TYPES and not _is_kind(v := getattr(self, f.name), f.type)]
        if wrong:  # a text where a number belongs would fail later with a TypeError deep inside the checks
            name, kind, value = wrong[0]
            raise GrpoKitError(f"{where}: {name} expects {_SCALAR_TYPES[kind]}, got {value!r}.")
        if self.num_generations < 2:
            raise GrpoKitError(
                f"{where}: num_generations is {self.num_generations}; GRPO compares completions within a group, "
                "so it needs at least 2 (4-16 is usual)."
            )
        if self.per_device_train_batch_size < 1 or self.gradient_accumulation_steps < 1:
            raise GrpoKitError(f"{where}: per_device_train_batch_size and gradient_accumulation_steps must be >= 1.")
        problem = batch_rule_problem(
            self.per_device_train_batch_size, self.gradient_accumulation_steps, self.num_generations,
            processes=launched_processes(),  # under accelerate launch / torchrun every process adds a batch
        )
        if problem:
            raise GrpoKitError(f"{where}: {problem}")
        if self.max_prompt_length + self.max_completion_length > self.max_seq_length:
            raise GrpoKitError(
                f"{where}: max_prompt_length ({self.max_prompt_length}) + max_completion_length "
                f"({self.max_completion_length}) exceeds max_seq_length ({self.max_seq_length}). Raise max_seq_length "
                f"to {self.max_prompt_length + self.max_completion_length} or shorten the prompt/completion budget."
            )
        if min(self.max_prompt_length, self.max_completion_length, self.lora_rank, self.max_steps) < 1:
            raise GrpoKitError(
                f"{where}: lengths, lora_rank and max_steps must be positive, got max_prompt_length="
                f"{self.max_prompt_length}, max_completion_length={self.max_completion_length}, lora_rank="
                f"{self.lora_rank}, max_steps={self.max_steps}."
            )
        if self.precision not in PRECISIONS:
            raise GrpoKitError(f"{where}: precision {self.precision!r} is not one of {', '.join(PRECISIONS)}.")
        if not 0.0 < self.vllm_gpu_memory_utilization < 1.0:
            raise GrpoKitError(
                f"{where}: vllm_gpu_memory_utilization is a fraction of the card (0-1), got "
                f"{self.vllm_gpu_memory_utilization}."
            )
        if self.vllm_mode not in VLLM_MODES:
            raise GrpoKitError(f"{where}: vllm_mode {self.vllm_mode!r} is not one of {', '.join(VLLM_MODES)}.")
        if self.vllm_mode == "server" and not self.use_vllm:
            raise GrpoKitError(
                f"{where}: vllm_mode='server' generates with a vLLM server, but use_vllm is off. Pass use_vllm=true "
                "too (--set use_vllm=true), or drop vllm_mode."
            )
        if self.vllm_server_base_url and not self.vllm_server_base_url.startswith(("http://", "https://")):
            raise GrpoKitError(
                f"{where}: vllm_server_base_url {self.vllm_server_base_url!r} is not a URL; write it as "
                "http://HOST:PORT (e.g. http://localhost:8000)."
            )
        if self.backend not in BACKENDS:
            raise GrpoKitError(f"{where}: backend {self.backend!r} is not one of {', '.join(BACKENDS)}.")
        if not (self.learning_rate > 0 and self.temperature > 0 and self.warmup_steps >= 0 and self.beta >= 0):
            raise GrpoKitError(
                f"{where}: learning_rate and temperature must be > 0, warmup_steps and beta >= 0, got learning_rate="
                f"{self.learning_rate}, temperature={self.temperature}, warmup_steps={self.warmup_steps}, "
                f"beta={self.beta}."
            )
        if not self.lora_targets:
            raise GrpoKitError(f"{where}: lora_targets is empty; name modules such as {', '.join(ALL_PROJECTIONS)}.")
        if not self.rewards or not all(name and math.isfinite(w) for name, w in self.rewards):
            raise GrpoKitError(
                f"{where}: rewards must be (name, finite weight) pairs, e.g. (('correctness', 1.0), ('format', 1.0))."
            )


def launched_processes() -> int:
    """Training processes of this launch: ``$WORLD_SIZE`` (set by accelerate launch / torchrun), else 1."""
    value = os.environ.get("WORLD_SIZE", "1")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def batch_rule_problem(per_device: int, accumulation: int, num_generations: int, processes: int = 1) -> str | None:
    """What breaks TRL's batch rule, with the fix, or None when the generation batch holds whole groups.

    >>> batch_rule_problem(1, 4, 4) is None
    True
    >>> print(batch_rule_problem(1, 3, 4).split("Fix: ")[1])
    make the product a multiple of 4 (e.g. gradient_accumulation_steps=4), or choose num_generations among the divisors of 3: [3].
    """
    batch = per_device * processes * accumulation
    if batch % num_generations == 0:
        return None
    step = per_device * processes
    suggested = -(-batch // num_generations) * num_generations  # the next multiple of G
    while suggested % step:
        suggested += num_generations
    divisors = [d for d in range(2, batch + 1) if batch % d == 0]
    return (
        f"TRL generates per_device_train_batch_size ({per_device}) × processes ({processes}) × "
        f"gradient_accumulation_steps ({accumulation}) = {batch} completions per step and must split them into whole "
        f"groups of num_generations ({num_generations}). Fix: make the product a multiple of {num_generations} "
        f"(e.g. gradient_accumulation_steps={suggested // step}), or choose num_generations among the divisors of "
        f"{batch}: {divisors}."
    )


# Shared by the GPU tiers: Unsloth's GRPO notebook settings (lr 5e-6, cosine, 10 % warmup, clip 0.1, weight decay
# 0.1, paged 8-bit AdamW, LoRA on all projections, seed 3407), vLLM generation and gradient checkpointing.
_GPU_COMMON = dict(
    lora_targets=ALL_PROJECTIONS,
    optim="paged_adamw_8bit",
    learning_rate=5e-6,
    lr_scheduler_type="cosine",
    warmup_steps=0.1,
    weight_decay=0.1,
    max_grad_norm=0.1,
    beta=0.0,
    loss_type="dapo",
    scale_rewards="group",
    temperature=1.0,
    mask_truncated_completions=False,
    use_vllm=True,
    gradient_checkpointing=True,
    logging_steps=1,
    rewards=(("correctness", 1.0), ("format", 1.0), ("tag_count", 1.0), ("integer", 1.0)),
    few_shot=0,
    prefill="",
    seed=3407,
)

CPU = Preset(
    name="cpu",
    vram_gb=0.0,
    description=(
        "For a laptop or CI machine without a GPU. The embedded SmolLM2-135M-Instruct (no download) trains in fp32: "
        "LoRA r16/alpha 32 on all projections, lr 5e-4 (high, so a few steps visibly move), 8 completions of 48 new "
        "tokens per step at temperature 1.0 - one question with a group of G=8 (batch 8 x accumulation 1) - three "
        "short worked examples shown as earlier turns, and the answer prefilled with '<think>\\n'. Measured here: with "
        "one worked example 0 of 8 sampled completions closed the tags (every group scores the same: nothing to "
        "learn); with three, some do from the first step. The tag_progress reward pays for each format tag, with "
        "correctness at a small weight. Measured (trl 1.15, 2 cores): mean reward 0.25, 0.125, 0.5, 0.56, 0.94, 0.81, "
        "0.94, 1.0 at steps 1-8; later steps only add noise, so the recipe stops at 8. It learns the format: a 135M model's "
        "GSM8K accuracy stays near zero. beta 0 needs no reference model; gradient checkpointing is off because it "
        "only slows a model this small."
    ),
    model=EMBEDDED_ID,
    load_in_4bit=False,
    max_seq_length=576,
    max_prompt_length=512,
    max_completion_length=48,
    lora_rank=16,
    lora_alpha=32,
    lora_targets=ALL_PROJECTIONS,
    num_generations=8,
    per_device_train_batch_size=8,
    gradient_accumulation_steps=1,
    optim="adamw_torch",
    precision="fp32",
    learning_rate=5e-4,
    lr_scheduler_type="linear",
    warmup_steps=0.0,
    weight_decay=0.0,
    max_grad_norm=1.0,
    beta=0.0,
    loss_type="dapo",
    scale_rewards="group",
    temperature=1.0,
    mask_truncated_completions=False,
    use_vllm=False,
    vllm_gpu_memory_utilization=0.3,
    gradient_checkpointing=False,
    max_steps=8,
    save_steps=4,
    logging_steps=1,
    rewards=(("tag_progress", 1.0), ("correctness", 0.25)),
    few_shot=3,
    prefill="<think>\n",
    seed=3407,
)

# The CPU recipe in which correctness carries the signal: same model, prompt and LoRA as ``cpu``, but trained on
# one-step arithmetic (``--data arithmetic-1step``), which the model gets right about a quarter of the time (greedy),
# so a group of 8 samples often holds both right and wrong answers. The format comes from the prompt (98 % in format
# before training), so the reward is correctness alone. Measured in benchmarks/bench_cpu_answers.py (README, demo).
CPU_ANSWERS = dataclasses.replace(
    CPU,
    name="cpu-answers",
    description=(
        "The CPU recipe that teaches answers, not only the format: the cpu preset's model, LoRA and prompt (three "
        "worked examples, answer prefilled with '<think>\\n'), trained on one-step synthetic arithmetic "
        "(--data arithmetic-1step), problems at the edge of what the 135M model gets right (greedy: 23 % of 100 "
        "held-out ones). The prompt alone already gives the format, so the reward is correctness. Temperature 0.7, "
        "not 1.0: at 1.0 only 1 of 32 samples per step was right and 60 % ran past the budget (measured), so most "
        "groups scored all-zero and taught nothing. 4 questions x G=8 per step (batch 8 x accumulation 4) average "
        "out the noise of one question per step; lr 1e-3 (twice the cpu preset's) because there are only about ten "
        "steps; 40 new tokens fit the one-line answers (about 30 tokens). Measured: 5 steps took held-out strict "
        "accuracy from 23 % to 38 % (n=100, paired 95 % interval +4.9 to +24.7 points)."
    ),
    max_completion_length=40,
    gradient_accumulation_steps=4,
    learning_rate=1e-3,
    temperature=0.7,
    max_steps=10,
    save_steps=5,
    rewards=(("correctness", 1.0),),
)

T4 = Preset(
    name="t4-16gb",
    vram_gb=14.7,
    description=(
        "For Colab's free Tesla T4 (a 16 GB card that shows 14.7 GiB; no bf16, so fp16). Llama-3.1-8B-Instruct as "
        "Unsloth's pre-quantised 4-bit checkpoint (~5.3 GiB; vLLM loads it as it is - a model without a bnb-4bit "
        "repo is loaded in 16-bit by vLLM and runs out of memory on 15 GB). vLLM generates, holding 60 % of the "
        "card for the weights it shares with the trainer plus its KV cache; the rest is left for LoRA r32 training "
        "with gradient checkpointing and paged 8-bit AdamW. The batch, honestly: per-device batch 1 x gradient "
        "accumulation 4 = 4 completions per step, which TRL must split into whole groups of G=4, so each optimizer "
        "step trains on ONE question with 4 sampled answers, one completion per forward/backward pass. That is what "
        "fits with 512-token completions; the gradient is noisy, hence the small learning rate (5e-6) and tight "
        "clipping (0.1). 200 steps take a few hours (not yet measured; a recorded T4 run of Unsloth's similar "
        "notebook took ~47 s/step at G=6 x 200 tokens). Checkpoints every 20 steps survive a Colab disconnect."
    ),
    model="unsloth/Meta-Llama-3.1-8B-Instruct-bnb-4bit",
    load_in_4bit=True,
    max_seq_length=768,
    max_prompt_length=256,
    max_completion_length=512,
    lora_rank=32,
    lora_alpha=32,
    num_generations=4,
    per_device_train_batch_size=1,
    gradient_accumulation_steps=4,
    precision="fp16",
    vllm_gpu_memory_utilization=0.6,
    max_steps=200,
    save_steps=20,
    **_GPU_COMMON,
)

L4 = Preset(
    name="l4-24gb",
    vram_gb=22.0,
    description=(
        "For a 24 GB card with bf16: NVIDIA L4 (Colab Pro), A10G, RTX 3090/4090 (they show 22-23.6 GiB). The same "
        "4-bit Llama-3.1-8B-Instruct as the T4 tier, but twice the group (G=8) and 768-token completions: "
        "per-device batch 2 x accumulation 8 = 16 completions per step = 2 questions x 8 answers, two completions "
        "per forward/backward. A larger group gives GRPO's group-relative advantage a steadier baseline and more "
        "chances that some answer is right. vLLM holds half the card (shared weights + KV cache)."
    ),
    model="unsloth/Meta-Llama-3.1-8B-Instruct-bnb-4bit",
    load_in_4bit=True,
    max_seq_length=1024,
    max_prompt_length=256,
    max_completion_length=768,
    lora_rank=32,
    lora_alpha=32,
    num_generations=8,
    per_device_train_batch_size=2,
    gradient_accumulation_steps=8,
    precision="bf16",
    vllm_gpu_memory_utilization=0.5,
    max_steps=250,
    save_steps=25,
    **_GPU_COMMON,
)

A100_40 = Preset(
    name="a100-40gb",
    vram_gb=39.0,
    description=(
        "For an A100 40GB (or a 40-48 GB bf16 card: A6000, L40S). Enough memory to skip quantisation: "
        "Llama-3.1-8B-Instruct in bf16 (15 GiB; exact weights, and no dequantising on every matmul), LoRA r64, "
        "G=8, 1024-token completions for longer reasoning, per-device batch 4 x accumulation 4 = 16 completions "
        "per step = 2 questions x 8 answers. vLLM holds 55 % of the card: the shared bf16 weights plus a KV cache "
        "several times what one generation batch needs."
    ),
    model="unsloth/Meta-Llama-3.1-8B-Instruct",
    load_in_4bit=False,
    max_seq_length=1280,
    max_prompt_length=256,
    max_completion_length=1024,
    lora_rank=64,
    lora_alpha=64,
    num_generations=8,
    per_device_train_batch_size=4,
    gradient_accumulation_steps=4,
    precision="bf16",
    vllm_gpu_memory_utilization=0.55,
    max_steps=300,
    save_steps=25,
    **_GPU_COMMON,
)

# The 80 GB tier is the 40 GB recipe with a bigger group and batch, and less of the card for vLLM.
A100_80 = dataclasses.replace(
    A100_40,
    name="a100-80gb",
    vram_gb=79.0,
    description=(
        "For an A100 80GB or H100 80GB. bf16 Llama-3.1-8B-Instruct with LoRA r64, G=16 (a big group still finds a "
        "right answer to learn from on the hard questions), 1024-token completions, per-device batch 8 x "
        "accumulation 8 = 64 completions per step = 4 questions x 16 answers. vLLM holds 40 % of the card. "
        "Qwen2.5-Math-7B-Instruct also fits (--model unsloth/Qwen2.5-Math-7B-Instruct), but it already scores "
        "~95 % on GSM8K, leaving little for GRPO to improve."
    ),
    num_generations=16,
    per_device_train_batch_size=8,
    gradient_accumulation_steps=8,
    vllm_gpu_memory_utilization=0.4,
)

#: name → preset, smallest tier first (``auto_preset`` relies on this order).
PRESETS: dict[str, Preset] = {p.name: p for p in (CPU, CPU_ANSWERS, T4, L4, A100_40, A100_80)}
FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Preset))


def get_preset(name: str, **overrides) -> Preset:
    """The preset called ``name`` with ``overrides`` applied (``model=`` swaps the model); validated again.

    >>> get_preset("t4-16gb", model="unsloth/Qwen2.5-1.5B-Instruct-bnb-4bit").model
    'unsloth/Qwen2.5-1.5B-Instruct-bnb-4bit'
    """
    if name not in PRESETS:
        hint = difflib.get_close_matches(name, PRESETS, n=1)
        raise GrpoKitError(
            f"Unknown preset {name!r}."
            + (f" Did you mean {hint[0]!r}?" if hint else "")
            + f" Valid presets: {', '.join(PRESETS)} (or 'auto'); `grpo-kit presets` describes them."
        )
    unknown = sorted(set(overrides) - set(FIELDS))
    if unknown:
        hints = [f"{u} → {m[0]}" for u in unknown if (m := difflib.get_close_matches(u, FIELDS, n=1))]
        raise GrpoKitError(
            f"Unknown preset field(s): {', '.join(unknown)}."
            + (f" Did you mean: {', '.join(hints)}?" if hints else "")
            + f" Valid fields: {', '.join(FIELDS)}."
        )
    return dataclasses.replace(PRESETS[name], **overrides)


def auto_preset(device=None) -> tuple[Preset, str]:
    """Pick the tier for ``device`` (a ``runtime.DeviceInfo``; detected when None) and say why in one line.

    The largest GPU tier whose ``vram_gb`` the card reaches (within ``TIER_TOLERANCE``) wins; a card without bf16
    gets fp16; a GPU smaller than a T4 gets the T4 recipe with the fallback 1.5B model.

    >>> from grpo_kit.runtime import DeviceInfo
    >>> auto_preset(DeviceInfo("cuda", "Tesla T4", 14.74, False))[0].name
    't4-16gb'
    """
    if device is None:
        from grpo_kit.runtime import detect_device

        device = detect_device()
    if device.kind != "cuda":
        return PRESETS["cpu"], (
            "No CUDA GPU → cpu: the embedded SmolLM2-135M trains on the CPU in minutes (it learns the answer format, "
            "not arithmetic)."
        )
    gpu_tiers = [p for p in PRESETS.values() if p.vram_gb > 0]
    fitting = [p for p in gpu_tiers if device.vram_gb >= p.vram_gb * TIER_TOLERANCE]
    changes: dict = {}
    if fitting:
        preset = fitting[-1]
        why = f"the largest tier for {preset.vram_gb:g}+ GiB cards"
    else:
        preset = gpu_tiers[0]
        changes["model"] = FALLBACK_MODEL_4BIT if preset.load_in_4bit else FALLBACK_MODEL
        why = f"smaller than a T4's {preset.vram_gb:g} GiB, so the T4 recipe with the 1.5B fallback model"
    if preset.precision == "bf16" and not device.bf16:
        changes["precision"] = "fp16"
        why += "; fp16 since this GPU has no bf16"
    if changes:
        preset = dataclasses.replace(preset, **changes)
    estimate = estimate_vram(preset, card_gb=device.vram_gb)
    reason = (
        f"{device.name} with {device.vram_gb:.1f} GiB → {preset.name} because it is {why} "
        f"(planner: ~{estimate.total_gib:.1f} GiB)."
    )
    warning = check_fits(preset, device)
    if warning:
        reason += " Warning: " + warning
    return preset, reason


def presets_json(presets=None) -> list[dict]:
    """Every preset as a JSON-ready dict: all fields, plus the batch arithmetic and the planner's estimate (GiB)."""
    rows = []
    for preset in _as_list(presets):
        row = dataclasses.asdict(preset)
        row["lora_targets"] = list(preset.lora_targets)
        row["rewards"] = [[name, weight] for name, weight in preset.rewards]
        row["generation_batch_size"] = preset.generation_batch_size
        row["prompts_per_step"] = preset.prompts_per_step
        row["estimate_gib"] = _estimate_or_none(preset)
        rows.append(row)
    return rows


def _as_list(presets) -> list[Preset]:
    """``None`` → every preset; a ``{name: Preset}`` dict → its values; any iterable of presets → a list."""
    if presets is None:
        presets = PRESETS
    return list(presets.values()) if isinstance(presets, dict) else list(presets)


def _estimate_or_none(preset: Preset) -> float | None:
    if shape_for(preset.model) is None:
        return None
    return round(estimate_vram(preset).total_gib, 2)


def presets_table(presets=None) -> str:
    """An aligned text table of the presets' key numbers (``grpo-kit presets`` prints it)."""
    presets = _as_list(presets)
    header = ("preset", "GiB", "model", "4bit", "prec", "G", "batch×accum", "q/step", "compl", "LoRA r", "vLLM", "plan")
    rows = [header]
    for p in presets:
        estimate = _estimate_or_none(p)
        rows.append(
            (
                p.name,
                f"{p.vram_gb:g}" if p.vram_gb else "cpu",
                p.model.split("/")[-1],
                "yes" if p.load_in_4bit else "no",
                p.precision,
                str(p.num_generations),
                f"{p.per_device_train_batch_size}×{p.gradient_accumulation_steps}",
                str(p.prompts_per_step),
                str(p.max_completion_length),
                str(p.lora_rank),
                f"{p.vllm_gpu_memory_utilization:g}" if p.use_vllm else "-",
                "?" if estimate is None else f"{estimate:.1f}",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def cli_presets(args) -> int:
    """``grpo-kit presets``: the table; ``--json`` the JSON list; ``--plan NAME [--model ID]`` the VRAM breakdown."""
    if getattr(args, "model", None) and not getattr(args, "plan", None):
        raise GrpoKitError("--model only applies with --plan NAME, e.g. grpo-kit presets --plan t4-16gb --model ID")
    if getattr(args, "plan", None):
        overrides = {"model": args.model} if args.model else {}
        preset = get_preset(args.plan, **overrides)
        shape = shape_for(preset.model) or _shape_from_hub(preset.model)
        print(f"{preset.name}: {preset.description}\n")
        print(estimate_vram(preset, shape).format())
        return 0
    if getattr(args, "json", False):
        print(json.dumps(presets_json(), indent=2))
        return 0
    print(presets_table())
    print(
        "\nGiB: memory PyTorch reports on the tier's card. G: completions per question. q/step: questions per "
        "optimizer step.\nplan: the VRAM planner's estimate in GiB (for cpu: RAM, prompts at full length). "
        "Breakdown: grpo-kit presets --plan NAME; docs/VRAM.md."
    )
    return 0


def _shape_from_hub(model: str):
    """Read an unknown model's shape from its config on the Hub (only ``config.json`` is downloaded)."""
    from grpo_kit.planner import ModelShape

    try:
        from transformers import AutoConfig

        return ModelShape.from_config(AutoConfig.from_pretrained(model))
    except GrpoKitError:
        raise
    except Exception as error:  # network, gated repo, not a transformers model
        raise GrpoKitError(
            f"Could not read the config of {model!r} to plan its memory ({type(error).__name__}: {error}). "
            "Check the id (and HF_TOKEN for gated models), or pass a local model folder."
        ) from error
