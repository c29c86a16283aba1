"""VRAM planner: will a recipe fit on a card? A part-by-part estimate, in GiB, of what GRPO training keeps in memory:

    total = weights + LoRA state (params, grads, Adam) + activations + logits + vLLM beyond the weights + CUDA overhead

docs/VRAM.md derives each part and works the t4-16gb example by hand. These are planning numbers, not measurements:
Unsloth chunks the logits and offloads checkpoints, so real peaks should come out below the estimate.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, replace

from grpo_kit.config import load_recipe, recipe_names
from grpo_kit.errors import GrpoKitError

GIB = 2**30
#: Bytes per parameter of a bitsandbytes NF4 matrix: 4 bits + an 8-bit absmax per 64 values + an fp32 second-level
#: scale per 256 absmax blocks (double quantisation): 0.5 + 1/64 + 4/(64*256).
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
GPU_OVERHEAD_GIB = 1.5  # CUDA context, cuBLAS/cuDNN workspaces, caching-allocator slack
VLLM_OVERHEAD_GIB = 0.5  # vLLM's CUDA graphs, sampler and scheduler buffers outside its KV cache
#: Which side of a LoRA target the projection maps from/to, for counting adapter parameters.
_TARGET_DIMS = {
    "q_proj": ("hidden", "q"),
    "k_proj": ("hidden", "kv"),
    "v_proj": ("hidden", "kv"),
    "o_proj": ("q", "hidden"),
    "gate_proj": ("hidden", "intermediate"),
    "up_proj": ("hidden", "intermediate"),
    "down_proj": ("intermediate", "hidden"),
}
#: A card is given a tier when it reports at least this fraction of the tier's ``vram_gb`` (rounding, ECC).
TIER_TOLERANCE = 0.97


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only transformer that decide its memory use (``head_dim`` 0: hidden // heads)."""

    name: str
    params: int
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    vocab: int
    tied_embeddings: bool = False
    head_dim: int = 0

    def dim(self, side: str) -> int:
        head = self.head_dim or self.hidden // self.heads
        return {
            "hidden": self.hidden,
            "q": self.heads * head,
            "kv": self.kv_heads * head,
            "intermediate": self.intermediate,
        }[side]

    @property
    def linear_params(self) -> int:
        """Parameters of the attention and MLP matrices: the ones 4-bit quantisation shrinks and LoRA adapts."""
        attention = 2 * self.hidden * (self.dim("q") + self.dim("kv"))
        return self.layers * (attention + 3 * self.hidden * self.intermediate)

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """Read a transformers config (or its ``config.json`` as a dict); a multimodal one through ``text_config``.

        ``params`` is counted from the dimensions (embeddings + matrices + norms): Llama's count exactly, Qwen2's to
        <1 % (its q/k/v biases are not counted).
        """
        get = config.get if isinstance(config, Mapping) else lambda key: getattr(config, key, None)
        if get("hidden_size") is None and get("text_config") is not None:
            return cls.from_config(get("text_config"))
        missing = [
            k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size") if get(k) is None
        ]
        if missing:
            raise GrpoKitError(
                f"The model config lacks {', '.join(missing)}, so the VRAM planner cannot read its "
                "shape. Pass a decoder-only language model's config (AutoConfig.from_pretrained(id))."
            )
        hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        shape = cls(
            name=str(get("_name_or_path") or get("model_type") or "custom"),
            params=0,
            layers=int(get("num_hidden_layers")),
            hidden=hidden,
            intermediate=int(get("intermediate_size") or 4 * hidden),
            heads=heads,
            kv_heads=int(get("num_key_value_heads") or heads),
            vocab=int(get("vocab_size")),
            tied_embeddings=bool(get("tie_word_embeddings")),
            head_dim=int(get("head_dim") or 0),
        )
        embeddings = shape.vocab * hidden * (1 if shape.tied_embeddings else 2)
        return replace(shape, params=embeddings + shape.linear_params + (2 * shape.layers + 1) * hidden)


