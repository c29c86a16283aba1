"""A stand-in for llama.cpp's converter in tests: a llama model's tensors as a GGUF file (f16 or q8_0), no tokenizer.

llama.cpp (through Unsloth, on a GPU) writes the real files; the tests need true GGUF files of a merged tiny model for
``grpo_kit.verify.check_weights`` to read back. What matters to that check is here: llama's tensor names, the q/k rows
in llama.cpp's interleaved rotary order (transformers' GGUF reader undoes it), and ``general.file_type``.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np


def permute_rotary(weight, n_head: int):
    """A q/k projection's rows from Hugging Face's rotary layout (two halves per head) to llama.cpp's interleaved
    pairs."""
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(model, path, kind: str = "q8_0") -> Path:
    config, qtype = model.config, gguf.GGMLQuantizationType[kind.upper()]
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_file_type(int(gguf.LlamaFileType[f"MOSTLY_{kind.upper()}"]))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.detach().float().numpy()
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
            array = permute_rotary(array, heads)
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if array.ndim == 1:
            writer.add_tensor(gguf_name, array)
        elif kind == "f16" or array.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
            writer.add_tensor(gguf_name, array.astype(np.float16))
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)
