"""GGUF through Unsloth (GPU only), in a child process: ``python -m grpo_kit.machinery.unsloth_gguf --adapter A --out D --type T``.

This is the route for models the CPU writer (``grpo_kit.machinery.gguf_export``) does not cover (Qwen2, Llama 3 rope scaling,
other tokenizers) and for k-quants such as ``q4_k_m``. What Unsloth 2026.10.7 does (``unsloth/save.py``,
``unsloth_save_pretrained_gguf``): merge the LoRA into a 16-bit checkpoint in ``save_directory``, build llama.cpp,
convert and quantize, and write the ``.gguf`` files into the **sibling** folder ``<save_directory>_gguf``; it
returns a dict whose ``"gguf_files"`` lists their paths.

Why a child process: importing Unsloth patches transformers' model forwards for the whole process, and the export's
verification must compare the file with plain transformers. The child loads the adapter with Unsloth, calls the
writer and prints one line ``grpo-kit-result: {json}`` (``RESULT_PREFIX``) with the paths the writer returned; the
parent (``write_with_unsloth``) streams the child's output, reads that line, and ``move_gguf_files`` takes only the
``.gguf`` files. The caller deletes the scratch folder (merged checkpoint, llama.cpp leftovers) afterwards.

NOT RUN ON A GPU: the tests run this module with a stand-in ``unsloth`` package that writes a real GGUF with the CPU
writer, so the plumbing (paths, moves, clean-up, error messages) is tested; Unsloth's own writer is not.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from grpo_kit.errors import GrpoKitError

#: Types this route accepts: each is one of Unsloth's ``quantization_method`` names and has a verification tolerance
#: in ``grpo_kit.machinery.export_checks.TOLERANCES`` (transformers' GGUF reader dequantizes all of them through gguf-py).
UNSLOTH_GGUF_TYPES = ("f16", "q8_0", "q4_k_m", "q5_k_m")
RESULT_PREFIX = "grpo-kit-result: "
#: The child's ``--type`` for a merged 16-bit checkpoint (``save_pretrained_merged``) instead of a GGUF file.
MERGED16 = "merged16"
MERGED_HELP = ("Its output is above. Free disk space (the merge needs the 16-bit base plus the merged copy) and run "
               "the export again, or keep the adapter (--format lora).")
NO_FILES_HELP = (
    "Unsloth converts and quantizes with llama.cpp, which it builds on first use (needs git, cmake, a C++ compiler "
    "and internet access); when that build or the conversion fails, no .gguf is written. Read the llama.cpp output "
    "above, fix the build (e.g. `apt-get install cmake build-essential`) and run the export again, or export "
    "--format merged16 and convert that folder yourself with llama.cpp's convert_hf_to_gguf.py and llama-quantize."
)


def check_unsloth_gguf_type(gguf_type: str) -> str:
    """The lower-cased type name, or a ``GrpoKitError`` listing the types this route verifies.

    >>> check_unsloth_gguf_type("Q4_K_M")
    'q4_k_m'
    """
    name = gguf_type.strip().lower()
    if name not in UNSLOTH_GGUF_TYPES:
        raise GrpoKitError(
            f"GGUF type '{gguf_type}' is not offered by grpo-kit's Unsloth route; use one of "
            f"{', '.join(UNSLOTH_GGUF_TYPES)} (each is verified by reloading the file)."
        )
    return name


def child_command(adapter_dir: Path, out_dir: Path, gguf_type: str, load_in_4bit: bool = False) -> list[str]:
    """The command line of the child process (this interpreter, this module)."""
    return [sys.executable, "-m", "grpo_kit.machinery.unsloth_gguf", "--adapter", str(adapter_dir), "--out", str(out_dir),
            "--type", gguf_type] + (["--load-in-4bit"] if load_in_4bit else [])


def parse_result(lines: Sequence[str]) -> dict | None:
    """The JSON of the last ``RESULT_PREFIX`` line, or None when the child printed none.

    >>> parse_result(["llama.cpp says hi", 'grpo-kit-result: {"gguf_files": ["a.gguf"]}'])
    {'gguf_files': ['a.gguf']}
    """
    for line in reversed(lines):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    return None


def write_with_unsloth(adapter_dir: Path, out_dir: Path, gguf_type: str, *, echo: Callable[[str], None] | None = None,
                       load_in_4bit: bool = False):
    """Run the child; returns ``(gguf_paths, result)``. ``out_dir`` is Unsloth's ``save_directory`` (must not exist).

    ``gguf_type="merged16"`` runs ``save_pretrained_merged`` instead and returns ``([merged folder], result)``.

    The child's output is passed to ``echo`` line by line (Unsloth's progress: a conversion takes minutes), and its
    last 40 lines go into the error message when it fails. ``GrpoKitError`` when the child fails or returns no file.
    """
    echo = echo or (lambda line: print(line, flush=True))
    tail: collections.deque[str] = collections.deque(maxlen=40)
    command = child_command(adapter_dir, out_dir, gguf_type, load_in_4bit)
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1) as child:
        assert child.stdout is not None
        try:
            for raw in child.stdout:
                line = raw.rstrip("\n")
                tail.append(line)
                if not line.startswith(RESULT_PREFIX):
                    echo(line)
        except BaseException:  # an interrupt (Ctrl-C, a notebook's stop button) must not leave the writer running
            child.kill()
            raise
    result = parse_result(list(tail))
    if child.returncode != 0 or result is None:
        output = "\n".join(tail)
        raise GrpoKitError(
            f"Unsloth's GGUF writer failed (exit code {child.returncode}) for type {gguf_type}. Its last output:\n"
            f"{output}\n{NO_FILES_HELP}"
        )
    if gguf_type == MERGED16:
        folder = Path(result.get("save_directory") or out_dir)
        if not list(folder.glob("*.safetensors")):
            raise GrpoKitError(f"Unsloth's save_pretrained_merged wrote no .safetensors into {folder}. {MERGED_HELP}")
        return [folder], result
    files = [Path(p) for p in result.get("gguf_files") or [] if str(p).endswith(".gguf")]
    missing = [str(p) for p in files if not p.is_file()]
    if not files or missing:
        what = f"files it listed do not exist: {missing}" if missing else "it returned no .gguf file"
        raise GrpoKitError(f"Unsloth's save_pretrained_gguf ran but {what} ({gguf_type}). {NO_FILES_HELP}")
    return files, result


def move_gguf_files(files: Sequence[Path], folder: Path, stem: str) -> list[Path]:
    """Move the writer's ``.gguf`` files into ``folder``; returns the new paths, the model file first.

    A single file is named ``<stem>.gguf`` like the CPU route's; several (llama.cpp shards) keep their own names,
    which llama.cpp needs to find the other shards.
    """
    folder.mkdir(parents=True, exist_ok=True)
    if len(files) == 1:
        targets = [folder / f"{stem}.gguf"]
    else:
        targets = [folder / path.name for path in files]
    for source, target in zip(files, targets, strict=True):
        if target.exists():
            raise GrpoKitError(f"{target} already exists in the export being built; use one --gguf-type once.")
        shutil.move(str(source), target)
    return targets


def remove_writer_folders(result: dict, out_dir: Path) -> None:
    """Delete the folders the writer reports (merged checkpoint, ``_gguf`` sibling) when they are this export's own.

    Unsloth can redirect ``save_directory`` (to /tmp on Kaggle): a folder counts as ours when it lies inside
    ``out_dir``'s parent scratch folder or carries ``out_dir``'s unique name.
    """
    ours = {out_dir.name, f"{out_dir.name}_gguf"}
    for key in ("save_directory", "gguf_directory"):
        value = result.get(key)
        if not value:
            continue
        path = Path(value)
        if path.is_dir() and (path.name in ours or out_dir.parent in path.resolve().parents):
            shutil.rmtree(path, ignore_errors=True)


def parse_gguf_types(spec: str) -> list[str]:
    """``"f16,q4_k_m"`` -> validated type names: the CPU writer's (``f32``, ``f16``, ``q8_0``) or the Unsloth route's.

    Which writer makes them is decided later (``gguf_route``): the k-quants need a GPU with Unsloth.

    >>> parse_gguf_types("F16, q4_k_m")
    ['f16', 'q4_k_m']
    """
    from grpo_kit.machinery.gguf_export import GGUF_TYPES

    types = [t.strip().lower() for t in spec.split(",") if t.strip()]
    unknown = [t for t in types if t not in GGUF_TYPES and t not in UNSLOTH_GGUF_TYPES]
    if unknown:
        raise GrpoKitError(
            f"GGUF type(s) {unknown} not offered. The CPU writer makes {', '.join(GGUF_TYPES)} (llama models with the "
            f"SmolLM2 tokenizer); on a GPU with Unsloth installed: {', '.join(UNSLOTH_GGUF_TYPES)}."
        )
    return types


def gguf_route(base_path: str, tokenizer, gguf_types: Sequence[str]) -> str:
    """``"cpu"`` when the gguf-py writer handles the model and every type, ``"unsloth"`` on a GPU with Unsloth
    installed, else the CPU writer's ``GrpoKitError`` (it names the way out)."""
    import importlib.util

    import torch
    from transformers import AutoConfig

    from grpo_kit.machinery.gguf_export import check_gguf_type, check_supported, embedded_tokenizer_fields

    try:
        for gguf_type in gguf_types:
            check_gguf_type(gguf_type)
        check_supported(AutoConfig.from_pretrained(base_path))
        embedded_tokenizer_fields(tokenizer)
        return "cpu"
    except GrpoKitError:
        if torch.cuda.is_available() and importlib.util.find_spec("unsloth") is not None:
            return "unsloth"
        raise