# Published configs (config.json on the Hub) of the shipped models, so the planner works offline.
LLAMA_31_8B = ModelShape("Llama-3.1-8B", 8_030_261_248, 32, 4096, 14336, 32, 8, 128256)
QWEN25_MATH_7B = ModelShape("Qwen2.5-Math-7B", 7_615_616_512, 28, 3584, 18944, 28, 4, 152064)
QWEN25_15B = ModelShape("Qwen2.5-1.5B", 1_543_714_304, 28, 1536, 8960, 12, 2, 151936, tied_embeddings=True)
SMOLLM2_135M = ModelShape("SmolLM2-135M", 134_515_008, 30, 576, 1536, 9, 3, 49152, tied_embeddings=True)
#: lower-cased fragment of a model id -> its shape (``embedded:smollm2-135m`` matches the last one).
KNOWN_SHAPES = {
    "llama-3.1-8b": LLAMA_31_8B,
    "qwen2.5-math-7b": QWEN25_MATH_7B,
    "qwen2.5-1.5b": QWEN25_15B,
    "smollm2-135m": SMOLLM2_135M,
}


def shape_for(model: str) -> ModelShape | None:
    """``model``'s shape from its transformers config (a local folder or the Hub cache, never downloaded), else from
    the built-in table; None when unknown."""
    from transformers import AutoConfig

    try:
        return ModelShape.from_config(AutoConfig.from_pretrained(model, local_files_only=True))
    except (OSError, ValueError):  # not cached or offline, not an id (embedded:...), not a transformers model
        return next((shape for fragment, shape in KNOWN_SHAPES.items() if fragment in model.lower()), None)


@dataclass(frozen=True)
class VramEstimate:
    """The planner's breakdown, each part in GiB; ``total_gib`` is their sum.

    ``vllm_gib`` is what vLLM adds beyond the weights it shares with the trainer; ``vllm_share_gib`` is its whole
    reservation and ``kv_needed_gib`` the KV cache one generation batch needs (a check, not added).
    """

    model: str
    card_gib: float
    weight_bits: int
    weights_gib: float
    lora_params: int
    lora_gib: float
    activations_gib: float
    logits_gib: float
    vllm_gib: float
    vllm_share_gib: float
    kv_needed_gib: float
    overhead_gib: float

    @property
    def total_gib(self) -> float:
        return (
            self.weights_gib
            + self.lora_gib
            + self.activations_gib
            + self.logits_gib
            + self.vllm_gib
            + self.overhead_gib
        )

    def fits(self) -> bool:
        return self.total_gib <= self.card_gib

    def format(self) -> str:
        rows = {
            f"weights ({self.weight_bits}-bit)": self.weights_gib,
            f"LoRA: {self.lora_params / 1e6:.1f}M params + grads + Adam": self.lora_gib,
            "activations (one micro-batch)": self.activations_gib,
            "logits (fp32, + their gradient)": self.logits_gib,
            f"vLLM beyond the weights (share {self.vllm_share_gib:.1f}, "
            f"KV needed {self.kv_needed_gib:.2f})": self.vllm_gib,
            "CUDA context + allocator slack": self.overhead_gib,
            "total": self.total_gib,
        }
        width = max(map(len, rows))
        lines = [f"VRAM plan for {self.model}"] + [f"  {label:<{width}}  {gib:6.2f} GiB" for label, gib in rows.items()]
        if self.card_gib:
            verdict = "fits" if self.fits() else "does NOT fit"
            lines.append(f"  {verdict} in {self.card_gib:.1f} GiB (margin {self.card_gib - self.total_gib:+.2f} GiB)")
        return "\n".join(lines)


def lora_param_count(shape: ModelShape, rank: int, targets) -> int:
    """Adapter parameters: ``rank × (in + out)`` per targeted projection per layer (None/"all-linear": all seven)."""
    if targets in (None, "all-linear", ["all-linear"]):
        targets = list(_TARGET_DIMS)
    unknown = [t for t in targets if t not in _TARGET_DIMS]
    if unknown:
        raise GrpoKitError(f"Unknown LoRA target {unknown[0]!r}; the planner knows {', '.join(_TARGET_DIMS)}.")
    return shape.layers * sum(rank * sum(map(shape.dim, _TARGET_DIMS[t])) for t in targets)


