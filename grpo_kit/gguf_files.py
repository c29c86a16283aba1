"""GGUF files (llama.cpp, Ollama) and Unsloth's savers, for ``grpo_kit.export``.

Unsloth (a GPU) makes the merged and GGUF exports: ``save_pretrained_merged`` (unsloth_zoo merges shard by shard, so
an 8B model's 16-bit copy never has to fit in a T4 or in Colab's RAM) and ``save_pretrained_gguf`` (llama.cpp; one
merge for all the types), in a child process (``python -m grpo_kit.gguf_files SPEC``): importing Unsloth patches
transformers' forwards for the whole process, and the checks must run on plain transformers. ``gguf_tensors`` reads a
GGUF file back for ``verify.check_weights``. NOT RUN ON A GPU: the tests use a stand-in ``unsloth``.
"""

from __future__ import annotations

import collections
import functools
import gc
import importlib.util
import json
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import gguf
import torch
from huggingface_hub import snapshot_download

from grpo_kit.adapters import adapter_config
from grpo_kit.errors import GrpoKitError
from grpo_kit.files import read_json, write_json
from grpo_kit.models import half_dtype_name

#: The weight check's limit per storage type: ``max |d| <= rtol * max |expected|`` per tensor. bf16 rounds by 2^-8 of a
#: value, fp16 2^-11, q8_0 by 1/254 of its block's max (benchmarks/export_weight_errors.py prints the worst errors). The
#: k-quants were NOT measured: their limits follow from their 4-/5-bit grids; loose, yet a broken file (wrong tensor
#: order, a missing LoRA) errs at the scale of the values themselves.
WEIGHT_RTOL = {"bfloat16": 2**-7, "float16": 2**-9, "f16": 2**-7, "q8_0": 0.02, "q5_k_m": 0.08, "q4_k_m": 0.15}
GGUF_TYPES = ("q4_k_m", "q5_k_m", "q8_0", "f16")
#: Bytes per weight of each GGUF type, for the disk-space check (llama.cpp's bits per weight: f16 16, q8_0 8.5, q5_k_m
#: about 5.7, q4_k_m about 4.9).
GGUF_BYTES = {"f16": 2.0, "q8_0": 1.0625, "q5_k_m": 0.71, "q4_k_m": 0.61}
NO_FILES_HELP = (
    "Unsloth converts with llama.cpp, which it builds on first use (git, cmake, a C++ compiler, internet "
    "access). Read the output above, fix the build (e.g. `apt-get install cmake build-essential`) and "
    "export again, or export --format merged16 and convert it with llama.cpp's convert_hf_to_gguf.py."
)


def parse_names(spec: str | Sequence[str], allowed: Sequence[str], what: str) -> list[str]:
    """``"F16, q4_k_m"`` or ``["f16"]`` -> ``["f16", "q4_k_m"]``: lower case, in order, once each, all ``allowed``."""
    names = spec.split(",") if isinstance(spec, str) else spec
    items = [t for t in dict.fromkeys(name.strip().lower() for name in names) if t]
    if not items or (unknown := [t for t in items if t not in allowed]):
        raise GrpoKitError(f"Unknown {what} {items and unknown}; choose from {', '.join(allowed)}.")
    return items


def write_modelfile(gguf_file: Path, tokenizer) -> None:
    """An Ollama ``Modelfile`` beside ``gguf_file`` (the first type asked for): ``FROM`` it, and the chat's stop
    tokens."""
    stops = [
        f'PARAMETER stop "{stop}"'
        for stop in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>")
        if stop in tokenizer.get_vocab()
    ]
    gguf_file.with_name("Modelfile").write_text(
        "\n".join([f"FROM ./{gguf_file.name}", *stops]) + "\n", encoding="utf-8"
    )


