"""Export a trained LoRA adapter as ``lora``, ``merged16`` or ``gguf``, and prove each export before it lands.

    <out_dir>/<name>/  README.md (model card)  export.json  lora/  merged16/  gguf/<name>-<type>.gguf + Modelfile

**Who writes what.** ``lora`` is the adapter's own files. On a GPU with Unsloth installed, Unsloth writes merged16 and
GGUF (``grpo_kit.gguf_files.run_unsloth``: one merge from the 4-bit or 16-bit load the run trained on, llama.cpp for
GGUF), as Unsloth's notebooks do; a T4 could not hold an 8B model in 16 bit for PEFT's merge. Elsewhere PEFT's
``merge_and_unload`` merges in float32 on the CPU, stored as bfloat16 (float32's exponent range, half the size), the
dtype Unsloth's merge writes too. GGUF needs llama.cpp, so it needs Unsloth's route. A 4-bit base
(``*-bnb-4bit``) is merged into its 16-bit original: 4-bit weights would lose the LoRA's precision.

**Verification**, the same for every route: each export is read back tensor by tensor and compared with base + LoRA
(``check_weights``; the adapter with the run's own tensors, bit for bit), within its storage type's limit
(``grpo_kit.gguf_files.WEIGHT_RTOL``), and must sit closer to base + LoRA than to the base wherever the adapter's effect
exceeds the storage noise: that catches a merge that silently dropped the LoRA. Everything is written into a staging
folder (``grpo_kit.files.staged_dir``), renamed into place once all checks pass. The GPU route is UNTESTED ON A GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Any

import torch
from huggingface_hub import HfApi, ModelCard, ModelCardData, get_token
from safetensors import safe_open

from grpo_kit import files, gguf_files, models, runs
from grpo_kit.adapters import adapter_config, check_adapter
from grpo_kit.errors import GrpoKitError
from grpo_kit.files import dumps_finite

FORMATS = ("lora", "merged16", "gguf")


@dataclass(frozen=True)
class ExportResult:
    """One verified export (``path``: its folder or ``.gguf`` file), with the numbers of its check
    (``check_tensors``)."""

    format: str
    path: Path
    detail: str
    max_abs_diff: float
    tolerance: float
    mean_abs_diff: float
    lora_effect: float
    mean_abs_diff_base: float = float("nan")
    note: str = ""

    def to_dict(self, relative_to: Path | None = None) -> dict:
        """The fields as JSON values, ``path`` relative to ``relative_to`` when given (export.json, tables)."""
        return {
            **dataclasses.asdict(self),
            "path": str(self.path.relative_to(relative_to) if relative_to else self.path),
        }

    def __str__(self) -> str:
        return (
            f"{self.format:<8} {self.path}  verified: max |d| {self.max_abs_diff:.2e} <= {self.tolerance:.2e} "
            f"({self.detail}; LoRA effect {self.lora_effect:.2e})"
        )


# --------------------------------------------------------------------------------------------- the checks


#: Values per block of rows the weight checks read at once (64 MiB in float32): an 8B model's 525M-value embedding
#: is never whole in host memory, in any dtype (a free Colab has ~12.7 GB of RAM).
BLOCK_VALUES = 2**24


@dataclass
class _Tally:
    """One tensor's comparison, added up block by block."""

    diff: float = 0.0  # max |got - expected|
    scale: float = 0.0  # max |expected|
    change: float = 0.0  # max |expected - base|: the adapter's effect
    sums: tuple[float, float, float] = (0.0, 0.0, 0.0)  # sum |got - expected|, |got - base|, |expected - base|
    count: int = 0
    problem: str = ""

    def add(self, label: str, got, expected, base) -> None:
        if self.problem:
            return
        if got is None or got.numel() != expected.numel():
            self.problem = (
                f"{label} is missing" if got is None else f"{label} has {got.numel()} values, not {expected.numel()}"
            )
            return
        got = got.float().reshape(expected.shape)
        if bad := [
            what
            for what, t in (("the export", got), ("base+adapter", expected), ("the base", base))
            if not bool(torch.isfinite(t).all())
        ]:
            self.problem = f"{label}: NaN/inf in {' and '.join(bad)}"
            return
        diff, to_base, change = (got - expected).abs(), (got - base).abs(), (expected - base).abs()
        self.diff, self.change = max(self.diff, float(diff.max())), max(self.change, float(change.max()))
        self.scale = max(self.scale, float(expected.abs().max()))
        self.sums = tuple(a + float(b.sum()) for a, b in zip(self.sums, (diff, to_base, change), strict=True))
        self.count += expected.numel()