def estimate_vram(recipe, shape: ModelShape | None = None, *, card_gb: float | None = None) -> VramEstimate:
    """Estimate a ``grpo_kit.config.Recipe`` (model: ``shape``, default ``shape_for`` its model) on a card of
    ``card_gb`` GiB (default: its ``vram_gb``). A recipe in 32 bits without vLLM is planned for the CPU (RAM)."""
    config, model_id = recipe.grpo, recipe.model.model_name_or_path
    shape = shape or shape_for(model_id)
    if shape is None:
        raise GrpoKitError(
            f"The VRAM planner does not know the shape of {model_id!r}: pass shape=ModelShape."
            f"from_config(AutoConfig.from_pretrained({model_id!r})) in Python (a local model folder "
            "or a model in the Hub cache needs no shape: its config is read)."
        )
    value_bytes = 2 if (config.bf16 or config.fp16) else 4  # weights and activations in the compute dtype
    bits = 4 if recipe.model.load_in_4bit else 8 * value_bytes
    on_gpu = bits < 32 or config.use_vllm
    card_gib = float(recipe.kit.vram_gb if card_gb is None else card_gb)
    if bits == 4:  # NF4 layer matrices; embeddings and norms stay 16-bit
        weights = shape.linear_params * NF4_BYTES + (shape.params - shape.linear_params) * 2
    else:
        weights = shape.params * bits / 8
    lora_params = lora_param_count(shape, recipe.model.lora_r, recipe.model.lora_target_modules)
    optimizer_8bit = "8bit" in config.optim  # bitsandbytes: 1 byte per Adam moment (OptimizerNames is a str enum)
    batch, seq = config.per_device_train_batch_size, recipe.kit.max_prompt_length + config.max_completion_length
    # Per token and layer: norm in/out (2h), q/k/v (h + 2kv), attention output (h), MLP norm (h), gate/up (2i),
    # activation and product (2i): 5h + 2kv + 4i values kept for backward. Gradient checkpointing keeps each layer's
    # input (h) and the values of the one layer being recomputed.
    layer_values = 5 * shape.hidden + 2 * shape.dim("kv") + 4 * shape.intermediate
    full_layers, inputs = (1, shape.layers * shape.hidden) if config.gradient_checkpointing else (shape.layers, 0)
    activations = (inputs + full_layers * layer_values) * batch * seq * value_bytes
    if not on_gpu:  # PyTorch's math attention keeps the heads × seq² scores (and their softmax)
        activations += full_layers * batch * shape.heads * seq**2 * value_bytes * 2
    # Colocated vLLM reserves a share of the card. Unsloth's fast_inference shares the trainer's weights, so only the
    # share beyond them is added; TRL's own colocated vLLM (the transformers backend) loads a second copy.
    share = config.vllm_gpu_memory_utilization * card_gib * GIB if recipe.vllm_colocated else 0.0
    shared_weights = recipe.kit.backend != "transformers"
    return VramEstimate(
        model=shape.name,
        card_gib=card_gib,
        weight_bits=bits,
        weights_gib=weights / GIB,
        lora_params=lora_params,
        lora_gib=lora_params * (4 + 4 + (2 if optimizer_8bit else 8)) / GIB,
        activations_gib=activations / GIB,
        logits_gib=batch * config.max_completion_length * shape.vocab * 4 * 2 / GIB,
        vllm_gib=(max(share - weights, 0.0) if shared_weights else share) / GIB,
        vllm_share_gib=share / GIB,
        kv_needed_gib=config.generation_batch_size * seq * 2 * shape.layers * shape.dim("kv") * 2 / GIB,
        overhead_gib=(GPU_OVERHEAD_GIB + (VLLM_OVERHEAD_GIB if recipe.vllm_colocated else 0.0)) if on_gpu else 0.0,
    )


