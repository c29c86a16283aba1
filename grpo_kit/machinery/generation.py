"""Text out of a model: batched transformers ``generate`` (``generate_hf``), or the vLLM engine Unsloth starts with
``fast_inference=True``, with the model's LoRA adapter (``generate_vllm``, ``engine_lora_request``).

``grpo_kit.evaluate``, ``machinery.chat`` and curriculum sampling (``machinery.sampling``) call these. The vLLM path
runs on a GPU when the model carries the engine (``_use_vllm``); it is not run on a GPU here and is tested on CPU
with a fake engine.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Sequence

from grpo_kit.errors import GrpoKitError

#: Decoding settings every ``generate_hf`` call pins. transformers fills each setting a GenerationConfig leaves unset
#: from the model's own ``generation_config`` (Qwen2.5-Instruct ships ``repetition_penalty=1.05``, ``top_k=20``), so
#: without these the protocol would change from model to model. Sampling is plain temperature sampling.
PINNED_GENERATION = {
    "num_beams": 1, "top_k": 0, "top_p": 1.0, "typical_p": 1.0, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
}


def stop_token_ids(model, tokenizer) -> list[int]:
    """End-of-turn ids: the generation config's eos id(s) plus the tokenizer's eos id."""
    ids: list[int] = []
    config_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (config_eos, tokenizer.eos_token_id):
        for token in value if isinstance(value, (list, tuple)) else [value]:
            if token is not None and token not in ids:
                ids.append(int(token))
    return ids


def generate_hf(
    model, tokenizer, prompts: Sequence[str], *, max_new_tokens: int, batch_size: int = 8,
    num_samples: int = 1, temperature: float | None = None, progress: bool = True, desc: str = "generating",
    streamer=None,
) -> list[list[tuple[str, int]]]:
    """Batched ``generate`` with left padding: per prompt, ``num_samples`` ``(completion_text, n_tokens)``.

    The kit's one transformers generate loop (evaluation, curriculum sampling and chat call it). Greedy when
    ``temperature`` is None, else plain temperature sampling; the model's own generation defaults are not used
    (``PINNED_GENERATION``). ``n_tokens`` counts generated tokens up to and including the first stop token (padding
    excluded). Input ids per batch: ``(batch, longest_prompt)``; output ``(batch * num_samples, +new)``. The model is
    in eval mode while it generates (dropout off) and back in its own mode afterwards. ``streamer`` (e.g. a
    transformers ``TextStreamer``) prints as tokens come: one prompt, one sample.
    """
    import torch
    from tqdm.auto import tqdm
    from transformers import GenerationConfig

    stops = stop_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stops[0]
    config = GenerationConfig(**PINNED_GENERATION, do_sample=bool(temperature), temperature=temperature or 1.0,
                              max_new_tokens=max_new_tokens, num_return_sequences=num_samples, eos_token_id=stops,
                              pad_token_id=pad_id)
    device = next(model.parameters()).device
    results: list[list[tuple[str, int]]] = []
    was_training, old_side = getattr(model, "training", False), tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
    try:
        for start in tqdm(range(0, len(prompts), batch_size), desc=desc, disable=not progress, unit="batch"):
            batch = list(prompts[start : start + batch_size])
            inputs = tokenizer(batch, return_tensors="pt", padding=True).to(device)
            with torch.no_grad():
                out = model.generate(**inputs, generation_config=config, streamer=streamer)
            new = out[:, inputs["input_ids"].shape[1] :]
            texts = tokenizer.batch_decode(new, skip_special_tokens=True)
            lengths = [_generated_length(row.tolist(), stops) for row in new]
            for i in range(len(batch)):
                span = slice(i * num_samples, (i + 1) * num_samples)
                results.append(list(zip(texts[span], lengths[span], strict=True)))
    finally:
        tokenizer.padding_side = old_side
        if was_training:
            model.train()
    return results


def _generated_length(ids: list[int], stops: Sequence[int]) -> int:
    """Tokens up to and including the first stop token.

    >>> _generated_length([5, 6, 2, 2, 2], [2]), _generated_length([5, 6, 7], [2])
    (3, 3)
    """
    for index, token in enumerate(ids):
        if token in stops:
            return index + 1
    return len(ids)



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
