"""Export a trained LoRA adapter as ``lora``, ``merged16`` or ``gguf``, and prove each export by reloading it.

Layout: ``<out_dir>/<name>/`` holds ``README.md`` (model card), ``export.json`` (the numbers) and one folder per
format: ``lora/`` (PEFT adapter + tokenizer), ``merged16/`` (merged safetensors + tokenizer), ``gguf/``
(``<name>-<type>.gguf`` + an Ollama ``Modelfile``).

**Verification** (``grpo_kit.machinery.export_checks``): each export is loaded back the way a user would and its
logits must match base+adapter within its storage type's tolerance, and sit closer to base+adapter than to the base.
A failed check raises ``GrpoKitError`` and nothing lands in ``<out_dir>/<name>``.

**Atomicity.** Everything is written into a hidden ``.<name>.partial-*`` folder next to the target and renamed
into place only after every check passed. An existing export is refused unless ``overwrite=True``; even then the
old one is moved aside only after the new one is verified, and deleted only after the rename succeeded.

**merged16 dtype.** The merge is done in float32, then stored in the base checkpoint's dtype when that is
bfloat16/float16; a float32 base (the embedded model) is stored as **bfloat16**: same exponent range as float32
(no overflow), half the size, and the dtype original SmolLM2/Llama/Qwen checkpoints ship in.

**GPU** (UNTESTED ON A GPU): the merge is PEFT's ``merge_and_unload`` on the 16-bit base; a 4-bit Unsloth base
(``*-bnb-4bit``) is swapped for its 16-bit original, since merging into 4-bit weights loses the LoRA's precision.
GGUF types or architectures the gguf-py writer (``grpo_kit.machinery.gguf_export``) does not cover go through
Unsloth's ``save_pretrained_gguf`` in a child process (``grpo_kit.machinery.unsloth_gguf``).

**Hub.** ``push_to_hub="user/repo"`` uploads the verified folder (``grpo_kit.machinery.hub``).
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grpo_kit.errors import GrpoKitError
from grpo_kit.machinery import export_checks, export_info, export_weights, gguf_export, hub, unsloth_gguf
from grpo_kit.machinery.export_checks import ExportResult

FORMATS = ("lora", "merged16", "gguf")
_MARKER = "export.json"


# --------------------------------------------------------------------------------------------- small helpers


def parse_formats(formats: str | Sequence[str]) -> tuple[str, ...]:
    """``"lora,gguf"`` or ``["lora"]`` -> validated tuple in canonical order.

    >>> parse_formats("gguf, lora")
    ('lora', 'gguf')
    """
    items = [f.strip().lower() for f in (formats.split(",") if isinstance(formats, str) else formats) if f.strip()]
    unknown = [f for f in items if f not in FORMATS]
    if unknown or not items:
        raise GrpoKitError(f"Unknown export format(s) {unknown or items}; choose from {', '.join(FORMATS)} (comma-separated).")
    if "merged_4bit" in items or "merged4" in items:
        raise GrpoKitError("4-bit merged exports lose the LoRA's precision; use merged16 or gguf --gguf-type q8_0.")
    return tuple(f for f in FORMATS if f in items)


def safe_name(name: str) -> str:
    """A folder name made of letters, digits, ``.``, ``_`` and ``-``.

    >>> safe_name("runs/demo 1")
    'runs-demo-1'
    """
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip(".-")
    return cleaned or "export"


def default_name(adapter_dir: Path) -> str:
    """``runs/x/adapter`` -> ``x``; ``runs/x/checkpoint-40`` -> ``x-checkpoint-40``; else the folder's name."""
    from grpo_kit.machinery.folders import checkpoint_step

    adapter_dir = adapter_dir.resolve()
    if adapter_dir.name == "adapter":
        return safe_name(adapter_dir.parent.name)
    if checkpoint_step(adapter_dir) is not None:
        return safe_name(f"{adapter_dir.parent.name}-{adapter_dir.name}")
    return safe_name(adapter_dir.name)


def _base_dtype_name(base_path: str) -> str:
    """The dtype the base checkpoint is stored in (``"float32"`` when unknown)."""
    from transformers import AutoConfig

    dtype = getattr(AutoConfig.from_pretrained(base_path), "dtype", None) or "float32"
    return str(dtype).replace("torch.", "")


def merged16_dtype(base_dtype: str) -> str:
    """Storage dtype for merged16: keep bf16/fp16 bases, store float32 bases as bfloat16 (module docstring).

    >>> merged16_dtype("float16"), merged16_dtype("float32")
    ('float16', 'bfloat16')
    """
    return base_dtype if base_dtype in {"bfloat16", "float16"} else "bfloat16"


