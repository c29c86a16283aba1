"""Verification of an export: each file read back tensor by tensor and compared with base + LoRA, one block of rows
at a time, before ``grpo_kit.export`` lets it land.

Every route is checked the same way (``check_weights``; the adapter itself with the run's own tensors, bit for bit:
``check_lora``): within its storage type's limit (``grpo_kit.gguf_files.WEIGHT_RTOL``), and closer to base + LoRA
than to the base wherever the adapter's effect exceeds the storage noise, which catches a merge that silently
dropped the LoRA. Weights, not logits: a wrong chat template would not show here (``export.verify_answers`` can).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean

import torch
from safetensors import safe_open

from grpo_kit import gguf_files
from grpo_kit.adapters import adapter_config
from grpo_kit.errors import GrpoKitError
from grpo_kit.files import read_json


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


#: Values per block of rows the weight checks read at once (64 MiB in float32): an 8B model's 525M-value embedding
#: is never whole in host memory, in any dtype (a free Colab has ~12.7 GB of RAM).
BLOCK_VALUES = 2**24


def check_tensors(fmt: str, items, rtol: float, *, path: Path, detail: str) -> ExportResult:
    """Check ``(label, got, expected, base)`` tensors (``got`` None when the export lacks it): each finite, within
    ``rtol * max |expected|`` of ``expected``, and closer to it than to ``base`` where the adapter's effect is above the
    noise. Consecutive items with the same label are blocks of rows of one tensor, checked as that tensor: host memory
    holds one block at a time (``BLOCK_VALUES``). ``GrpoKitError`` naming the first failures."""
    problems, worst, effect, to_tuned, to_base, lost = [], None, 0.0, [], [], 0
    for label, blocks in itertools.groupby(items, key=lambda item: item[0]):  # one tensor's blocks of rows
        problem, count = "", 0
        diff = scale = change = 0.0  # max |got - expected|, max |expected|, max |expected - base|: the effect
        sums = (0.0, 0.0, 0.0)  # sum |got - expected|, |got - base|, |expected - base|
        for _, got, expected, base in blocks:
            if got is None or got.numel() != expected.numel():
                problem = (
                    f"{label} is missing"
                    if got is None
                    else f"{label} has {got.numel()} values, not {expected.numel()}"
                )
                break
            got = got.float().reshape(expected.shape)
            if bad := [
                what
                for what, t in (("the export", got), ("base+adapter", expected), ("the base", base))
                if not torch.isfinite(t).all()
            ]:
                problem = f"{label}: NaN/inf in {' and '.join(bad)}"
                break
            gap, from_base, delta = (got - expected).abs(), (got - base).abs(), (expected - base).abs()
            diff, change = max(diff, float(gap.max())), max(change, float(delta.max()))
            scale = max(scale, float(expected.abs().max()))
            sums = tuple(a + float(b.sum()) for a, b in zip(sums, (gap, from_base, delta), strict=True))
            count += expected.numel()
        if problem:
            problems.append(problem)
            continue
        limit = rtol * scale
        worst = max(worst or (0.0, limit), (diff, limit), key=lambda pair: pair[0] / (pair[1] or 1e-30))
        if not diff <= limit:
            problems.append(f"{label}: max |d| {diff:.3g} exceeds the limit {limit:.3g}")
        if change == 0.0:
            continue  # not touched by the LoRA (most weight tensors)
        effect = max(effect, change)
        near_tuned, near_base, moved = (total / count for total in sums)  # mean per value of each sum
        to_tuned.append(near_tuned)
        to_base.append(near_base)
        # Closer to tuned than to base is required only where the adapter's effect is at least twice the storage noise
        # (the smaller distance): below that, rounding can erase the effect for real (a q8_0 block's step is 1/254 of
        # its largest weight, more than a short run's LoRA moves most weights), which is a note, not a broken export.
        if moved < 2 * min(near_tuned, near_base):
            lost += 1
        elif not near_tuned < near_base:
            problems.append(f"{label} is closer to the base than to base+adapter: the LoRA weights are missing from it")
    if problems:
        raise GrpoKitError(
            f"Export verification failed for {fmt} ({detail}): {'; '.join(problems[:5])}. Nothing was "
            "written to the export folder. Keep the adapter itself (--format lora) and report the "
            "message: a bug in the export path or a corrupt adapter."
        )
    note = (
        f"{fmt}: the adapter changes nothing checked here (LoRA B still zero?); check that training ran."
        if not to_tuned
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


def lora_deltas(adapter_dir: Path) -> dict[str, _Delta]:
    """``{base tensor name: its _Delta}``: what each LoRA pair adds to the base weight it adapts."""
    config = adapter_config(adapter_dir)
    if config.use_dora or config.rank_pattern or config.alpha_pattern:
        raise GrpoKitError(
            "The export's weight check handles plain LoRA only (no DoRA, rank_pattern or alpha_pattern): "
            "export --format lora."
        )
    scale = config.lora_alpha / (config.r**0.5 if config.use_rslora else config.r)
    weights = _tensors(adapter_dir)  # memory-mapped, a factor read when its delta is asked for
    return {
        _base_name(key): _Delta(weights[key], weights[key.replace(".lora_A.", ".lora_B.")], scale)
        for key in weights
        if ".lora_A." in key
    }


def lora_effect(adapter_dir: Path) -> float:
    """How far the adapter moves the model: the largest ``|scale * B @ A|`` over its LoRA pairs, a block of rows at a
    time. 0 when it changes nothing (every ``lora_B`` still 0: a run that had nothing to learn from)."""
    deltas = lora_deltas(adapter_dir).values()
    return max((float(delta(rows).abs().max()) for delta in deltas for rows in _blocks(delta.shape)), default=0.0)


def _base_name(lora_a_key: str) -> str:
    """The base weight a LoRA factor adapts: ``base_model.model.x.q_proj.lora_A.weight`` -> ``x.q_proj.weight``."""
    return f"{lora_a_key.split('.lora_A.')[0].removeprefix('base_model.model.')}.weight"


@dataclass(frozen=True)
class _Stored:
    """One tensor of a safetensors file: ``shape`` from the header, ``[...]`` all of it, ``[a:b]`` rows a to b
    (``[:]`` fails on a 0-dim tensor). Each read maps the file for that read alone, so the pages it touched leave the
    process's memory with it (a handle kept open holds every page read through it: gigabytes for an 8B's shards)."""

    file: Path
    name: str
    shape: tuple[int, ...]

    def __getitem__(self, index):
        with safe_open(self.file, framework="pt") as handle:
            return handle.get_slice(self.name)[index]


@dataclass(frozen=True)
class _Delta:
    """``scale * B @ A`` of one LoRA pair, kept as its rank-r factors until asked for (the full deltas of an 8B model
    at once would not fit in a Colab's RAM); ``delta(rows=slice(a, b))`` gives rows a to b. The kit's models are
    ``nn.Linear``: no ``fan_in_fan_out`` (Conv1D)."""

    a: _Stored
    b: _Stored
    scale: float

    @property
    def shape(self) -> tuple[int, int]:
        return self.b.shape[0], self.a.shape[1]

    def __call__(self, rows: slice = slice(None)):
        return self.scale * (self.b[...][rows].float() @ self.a[...].float())


def _tensors(folder: Path) -> dict[str, _Stored]:
    """``{tensor name: _Stored}`` of a checkpoint folder, sharded or not. The index names the shards: a Hub snapshot
    may also hold a ``consolidated.safetensors`` (Mistral)."""
    index = folder / "model.safetensors.index.json"
    shards = (
        set(read_json(index)["weight_map"].values())
        if index.is_file()
        else [path.name for path in folder.glob("*.safetensors")]
    )
    found = {}
    for file in sorted(shards):
        with safe_open(folder / file, framework="pt") as handle:
            for name in handle.keys():
                found[name] = _Stored(folder / file, name, tuple(handle.get_slice(name).get_shape()))
    if not found:
        raise GrpoKitError(f"{folder} holds no .safetensors weights to compare.")
    return found


def _blocks(shape) -> list[slice]:
    """Row ranges of a tensor of ``shape``, ``BLOCK_VALUES`` values at most each (one for a 0- or 1-dim tensor)."""
    if len(shape) < 2:
        return [slice(None)]
    step = max(1, BLOCK_VALUES // max(1, math.prod(shape[1:])))
    return [slice(start, min(start + step, shape[0])) for start in range(0, shape[0], step)]


def check_weights(fmt: str, path: Path, base_dir: Path, adapter_dir: Path, kind: str) -> ExportResult:
    """``check_tensors`` on a merged16 folder (every tensor of the base) or a GGUF file (embedding, final norm, first
    and last block) with base + LoRA, one tensor at a time. Weights, not logits: a wrong chat template would not show
    here."""
    base_files, deltas = _tensors(base_dir), lora_deltas(adapter_dir)
    if fmt == "gguf":
        entries = gguf_files.gguf_tensors(path, read_json(base_dir / "config.json"), base_files)
        what = " (embedding, final norm, first and last block)"
    else:
        exported = _tensors(path)
        entries = {
            name: (name, exported[name].__getitem__ if name in exported else None)  # None: missing, as gguf_tensors'
            for name in base_files
            if name in exported or name != "lm_head.weight"
        }  # a tied head may be left out: its embedding is here
        what = ""

    def items():  # block by block: never a whole large tensor in float32
        for name, (label, read) in entries.items():
            stored = base_files[name]
            for rows in _blocks(stored.shape):
                base = stored[rows if stored.shape else ...].float()
                yield label, read(rows) if read else None, base + deltas[name](rows) if name in deltas else base, base

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
    base = _tensors(base_dir)
    for name, delta in lora_deltas(adapter_dir).items():
        if name not in base or base[name].shape != delta.shape:
            has = list(base[name].shape) if name in base else "no such weight"
            raise GrpoKitError(
                f"The adapter in {adapter_dir} does not fit the model {model}: it was trained on "
                f"{adapter_config(adapter_dir).base_model_name_or_path or '(not recorded)'} (adapter_config.json): "
                f"pass that model as --model. (size mismatch for {name}: the adapter needs {list(delta.shape)}, the "
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