def check_tensors(fmt: str, items, rtol: float, *, path: Path, detail: str) -> ExportResult:
    """Check ``(label, got, expected, base)`` tensors (``got`` None when the export lacks it): each finite, within
    ``rtol * max |expected|`` of ``expected``, and closer to it than to ``base`` where the adapter's effect is above the
    noise. Consecutive items with the same label are blocks of rows of one tensor, checked as that tensor: host memory
    holds one block at a time (``BLOCK_VALUES``). ``GrpoKitError`` naming the first failures."""
    tallies: dict[str, _Tally] = {}
    for label, got, expected, base in items:
        tallies.setdefault(label, _Tally()).add(label, got, expected, base)
    problems, worst, effect, to_tuned, to_base, lost = [], None, 0.0, [], [], 0
    for label, t in tallies.items():
        if t.problem:
            problems.append(t.problem)
            continue
        limit = rtol * t.scale
        worst = max(worst or (0.0, limit), (t.diff, limit), key=lambda pair: pair[0] / (pair[1] or 1e-30))
        if not t.diff <= limit:
            problems.append(f"{label}: max |d| {t.diff:.3g} exceeds the limit {limit:.3g}")
        if t.change == 0.0:
            continue  # not touched by the LoRA (most weight tensors)
        effect = max(effect, t.change)
        to_tuned.append(t.sums[0] / t.count)
        to_base.append(t.sums[1] / t.count)
        # Closer to tuned than to base is required only where the adapter's effect is at least twice the storage noise
        # (the smaller distance): below that, rounding can erase the effect for real (a q8_0 block's step is 1/254 of
        # its largest weight, more than a short run's LoRA moves most weights), which is a note, not a broken export.
        if t.sums[2] / t.count < 2 * min(to_tuned[-1], to_base[-1]):
            lost += 1
        elif not to_tuned[-1] < to_base[-1]:
            problems.append(f"{label} is closer to the base than to base+adapter: the LoRA weights are missing from it")
    if problems:
        raise GrpoKitError(
            f"Export verification failed for {fmt} ({detail}): {'; '.join(problems[:5])}. Nothing was "
            "written to the export folder. Keep the adapter itself (--format lora) and report the "
            "message: a bug in the export path or a corrupt adapter."
        )
    note = (
        f"{fmt}: the adapter changes nothing checked here (LoRA B still zero?); check that training ran."
        if (not to_tuned)
        else (
            f"{fmt}: in {lost} of {len(to_tuned)} checks the adapter's effect is lost in the storage "
            "noise; there a merged LoRA cannot be told from a missing one."
            if lost
            else ""
        )
    )
    return ExportResult(
        fmt, path, detail, *(worst or (0.0, 0.0)), fmean(to_tuned or [0.0]), effect, fmean(to_base or [0.0]), note
    )