def check_device(recipe, device) -> None:
    """Refuse what this machine cannot run: a ``report_to`` integration whose package is missing, GPU-only settings
    without a GPU (``device``: ``models.detect_device()``), bf16 on a GPU without it (compute capability below 8.0,
    e.g. a T4). Warn, naming the fixes, when the planner expects the recipe not to fit the card."""
    from transformers.integrations import get_reporting_integration_callbacks

    config = recipe.grpo
    try:  # transformers' own checks: each integration's callback refuses to start without its package
        for callback in get_reporting_integration_callbacks(config.report_to):
            callback()
    except Exception as error:  # the message names the install command: `pip install wandb`
        raise GrpoKitError(
            f"Recipe '{recipe.name}': report_to={','.join(config.report_to)} cannot work here: {error} Or log to "
            "metrics.jsonl only: --set report_to=none."
        ) from None
    if device.kind != "cuda":
        # 4-bit weights are not among them: bitsandbytes (0.50.2) has CPU kernels for NF4 (the cpu-4bit recipe)
        if gpu_only := [key for key in ("use_vllm", "bf16", "fp16") if getattr(config, key)]:
            raise GrpoKitError(
                f"Recipe '{recipe.name}' needs a CUDA GPU for {', '.join(gpu_only)} and this machine has none (the "
                f"kit runs vLLM on a GPU only). Turn off ({' '.join(f'--set {key}=false' for key in gpu_only)}) or use "
                "a CPU recipe (--preset cpu); on "
                "Colab: Runtime > Change runtime type > T4 GPU."
            )
        return
    if config.bf16 and not device.bf16:
        raise GrpoKitError(
            f"{device.name} has no bf16 (compute capability below 8.0, e.g. a T4). Use fp16: --set "
            "bf16=false --set fp16=true (in code: recipe.replace(bf16=False, fp16=True)), or the "
            "t4-16gb recipe."
        )
    shape = shape_for(recipe.model.model_name_or_path)
    if shape is None:  # unknown offline: no check
        return
    est = estimate_vram(recipe, shape, card_gb=device.vram_gb)
    problems = []
    if not est.fits():
        problems.append(
            f"Recipe '{recipe.name}' with {shape.name} needs about {est.total_gib:.1f} GiB but "
            f"{device.name} has {device.vram_gb:.1f} GiB."
        )
    if recipe.vllm_colocated and est.vllm_share_gib - est.weights_gib < est.kv_needed_gib:
        problems.append(
            f"vLLM's share ({config.vllm_gpu_memory_utilization:.2f} × {device.vram_gb:.1f} GiB = "
            f"{est.vllm_share_gib:.1f} GiB) leaves less than the {est.kv_needed_gib:.2f} GiB of KV cache "
            "one generation batch needs after the weights."
        )
    if not problems:
        return
    fixes = [
        "a smaller preset (--preset auto picks by memory)",
        f"shorter completions (--set max_completion_length={max(64, config.max_completion_length // 2)})",
    ]
    if recipe.vllm_colocated:
        fixes.append(
            f"another vllm_gpu_memory_utilization (now {config.vllm_gpu_memory_utilization}): lower leaves "
            "training more memory, higher gives vLLM's KV cache more"
        )
    if not recipe.model.load_in_4bit:
        fixes.append("4-bit weights (--set load_in_4bit=true with an unsloth/...-bnb-4bit model)")
    warnings.warn(f"VRAM planner: {' '.join(problems)} Try: {'; '.join(fixes)}. See docs/VRAM.md.", stacklevel=2)