# --------------------------------------------------------------------------------------------- writers


def _write_lora(adapter_dir: Path, tokenizer, folder: Path) -> None:
    """The adapter's own files (``adapter_config.json``, ``adapter_model.safetensors``) byte for byte, plus the tokenizer."""
    folder.mkdir(parents=True)
    for item in adapter_dir.iterdir():
        if item.name.startswith("adapter_") and item.is_file():
            shutil.copy2(item, folder / item.name)
    tokenizer.save_pretrained(folder)


def _write_merged16(merged, tokenizer, folder: Path, dtype_name: str) -> None:
    """Cast ``merged`` to ``dtype_name`` in place and save it as safetensors with the tokenizer."""
    import torch

    merged.to(getattr(torch, dtype_name))
    merged.config.dtype = dtype_name
    merged.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    stray = [p.name for p in folder.iterdir() if p.suffix in {".bin", ".pt", ".pth"}]
    if stray:
        raise GrpoKitError(f"merged16 export wrote non-safetensors files {stray}; please report this.")


def _write_gguf(merged, tokenizer, folder: Path, gguf_type: str, name: str) -> Path:
    from grpo_kit.machinery.gguf_export import write_gguf

    folder.mkdir(parents=True, exist_ok=True)
    return write_gguf(merged, tokenizer, folder / f"{name}-{gguf_type}.gguf", gguf_type, name=name)


def check_target(target: Path, overwrite: bool) -> None:
    """Refuse an existing export unless ``overwrite`` (checked before any work, and again just before the rename)."""
    if target.exists() and not overwrite:
        raise GrpoKitError(f"{target} already exists. Pass --overwrite (overwrite=True) to replace it, or choose --name.")


# --------------------------------------------------------------------------------------------- export