def lora_deltas(adapter_dir: Path) -> dict[str, functools.partial]:
    """``{base tensor name: function returning scale * B @ A}``, kept as the rank-r factors until asked for (the full
    deltas of an 8B model at once would not fit in a Colab's RAM); ``delta(rows=slice(a, b))`` gives rows a to b."""
    config = adapter_config(adapter_dir)
    if config.use_dora or config.rank_pattern or config.alpha_pattern:
        raise GrpoKitError(
            "The export's weight check handles plain LoRA only (no DoRA, rank_pattern or alpha_pattern): "
            "export --format lora."
        )
    scale = config.lora_alpha / (config.r**0.5 if config.use_rslora else config.r)
    weights = _tensors(adapter_dir)  # memory-mapped, a factor read when its delta is asked for

    def delta(a_key: str, rows: slice = slice(None)):  # the kit's models are nn.Linear: no fan_in_fan_out (Conv1D)
        return scale * (weights[a_key.replace(".lora_A.", ".lora_B.")][...][rows].float() @ weights[a_key][...].float())

    return {_base_name(key): functools.partial(delta, key) for key in weights if ".lora_A." in key}


def lora_effect(adapter_dir: Path) -> float:
    """How far the adapter moves the model: the largest ``|scale * B @ A|`` over its LoRA pairs, a block of rows at a
    time. 0 when it changes nothing (every ``lora_B`` still 0: a run that had nothing to learn from)."""
    stored, effect = _tensors(adapter_dir), 0.0
    for delta in lora_deltas(adapter_dir).values():
        a_key = delta.args[0]
        shape = (stored[a_key.replace(".lora_A.", ".lora_B.")].shape[0], stored[a_key].shape[1])
        for rows in _blocks(shape):
            effect = max(effect, float(delta(rows=rows).abs().max()))
    return effect


def _base_name(lora_a_key: str) -> str:
    """The base weight a LoRA factor adapts: ``base_model.model.x.q_proj.lora_A.weight`` -> ``x.q_proj.weight``."""
    return f"{lora_a_key.split('.lora_A.')[0].removeprefix('base_model.model.')}.weight"


@dataclass(frozen=True)
class _Stored:
    """One tensor of a safetensors file: ``get_shape()`` from the header, ``[...]`` all of it, ``[a:b]`` rows a to b
    (``[:]`` fails on a 0-dim tensor). Each read maps the file for that read alone, so the pages it touched leave the
    process's memory with it (a handle kept open holds every page read through it: gigabytes for an 8B's shards)."""

    file: Path
    name: str
    shape: tuple[int, ...]

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index):
        with safe_open(str(self.file), framework="pt") as handle:
            return handle.get_slice(self.name)[index]


def _tensors(folder: Path) -> dict[str, _Stored]:
    """``{tensor name: _Stored}`` of a checkpoint folder, sharded or not. The index names the shards: a Hub snapshot
    may also hold a ``consolidated.safetensors`` (Mistral)."""
    index = folder / "model.safetensors.index.json"
    shards = (
        set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        if index.is_file()
        else [path.name for path in folder.glob("*.safetensors")]
    )
    found = {}
    for file in sorted(shards):
        with safe_open(str(folder / file), framework="pt") as handle:
            found.update(
                {
                    name: _Stored(folder / file, name, tuple(handle.get_slice(name).get_shape()))
                    for name in handle.keys()
                }
            )
    if not found:
        raise GrpoKitError(f"{folder} holds no .safetensors weights to compare.")
    return found


