"""GGUF files (llama.cpp, Ollama) and Unsloth's savers, for ``grpo_kit.export``.

**CPU writer** (gguf-py): llama models with the embedded SmolLM2 tokenizer, whose ``tokenizer.*`` metadata is copied
verbatim from the embedded model's GGUF, so llama.cpp tokenizes as the original does.

**Unsloth** (a GPU) makes everything else: ``save_pretrained_gguf`` (other models, the k-quants; one merge for all the
types) and ``save_pretrained_merged`` (a base too large for the GPU in 16 bit, merged shard by shard from a 4-bit
load), in a child process (``python -m grpo_kit.gguf SPEC``): importing Unsloth patches transformers' forwards for the
whole process, and the checks must run on plain transformers. NOT RUN ON A GPU: the tests use a stand-in ``unsloth``.
"""

from __future__ import annotations

import collections
import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np
import torch
from huggingface_hub import snapshot_download

from grpo_kit.errors import GrpoKitError
from grpo_kit.models import embedded_gguf_path, half_dtype_name

#: The one table of the types an export is stored and checked in: (logit atol, logit rtol, weight rtol, GGUF writer).
#: Logits: ``max |d| <= atol + rtol * max |tuned logit|``; measured on SmolLM2-135M (max logit 28-43): bf16 storage
#: 0.21-0.27, fp16 0.05, GGUF f16 0.04-0.05, q8_0 1.0-1.7, a reloaded LoRA bit-identical: a 2.5-10x margin. Weights:
#: ``max |d| <= rtol * max |expected|`` per tensor; bf16 rounds by 2^-8 of a value, fp16 2^-11, q8_0 1/254 of its
#: block's max. The k-quants (llama.cpp's, on a GPU) were NOT measured: their limits follow from their 4-/5-bit grids
#: and the nearest types gguf-py writes (Q4_0 38 %, Q5_0 16 % of the max logit); loose, yet a broken file (wrong
#: tensor order, a missing LoRA) errs at the scale of the values themselves.
LIMITS = {
    "float32": (1e-4, 1e-5, 1e-6, None),  # a reloaded LoRA
    "bfloat16": (1e-3, 0.03, 2**-7, None),  # merged16
    "float16": (1e-3, 0.01, 2**-9, None),
    "f16": (1e-3, 0.01, 2**-7, "cpu"),  # GGUF: "cpu" = the CPU writer here (Unsloth's on a GPU for other models)
    "q8_0": (1e-2, 0.15, 0.02, "cpu"),
    "q5_k_m": (1e-2, 0.3, 0.08, "unsloth"),
    "q4_k_m": (1e-2, 0.5, 0.15, "unsloth"),
}
GGUF_TYPES = tuple(kind for kind, limit in LIMITS.items() if limit[3])
#: Bytes per weight of each GGUF type, for the disk-space check (llama.cpp's bits per weight: f16 16, q8_0 8.5, q5_k_m
#: about 5.7, q4_k_m about 4.9).
GGUF_BYTES = {"f16": 2.0, "q8_0": 1.0625, "q5_k_m": 0.71, "q4_k_m": 0.61}
GPU_HINT = ("On a GPU with Unsloth installed the export uses Unsloth's save_pretrained_gguf; or export --format "
            "merged16 and convert that folder with llama.cpp's convert_hf_to_gguf.py.")
NO_FILES_HELP = ("Unsloth converts with llama.cpp, which it builds on first use (git, cmake, a C++ compiler, internet "
                 "access). Read the output above, fix the build (e.g. `apt-get install cmake build-essential`) and "
                 "export again, or export --format merged16 and convert it with llama.cpp's convert_hf_to_gguf.py.")
RESULT_PREFIX = "grpo-kit-result: "


def parse_names(spec: str | Sequence[str], allowed: Sequence[str], what: str) -> list[str]:
    """``"F16, q4_k_m"`` or ``["f16"]`` -> ``["f16", "q4_k_m"]``: lower case, in order, once each, all ``allowed``."""
    items = list(dict.fromkeys(t.strip().lower() for t in (spec.split(",") if isinstance(spec, str) else spec)))
    if not (items := [t for t in items if t]) or (unknown := [t for t in items if t not in allowed]):
        raise GrpoKitError(f"Unknown {what} {items and unknown}; choose from {', '.join(allowed)}.")
    return items


