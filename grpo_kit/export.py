"""Export a trained LoRA adapter as ``lora``, ``merged16`` or ``gguf``, and prove each export before it lands.

    <out_dir>/<name>/  README.md (model card)  export.json  lora/  merged16/  gguf/<name>-<type>.gguf + Modelfile

**Who writes what.** ``lora`` is the adapter's own files. On a GPU with Unsloth installed, Unsloth writes merged16 and
GGUF (``grpo_kit.gguf_files.run_unsloth``: one merge from the 4-bit or 16-bit load the run trained on, llama.cpp for
GGUF), as Unsloth's notebooks do; a T4 could not hold an 8B model in 16 bit for PEFT's merge. Elsewhere PEFT's
``merge_and_unload`` merges in float32 on the CPU, stored as bfloat16 (float32's exponent range, half the size), the
dtype Unsloth's merge writes too. GGUF needs llama.cpp, so it needs Unsloth's route. A 4-bit base
(``*-bnb-4bit``) is merged into its 16-bit original: 4-bit weights would lose the LoRA's precision.

**Verification** (``grpo_kit.verify``), the same for every route: each export is read back and compared with base +
LoRA weight by weight before it lands. Everything is written into a staging folder (``grpo_kit.files.staged_dir``),
renamed into place once all checks pass. The GPU route is UNTESTED ON A GPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import HfApi, ModelCard, ModelCardData, get_token

from grpo_kit import files, gguf_files, models, runs
from grpo_kit.adapters import adapter_config, check_adapter
from grpo_kit.errors import GrpoKitError
from grpo_kit.files import dumps_finite
from grpo_kit.verify import ExportResult, check_base, check_lora, check_weights, lora_effect

FORMATS = ("lora", "merged16", "gguf")


# --------------------------------------------------------------------------------------------- what an export records


def model_card(info: Mapping[str, Any]) -> str:
    """The export's README.md, from what export.json records (training, evaluation, verification, how to load and
    prompt it): the template ``grpo_kit/resources/model_card.md``, rendered by huggingface_hub's
    ``ModelCard.from_template``."""
    kinds = {r["format"] for r in info["formats"]}
    data = ModelCardData(
        library_name="peft" if kinds == {"lora"} else "transformers",
        tags=["grpo", "gsm8k", "grpo-kit"],
        base_model=info["base_model_hub"],
    )
    template = Path(__file__).with_name("resources") / "model_card.md"
    card = ModelCard.from_template(
        data, template, info=info, kinds=kinds, prompt_file=runs.PROMPT_FILE, dumps=json.dumps, isabs=os.path.isabs
    )
    return f"{card}\n"  # Jinja drops the template's last newline


def push_folder(folder: Path, repo: str) -> str:
    """Upload a verified export with the token ``huggingface_hub`` finds (``HF_TOKEN``, ``hf auth login``, Colab's
    ``HF_TOKEN`` secret), never printing it; returns the repo's URL."""
    if not (token := get_token()):
        raise GrpoKitError(
            f"No Hugging Face token for pushing to {repo}. Set HF_TOKEN (a write token from "
            "https://huggingface.co/settings/tokens), or in Colab add it as the secret 'HF_TOKEN'. The "
            f"export itself is complete in {folder}."
        )
    try:
        api = HfApi(token=token)
        url = api.create_repo(repo, exist_ok=True)
        api.upload_folder(repo_id=repo, folder_path=folder, commit_message="grpo-kit export")
    except Exception as error:  # network, permissions, a bad repo id: say what, and keep the token out of it
        raise GrpoKitError(
            f"Upload of {folder} to {repo} failed: {type(error).__name__}: "
            f"{str(error).replace(token, '***')}. The export itself is complete and verified on disk in "
            f"{folder}; retry with `hf upload {repo} {folder}`."
        ) from None
    return str(url)


# --------------------------------------------------------------------------------------------- export