def _blocks(shape) -> list[slice]:
    """Row ranges of a tensor of ``shape``, ``BLOCK_VALUES`` values at most each (one for a 0- or 1-dim tensor)."""
    if len(shape) < 2:
        return [slice(None)]
    step = max(1, BLOCK_VALUES // max(1, int(torch.Size(shape[1:]).numel())))
    return [slice(start, min(start + step, shape[0])) for start in range(0, shape[0], step)]


def check_weights(fmt: str, path: Path, base_dir: Path, adapter_dir: Path, kind: str) -> ExportResult:
    """``check_tensors`` on a merged16 folder (every tensor of the base) or a GGUF file (embedding, final norm, first
    and last block) with base + LoRA, one tensor at a time. Weights, not logits: a wrong chat template would not show
    here."""
    base_files, deltas = _tensors(base_dir), lora_deltas(adapter_dir)
    if fmt == "gguf":
        config = json.loads((base_dir / "config.json").read_text(encoding="utf-8"))
        entries = gguf_files.gguf_tensors(path, config, base_files)
    else:
        exported = _tensors(path)

        def read_export(name, rows=slice(None)):  # None when missing, as gguf_tensors' read()
            return exported[name][rows] if name in exported else None

        entries = {
            name: (name, functools.partial(read_export, name))
            for name in base_files
            if name in exported or name != "lm_head.weight"
        }  # a tied head may be left out: its embedding is here

    def items():  # block by block: never a whole large tensor in float32
        for name, (label, read) in entries.items():
            stored = base_files[name]
            for rows in _blocks(stored.shape):
                base = stored[rows if stored.shape else ...].float()
                yield label, read(rows), base + deltas[name](rows) if name in deltas else base, base

    what = " (embedding, final norm, first and last block)" if fmt == "gguf" else ""
    return check_tensors(
        fmt,
        items(),
        gguf_files.WEIGHT_RTOL[kind],
        path=path,
        detail=f"{kind}: {len(entries)} tensors{what} compared with base + LoRA",
    )


def check_base(adapter_dir: Path, base_dir: Path, model: str) -> None:
    """Refuse a base whose weights the adapter's LoRA factors do not fit (not the model it was trained on), before
    anything is merged: PEFT's merge would stop on a shape error, Unsloth's after minutes."""
    base, lora = _tensors(base_dir), _tensors(adapter_dir)
    for key in (key for key in lora if ".lora_A." in key):
        name, b_key = _base_name(key), key.replace(".lora_A.", ".lora_B.")
        want = [lora[b_key].get_shape()[0], lora[key].get_shape()[1]]
        if name not in base or base[name].get_shape() != want:
            has = base[name].get_shape() if name in base else "no such weight"
            raise GrpoKitError(
                f"The adapter in {adapter_dir} does not fit the model {model}: it was trained on "
                f"{adapter_config(adapter_dir).base_model_name_or_path or '(not recorded)'} (adapter_config.json): "
                f"pass that model as --model. (size mismatch for {name}: the adapter needs {want}, the "
                f"base has {has})"
            )


def check_lora(folder: Path, adapter_dir: Path) -> ExportResult:
    """The exported adapter's tensors against the run's, bit for bit (each compared with zero as its "base": a
    tensor that went missing or came back zeroed fails). Its ``lora_effect`` is the largest factor; ``export`` puts
    the adapter's effect on the model in its place (``lora_effect``)."""
    got, expected = _tensors(folder), _tensors(adapter_dir)

    def items():
        for name, stored in expected.items():
            want = stored[...].float()
            yield name, got[name][...] if name in got else None, want, torch.zeros_like(want)

    return check_tensors(
        "lora", items(), 0.0, path=folder, detail=f"PEFT adapter: {len(expected)} tensors, bit for bit"
    )


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
        data, str(template), info=info, kinds=kinds, prompt_file=runs.PROMPT_FILE, dumps=json.dumps, isabs=os.path.isabs
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
    out_dir, target = Path(out_dir), Path(out_dir) / name
    _check_target(target, overwrite)
    recipe = run.info.get("recipe") or {}
    prompt = run.prompt  # the prompt it trained with (its run's recipe, or an exported adapter's), for each folder
    trained_on = base_model or run.base_model
    merging = "merged16" in wanted or bool(gguf_types)  # a LoRA alone needs no base model
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
    check_space(base_path, out_dir, name, wanted, gguf_types, by_unsloth=by_unsloth)
    base_dir = gguf_files.local_base(base_path) if merging else None  # what check_weights compares with
    if base_dir:
        check_base(adapter_dir, base_dir, trained_on)
    results: list[ExportResult] = []
    try:
        with files.staged_dir(target) as staging:
            if "lora" in wanted:
                (staging / "lora").mkdir()
                for item in adapter_dir.glob("adapter_*"):
                    shutil.copy2(item, staging / "lora" / item.name)
                tokenizer.save_pretrained(staging / "lora")
                results.append(dataclasses.replace(check_lora(staging / "lora", adapter_dir), lora_effect=effect))
                run.write_prompt(staging / "lora")
            # Unsloth in its own folder (it leaves a merged checkpoint and llama.cpp's files there), removed before
            # the rename; only its results are moved in. It loads the model as the run trained it (4 bit or 16).
            scratch = staging / f"unsloth{staging.name}"
            if by_unsloth:
                in_4bit = merge_base != trained_on or bool(recipe.get("load_in_4bit"))
                made = gguf_files.run_unsloth(
                    adapter_dir,
                    trained_path,
                    scratch,
                    gguf_types,
                    merged16="merged16" in wanted,
                    load_in_4bit=in_4bit,
                    say=print_fn,
                )
            gguf_paths = [staging / "gguf" / f"{name}-{kind}.gguf" for kind in gguf_types]
            for kind, path in zip(gguf_types, gguf_paths, strict=True):
                path.parent.mkdir(exist_ok=True)
                shutil.move(made[kind], path)
                results.append(check_weights("gguf", path, base_dir, adapter_dir, kind))
            if gguf_paths:
                gguf_files.write_modelfile(staging / "gguf", gguf_paths, tokenizer)
            if "merged16" in wanted:
                if by_unsloth:  # Unsloth keeps the shards' dtype: bf16 mostly (fp16 rounds finer, within bf16's limit)
                    shutil.move(made["merged16"], staging / "merged16")
                else:
                    _write_merged16(base_path, adapter_dir, tokenizer, staging / "merged16")
                results.append(check_weights("merged16", staging / "merged16", base_dir, adapter_dir, "bfloat16"))
                run.write_prompt(staging / "merged16")
            answered = None
            if answers and prompt and "merged16" in wanted:
                length = int(recipe.get("max_completion_length") or 256)
                answered = verify_answers(staging / "merged16", trained_on, adapter_dir, prompt, answers, length)
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


def check_space(base_path: str, out_dir: Path, name: str, wanted, gguf_types, *, by_unsloth: bool) -> None:
    """Refuse an export that would not fit on the disk of ``out_dir``, before a byte is written, counting every file
    it writes or downloads (``export_sizes``); the message names the biggest item and what to drop. Unknown model
    sizes are not checked."""
    from grpo_kit.colab import check_fits

    sizes = export_sizes(base_path, wanted, gguf_types, by_unsloth=by_unsloth)
    if sizes:
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


def export_sizes(base_path: str, wanted, gguf_types, *, by_unsloth: bool) -> dict[str, int]:
    """Bytes of every file an export of a model like ``base_path`` writes or downloads, by name: the formats, the
    16-bit base its weight check reads (a download unless it is a folder or cached), Unsloth's 16-bit merge when no
    merged16 is kept (GGUF is converted from that one merge) and llama.cpp's 16-bit GGUF before quantizing. Empty when
    the model's size is unknown or nothing is merged (a LoRA alone takes megabytes).

    >>> {k: round(v / 1e9, 1) for k, v in export_sizes("unsloth/Meta-Llama-3.1-8B-Instruct", ["lora", "merged16",
    ...     "gguf"], ["q4_k_m"], by_unsloth=True).items()}  # doctest: +NORMALIZE_WHITESPACE
    {'merged16': 16.1, 'gguf q4_k_m': 4.9, "llama.cpp's 16-bit GGUF before quantizing (removed afterwards)": 16.1,
     'the 16-bit base for the weight check (download to the Hugging Face cache)': 16.1}
    """
    from grpo_kit.planner import shape_for

    if (shape := shape_for(base_path)) is None or not (gguf_types or "merged16" in wanted):
        return {}
    half = 2 * shape.params
    sizes = {"merged16": half} if "merged16" in wanted else {}
    sizes.update({f"gguf {kind}": int(shape.params * gguf_files.GGUF_BYTES[kind]) for kind in gguf_types})
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