def auto_recipe(device=None) -> tuple[str, str]:
    """``(recipe name, why)`` for ``device`` (detected when None): ``cpu`` without a GPU, else the largest tier the
    card reaches (within ``TIER_TOLERANCE``) in its precision (bf16 tiers on a card with bf16, the T4's fp16 tier
    otherwise); below every tier the smallest, and ``why`` names the smaller model to switch to."""
    from grpo_kit.models import detect_device

    device = device or detect_device()
    if device.kind != "cuda":
        return "cpu", (
            "no CUDA GPU: the embedded SmolLM2-135M trains on the CPU in minutes (it learns the answer "
            "format; the cpu-answers recipe teaches one-step arithmetic)"
        )
    tiers = [r for r in map(load_recipe, recipe_names()) if r.kit.vram_gb > 0]
    runnable = [r for r in tiers if r.grpo.bf16 == device.bf16] or tiers  # a bf16 card trains in bf16
    fitting = [r for r in runnable if device.vram_gb >= r.kit.vram_gb * TIER_TOLERANCE]
    if not fitting:
        smallest = runnable[0]
        model = "unsloth/Qwen2.5-1.5B-Instruct" + ("-bnb-4bit" if smallest.model.load_in_4bit else "")
        advice = (  # the 8 GB tier trains the 1.5B already, and vLLM's share of the card shrinks with it
            f"its 1.5B model plans ~{estimate_vram(smallest, card_gb=device.vram_gb).total_gib:.1f} GiB here"
            if smallest.model.model_name_or_path == model
            else f'use a 1.5B model (notebook 00: MODEL = "Qwen2.5-1.5B"; grpo-kit: --set model_name_or_path={model})'
        )
        return smallest.name, (
            f"{device.name} ({device.vram_gb:.1f} GiB) is smaller than the smallest tier "
            f"({smallest.kit.vram_gb:g} GiB): {advice}"
        )
    recipe = fitting[-1]
    estimate = estimate_vram(recipe, card_gb=device.vram_gb)
    return recipe.name, (
        f"{device.name} with {device.vram_gb:.1f} GiB: the largest tier it runs as shipped "
        f"({recipe.kit.vram_gb:g}+ GiB{'' if device.bf16 else ', fp16: no bf16 on this card'}; "
        f"planner: ~{estimate.total_gib:.1f} GiB)"
    )


# --------------------------------------------------------------------------------------------- grpo-kit presets


def presets_table(recipes) -> str:
    rows = [("preset", "GiB", "model", "4bit", "prec", "G", "batch×accum", "q/step", "compl", "LoRA r", "vLLM", "plan")]
    for recipe in recipes:
        config, shape = recipe.grpo, shape_for(recipe.model.model_name_or_path)  # None: unknown offline, planned as "?"
        rows.append(
            (
                recipe.name,
                f"{recipe.kit.vram_gb:g}" if recipe.kit.vram_gb else "cpu",
                recipe.model.model_name_or_path.split("/")[-1],
                "yes" if recipe.model.load_in_4bit else "no",
                "bf16" if config.bf16 else "fp16" if config.fp16 else "fp32",
                str(config.num_generations),
                f"{config.per_device_train_batch_size}×{config.gradient_accumulation_steps}",
                str(recipe.prompts_per_step),
                str(config.max_completion_length),
                str(recipe.model.lora_r),
                f"{config.vllm_gpu_memory_utilization:g}" if config.use_vllm else "-",
                "?" if shape is None else f"{estimate_vram(recipe, shape).total_gib:.1f}",
            )
        )
    widths = [max(map(len, column)) for column in zip(*rows, strict=True)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows)


def cli_presets(args) -> int:
    """``grpo-kit presets``: the table; ``--plan NAME`` one VRAM breakdown."""
    if args.plan:
        recipe = load_recipe(args.plan)
        text = f"{recipe.name}: {recipe.kit.description}\n\n{estimate_vram(recipe).format()}"
    else:
        text = presets_table(map(load_recipe, recipe_names())) + (
            "\n\nG: completions per question; q/step: questions per optimizer step; plan: the VRAM planner's GiB (cpu: "
            "RAM), broken down by --plan NAME.\nEach preset is recipes/NAME.yaml; one run's change: --set key=value."
        )
    print(text)
    return 0
