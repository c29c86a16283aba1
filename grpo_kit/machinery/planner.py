"""VRAM planner: will a preset fit on a card? A line-by-line estimate, in GiB, of what GRPO training keeps in memory.

The estimate is a sum of parts (docs/VRAM.md derives each one and works the t4-16gb example by hand)::

    total = overhead + weights + vLLM cache + LoRA training state + activations + logits

- **weights**: the frozen base model at 4 bits (bitsandbytes NF4 with double quantisation: ~0.516 byte per
  parameter of the layer matrices; embeddings and norms stay 16-bit), 16 bits (2 bytes) or 32 bits (4 bytes).
- **vLLM**: with ``use_vllm`` vLLM reserves ``vllm_gpu_memory_utilization × card memory``. Unsloth's
  ``fast_inference`` (what ``grpo_kit.models.load_model`` uses) lets vLLM and the trainer share one copy of the
  weights, so that share holds the weights *plus* vLLM's KV cache: only the part beyond the weights is added.
  Pass ``shared_weights=False`` for TRL's own colocated vLLM, which loads a second copy.
- **LoRA training state**: adapter parameters (fp32), their gradients (fp32) and Adam's two moments (8-bit for
  ``paged_adamw_8bit``/``adamw_8bit``: 2 bytes per parameter; fp32 otherwise: 8 bytes).
- **activations** of one micro-batch of ``per_device_train_batch_size`` sequences of prompt + completion tokens:
  with gradient checkpointing only each layer's input is kept, plus one layer's recomputed internals.
- **logits**: ``per_device_train_batch_size × max_completion_length × vocab`` in fp32, and as much again for their
  gradient. With Llama's 128k vocabulary this is often the largest training-side term.
- **overhead**: CUDA context, cuBLAS workspaces and allocator slack (1.5 GiB on GPU, more with vLLM's CUDA graphs).

These are planning numbers, not measurements: Unsloth chunks the logits and offloads checkpoints, so real peaks
should come out *below* the estimate. docs/VRAM.md has a table for measured peaks.

>>> est = estimate_vram_for(LLAMA_31_8B, bits=4, card_gib=14.7, per_device_batch=1, prompt_tokens=256,
...                         completion_tokens=512, lora_rank=32, use_vllm=True, vllm_share=0.6)
>>> round(est.weights_gib, 1), est.fits()
(5.3, True)
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from grpo_kit.errors import GrpoKitError
from grpo_kit.machinery.backend import gpu_required_message, needs_gpu
from grpo_kit.machinery.embedded import EMBEDDED_ID, EMBEDDED_NAME

GIB = 2**30
#: Bytes per parameter of a bitsandbytes NF4 matrix: 4 bits + an 8-bit absmax per 64 values + an fp32 second-level
#: scale per 256 absmax blocks (double quantisation): 0.5 + 1/64 + 4/(64*256).
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
#: CUDA context, cuBLAS/cuDNN workspaces and caching-allocator slack on a GPU.
GPU_OVERHEAD_GIB = 1.5
#: Extra for vLLM's CUDA graphs, sampler and scheduler buffers outside its KV cache.
VLLM_OVERHEAD_GIB = 0.5
#: Optimizers whose two Adam moments are stored in 8 bits (1 byte each per parameter).
EIGHT_BIT_OPTIMIZERS = frozenset({"paged_adamw_8bit", "adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit_fused"})
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


@dataclass(frozen=True)
class ModelShape:
    """The dimensions of a decoder-only transformer that decide its memory use.

    ``head_dim`` 0 means ``hidden // heads``. ``params`` is the published total parameter count.

    >>> LLAMA_31_8B.kv_dim, LLAMA_31_8B.embedding_params
    (1024, 1050673152)
    """

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

    @property
    def q_dim(self) -> int:
        return self.heads * (self.head_dim or self.hidden // self.heads)

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * (self.head_dim or self.hidden // self.heads)

    @property
    def embedding_params(self) -> int:
        """Input embedding plus output head (once when they are tied)."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def linear_params(self) -> int:
        """Parameters of the attention and MLP matrices: the ones 4-bit quantisation shrinks and LoRA adapts."""
        attention = self.hidden * self.q_dim * 2 + self.hidden * self.kv_dim * 2
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attention + mlp)

    def dim(self, side: str) -> int:
        return {"hidden": self.hidden, "q": self.q_dim, "kv": self.kv_dim, "intermediate": self.intermediate}[side]

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """Read a ``transformers`` config object (or its ``config.json`` as a dict).

        Multimodal configs are read through their ``text_config``. ``params`` is counted from the dimensions
        (embeddings + attention + MLP + norms), which matches the published counts of Llama/Qwen2 to <1 %.

        >>> ModelShape.from_config({"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128,
        ...     "num_attention_heads": 4, "vocab_size": 1000, "tie_word_embeddings": True}).params
        146240
        """
        get = _getter(config)
        if get("hidden_size") is None and get("text_config") is not None:
            return cls.from_config(get("text_config"))
        missing = [
            k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size") if get(k) is None
        ]
        if missing:
            raise GrpoKitError(
                f"The model config lacks {', '.join(missing)}, so the VRAM planner cannot read its shape. "
                "Pass a decoder-only language model's config (AutoConfig.from_pretrained(model_id))."
            )
        hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
        shape = cls(
            name=str(get("_name_or_path") or get("name_or_path") or get("model_type") or "custom"),
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
        norms = shape.layers * 2 * hidden + hidden
        return _replace_params(shape, shape.embedding_params + shape.linear_params + norms)


def _getter(config):
    if isinstance(config, Mapping):
        return config.get
    return lambda key: getattr(config, key, None)


def _replace_params(shape: ModelShape, params: int) -> ModelShape:
    from dataclasses import replace

    return replace(shape, params=int(params))


# Published configs (config.json on the Hub) of the models the presets name.
LLAMA_31_8B = ModelShape("Llama-3.1-8B", 8_030_261_248, 32, 4096, 14336, 32, 8, 128256)
QWEN25_MATH_7B = ModelShape("Qwen2.5-Math-7B", 7_615_616_512, 28, 3584, 18944, 28, 4, 152064)
QWEN25_15B = ModelShape("Qwen2.5-1.5B", 1_543_714_304, 28, 1536, 8960, 12, 2, 151936, tied_embeddings=True)
SMOLLM2_135M = ModelShape("SmolLM2-135M", 134_515_008, 30, 576, 1536, 9, 3, 49152, tied_embeddings=True)

#: lower-cased fragment of a model id → its shape (first match wins, so longer fragments come first).
KNOWN_SHAPES: dict[str, ModelShape] = {
    "llama-3.1-8b": LLAMA_31_8B,
    "qwen2.5-math-7b": QWEN25_MATH_7B,
    "qwen2.5-1.5b": QWEN25_15B,
    "smollm2-135m": SMOLLM2_135M,
}


def shape_for(model: str) -> ModelShape | None:
    """The shape of ``model`` from the table, or from ``config.json`` when it is a local folder; else ``None``.

    Never touches the network. ``EMBEDDED_ID`` maps to SmolLM2-135M.

    >>> shape_for("unsloth/Meta-Llama-3.1-8B-Instruct-bnb-4bit").name
    'Llama-3.1-8B'
    >>> shape_for("someone/unknown-model") is None
    True
    """
    if model in {EMBEDDED_ID, "embedded", EMBEDDED_NAME}:
        return SMOLLM2_135M
    key = model.lower()
    for fragment, shape in KNOWN_SHAPES.items():
        if fragment in key:
            return shape
    config = Path(model) / "config.json"
    if config.is_file():
        return ModelShape.from_config(json.loads(config.read_text()))
    return None


@dataclass(frozen=True)
class VramEstimate:
    """The planner's breakdown, each part in GiB; ``total_gib`` is their sum.

    ``vllm_gib`` is what vLLM adds beyond the weights it shares with the trainer (its KV cache and buffers);
    ``vllm_share_gib`` is the whole reservation and ``kv_needed_gib`` the KV cache one generation batch needs.
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

    def fits(self, card_gb: float | None = None) -> bool:
        """True when the total is within ``card_gb`` GiB (default: the card the estimate was made for)."""
        budget = self.card_gib if card_gb is None else card_gb
        return self.total_gib <= budget

    def format(self) -> str:
        """A readable breakdown, one part per line, ending with the total and the verdict."""
        rows = [
            (f"weights ({self.weight_bits}-bit)", self.weights_gib),
            (f"LoRA: {self.lora_params / 1e6:.1f}M params + grads + Adam", self.lora_gib),
            ("activations (one micro-batch)", self.activations_gib),
            ("logits (fp32, + their gradient)", self.logits_gib),
        ]
        if self.vllm_share_gib:
            rows.append(
                (
                    f"vLLM beyond the weights (share {self.vllm_share_gib:.1f}, KV needed {self.kv_needed_gib:.2f})",
                    self.vllm_gib,
                )
            )
        rows.append(("CUDA context + allocator slack", self.overhead_gib))
        width = max(len(label) for label, _ in rows)
        lines = [f"VRAM plan for {self.model}"]
        lines += [f"  {label:<{width}}  {gib:6.2f} GiB" for label, gib in rows]
        lines.append(f"  {'total':<{width}}  {self.total_gib:6.2f} GiB")
        if self.card_gib:
            verdict = "fits" if self.fits() else "does NOT fit"
            lines.append(f"  {verdict} in {self.card_gib:.1f} GiB (margin {self.card_gib - self.total_gib:+.2f} GiB)")
        return "\n".join(lines)


def lora_param_count(shape: ModelShape, rank: int, targets) -> int:
    """Adapter parameters: ``rank × (in + out)`` for each targeted projection in every layer.

    >>> lora_param_count(LLAMA_31_8B, 32, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    83886080
    """
    per_layer = 0
    for target in targets:
        sides = _TARGET_DIMS.get(target)
        if sides is None:
            raise GrpoKitError(f"Unknown LoRA target {target!r}; the planner knows {', '.join(_TARGET_DIMS)}.")
        per_layer += rank * (shape.dim(sides[0]) + shape.dim(sides[1]))
    return shape.layers * per_layer


def weight_bytes(shape: ModelShape, bits: int) -> float:
    """Bytes of the frozen weights at 4 (NF4 layer matrices, rest 16-bit), 16 or 32 bits."""
    if bits == 4:
        return shape.linear_params * NF4_BYTES + (shape.params - shape.linear_params) * 2
    if bits in (16, 32):
        return shape.params * bits / 8
    raise GrpoKitError(f"Weights can be planned at 4, 16 or 32 bits, not {bits}.")


def estimate_vram_for(
    shape: ModelShape,
    *,
    bits: int,
    card_gib: float,
    per_device_batch: int,
    prompt_tokens: int,
    completion_tokens: int,
    lora_rank: int,
    lora_targets=tuple(_TARGET_DIMS),
    optimizer_8bit: bool = True,
    activation_bytes: int = 2,
    gradient_checkpointing: bool = True,
    use_vllm: bool = False,
    vllm_share: float = 0.0,
    generation_batch: int = 1,
    shared_weights: bool = True,
    attention_scores: bool = False,
    on_gpu: bool = True,
) -> VramEstimate:
    """The estimate from explicit numbers (``estimate_vram`` reads them from a preset).

    Shapes: activations are counted for ``per_device_batch × (prompt_tokens + completion_tokens)`` tokens;
    logits for ``per_device_batch × completion_tokens × vocab``; the vLLM KV cache for ``generation_batch``
    sequences of ``prompt_tokens + completion_tokens``. ``attention_scores`` adds the ``heads × seq²`` score
    matrices that PyTorch's math attention (the CPU path) keeps; GPU kernels (flash / memory-efficient) do not.
    """
    weights = weight_bytes(shape, bits)
    lora_params = lora_param_count(shape, lora_rank, lora_targets)
    lora = lora_params * (4 + 4 + (2 if optimizer_8bit else 8))

    seq = prompt_tokens + completion_tokens
    tokens = per_device_batch * seq
    # Per token and layer: norm in/out (2h), q/k/v (h + 2kv), attention output (h), MLP norm (h),
    # gate/up (2i), activation and product (2i)  →  5h + 2kv + 4i values kept for backward.
    layer_values = 5 * shape.hidden + 2 * shape.kv_dim + 4 * shape.intermediate
    if gradient_checkpointing:
        activations = (shape.layers * shape.hidden + layer_values) * tokens * activation_bytes
    else:
        activations = shape.layers * layer_values * tokens * activation_bytes
    if attention_scores:
        layers_kept = 1 if gradient_checkpointing else shape.layers
        activations += layers_kept * per_device_batch * shape.heads * seq * seq * activation_bytes * 2
    logits = per_device_batch * completion_tokens * shape.vocab * 4 * 2

    kv_needed = generation_batch * seq * 2 * shape.layers * shape.kv_dim * 2
    share = vllm_share * card_gib * GIB if use_vllm else 0.0
    vllm_extra = max(share - weights, 0.0) if shared_weights else share
    overhead = (GPU_OVERHEAD_GIB + (VLLM_OVERHEAD_GIB if use_vllm else 0.0)) * GIB if on_gpu else 0.0
    return VramEstimate(
        model=shape.name,
        card_gib=card_gib,
        weight_bits=bits,
        weights_gib=weights / GIB,
        lora_params=lora_params,
        lora_gib=lora / GIB,
        activations_gib=activations / GIB,
        logits_gib=logits / GIB,
        vllm_gib=vllm_extra / GIB,
        vllm_share_gib=share / GIB,
        kv_needed_gib=kv_needed / GIB,
        overhead_gib=overhead / GIB,
    )


def estimate_vram(
    preset, model_shape: ModelShape | None = None, *, card_gb: float | None = None, shared_weights: bool | None = None
) -> VramEstimate:
    """Estimate a ``grpo_kit.recipes.Recipe`` on a card of ``card_gb`` GiB (default: the preset's ``vram_gb``).

    ``model_shape`` defaults to ``shape_for(preset.model_id)``; for any other model pass
    ``ModelShape.from_config(AutoConfig.from_pretrained(model_id))``. ``shared_weights`` (vLLM and the trainer share
    one copy of the weights) defaults to "not the transformers backend": only Unsloth's in-process vLLM shares them.
    With ``vllm_mode='server'`` vLLM runs on another GPU, so nothing of it is counted on the training card.

    >>> from grpo_kit.recipes import load_recipe
    >>> est = estimate_vram(load_recipe("t4-16gb"))
    >>> est.fits(14.7), est.weight_bits
    (True, 4)
    """
    shape = model_shape or shape_for(preset.model_id)
    if shape is None:
        raise GrpoKitError(
            f"The VRAM planner does not know the shape of {preset.model_id!r}. Pass model_shape="
            "ModelShape.from_config(AutoConfig.from_pretrained(model_id)), or use `grpo-kit presets --plan NAME "
            "--model ID` (it reads the config from the Hub)."
        )
    on_gpu = preset.precision != "fp32" or preset.load_in_4bit or preset.use_vllm
    if shared_weights is None:
        shared_weights = preset.backend != "transformers"
    bits = 4 if preset.load_in_4bit else (32 if preset.precision == "fp32" else 16)
    return estimate_vram_for(
        shape,
        bits=bits,
        card_gib=float(preset.vram_gb if card_gb is None else card_gb),
        per_device_batch=preset.per_device_train_batch_size,
        prompt_tokens=preset.max_prompt_length,
        completion_tokens=preset.max_completion_length,
        lora_rank=preset.lora_rank,
        lora_targets=preset.lora_targets,
        optimizer_8bit=preset.optim in EIGHT_BIT_OPTIMIZERS,
        activation_bytes=4 if preset.precision == "fp32" else 2,
        gradient_checkpointing=preset.gradient_checkpointing,
        use_vllm=preset.vllm_colocated,
        vllm_share=preset.vllm_gpu_memory_utilization,
        generation_batch=preset.per_device_train_batch_size * preset.gradient_accumulation_steps,
        shared_weights=shared_weights,
        attention_scores=not on_gpu,
        on_gpu=bool(on_gpu),
    )


def check_fits(preset, device, model_shape: ModelShape | None = None) -> str | None:
    """A warning saying what to change when ``preset`` will not fit ``device`` (a ``runtime.DeviceInfo``), else None.

    Returns None when the model's shape is unknown offline (nothing to check against).
    """
    if device.kind != "cuda":
        return gpu_required_message(preset) if needs_gpu(preset) else None
    shape = model_shape or shape_for(preset.model_id)
    if shape is None:
        return None
    est = estimate_vram(preset, shape, card_gb=device.vram_gb)
    problems = []
    if not est.fits():
        problems.append(
            f"Preset '{preset.name}' with {shape.name} needs about {est.total_gib:.1f} GiB but {device.name} has "
            f"{device.vram_gb:.1f} GiB."
        )
    if preset.vllm_colocated and est.vllm_share_gib - est.weights_gib < est.kv_needed_gib:
        problems.append(
            f"vLLM's share ({preset.vllm_gpu_memory_utilization:.2f} × {device.vram_gb:.1f} GiB = "
            f"{est.vllm_share_gib:.1f} GiB) leaves less than the {est.kv_needed_gib:.2f} GiB of KV cache one "
            "generation batch needs after the weights."
        )
    if not problems:
        return None
    fixes = [
        "a smaller preset (`grpo-kit presets` lists them; --preset auto picks by memory)",
        f"shorter completions (--set max_completion_length={max(64, preset.max_completion_length // 2)})",
        "fewer generations (--set num_generations=N with gradient_accumulation_steps a multiple of it)",
    ]
    if preset.vllm_colocated:
        fixes.append(
            f"a different vLLM share (vllm_gpu_memory_utilization, now {preset.vllm_gpu_memory_utilization}): lower "
            "frees memory for training, higher gives vLLM room for its KV cache"
        )
    if not preset.load_in_4bit:
        fixes.append("4-bit weights (load_in_4bit=True with an unsloth/...-bnb-4bit model)")
    return " ".join(problems) + " Try: " + "; ".join(fixes) + ". See docs/VRAM.md."


def check_device(recipe, device) -> None:
    """Refuse settings the machine cannot run, and warn when the VRAM planner expects the recipe not to fit.

    Raises ``GrpoKitError`` for a GPU-only recipe without a GPU and for bf16 on a card without bf16 (a T4).
    """
    import warnings


    if device.kind != "cuda" and needs_gpu(recipe):
        raise GrpoKitError(check_fits(recipe, device))
    if device.kind == "cuda" and recipe.precision == "bf16" and not device.bf16:
        raise GrpoKitError(
            f"{device.name} has no bf16 support (a T4 or older card). Use fp16: pass precision='fp16' "
            "(--set precision=fp16) or the t4-16gb recipe."
        )
    problem = check_fits(recipe, device)
    if problem:
        warnings.warn(f"VRAM planner: {problem}", stacklevel=3)


#: A card is given a tier when it reports at least this fraction of the tier's ``vram_gb`` (rounding, ECC).
TIER_TOLERANCE = 0.97


#: The documented fallback model when the tier's model is too big: 1.5B parameters.
FALLBACK_MODEL = "unsloth/Qwen2.5-1.5B-Instruct"


#: The same model pre-quantised to 4 bits, for recipes with ``load_in_4bit`` (vLLM loads it as it is).
FALLBACK_MODEL_4BIT = "unsloth/Qwen2.5-1.5B-Instruct-bnb-4bit"


def auto_recipe(device=None) -> tuple:
    """Pick the tier for ``device`` (a ``runtime.DeviceInfo``; detected when None) and say why in one line.

    The largest GPU tier whose ``vram_gb`` the card reaches (within ``TIER_TOLERANCE``) wins; a card without bf16
    gets fp16; a GPU smaller than a T4 gets the T4 recipe with the fallback 1.5B model.

    >>> from grpo_kit.machinery.runtime import DeviceInfo
    >>> auto_recipe(DeviceInfo("cuda", "Tesla T4", 14.74, False))[0].name
    't4-16gb'
    """
    from grpo_kit.recipes import RECIPES

    if device is None:
        from grpo_kit.machinery.runtime import detect_device

        device = detect_device()
    if device.kind != "cuda":
        return RECIPES["cpu"], (
            "No CUDA GPU → cpu: the embedded SmolLM2-135M trains on the CPU in minutes (it learns the answer format; "
            "the cpu-answers recipe teaches one-step arithmetic)."
        )
    gpu_tiers = [r for r in RECIPES.values() if r.vram_gb > 0]
    fitting = [r for r in gpu_tiers if device.vram_gb >= r.vram_gb * TIER_TOLERANCE]
    changes: dict = {}
    if fitting:
        recipe = fitting[-1]
        why = f"the largest tier for {recipe.vram_gb:g}+ GiB cards"
    else:
        recipe = gpu_tiers[0]
        changes["model.id"] = FALLBACK_MODEL_4BIT if recipe.model["load_in_4bit"] else FALLBACK_MODEL
        why = f"smaller than a T4's {recipe.vram_gb:g} GiB, so the T4 recipe with the 1.5B fallback model"
    if recipe.model["precision"] == "bf16" and not device.bf16:
        changes["model.precision"] = "fp16"
        why += "; fp16 since this GPU has no bf16"
    recipe = recipe.with_overrides(changes)
    estimate = estimate_vram(recipe, card_gb=device.vram_gb)
    reason = (f"{device.name} with {device.vram_gb:.1f} GiB → {recipe.name} because it is {why} "
              f"(planner: ~{estimate.total_gib:.1f} GiB).")
    warning = check_fits(recipe, device)
    return recipe, reason + (" Warning: " + warning if warning else "")