def adapter_on_base(adapter_dir: Path, base_path: str, folder: Path) -> Path:
    """A copy of the adapter in ``folder`` whose ``adapter_config.json`` names ``base_path`` as its base.

    Unsloth merges into the base the adapter config names; pointing it at the base the verification loads (the
    16-bit original of a 4-bit training base, or ``--model``) makes both sides use the same weights.
    """
    folder.mkdir(parents=True)
    for item in adapter_dir.iterdir():
        if item.is_file():
            shutil.copy2(item, folder / item.name)
    config = json.loads((folder / "adapter_config.json").read_text(encoding="utf-8"))
    config["base_model_name_or_path"] = base_path
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return folder


def gguf_with_unsloth(adapter_dir: Path, base_path: str, scratch: Path, gguf_type: str, say,
                      load_in_4bit: bool = False) -> tuple[list[Path], str]:
    """Run Unsloth's writer in a child process under ``scratch``: ``(gguf files, dtype it merged in)``.

    The files stay in ``scratch`` (outside the staging folder) until ``move_gguf_files`` puts them in place.
    ``gguf_type="merged16"``: the merged 16-bit folder instead (``load_in_4bit``: the T4/L4 route, see
    ``grpo_kit.machinery.export_weights``).
    """
    adapter = adapter_on_base(adapter_dir, base_path, scratch / f"adapter-{gguf_type}")
    out = scratch / f"merged-{gguf_type}-{scratch.name}"  # unique name: the writer may relocate it (Kaggle)
    files, result = write_with_unsloth(adapter, out, gguf_type, echo=say, load_in_4bit=load_in_4bit)
    keep = scratch / f"gguf-{gguf_type}"
    keep.mkdir()
    moved = [Path(shutil.move(str(path), keep / path.name)) for path in files]
    remove_writer_folders(result, out)  # the merged 16-bit checkpoint and llama.cpp leftovers (GBs)
    return moved, str(result.get("dtype") or "float16")