def _write_merged16(base_path: str, adapter_dir: Path, tokenizer, folder: Path) -> None:
    """PEFT's merge, in float32 on the CPU (exact; a 16-bit merge would round twice), stored as bfloat16."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32, device_map="cpu")
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged.to(torch.bfloat16).save_pretrained(folder)  # it records the parameters' dtype in config.json
    tokenizer.save_pretrained(folder)


def _check_target(target: Path, overwrite: bool) -> None:
    if target.exists() and not overwrite:
        raise GrpoKitError(
            f"{target} already exists. Pass --overwrite (overwrite=True) to replace it, or choose --name."
        )


def verify_answers(
    folder: Path, base: str, adapter_dir: Path, prompt: dict, questions: int, max_new_tokens: int
) -> dict[str, dict]:
    """The merged model's answers next to base + adapter's, greedy, under the training prompt, on ``questions`` of the
    kit's bundled held-out questions: ``{"base + adapter": metrics, "merged16": metrics}``. The weight check cannot
    see a saved config, tokenizer or chat template that changes how the model answers; this can."""
    from grpo_kit.data import load_gsm8k
    from grpo_kit.evaluate import evaluate

    dataset, found = load_gsm8k("sample", split="test", limit=questions), {}
    for label, (model_id, adapter) in {"base + adapter": (base, adapter_dir), "merged16": (str(folder), None)}.items():
        model, tokenizer = models.load_inference_model(model_id, adapter)  # one at a time: an 8B is 16 GB in 16 bit
        found[label] = evaluate(
            model, tokenizer, dataset, max_new_tokens=max_new_tokens, progress=False, label=label, **prompt
        ).to_dict()
        del model
    return found


def export(
    adapter_dir: str | os.PathLike,
    formats: str | Sequence[str] = ("lora",),
    *,
    base_model: str | None = None,
    out_dir: str | os.PathLike = "exports",
    name: str | None = None,
    gguf_type: str | Sequence[str] = "q4_k_m",
    overwrite: bool = False,
    push_to_hub: str | None = None,
    answers: int = 0,
    print_fn=lambda line: None,
) -> list[ExportResult]:
    """Export ``adapter_dir`` in each of ``formats`` to ``<out_dir>/<name>/``, each verified (module docstring).

    ``gguf_type``: one type or several (``"q4_k_m,q8_0"``); ``push_to_hub="user/repo"`` uploads the verified folder;
    the run's evaluations (``runs.Run.evaluations``) go into the model card. ``answers=N``: merged16's answers are
    also compared with base + adapter's on N bundled questions (``verify_answers``; it loads both models, one after the
    other), into export.json and the model card. Returns one ``ExportResult`` per folder or file written
    (``str(result)`` is a one-line summary); ``print_fn`` (e.g. ``print``) gets those lines and any notes.
    """
    from grpo_kit import doctor  # transformers: after Unsloth

    adapter_dir = Path(adapter_dir)
    check_adapter(adapter_dir, use=f"export {adapter_dir}")  # a torn or NaN adapter never reaches "verified"
    run = runs.Run.of(adapter_dir)
    steps = run.steps  # the run's log up to this adapter: a checkpoint before a collapse is fine
    logged = [row for row in run.history if row.get("step", 0) <= (steps or 0)]
    if problem := doctor.collapse(logged):  # small finite weights pass every weight check: the log shows the damage
        raise GrpoKitError(
            f"Cannot export {adapter_dir}: its run collapsed ({problem}), so the model no longer answers. Export an "
            "earlier checkpoint-N of the run, or train again with a lower --set learning_rate."
        )
    if not (effect := lora_effect(adapter_dir)):  # it would pass every check: base + 0 is the base
        raise GrpoKitError(
            f"Cannot export {adapter_dir}: its LoRA changes nothing (scale * B @ A is 0 everywhere: every lora_B is "
            "still 0), so an export would be the base model. Its run learned nothing"
            + (f" ({why})" if (why := doctor.learned_nothing(logged)) else "")
            + ": train again with rewards that tell a group's completions apart (the run's summary says how)."
        )
    wanted = gguf_files.parse_names(formats, FORMATS, "export format(s)")
    gguf_types = gguf_files.parse_names(gguf_type, gguf_files.GGUF_TYPES, "GGUF type(s)") if "gguf" in wanted else []
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name or run.name).strip(".-") or "export"
    out_dir = Path(out_dir)
    target = out_dir / name
    _check_target(target, overwrite)
    recipe = run.recorded
    prompt = run.prompt  # the prompt it trained with (its run's recipe, or an exported adapter's), for each folder
    trained_on = base_model or run.base_model
    merging = wanted != ["lora"]  # a LoRA alone needs no base model
    merge_base = trained_on.removesuffix("-bnb-4bit") if merging else trained_on
    base_path = models.resolve_model_id(merge_base)
    by_unsloth = merging and gguf_files.unsloth_on_gpu()
    if gguf_types and not by_unsloth:
        raise GrpoKitError(
            f"GGUF files are made by llama.cpp, through Unsloth on a GPU, and this machine has "
            f"{'no CUDA GPU' if not torch.cuda.is_available() else 'no Unsloth'}. Export --format "
            "merged16 here and convert that folder with llama.cpp's convert_hf_to_gguf.py, or export "
            "on a GPU with Unsloth installed (the Colab notebook installs it)."
        )
    files.check_writable(out_dir, what="exports", option="--out-dir")  # before the minutes of loading and merging
    trained_path = models.resolve_model_id(trained_on)
    tokenizer = models.load_tokenizer(trained_path)
    files.remove_stale_staging(out_dir, name)  # left by an export that was killed mid-write (can be many GB)
    check_space(base_path, out_dir, name, wanted, gguf_types)
    if merging:
        base_dir = gguf_files.local_base(base_path)  # what check_weights compares with
        check_base(adapter_dir, base_dir, trained_on)
    results: list[ExportResult] = []
    try:
        with files.staged_dir(target) as staging:
            if "lora" in wanted:
                lora = staging / "lora"
                lora.mkdir()
                for item in adapter_dir.glob("adapter_*"):
                    shutil.copy2(item, lora)  # into the folder, under its own name
                tokenizer.save_pretrained(lora)
                results.append(dataclasses.replace(check_lora(lora, adapter_dir), lora_effect=effect))
                run.write_prompt(lora)
            # Unsloth in its own folder (it leaves a merged checkpoint and llama.cpp's files there), removed before
            # the rename; only its results are moved in. It loads the model as the run trained it (4 bit or 16).
            scratch = staging / f"unsloth{staging.name}"
            if by_unsloth:
                made = gguf_files.run_unsloth(
                    adapter_dir,
                    trained_path,
                    scratch,
                    gguf_types,
                    merged16="merged16" in wanted,
                    load_in_4bit=merge_base != trained_on or bool(recipe.get("load_in_4bit")),
                    say=print_fn,
                )
            for kind in gguf_types:
                path = staging / "gguf" / f"{name}-{kind}.gguf"
                path.parent.mkdir(exist_ok=True)
                shutil.move(made[kind], path)
                results.append(check_weights("gguf", path, base_dir, adapter_dir, kind))
                if kind == gguf_types[0]:  # Ollama's Modelfile: FROM the first type asked for
                    gguf_files.write_modelfile(path, tokenizer)
            answered = None
            if "merged16" in wanted:
                merged = staging / "merged16"
                if by_unsloth:  # Unsloth keeps the shards' dtype: bf16 mostly (fp16 rounds finer, within bf16's limit)
                    shutil.move(made["merged16"], merged)
                else:
                    _write_merged16(base_path, adapter_dir, tokenizer, merged)
                results.append(check_weights("merged16", merged, base_dir, adapter_dir, "bfloat16"))
                run.write_prompt(merged)
                if answers and prompt:
                    length = int(recipe.get("max_completion_length") or 256)
                    answered = verify_answers(merged, trained_on, adapter_dir, prompt, answers, length)
            results = [dataclasses.replace(r, path=target / r.path.relative_to(staging)) for r in results]
            note = f"Merged into {merge_base}, the 16-bit original of {trained_on}." if merge_base != trained_on else ""
            info = {
                "name": name,
                "base_model": merge_base,
                "base_model_note": note,
                "base_model_hub": None if os.path.isabs(base_path) else merge_base,  # a folder: no Hub id
                "lora_base": adapter_config(adapter_dir).base_model_name_or_path,
                "folder": str(target),
                "run": run.info or None,
                "steps": steps,
                "evals": run.evaluations,
                "doctor": [
                    f"step {f['step']}: {f['message']}" for f in doctor.diagnose(logged) if f["level"] == "warning"
                ],
                "repo": push_to_hub,
                "prompt": prompt,
                "answers": answered,
                "formats": [r.to_dict(relative_to=target) for r in results],
            }
            (staging / "README.md").write_text(model_card(info), encoding="utf-8")
            # a plain write, as every file in the staging folder: its OSError gets the export's message below
            (staging / "export.json").write_text(dumps_finite(info, indent=2, default=str) + "\n", encoding="utf-8")
            shutil.rmtree(scratch, ignore_errors=True)
            _check_target(target, overwrite)  # another export may have landed there in the meantime
    except OSError as error:  # a full disk, a vanished folder: the partial export goes, the old one stays
        raise GrpoKitError(
            f"The export stopped: {error.strerror or error} ({error.filename or out_dir}); nothing was "
            f"changed in {target}, and the partial files were removed. Free disk space (merged16 needs "
            "its 16-bit size; `export_sizes` lists each file) or choose another --out-dir, then "
            "run the export again."
        ) from None
    for result in results:
        print_fn(str(result) + (f"\n  note: {result.note}" if result.note else ""))
    for label, m in (answered or {}).items():
        print_fn(
            f"answers of {label}: format {100 * m['format_rate']:.1f} %, strict accuracy "
            f"{100 * m['accuracy_strict']:.1f} % (n={m['n']}, the training prompt)"
        )
    if push_to_hub:
        print_fn(f"uploaded {target} to {push_folder(target, push_to_hub)}")
    return results


def check_space(base_path: str, out_dir: Path, name: str, wanted, gguf_types) -> None:
    """Refuse an export that would not fit on the disk of ``out_dir``, before a byte is written, counting every file
    it writes or downloads (``export_sizes``); the message names the biggest item and what to drop. Unknown model
    sizes are not checked."""
    from grpo_kit.colab import check_fits

    if sizes := export_sizes(base_path, wanted, gguf_types):
        biggest = max(sizes, key=sizes.get)
        drop = (
            "--format lora alone takes megabytes"
            if biggest.startswith(("merged16", "gguf"))
            else "export on a machine that has the 16-bit base in its Hugging Face cache, or export fewer formats"
        )
        check_fits(
            sizes,
            out_dir,
            what=f"the export {name}",
            fix=f"Nothing was written. The biggest item is {biggest} "
            f"({sizes[biggest] / 1e9:.1f} GB): {drop}; or export fewer formats (one --gguf-type), free disk "
            "space, or choose another --out-dir.",
        )


def export_sizes(base_path: str, wanted, gguf_types) -> dict[str, int]:
    """Bytes of every file an export of a model like ``base_path`` writes or downloads, by name: the formats, the
    16-bit base its weight check reads (a download unless it is a folder or cached), Unsloth's 16-bit merge when no
    merged16 is kept (GGUF is converted from that one merge) and llama.cpp's 16-bit GGUF before quantizing. Empty when
    the model's size is unknown or nothing is merged (a LoRA alone takes megabytes).

    >>> {k: round(v / 1e9, 1) for k, v in export_sizes("unsloth/Meta-Llama-3.1-8B-Instruct", ["lora", "merged16",
    ...     "gguf"], ["q4_k_m"]).items()}  # doctest: +NORMALIZE_WHITESPACE
    {'merged16': 16.1, 'gguf q4_k_m': 4.9, "llama.cpp's 16-bit GGUF before quantizing (removed afterwards)": 16.1,
     'the 16-bit base for the weight check (download to the Hugging Face cache)': 16.1}
    """
    from grpo_kit.planner import shape_for

    if (shape := shape_for(base_path)) is None or not (gguf_types or "merged16" in wanted):
        return {}
    half = 2 * shape.params
    sizes = {"merged16": half} if "merged16" in wanted else {}
    sizes |= {f"gguf {kind}": int(shape.params * gguf_files.GGUF_BYTES[kind]) for kind in gguf_types}
    if gguf_types and "merged16" not in wanted:
        sizes["Unsloth's 16-bit merge for llama.cpp (removed afterwards)"] = half
    if gguf_types and "f16" not in gguf_types:
        sizes["llama.cpp's 16-bit GGUF before quantizing (removed afterwards)"] = half
    if not Path(base_path).is_dir() and not gguf_files.base_cached(base_path):
        sizes["the 16-bit base for the weight check (download to the Hugging Face cache)"] = half
    return sizes


def cli_export(args) -> int:
    if args.check_answers < 0:
        raise GrpoKitError(f"--check-answers takes a number of questions, 0 or more (got {args.check_answers}).")
    models.set_torch_threads()
    export(
        args.adapter,
        args.format,
        base_model=args.model,
        out_dir=args.out_dir,
        name=args.name,
        gguf_type=args.gguf_type,
        overwrite=args.overwrite,
        push_to_hub=args.push_to_hub,
        answers=args.check_answers,
        print_fn=print,
    )
    return 0
