"""Write a merged Hugging Face model as a GGUF file on CPU, with the ``gguf`` library (no llama.cpp build needed).

Scope, stated plainly: **llama-architecture models** (``LlamaForCausalLM``: SmolLM2, Llama 2/3 without rope scaling,
TinyLlama...) **whose tokenizer is the embedded SmolLM2 one** (the whole SmolLM2 family shares it). The tokenizer
metadata (``tokenizer.ggml.*``: tokens, merges, token types, special ids, the pre-tokenizer name) is copied verbatim
from the GGUF file that ships the embedded model, so llama.cpp tokenizes exactly as the original does. Anything else
(Qwen2, Gemma, Llama 3 rope scaling, another tokenizer) raises ``GrpoKitError`` pointing at the GPU path
(Unsloth's ``save_pretrained_gguf``) or llama.cpp's ``convert_hf_to_gguf.py``.

Tensor types (``GGUF_TYPES``): ``f32``, ``f16`` and ``q8_0`` (8-bit blocks of 32 with one fp16 scale each). As in
llama.cpp, 1-D tensors (norms) stay float32, and a matrix whose rows are not a multiple of 32 falls back to f16.

One detail matters for correctness: llama.cpp applies rotary embeddings to *interleaved* pairs of dimensions,
Hugging Face to the two *halves* of each head. GGUF files therefore store ``attn_q``/``attn_k`` rows reordered per
head (``permute_rotary``); readers (llama.cpp, transformers' GGUF loader) rely on it. ``grpo_kit.export`` verifies
every file by loading it back with transformers and comparing logits, which catches a wrong order at once.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grpo_kit.errors import GrpoKitError

#: User-facing type name -> (GGML tensor type name, llama.cpp file type name).
GGUF_TYPES = {"f32": ("F32", "ALL_F32"), "f16": ("F16", "MOSTLY_F16"), "q8_0": ("Q8_0", "MOSTLY_Q8_0")}
#: HF ``model_type`` -> gguf-py architecture name this writer supports.
SUPPORTED_ARCHITECTURES = {"llama": "LLAMA"}
#: Quantized blocks hold this many values; rows must be a multiple of it.
QK8_0 = 32
GPU_HINT = (
    "On a GPU use Unsloth: model.save_pretrained_gguf(dir, tokenizer, quantization_method='q8_0'), or export "
    "--format merged16 and convert that folder with llama.cpp's convert_hf_to_gguf.py."
)


def check_gguf_type(gguf_type: str) -> str:
    """The lower-cased type name, or a ``GrpoKitError`` listing the supported ones.

    >>> check_gguf_type("Q8_0")
    'q8_0'
    """
    name = gguf_type.strip().lower()
    if name not in GGUF_TYPES:
        raise GrpoKitError(
            f"GGUF type '{gguf_type}' is not supported by the CPU GGUF writer; use one of {', '.join(GGUF_TYPES)}. "
            f"For k-quants such as q4_k_m: {GPU_HINT}"
        )
    return name


def check_supported(config) -> None:
    """Raise ``GrpoKitError`` unless ``config`` is a plain llama architecture this writer handles."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise GrpoKitError(
            f"The CPU GGUF writer supports the llama architecture only (SmolLM2, Llama, TinyLlama); this model is "
            f"'{model_type}'. {GPU_HINT}"
        )
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", "default") not in {"default", None}:
        raise GrpoKitError(f"Rope scaling '{rope.get('rope_type')}' is not handled by the CPU GGUF writer. {GPU_HINT}")
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise GrpoKitError(f"Models with attention/MLP biases are not handled by the CPU GGUF writer. {GPU_HINT}")