def gguf_tensors(path: Path, config: dict, hf_names) -> dict:
    """``{hf name: (gguf name, read)}`` for the embedding, the final norm and the first and last block of a GGUF file;
    ``read(rows)`` dequantizes rows of one tensor (a slice) into the Hugging Face layout (transformers' own
    tensor processor undoes llama's q/k row order); ``read`` is None when the file lacks the tensor."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    reader = gguf.GGUFReader(path)
    arch_name = reader.fields["general.architecture"].contents()
    if (arch := next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name), None)) is None:
        raise GrpoKitError(f"{path.name} declares architecture '{arch_name}', unknown to this gguf library.")
    processor = TENSOR_PROCESSORS.get(arch_name, TensorProcessor)(config=config)
    stored = {tensor.name: tensor for tensor in reader.tensors}

    def read(gguf_name, rows):
        tensor = stored[gguf_name]
        # Rows a to b alone (the file is memory-mapped), except llama's q/k, whose row order is undone over all rows.
        whole = ".attn_q." in gguf_name or ".attn_k." in gguf_name
        values = gguf.quants.dequantize(tensor.data if whole else tensor.data[rows], tensor.tensor_type)
        weights = torch.tensor(processor.process(values, gguf_name).weights)
        return weights[rows] if whole else weights

    layers, wanted = config["num_hidden_layers"], {}
    names = gguf.get_tensor_name_map(arch, layers)
    for hf_name in hf_names:
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias")) or ""
        ends = gguf_name in {"token_embd.weight", "output_norm.weight"}
        if ends or gguf_name.startswith(("blk.0.", f"blk.{layers - 1}.")):
            wanted[hf_name] = (
                f"{gguf_name} ({hf_name})",
                functools.partial(read, gguf_name) if gguf_name in stored else None,
            )
    return wanted


# --------------------------------------------------------------------------------------------- Unsloth (GPU)


def unsloth_on_gpu() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("unsloth") is not None


def local_base(base_path: str) -> Path:
    """``base_path`` itself when it is a folder, else its Hub snapshot (config, tokenizer, safetensors only)."""
    if Path(base_path).is_dir():
        return Path(base_path)
    return Path(snapshot_download(base_path, allow_patterns=["*.json", "*.safetensors", "tokenizer*"]))


def base_cached(base_path: str) -> bool:
    """True when the Hugging Face cache already holds ``base_path``'s weights (``local_base`` then downloads
    nothing)."""
    try:
        folder = snapshot_download(base_path, allow_patterns=["*.safetensors"], local_files_only=True)
    except (OSError, ValueError):  # not cached: huggingface_hub's LocalEntryNotFoundError is a FileNotFoundError
        return False
    return any(Path(folder).glob("*.safetensors"))


def run_unsloth(
    adapter_dir: Path,
    base_path: str,
    scratch: Path,
    gguf_types: Sequence[str],
    *,
    merged16: bool,
    load_in_4bit: bool,
    say,
) -> dict[str, Path]:
    """Unsloth's savers, in one child process under ``scratch``: ``{"merged16" and/or each GGUF type: path}``.

    The adapter is copied with ``adapter_config.json`` naming ``base_path``: Unsloth merges into the base named there,
    which must be the one the checks compare with. The child's output goes to ``say`` line by line (a conversion
    takes minutes); its last 40 lines go into the error when it fails.
    """
    scratch = scratch.resolve()  # the child works in it: every path it is given must be absolute
    adapter = shutil.copytree(adapter_dir, scratch / "adapter")
    config = adapter_config(adapter)
    config.base_model_name_or_path = base_path
    config.save_pretrained(adapter)
    spec = {
        "adapter": str(adapter),
        "out": str(scratch / f"unsloth-{scratch.name}"),  # unique: Unsloth may move it
        "types": list(gguf_types),
        "merged16": merged16,
        "load_in_4bit": load_in_4bit,
    }
    tail: collections.deque[str] = collections.deque(maxlen=40)
    command = [sys.executable, "-m", "grpo_kit.gguf_files", json.dumps(spec)]
    # In scratch: llama.cpp's 16-bit GGUF is written to the working directory before quantizing (counted by the
    # space check; removed with scratch), never into the folder the export was started from.
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, cwd=scratch
    ) as child:
        try:
            for raw in child.stdout:
                line = raw.rstrip("\n")
                tail.append(line)
                say(line)
        except BaseException:  # an interrupt (Ctrl-C, a notebook's stop button) must not leave the writer running
            child.kill()
            raise
    report = Path(spec["out"] + ".json")  # the child's answer, written last: a file, not a line lost among its output
    if child.returncode != 0 or not report.is_file():
        raise GrpoKitError(
            f"Unsloth's writer failed (exit code {child.returncode}). Its last output:\n"
            + "\n".join(tail)
            + f"\n{NO_FILES_HELP}"
        )
    result = read_json(report)
    found = {"merged16": Path(result["merged16"])} if merged16 else {}
    for path in filter(Path.is_file, map(Path, result["gguf_files"])):
        file_type = gguf.GGUFReader(path).fields["general.file_type"].contents()  # Unsloth names files its own way
        kind = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_").lower().replace("bf16", "f16")
        found.setdefault(kind, shutil.move(path, scratch / path.name))  # out of the folders removed next (its new path)
    for folder in result["folders"]:  # the merged checkpoint and llama.cpp's leftovers (GBs), wherever they went
        if scratch.name in Path(folder).name and Path(folder) != found.get("merged16"):  # merged16 is kept
            shutil.rmtree(folder, ignore_errors=True)
    if missing := [t for t in gguf_types if t not in found]:
        raise GrpoKitError(
            f"Unsloth's save_pretrained_gguf ran but returned no .gguf file of type {missing}. {NO_FILES_HELP}"
        )
    return found


def _child(spec: dict) -> None:
    """In the child: Unsloth loads the adapter in the GPU's 16-bit dtype (4 bit when asked; fp16 on a T4, whose bf16
    is emulated) and runs the savers; what they wrote goes to ``<out>.json``."""
    import unsloth  # noqa: F401  before anything imports transformers: it patches its forwards
    from unsloth import FastLanguageModel

    dtype = getattr(torch, half_dtype_name())
    model, tokenizer = FastLanguageModel.from_pretrained(
        model_name=spec["adapter"], load_in_4bit=spec["load_in_4bit"], dtype=dtype
    )
    report = {"merged16": spec["out"] + "-merged16", "gguf_files": [], "folders": []}
    if spec["merged16"]:  # unsloth_zoo's merge_and_overwrite_lora: each 16-bit shard + LoRA, one at a time
        model.save_pretrained_merged(report["merged16"], tokenizer, save_method="merged_16bit")
    if spec["types"]:
        if spec["merged16"]:
            # One merge per export: a model that is not PEFT and was loaded from a folder is converted from that
            # folder (unsloth/save.py, _gguf_reuses_loaded_checkpoint), where a PEFT model would be merged again
            # (16 GB for an 8B). Loaded in 4 bit: llama.cpp reads the 16-bit files on disk, the GPU only needs room
            # for the load.
            del model
            gc.collect()
            torch.cuda.empty_cache()
            model, tokenizer = FastLanguageModel.from_pretrained(
                model_name=report["merged16"], load_in_4bit=True, dtype=dtype
            )
        result = model.save_pretrained_gguf(spec["out"], tokenizer, quantization_method=spec["types"]) or {}
        report["gguf_files"] = [str(p) for p in result.get("gguf_files") or []]
        report["folders"] = [str(p) for p in (result.get("save_directory"), result.get("gguf_directory")) if p]
    write_json(spec["out"] + ".json", report)


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