def cpu_writer_problem(config, tokenizer, gguf_types: Sequence[str]) -> str | None:
    """Why the CPU writer cannot write ``gguf_types`` of this model, or None."""
    if quants := [t for t in gguf_types if LIMITS[t][3] != "cpu"]:
        return f"the k-quants {quants} come from llama.cpp, which the CPU GGUF writer does not run"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    biases = getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False)
    if config.model_type != "llama" or rope.get("rope_type", "default") != "default" or biases:
        return (f"the CPU GGUF writer supports the llama architecture only (SmolLM2, Llama, TinyLlama: no rope "
                f"scaling, no biases); this model is '{config.model_type}'")
    tokens = _embedded_tokenizer()["tokenizer.ggml.tokens"][0]
    if len(tokenizer) != len(tokens) or tokenizer.convert_ids_to_tokens(list(range(len(tokens)))) != tokens:
        return (f"the CPU GGUF writer copies the embedded SmolLM2 tokenizer's metadata, and this model's tokenizer "
                f"differs from it (vocab {len(tokenizer)} vs {len(tokens)})")
    return None


@functools.lru_cache(maxsize=1)
def _embedded_tokenizer() -> dict[str, tuple]:
    """``{key: (value, type, sub type)}`` of the ``tokenizer.*`` fields of the embedded model's GGUF; cached because
    gguf-py parses its 49k-entry arrays slowly (5-10 s)."""
    reader = gguf.GGUFReader(str(embedded_gguf_path()))
    return {key: (field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
            for key, field in reader.fields.items() if key.startswith("tokenizer.")}


def permute_rotary(weight, n_head: int):
    """A q/k projection's rows from Hugging Face's rotary layout (the two *halves* of each head) to llama.cpp's
    (*interleaved* pairs): the exact inverse of transformers' GGUF loader (tests/test_export.py)."""
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_gguf(model, tokenizer, path: str | os.PathLike, gguf_type: str = "q8_0", *, name: str = "model") -> Path:
    """Write ``model`` (merged, un-wrapped; ``cpu_writer_problem`` None) as one GGUF file of ``gguf_type`` (f16, q8_0).
    As in llama.cpp, norms stay float32, and a matrix whose rows do not fill whole q8_0 blocks is stored f16."""
    config = model.config
    qtype = gguf.GGMLQuantizationType[gguf_type.upper()]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {}
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(int(gguf.LlamaFileType[f"MOSTLY_{gguf_type.upper()}"]))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    for key, (value, vtype, sub_type) in _embedded_tokenizer().items():
        if key == "tokenizer.chat_template" and getattr(tokenizer, "chat_template", None):
            value = tokenizer.chat_template  # the template the adapter was trained with wins
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # readers reuse token_embd when output.weight is absent
        if (gguf_name := names.get_name(hf_name, try_suffixes=(".weight", ".bias"))) is None:
            raise GrpoKitError(f"No GGUF name for tensor '{hf_name}'. {GPU_HINT}")
        array = tensor.detach().float().cpu().numpy()
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in hf_name else config.num_key_value_heads
            array = permute_rotary(array, heads)
        if array.ndim == 1:
            writer.add_tensor(gguf_name, array)
        elif gguf_type == "f16" or array.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
            writer.add_tensor(gguf_name, array.astype(np.float16))
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def write_modelfile(folder: Path, gguf_files: Sequence[Path], tokenizer) -> None:
    """An Ollama ``Modelfile`` beside the GGUF files: ``FROM`` the first type asked for, and the chat's stop tokens."""
    stops = [f'PARAMETER stop "{stop}"' for stop in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")
             if stop in tokenizer.get_vocab()]
    (folder / "Modelfile").write_text("\n".join([f"FROM ./{gguf_files[0].name}", *stops]) + "\n", encoding="utf-8")


def gguf_tensors(path: Path, config: dict, hf_names) -> dict:
    """``{hf name: (gguf name, read)}`` for the embedding, the final norm and the first and last block of a GGUF file;
    ``read()`` dequantizes one tensor into the Hugging Face layout (transformers' own tensor processor undoes llama's
    q/k row order), or returns None when the file lacks it."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    reader = gguf.GGUFReader(str(path))
    arch_name = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    if (arch := next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name), None)) is None:
        raise GrpoKitError(f"{path.name} declares architecture '{arch_name}', unknown to this gguf library.")
    processor = TENSOR_PROCESSORS.get(arch_name, TensorProcessor)(config=config)
    stored = {tensor.name: tensor for tensor in reader.tensors}

    def read(gguf_name):
        if (tensor := stored.get(gguf_name)) is None:
            return None
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        return torch.tensor(processor.process(values, gguf_name).weights)

    layers, wanted = config["num_hidden_layers"], {}
    names = gguf.get_tensor_name_map(arch, layers)
    for hf_name in hf_names:
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias")) or ""
        ends = gguf_name in {"token_embd.weight", "output_norm.weight"}
        if ends or gguf_name.startswith(("blk.0.", f"blk.{layers - 1}.")):
            wanted[hf_name] = (f"{gguf_name} ({hf_name})", functools.partial(read, gguf_name))
    return wanted


# --------------------------------------------------------------------------------------------- Unsloth (GPU)


def unsloth_on_gpu() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("unsloth") is not None


def gguf_route(base_path: str, tokenizer, gguf_types: Sequence[str]) -> str:
    """``"cpu"`` when the CPU writer makes every type of this model, else ``"unsloth"`` on a GPU with Unsloth
    installed, else a ``GrpoKitError`` naming the way out."""
    from transformers import AutoConfig

    problem = cpu_writer_problem(AutoConfig.from_pretrained(base_path), tokenizer, gguf_types)
    if problem and not unsloth_on_gpu():
        raise GrpoKitError(f"GGUF: {problem}. {GPU_HINT}")
    return "unsloth" if problem else "cpu"


def base_too_big_for_gpu(base_path: str) -> Path | None:
    """The local folder of the 16-bit base when it is too large to load twice over for the logit check on this GPU
    (weights x 1.2 > free memory; 7-8B on a T4/L4), else None. A Hub id is downloaded (the merge needs it anyway)."""
    if not torch.cuda.is_available():
        return None
    folder = local_base(base_path)  # pragma: no cover - UNTESTED ON A GPU from here
    size, (free, total) = sum(p.stat().st_size for p in folder.glob("*.safetensors")), torch.cuda.mem_get_info()
    # mem_get_info is the card's; a per-process cap (set_per_process_memory_fraction, PyTorch's allocator setting
    # per_process_memory_fraction: a shared card, or the GPU proof's emulated T4) leaves this process less
    free = min(free, int(torch.cuda.get_per_process_memory_fraction(0) * total) - torch.cuda.memory_reserved(0))
    if size * 1.2 > free and not unsloth_on_gpu():
        raise GrpoKitError(f"The 16-bit base {base_path} ({size / 2**30:.1f} GiB) does not fit in the GPU's free "
                           f"memory ({free / 2**30:.1f} GiB), and without Unsloth it cannot be merged shard by shard. "
                           "Install Unsloth (`pip install unsloth`, as the Colab notebook does), or export --format lora.")
    return folder if size * 1.2 > free else None


def local_base(base_path: str) -> Path:
    """``base_path`` itself when it is a folder, else its Hub snapshot (config, tokenizer, safetensors only)."""
    if Path(base_path).is_dir():
        return Path(base_path)
    return Path(snapshot_download(base_path, allow_patterns=["*.json", "*.safetensors", "tokenizer*"]))


def run_unsloth(adapter_dir: Path, base_path: str, scratch: Path, gguf_types: Sequence[str], *, merged16: bool,
                load_in_4bit: bool, say) -> dict[str, Path]:
    """Unsloth's savers, in one child process under ``scratch``: ``{"merged16" and/or each GGUF type: path}``.

    The adapter is copied with ``adapter_config.json`` naming ``base_path``: Unsloth merges into the base named there,
    which must be the one the checks compare with. The child's output goes to ``say`` line by line (a conversion
    takes minutes); its last 40 lines go into the error when it fails.
    """
    adapter = scratch / "adapter"
    adapter.mkdir(parents=True)
    for item in (item for item in adapter_dir.iterdir() if item.is_file()):
        shutil.copy2(item, adapter / item.name)
    config = json.loads((adapter / "adapter_config.json").read_text(encoding="utf-8"))
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": base_path}))
    spec = {"adapter": str(adapter), "out": str(scratch / f"unsloth-{scratch.name}"),  # unique: Unsloth may move it
            "types": list(gguf_types), "merged16": merged16, "load_in_4bit": load_in_4bit}
    tail: collections.deque[str] = collections.deque(maxlen=40)
    command = [sys.executable, "-m", "grpo_kit.gguf", json.dumps(spec)]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as child:
        try:
            for line in (raw.rstrip("\n") for raw in child.stdout):
                tail.append(line)
                if not line.startswith(RESULT_PREFIX):
                    say(line)
        except BaseException:  # an interrupt (Ctrl-C, a notebook's stop button) must not leave the writer running
            child.kill()
            raise
    result = next((json.loads(line[len(RESULT_PREFIX):]) for line in tail if line.startswith(RESULT_PREFIX)), None)
    if child.returncode != 0 or result is None:
        raise GrpoKitError(f"Unsloth's writer failed (exit code {child.returncode}). Its last output:\n"
                           + "\n".join(tail) + f"\n{NO_FILES_HELP}")
    found = {"merged16": Path(result["merged16"])} if merged16 else {}
    (scratch / "kept").mkdir()
    for path in (path for path in map(Path, result["gguf_files"]) if path.is_file()):
        field = gguf.GGUFReader(str(path)).fields["general.file_type"]  # Unsloth names its files its own way
        kind = gguf.LlamaFileType(int(field.parts[-1][0])).name.removeprefix("MOSTLY_").lower().replace("bf16", "f16")
        found.setdefault(kind, Path(shutil.move(path, scratch / "kept" / path.name)))
    for folder in result["folders"]:  # the merged checkpoint and llama.cpp's leftovers (GBs), wherever they went
        if scratch.name in Path(folder).name:
            shutil.rmtree(folder, ignore_errors=True)
    if missing := [t for t in gguf_types if t not in found]:
        raise GrpoKitError(f"Unsloth's save_pretrained_gguf ran but returned no .gguf file of type {missing}. "
                           f"{NO_FILES_HELP}")
    return found


def _child(spec: dict) -> dict:
    """In the child: load the adapter with Unsloth in the GPU's 16-bit dtype (4 bit when asked) and run the savers."""
    import unsloth  # noqa: F401  before anything imports transformers: it patches its forwards
    from unsloth import FastLanguageModel

    model, tokenizer = FastLanguageModel.from_pretrained(model_name=spec["adapter"], load_in_4bit=spec["load_in_4bit"],
                                                         dtype=getattr(torch, half_dtype_name()))
    report = {"merged16": spec["out"] + "-merged16", "gguf_files": [], "folders": []}
    if spec["merged16"]:  # unsloth_zoo's merge_and_overwrite_lora: each 16-bit shard + LoRA, one at a time
        model.save_pretrained_merged(report["merged16"], tokenizer, save_method="merged_16bit")
    if spec["types"]:
        result = model.save_pretrained_gguf(spec["out"], tokenizer, quantization_method=spec["types"]) or {}
        report["gguf_files"] = [os.fspath(p) for p in result.get("gguf_files") or []]
        report["folders"] = [str(p) for p in (result.get("save_directory"), result.get("gguf_directory")) if p]
    return report


if __name__ == "__main__":
    print(RESULT_PREFIX + json.dumps(_child(json.loads(sys.argv[1]))), flush=True)