def permute_rotary(weight, n_head: int):
    """Reorder the rows of a q/k projection from Hugging Face's half-split rotary layout to GGUF's interleaved one.

    Within each head, HF keeps the rotary pairs as (row i, row i + head_dim/2); GGUF wants them adjacent.
    ``weight`` is ``(n_head * head_dim, in_features)``; the result has the same shape.

    >>> import numpy as np
    >>> permute_rotary(np.arange(8).reshape(8, 1), n_head=2).ravel().tolist()
    [0, 2, 1, 3, 4, 6, 5, 7]
    """
    rows = weight.shape[0]
    half = rows // n_head // 2
    return weight.reshape(n_head, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def embedded_tokenizer_fields(tokenizer) -> list[tuple[str, Any, Any, Any]]:
    """``tokenizer.*`` fields of the embedded model's GGUF as ``(key, value, type, sub_type)``, if the vocab matches.

    Raises ``GrpoKitError`` when ``tokenizer``'s tokens differ from the embedded SmolLM2 tokenizer's.
    """
    from grpo_kit.machinery.embedded import embedded_gguf_path

    tokens, fields = _read_tokenizer_fields(str(embedded_gguf_path()))
    if len(tokenizer) != len(tokens) or tuple(tokenizer.convert_ids_to_tokens(list(range(len(tokens))))) != tokens:
        raise GrpoKitError(
            "The CPU GGUF writer copies tokenizer metadata from the embedded SmolLM2 model, and this model's "
            f"tokenizer differs from it (vocab {len(tokenizer)} vs {len(tokens)}). {GPU_HINT}"
        )
    return list(fields)


@functools.lru_cache(maxsize=2)
def _read_tokenizer_fields(path: str) -> tuple[tuple[str, ...], tuple]:
    """(tokens, tokenizer.* fields) of a GGUF file; cached because gguf-py parses 49k-entry arrays slowly (~5-10 s)."""
    import gguf

    reader = gguf.GGUFReader(path)
    fields = []
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
            fields.append((key, field.contents(), field.types[0], sub_type))
    return tuple(reader.fields["tokenizer.ggml.tokens"].contents()), tuple(fields)


def _tensor_for(name: str, array, qtype_name: str):
    """``(data, raw_dtype)`` for one tensor: float32 for 1-D, ``qtype_name`` for matrices (f16 if rows don't fit)."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    if array.ndim == 1 or qtype_name == "F32":
        return array.astype(np.float32), None
    if qtype_name == "F16" or array.shape[-1] % QK8_0:
        return array.astype(np.float16), None
    return quants.quantize(array.astype(np.float32), GGMLQuantizationType[qtype_name]), GGMLQuantizationType[qtype_name]


def gguf_tensors(model, qtype_name: str):
    """Yield ``(gguf_name, data, raw_dtype)`` for every weight of a llama ``model`` (q/k permuted, tied head skipped)."""
    import gguf

    config = model.config
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH[SUPPORTED_ARCHITECTURES[config.model_type]], config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # GGUF readers reuse token_embd when output.weight is absent
        if hf_name.endswith("rotary_emb.inv_freq"):
            continue
        gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise GrpoKitError(f"No GGUF name for tensor '{hf_name}'. {GPU_HINT}")
        array = tensor.detach().float().cpu().numpy()
        if hf_name.endswith("q_proj.weight"):
            array = permute_rotary(array, config.num_attention_heads)
        elif hf_name.endswith("k_proj.weight"):
            array = permute_rotary(array, config.num_key_value_heads)
        data, raw_dtype = _tensor_for(gguf_name, array, qtype_name)
        yield gguf_name, data, raw_dtype


def write_gguf(model, tokenizer, path: str | os.PathLike, gguf_type: str = "q8_0", *, name: str = "model") -> Path:
    """Write ``model`` (a merged, un-wrapped llama ``PreTrainedModel``) and its tokenizer as one GGUF file.

    ``gguf_type`` is ``f32``, ``f16`` or ``q8_0``. Returns ``path``. A 135M model takes a few seconds on 2 cores.
    """
    import gguf

    gguf_type = check_gguf_type(gguf_type)
    config = model.config
    check_supported(config)
    tokenizer_fields = embedded_tokenizer_fields(tokenizer)
    qtype_name, file_type = GGUF_TYPES[gguf_type]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    rope_theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))

    path = Path(path)
    writer = gguf.GGUFWriter(path, arch=gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[SUPPORTED_ARCHITECTURES[config.model_type]]])
    writer.add_name(name)
    writer.add_type("model")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(rope_theta))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_rope_dimension_count(head_dim)
    if head_dim != config.hidden_size // config.num_attention_heads:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(int(gguf.LlamaFileType[file_type]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, value, vtype, sub_type in tokenizer_fields:
        if key == "tokenizer.chat_template" and getattr(tokenizer, "chat_template", None):
            value = tokenizer.chat_template  # the tokenizer the adapter was trained with wins
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    for gguf_name, data, raw_dtype in gguf_tensors(model, qtype_name):
        writer.add_tensor(gguf_name, data, raw_dtype=raw_dtype)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()
    return path


def write_modelfile(folder: Path, gguf_files: Sequence[Path], tokenizer) -> None:
    """An Ollama ``Modelfile`` next to the GGUF files: ``FROM`` the last one, plus the chat template's stop tokens."""
    lines = [f"FROM ./{gguf_files[-1].name}"]
    for stop in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>"):
        if stop in tokenizer.get_vocab():
            lines.append(f'PARAMETER stop "{stop}"')
    (folder / "Modelfile").write_text("\n".join(lines) + "\n", encoding="utf-8")