# --------------------------------------------------------------------------------------------- the child


def main(argv: Sequence[str] | None = None) -> int:
    """Child entry point: merge ``--adapter`` with Unsloth and write GGUF ``--type`` via ``<--out>_gguf``."""
    parser = argparse.ArgumentParser(prog="python -m grpo_kit.machinery.unsloth_gguf", description=main.__doc__)
    parser.add_argument("--adapter", required=True, help="LoRA adapter folder (its adapter_config names the base)")
    parser.add_argument("--out", required=True, help="Unsloth's save_directory; the .gguf lands in <out>_gguf")
    parser.add_argument("--type", required=True, help=f"one of {', '.join(UNSLOTH_GGUF_TYPES)}, or {MERGED16}")
    parser.add_argument("--load-in-4bit", action="store_true",
                        help="load the base in 4 bit; Unsloth still merges into its 16-bit original, shard by shard")
    args = parser.parse_args(argv)
    gguf_type = args.type if args.type == MERGED16 else check_unsloth_gguf_type(args.type)

    import torch
    import unsloth  # noqa: F401  before anything imports transformers: it patches its forwards
    from unsloth import FastLanguageModel

    from grpo_kit.machinery.runtime import half_dtype_name

    # The adapter's config names the base (adapter_on_base). Without --load-in-4bit Unsloth loads it unquantized in
    # the GPU's 16-bit dtype; with it (a base too large for the GPU in 16 bit) it loads 4-bit weights, and both savers
    # merge into the 16-bit original's shards one at a time, not into the 4-bit weights (unsloth_generic_save).
    dtype = getattr(torch, half_dtype_name())
    model, tokenizer = FastLanguageModel.from_pretrained(model_name=args.adapter, load_in_4bit=args.load_in_4bit,
                                                         dtype=dtype)
    if gguf_type == MERGED16:  # unsloth_generic_save -> unsloth_zoo's merge_and_overwrite_lora: 16-bit shards + LoRA
        model.save_pretrained_merged(args.out, tokenizer, save_method="merged_16bit")
        result = {"save_directory": args.out}
    else:
        result = model.save_pretrained_gguf(args.out, tokenizer, quantization_method=gguf_type) or {}
    report = {
        "gguf_files": [os.fspath(p) for p in result.get("gguf_files") or []],
        "save_directory": result.get("save_directory"),
        "gguf_directory": result.get("gguf_directory"),
        "dtype": str(dtype).replace("torch.", ""),
    }
    print(RESULT_PREFIX + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
