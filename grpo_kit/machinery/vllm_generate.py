"""Generation through the vLLM engine Unsloth starts with ``fast_inference=True``, with the model's LoRA adapter.

``grpo_kit.evaluate`` and ``machinery.chat`` call these on a GPU when the model carries the engine (``_use_vllm``);
everything else generates with ``grpo_kit.evaluate.generate_hf``. Not run on a GPU here; tested on CPU with a fake
engine.
"""

from __future__ import annotations

import contextlib
import tempfile

from grpo_kit.errors import GrpoKitError


def generate_vllm(model, prompts, *, max_new_tokens: int, num_samples: int = 1, temperature: float | None = None,
                  seed: int = 0, lora_request=None) -> list[list[tuple[str, int]]]:
    """Sample through Unsloth's ``model.fast_generate`` (not run on a GPU; tested on CPU with a fake engine).

    Same return shape as ``generate_hf``. ``lora_request`` is what Unsloth's ``model.load_lora`` returns
    (``engine_lora_request``); None generates with the engine's base weights.
    """
    from vllm import SamplingParams  # lazy: GPU only

    params = SamplingParams(
        n=num_samples, temperature=temperature or 0.0, top_p=1.0, max_tokens=max_new_tokens, seed=seed
    )
    outputs = model.fast_generate(list(prompts), sampling_params=params, lora_request=lora_request, use_tqdm=False)
    return [[(o.text, len(o.token_ids)) for o in request.outputs] for request in outputs]


@contextlib.contextmanager
def engine_lora_request(model, lora_request=None):
    """The ``lora_request`` that makes Unsloth's vLLM engine generate with ``model``'s active LoRA adapter.

    The engine Unsloth starts with ``fast_inference=True`` holds only the base weights (it shares them with the
    trainer), so a ``fast_generate`` call without a request scores the base model. The request comes from Unsloth's
    ``model.load_lora(folder, load_tensors=True)``, which reads the adapter's live tensors (as Unsloth's GRPO trainer
    does) and writes only ``adapter_config.json`` into ``folder``, a temporary folder kept until generation ends.
    A request the caller passes is used as is; a model with no active adapter (no LoRA, or inside PEFT's
    ``disable_adapter()``) gets None: the base model, as asked.
    """
    if lora_request is not None or not _lora_active(model):
        yield lora_request
        return
    load_lora = getattr(model, "load_lora", None)
    if load_lora is None:
        raise GrpoKitError(
            "This model generates with a vLLM engine that cannot load its LoRA adapter (no load_lora), so it would "
            "score the base model. Load it with Unsloth's FastLanguageModel + get_peft_model, or evaluate through "
            "grpo_kit.models.load_inference_model (transformers generate)."
        )
    with tempfile.TemporaryDirectory(prefix="grpo-kit-lora-") as folder:
        yield load_lora(folder, load_tensors=True)


def _lora_active(model) -> bool:
    """True when a PEFT LoRA layer of ``model`` is switched on (False for a plain model or under disable_adapter)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    modules = model.modules() if hasattr(model, "modules") else ()
    return any(isinstance(m, BaseTunerLayer) and not m.disable_adapters for m in modules)


def _use_vllm(model) -> bool:
    """True for an Unsloth model loaded with ``fast_inference=True`` (it carries a vLLM engine) on a GPU."""
    import torch

    return torch.cuda.is_available() and hasattr(model, "fast_generate") and getattr(model, "vllm_engine", None) is not None