def export(
    adapter_dir: str | os.PathLike,
    formats: str | Sequence[str] = ("lora",),
    *,
    base_model: str | None = None,
    out_dir: str | os.PathLike = "exports",
    name: str | None = None,
    gguf_type: str = "q8_0",
    overwrite: bool = False,
    eval_results: Any = None,
    push_to_hub: str | None = None,
    print_fn=None,
) -> list[ExportResult]:
    """Export ``adapter_dir`` in each of ``formats`` to ``<out_dir>/<name>/``, each verified (module docstring).

    ``gguf_type`` may list several types (``"f16,q8_0"``). ``eval_results`` (``export_info.normalize_evals``) goes
    into the model card. Returns one ``ExportResult`` per written file/folder (``str(result)`` is a one-line summary);
    ``print_fn`` (e.g. ``print``) also gets those lines and any notes.
    """
    from grpo_kit.machinery.folders import check_writable, remove_stale_staging, staged_dir, staging_prefix
    from grpo_kit.machinery.guards import check_adapter, dumps_finite
    from grpo_kit.machinery.model_card import render_model_card
    from grpo_kit.models import load_tokenizer, resolve_model_id

    adapter_dir = Path(adapter_dir)
    if not (adapter_dir / "adapter_config.json").is_file():
        inside = adapter_dir / "adapter"  # --adapter given the run folder instead of its adapter/
        hint = f"--adapter {inside}" if (inside / "adapter_config.json").is_file() else "a run's adapter/ or checkpoint-N/"
        raise GrpoKitError(f"{adapter_dir} is not a LoRA adapter folder (no adapter_config.json). Pass {hint}.")
    check_adapter(adapter_dir, use=f"export {adapter_dir}")  # a torn or NaN adapter never reaches "verified"
    wanted = parse_formats(formats)
    gguf_types = unsloth_gguf.parse_gguf_types(gguf_type) if "gguf" in wanted else []
    name = safe_name(name) if name else default_name(adapter_dir)
    out_dir = Path(out_dir)
    target = out_dir / name
    check_target(target, overwrite)
    evals = export_info.normalize_evals(eval_results)
    run = export_info.read_run_info(adapter_dir)
    trained_on = export_info.resolve_base_model(adapter_dir, base_model, run)
    merging = "merged16" in wanted or "gguf" in wanted  # a LoRA alone is checked on the base it was trained on
    base_model, base_note = export_info.sixteen_bit_base(trained_on) if merging else (trained_on, "")
    base_path = resolve_model_id(base_model)
    check_writable(out_dir, what="exports", option="--out-dir")  # before the minutes of loading and merging

    say = print_fn or (lambda line: None)
    # A 16-bit base larger than the GPU (7-8B on a T4/L4): Unsloth's savers merge shard by shard from a 4-bit load,
    # and the files are checked weight by weight, since base+adapter cannot be loaded for the logit check.
    base_dir = export_weights.base_too_big_for_gpu(base_path) if merging else None
    if base_dir is not None:
        route, reference_base = "unsloth", resolve_model_id(trained_on)
        say(f"{base_model} does not fit in GPU memory in 16 bit: merging with Unsloth, checking weight by weight.")
    else:
        reference_base = base_path
        route = unsloth_gguf.gguf_route(base_path, load_tokenizer(base_path), gguf_types) if gguf_types else "cpu"
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(out_dir, name)  # left by an export that was killed mid-write (can be many GB)
    # Unsloth's writers run first, while this process holds no model on the GPU, in their own scratch folder (the
    # GGUF writer also leaves a merged checkpoint and llama.cpp files): only what the export needs is moved in.
    scratch = Path(tempfile.mkdtemp(prefix=staging_prefix(name), dir=out_dir)) if route == "unsloth" else None
    results: list[ExportResult] = []
    try:
        unsloth_files = {}
        kinds = (["merged16"] if base_dir is not None and "merged16" in wanted else []) + gguf_types
        for kind in kinds if scratch is not None else []:
            unsloth_files[kind] = unsloth_gguf.gguf_with_unsloth(adapter_dir, reference_base, scratch, kind, say,
                                                                 load_in_4bit=base_dir is not None)
        if base_dir is not None and "lora" not in wanted:  # nothing left to compare by logits: skip the model load
            model, tokenizer, reference = None, load_tokenizer(reference_base), None
        else:
            model, tokenizer, reference = export_checks.load_reference(reference_base, adapter_dir)
        with staged_dir(target, prefix=staging_prefix(name)) as staging:
            if "lora" in wanted:
                _write_lora(adapter_dir, tokenizer, staging / "lora")
                results.append(export_checks.verify_lora(staging / "lora", reference_base, reference))
            if base_dir is not None:
                results += export_weights.place_and_check(unsloth_files, staging, name, base_dir, adapter_dir, tokenizer)
            elif merging:
                merged = model.merge_and_unload()  # PEFT folds the LoRA into the float32 base, in place
                files = []
                for kind in gguf_types:
                    if kind in unsloth_files:
                        found, merge_dtype = unsloth_files[kind]
                        path = unsloth_gguf.move_gguf_files(found, staging / "gguf", f"{name}-{kind}")[0]
                    else:
                        path, merge_dtype = _write_gguf(merged, tokenizer, staging / "gguf", kind, name), "float32"
                    files.append(path)
                    results.append(export_checks.verify_gguf(path, reference, kind, merge_dtype))
                if files:
                    gguf_export.write_modelfile(staging / "gguf", files, tokenizer)
                if "merged16" in wanted:
                    dtype_name = merged16_dtype(_base_dtype_name(base_path))
                    _write_merged16(merged, tokenizer, staging / "merged16", dtype_name)
                    results.append(export_checks.verify_merged16(staging / "merged16", reference, dtype_name))
            results = [dataclasses.replace(r, path=target / r.path.relative_to(staging)) for r in results]
            info = export_info.export_info(name, base_model, base_path, base_note, adapter_dir, run, evals, results,
                                           target, push_to_hub)
            (staging / "README.md").write_text(render_model_card(info), encoding="utf-8")
            (staging / _MARKER).write_text(dumps_finite(info, indent=2, default=str) + "\n", encoding="utf-8")
            check_target(target, overwrite)  # another export may have landed there in the meantime
    except OSError as error:  # a full disk, a vanished folder: the partial export goes, the old one stays
        raise GrpoKitError(
            f"The export stopped: {error.strerror or error} ({error.filename or out_dir}); nothing was changed in "
            f"{target}, and the partial files were removed. Free disk space (merged16 needs about twice the model's "
            "16-bit size while it is verified) or choose another --out-dir, then run the export again."
        ) from None
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    for result in results:
        say(str(result))
        if result.note:
            say(f"  note: {result.note}")
    if push_to_hub:
        url = hub.push_folder(target, push_to_hub)
        results = [dataclasses.replace(r, hub_url=url) for r in results]
        say(f"uploaded {target} to {url}")
    return results


def cli_export(args) -> int:
    """``grpo-kit export``: verified exports under --out-dir/--name, optional Hub upload."""
    from grpo_kit.machinery.runtime import set_torch_threads

    set_torch_threads()
    adapter_dir = Path(args.adapter)
    export(
        adapter_dir,
        args.format,
        base_model=args.model,
        out_dir=args.out_dir,
        name=args.name,
        gguf_type=args.gguf_type,
        overwrite=args.overwrite,
        eval_results=export_info.find_run_evals(adapter_dir) if (adapter_dir / "adapter_config.json").is_file() else None,
        push_to_hub=args.push_to_hub,
        print_fn=print,
    )
    return 0
