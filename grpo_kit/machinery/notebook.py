"""Notebook-session helpers: the shared run folder, the smoke switch, and "load what the previous notebook made".

The five notebooks in ``notebooks/`` form one path (setup → GRPO explained → train → evaluate → export), yet each
one must also run on its own, top to bottom, on a fresh Colab runtime or in CI. ``NotebookSession.open()`` gives
every notebook the same answers to the same questions:

- **which preset?** the one notebook 01 saved to ``session.json``, else ``auto_recipe()`` for this machine; in
  smoke mode always ``cpu``;
- **how big a run?** ``RunSizes``: the preset's steps and a real evaluation, or, in smoke mode, 2 training steps,
  4 evaluation questions and short generations (the narrative stays the same, only the numbers shrink);
- **where do files go?** ``NotebookPaths``: one folder per preset under the session root, which is
  ``runs/notebook`` in the project, or ``MyDrive/grpo-kit/notebook`` on Colab once Drive is mounted (so a
  disconnected runtime loses nothing).

``find_trained_adapter(session, source)`` finds a trained adapter (the session's run, a folder or a Hub repo) for
notebooks 04 and 05; they train only when the user asks for it in a cell (or CI's smoke mode makes a 2-step run).

Smoke mode is on when ``GRPO_KIT_SMOKE=1`` (``runtime.smoke_mode()``, what CI sets) and also, unless
``GRPO_KIT_SMOKE=0`` says otherwise, when there is no GPU.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from grpo_kit.errors import GrpoKitError
from grpo_kit.machinery.folders import set_aside

#: Where the repository lives (Colab badges point here).
GITHUB_REPO = "grpo-kit/grpo-kit"
GITHUB_BRANCH = "main"
#: The notebooks, in reading order.
NOTEBOOKS = (
    "00_train_grpo_colab.ipynb",
    "01_setup.ipynb",
    "02_grpo_explained.ipynb",
    "03_train.ipynb",
    "04_evaluate.ipynb",
    "05_export.ipynb",
)
COLAB_BADGE_IMAGE = "https://colab.research.google.com/assets/colab-badge.svg"

#: Environment variable that moves the session root (e.g. to a scratch disk).
ROOT_ENV = "GRPO_KIT_NOTEBOOK_DIR"
#: The session root inside a project checkout, and on a mounted Google Drive.
LOCAL_SUBDIR = Path("runs") / "notebook"
DRIVE_MOUNT = Path("/content/drive")
DRIVE_SUBDIR = Path("MyDrive") / "grpo-kit" / "notebook"
SESSION_FILE = "session.json"

#: Smoke mode: enough to exercise every cell, small enough for a 2-core CI machine.
SMOKE_STEPS = 2
SMOKE_EVAL_QUESTIONS = 4
SMOKE_NEW_TOKENS = 32
#: Smoke mode also shrinks each step (cpu preset: 8 completions of 48 tokens -> 4 of 16), keeping the recipe's shape.
SMOKE_OVERRIDES = {"num_generations": 4, "per_device_train_batch_size": 4, "max_completion_length": 16}
#: Full runs: held-out questions evaluated before/after on the CPU (bundled sample) and on a GPU (GSM8K test).
CPU_EVAL_QUESTIONS = 22
GPU_EVAL_QUESTIONS = 200
CPU_NEW_TOKENS = 64


# ------------------------------------------------------------------------------------------------ Colab


def colab_badge_url(notebook: str, repo: str = GITHUB_REPO, branch: str = GITHUB_BRANCH) -> str:
    """The URL that opens ``notebooks/<notebook>`` of the GitHub repo in Colab.

    >>> colab_badge_url("01_setup.ipynb")
    'https://colab.research.google.com/github/grpo-kit/grpo-kit/blob/main/notebooks/01_setup.ipynb'
    """
    return f"https://colab.research.google.com/github/{repo}/blob/{branch}/notebooks/{notebook}"


def colab_badge_markdown(notebook: str) -> str:
    """The "Open in Colab" badge as markdown, for the first cell of each notebook.

    >>> colab_badge_markdown("03_train.ipynb").startswith("[![Open In Colab](")
    True
    """
    return f"[![Open In Colab]({COLAB_BADGE_IMAGE})]({colab_badge_url(notebook)})"


def mount_drive_if_colab(mount: str | os.PathLike = DRIVE_MOUNT) -> Path | None:
    """On Colab, mount Google Drive (Colab asks for permission once) and return the session root on it; else None."""
    from grpo_kit.machinery.runtime import in_colab

    if not in_colab():
        return None
    from google.colab import drive  # only importable on Colab

    drive.mount(str(mount))
    root = Path(mount) / DRIVE_SUBDIR
    root.mkdir(parents=True, exist_ok=True)
    return root


# ------------------------------------------------------------------------------------------------ paths


def find_project_root(start: str | os.PathLike | None = None) -> Path | None:
    """The nearest folder at or above ``start`` (default: the working directory) holding a grpo-kit checkout.

    Notebooks run with ``notebooks/`` as their working directory; their runs belong in the checkout's ``runs/``.
    """
    here = Path(start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        if (folder / "pyproject.toml").is_file() and (folder / "grpo_kit").is_dir():
            return folder
    return None


def drive_root(mount: str | os.PathLike = DRIVE_MOUNT) -> Path | None:
    """The session root on Google Drive when Drive is mounted at ``mount``, else None."""
    if (Path(mount) / "MyDrive").is_dir():
        return Path(mount) / DRIVE_SUBDIR
    return None


def local_root(start: str | os.PathLike | None = None) -> Path:
    """``$GRPO_KIT_NOTEBOOK_DIR``, else ``<checkout or start or cwd>/runs/notebook`` (never on Google Drive)."""
    env = os.environ.get(ROOT_ENV)
    if env:
        return Path(env).expanduser().resolve()
    base = find_project_root(start) or Path(start or Path.cwd()).resolve()
    return base / LOCAL_SUBDIR


def default_root(start: str | os.PathLike | None = None, mount: str | os.PathLike = DRIVE_MOUNT) -> Path:
    """``$GRPO_KIT_NOTEBOOK_DIR``, else the Drive root when Drive is mounted, else ``local_root(start)``."""
    if os.environ.get(ROOT_ENV):
        return local_root(start)
    return drive_root(mount) or local_root(start)


@dataclass(frozen=True)
class NotebookPaths:
    """Where a session keeps its files; one folder per preset so runs of different recipes never mix.

    ``run_dir``: the training run folder (layout in docs/DESIGN.md); ``eval_dir``: ``before.json``/``after.json``
    and the bar chart; both under ``root`` (on Drive when mounted). ``export_dir`` is always on the local disk
    (merged models are large); ``drive_export_dir`` is where notebook 05 copies them when ``root`` is on Drive.
    """

    root: Path
    run_dir: Path
    eval_dir: Path
    export_dir: Path
    drive_export_dir: Path | None = None

    @property
    def on_drive(self) -> bool:
        return self.drive_export_dir is not None


def session_paths(
    preset_name: str, root: str | os.PathLike | None = None, *, local: str | os.PathLike | None = None
) -> NotebookPaths:
    """The paths for ``preset_name`` under ``root`` (default ``default_root()``); exports under ``local``.

    ``local`` defaults to ``root`` unless ``root`` is on the mounted Drive, then to ``local_root()``.

    >>> p = session_paths("cpu", root="/tmp/nb")
    >>> p.run_dir.as_posix(), p.eval_dir.as_posix(), p.export_dir.as_posix(), p.on_drive
    ('/tmp/nb/cpu/train', '/tmp/nb/cpu/eval', '/tmp/nb/cpu/exports', False)
    """
    base = Path(root) if root is not None else default_root()
    on_drive = _is_under(base, DRIVE_MOUNT)
    if local is None:
        local = local_root() if on_drive else base
    folder = base / preset_name
    return NotebookPaths(
        root=base,
        run_dir=folder / "train",
        eval_dir=folder / "eval",
        export_dir=Path(local) / preset_name / "exports",
        drive_export_dir=folder / "exports" if on_drive else None,
    )


def _is_under(path: Path, parent: Path) -> bool:
    try:
        Path(path).resolve().relative_to(Path(parent).resolve())
    except ValueError:
        return False
    return True


def copy_to_drive(folder: str | os.PathLike, paths: NotebookPaths, *, include=None) -> Path | None:
    """Copy an export folder to ``paths.drive_export_dir``; None when the session is not on Drive.

    ``include``: names of the entries of ``folder`` to copy (default: all). The copy is assembled next to the target
    and renamed into place; an older copy of the same name is renamed aside (``<name>.old-<time>``), never deleted.
    """
    if paths.drive_export_dir is None:
        return None
    folder = Path(folder)
    target = paths.drive_export_dir / folder.name
    staging = target.with_name(f".{target.name}.copying")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for entry in sorted(folder.iterdir()):
        if include is not None and entry.name not in include:
            continue
        if entry.is_dir():
            shutil.copytree(entry, staging / entry.name)
        else:
            shutil.copy2(entry, staging / entry.name)
    if target.exists():
        set_aside(target)
    os.rename(staging, target)
    return target


def save_choice(root: str | os.PathLike, preset_name: str, overrides: dict | None = None) -> Path:
    """Remember the preset chosen in notebook 01 (``session.json`` in ``root``) for the later notebooks."""
    path = Path(root) / SESSION_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"preset": preset_name, "overrides": overrides or {}}, indent=2) + "\n")
    return path


def load_choice(root: str | os.PathLike) -> dict | None:
    """The ``{"preset": ..., "overrides": {...}}`` saved by ``save_choice``, or None (missing or unreadable)."""
    path = Path(root) / SESSION_FILE
    try:
        choice = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(choice, dict) or not isinstance(choice.get("preset"), str):
        return None
    choice.setdefault("overrides", {})
    return choice


# ------------------------------------------------------------------------------------------------ smoke switch


def smoke_decision(device) -> tuple[bool, str]:
    """Whether to run in smoke mode on ``device`` (a ``runtime.DeviceInfo``), and why, in one line.

    ``GRPO_KIT_SMOKE=1`` turns it on, ``GRPO_KIT_SMOKE=0`` turns it off; unset, it is on exactly when there is no GPU.
    """
    from grpo_kit.machinery.runtime import smoke_mode

    raw = os.environ.get("GRPO_KIT_SMOKE", "").strip()
    if smoke_mode():
        return True, "GRPO_KIT_SMOKE=1: the cpu preset with tiny step counts (how CI runs the notebooks)"
    if raw:
        return False, f"GRPO_KIT_SMOKE={raw}: full-size run"
    if device.kind != "cuda":
        return True, "no GPU found, so smoke mode: tiny step counts (set GRPO_KIT_SMOKE=0 to train the full cpu recipe)"
    return False, f"GPU found ({device.name}): full-size run"


@dataclass(frozen=True)
class RunSizes:
    """How much work each notebook does: training steps, held-out questions, generation length, data sources."""

    max_steps: int
    eval_questions: int
    max_new_tokens: int
    train_data: str
    eval_data: str


def run_sizes(preset, *, smoke: bool, on_gpu: bool) -> RunSizes:
    """Smoke: 2 steps, 4 questions, 32 new tokens, bundled sample. CPU: the preset's steps on the sample. GPU: GSM8K.

    >>> from grpo_kit.recipes import load_recipe
    >>> run_sizes(load_recipe("cpu"), smoke=True, on_gpu=False)
    RunSizes(max_steps=2, eval_questions=4, max_new_tokens=32, train_data='sample', eval_data='sample')
    """
    if smoke:
        return RunSizes(SMOKE_STEPS, SMOKE_EVAL_QUESTIONS, min(SMOKE_NEW_TOKENS, preset.max_completion_length),
                        "sample", "sample")
    if not on_gpu:
        return RunSizes(preset.max_steps, CPU_EVAL_QUESTIONS, CPU_NEW_TOKENS, "sample", "sample")
    return RunSizes(preset.max_steps, GPU_EVAL_QUESTIONS, preset.max_completion_length, "gsm8k", "gsm8k")


# ------------------------------------------------------------------------------------------------ session


@dataclass(frozen=True)
class NotebookSession:
    """Everything a notebook needs to know about this run; build it with ``NotebookSession.open()``."""

    preset: object  # grpo_kit.recipes.Recipe (kept untyped so importing this module stays light)
    reason: str
    smoke: bool
    smoke_reason: str
    device: object  # grpo_kit.machinery.runtime.DeviceInfo
    paths: NotebookPaths
    sizes: RunSizes

    @classmethod
    def open(
        cls,
        preset: str | None = None,
        *,
        root: str | os.PathLike | None = None,
        smoke: bool | None = None,
        device=None,
        model_choice: str | None = None,
        **overrides,
    ) -> NotebookSession:
        """Resolve preset, smoke mode and paths. ``preset``: a name, or None for the saved choice / ``auto``.

        Order: smoke mode forces ``cpu``; else an explicit ``preset``; else the one saved by notebook 01; else
        ``auto_recipe()``. ``overrides`` are preset fields (``load_recipe(name, **overrides)``); in smoke mode
        ``max_steps`` becomes ``SMOKE_STEPS`` and ``SMOKE_OVERRIDES`` shrink each step. ``model_choice`` (a key of
        ``MODEL_CHOICES``) swaps the tier's model on a GPU; smoke mode keeps the embedded CPU model.
        """
        from grpo_kit.machinery.planner import auto_recipe, check_fits
        from grpo_kit.machinery.runtime import detect_device
        from grpo_kit.recipes import load_recipe

        device = device or detect_device()
        if smoke is None:
            smoke, smoke_reason = smoke_decision(device)
        else:
            smoke_reason = "smoke mode set by the caller" if smoke else "full-size run set by the caller"
        base = Path(root) if root is not None else default_root()
        saved = load_choice(base)
        if smoke:
            name, reason = "cpu", "smoke mode always uses the cpu preset"
        elif preset and preset != "auto":
            name, reason = preset, "chosen by name"
        elif saved and preset != "auto":
            name, reason = saved["preset"], f"chosen in notebook 01 (saved in {base / SESSION_FILE})"
            overrides = {**saved["overrides"], **overrides}
        else:
            chosen, reason = auto_recipe(device)
            name = chosen.name
            if chosen != load_recipe(name):  # auto_recipe adapted the tier (fallback model, fp16)
                overrides = {**_differences(load_recipe(name), chosen), **overrides}
        if model_choice and not smoke:
            overrides = {**overrides, "model": model_for(model_choice, load_recipe(name, **overrides))}
        sizes_preset = load_recipe(name, **overrides)
        sizes = run_sizes(sizes_preset, smoke=smoke, on_gpu=device.kind == "cuda")
        if smoke:
            overrides = {**overrides, **SMOKE_OVERRIDES, "max_steps": sizes.max_steps, "save_steps": sizes.max_steps}
        chosen_preset = load_recipe(name, **overrides)
        warning = check_fits(chosen_preset, device)
        if warning and "Warning:" not in reason:  # e.g. a preset saved on a bigger GPU, reopened on a smaller one
            reason += f". Warning: {warning}"
        return cls(
            preset=chosen_preset,
            reason=reason,
            smoke=smoke,
            smoke_reason=smoke_reason,
            device=device,
            paths=session_paths(name, base),
            sizes=sizes,
        )

    def summary(self) -> str:
        """A few lines to print at the top of a notebook: machine, preset and why, sizes, folders."""
        p, s = self.preset, self.sizes
        gpu = f"{self.device.name} ({self.device.vram_gb:.1f} GiB)" if self.device.kind == "cuda" else "no GPU (CPU)"
        lines = [
            f"device : {gpu}",
            f"preset : {p.name} - {self.reason}",
            f"model  : {p.model_id}",
            f"mode   : {'SMOKE' if self.smoke else 'full'} - {self.smoke_reason}",
            f"sizes  : {s.max_steps} training steps on '{s.train_data}', G={p.num_generations}, "
            f"{s.eval_questions} held-out questions on '{s.eval_data}', {s.max_new_tokens} new tokens",
            f"folder : {self.paths.root / p.name}" + ("  (Google Drive)" if self.paths.on_drive else ""),
        ]
        return "\n".join(lines)

    def save_choice(self) -> Path | None:
        """Save this preset (and its differences from the named preset) for the next notebooks.

        Smoke sessions save nothing: their choice is forced, and must not leak into a later full-size session.
        """
        from grpo_kit.recipes import load_recipe

        if self.smoke:
            return None
        return save_choice(self.paths.root, self.preset.name, _differences(load_recipe(self.preset.name), self.preset))


def _differences(base, changed) -> dict:
    """Values of ``changed`` that differ from ``base`` (two recipes), as ``--set`` keys."""
    old = base.flat()
    out = {k: v for k, v in changed.flat().items() if old.get(k) != v and k not in ("name", "description")}
    if "rewards" in out:  # pairs again, as with_overrides reads them
        out["rewards"] = [tuple(pair) for pair in out["rewards"]]
    return out


# ------------------------------------------------------------------------------------------------ the main notebook

#: The models 00_train_grpo_colab.ipynb offers on a GPU (Unsloth's uploads of the instruct models; ``model_for`` picks
#: the pre-quantized ``-bnb-4bit`` upload for 4-bit tiers).
MODEL_CHOICES = {
    "Llama-3.1-8B": "unsloth/Meta-Llama-3.1-8B-Instruct",
    "Qwen2.5-Math-7B": "unsloth/Qwen2.5-Math-7B-Instruct",
    "Qwen2.5-1.5B": "unsloth/Qwen2.5-1.5B-Instruct",
}


def model_for(choice: str, preset) -> str:
    """The Hub id of ``MODEL_CHOICES[choice]`` in the form ``preset`` loads (4-bit upload for 4-bit tiers).

    >>> from grpo_kit.recipes import load_recipe
    >>> model_for("Qwen2.5-Math-7B", load_recipe("t4-16gb")), model_for("Qwen2.5-1.5B", load_recipe("a100-80gb"))
    ('unsloth/Qwen2.5-Math-7B-Instruct-bnb-4bit', 'unsloth/Qwen2.5-1.5B-Instruct')
    """
    if choice not in MODEL_CHOICES:
        raise GrpoKitError(f"MODEL = {choice!r} is not offered. Choose one of: {', '.join(MODEL_CHOICES)}.")
    model = MODEL_CHOICES[choice]
    return f"{model}-bnb-4bit" if preset.load_in_4bit else model


#: Seconds per optimizer step of each tier's recipe with its default model: ``(seconds, "measured" | "estimated")``.
#: cpu: measured with `make demo` on an idle 2-core machine (steps of 40-51 s; README). No GPU figure is measured. The GPU estimates
#: scale the one public anchor, a saved T4 log of Unsloth's Llama-3.1-8B GRPO notebook (250 steps of 6 completions
#: of at most 200 tokens in 13,743 s: ~22 completion tokens/s end to end), by completions per step x ~250 tokens (a
#: typical GSM8K reasoning length), with an assumed 60 (L4), 150 (A100 40GB) and 300 (A100 80GB) tokens/s.
STEP_SECONDS = {
    "cpu": (45.0, "measured"),
    "cpu-answers": (168.0, "measured"),  # bench_cpu_answers: 842 s for 5 steps, 2 cores shared with other jobs
    "t4-16gb": (45.0, "estimated"),
    "l4-24gb": (67.0, "estimated"),
    "a100-40gb": (27.0, "estimated"),
    "a100-80gb": (53.0, "estimated"),
}


def expected_minutes(preset, steps: int | None = None) -> str:
    """``"~N min (measured|estimated)"`` for ``steps`` (default: the preset's) of ``preset``'s tier.

    >>> from grpo_kit.recipes import load_recipe
    >>> expected_minutes(load_recipe("t4-16gb"), 20)
    '~15 min (estimated)'
    """
    seconds, source = STEP_SECONDS.get(preset.name, (float("nan"), "unknown"))
    if source == "unknown":
        return "no time estimate for this recipe"
    minutes = seconds * (preset.max_steps if steps is None else steps) / 60
    return f"~{minutes:.0f} min ({source})"


def expected_time_table(presets=None):
    """A ``pandas.DataFrame``: per tier, its model, steps, minutes per 10 steps and for the whole run, and whether
    the figure was measured or estimated (``STEP_SECONDS``). Training steps only: loading and evaluation come on top."""
    import pandas as pd

    from grpo_kit.recipes import RECIPES

    rows = []
    for preset in (presets or RECIPES.values()):
        seconds, source = STEP_SECONDS.get(preset.name, (float("nan"), "unknown"))
        rows.append({"tier": preset.name, "model": preset.model_id.split("/")[-1], "steps": preset.max_steps,
                     "min / 10 steps": round(seconds * 10 / 60, 1),
                     "min / whole run": round(seconds * preset.max_steps / 60), "figure": source})
    return pd.DataFrame(rows).set_index("tier")


def save_run_record(run_dir: str | os.PathLike, preset, *, data: str, reward_names) -> Path:
    """Write ``run.json`` (recipe, model, data, rewards) into ``run_dir``: what chat, evaluation, export and the
    resume check (``recipe_mismatch``) read to rebuild the prompt and find the base model."""
    path = Path(run_dir) / "run.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    from grpo_kit.machinery.runs import run_info

    record = run_info(preset, data=data, overrides={}, reward_names=list(reward_names))
    path.write_text(json.dumps(record, indent=2, default=str) + "\n", encoding="utf-8")
    return path


# ------------------------------------------------------------------------------------------------ runs


def run_status(run_dir: str | os.PathLike, max_steps: int) -> str:
    """``"new"`` (nothing to continue), ``"partial"`` (a checkpoint below ``max_steps``), or ``"done"``.

    Done means the final ``adapter/`` exists and the latest complete checkpoint reached ``max_steps``.
    """
    from grpo_kit.machinery.runs import latest_checkpoint

    run_dir = Path(run_dir)
    checkpoint = latest_checkpoint(run_dir)
    step = int(checkpoint.name.split("-", 1)[1]) if checkpoint else 0
    if (run_dir / "adapter" / "adapter_config.json").is_file() and step >= max_steps:
        return "done"
    return "partial" if checkpoint else "new"


#: Preset fields that may change between a run and its continuation (train longer, checkpoint more often).
RESUMABLE_CHANGES = frozenset({"max_steps", "save_steps", "logging_steps"})


def recipe_mismatch(run_dir: str | os.PathLike, preset) -> list[str]:
    """Preset fields whose values differ between ``preset`` and the one recorded in ``run_dir/run.json``.

    Empty when they agree (apart from ``RESUMABLE_CHANGES``) or when there is no readable ``run.json``.
    """
    from grpo_kit.recipes import recorded_settings

    recorded = recorded_settings(run_dir)
    if not recorded:
        return []
    current = json.loads(json.dumps(preset.flat(), default=str))
    return sorted(k for k in current if k not in RESUMABLE_CHANGES and recorded.get(k, current[k]) != current[k])


def load_finished_run(run_dir: str | os.PathLike):
    """A ``TrainResult`` for a run folder trained earlier (e.g. by notebook 03), read from its files.

    ``seconds`` is the sum of the logged step times (0.0 when none were logged).
    """
    from grpo_kit.machinery.metrics import read_metrics, reward_first_last
    from grpo_kit.machinery.runs import latest_checkpoint
    from grpo_kit.train import TrainResult

    run_dir = Path(run_dir)
    adapter = run_dir / "adapter"
    if not (adapter / "adapter_config.json").is_file():
        raise GrpoKitError(f"{run_dir} has no finished adapter. Train it first: 00_train_grpo_colab.ipynb, or notebook 03.")
    history = read_metrics(run_dir / "metrics.jsonl")
    checkpoint = latest_checkpoint(run_dir)
    steps = int(checkpoint.name.split("-", 1)[1]) if checkpoint else max((r.get("step", 0) for r in history), default=0)
    first, last = reward_first_last(history)
    seconds = sum(r["step_time"] for r in history if isinstance(r.get("step_time"), (int, float)))
    return TrainResult(
        run_dir=run_dir,
        adapter_dir=adapter,
        metrics_path=run_dir / "metrics.jsonl",
        steps=steps,
        seconds=float(seconds),
        reward_first=first,
        reward_last=last,
        history=history,
    )


def prepare_run(session: NotebookSession, *, restart: bool = False) -> tuple[str, Path | None]:
    """Make ``session.paths.run_dir`` ready to train into: ``(status, checkpoint to resume from or None)``.

    ``status`` is ``run_status``'s: ``"done"`` (nothing to train), ``"partial"`` (resume from the checkpoint, its
    metrics cut to match) or ``"new"``. ``restart=True``, or a folder trained with a different recipe
    (``recipe_mismatch``), is moved aside (``train.old-<time>``) first; so is a folder with files but no checkpoint
    (a run that died before its first save, kept for inspection). Nothing is deleted.
    """
    from grpo_kit.machinery.metrics import truncate_metrics
    from grpo_kit.machinery.runs import checkpoint_step, latest_checkpoint

    run_dir = session.paths.run_dir
    changed = recipe_mismatch(run_dir, session.preset)
    if changed and not restart:
        print(f"{run_dir} was trained with a different recipe ({', '.join(changed)} differ): starting a new run.")
    if restart or changed:
        set_aside(run_dir)
    status = run_status(run_dir, session.sizes.max_steps)
    if status == "new" and run_dir.exists() and any(run_dir.iterdir()):
        set_aside(run_dir)
    checkpoint = latest_checkpoint(run_dir) if status == "partial" else None
    if checkpoint is not None:
        truncate_metrics(run_dir / "metrics.jsonl", checkpoint_step(checkpoint))
    return status, checkpoint


def train_session(session: NotebookSession, *, restart: bool = False, callbacks: tuple = ()):
    """Train the session's recipe into ``session.paths.run_dir`` with ``grpo_kit.train.train``; returns a
    ``TrainResult``. A finished run is loaded, not retrained; an interrupted one resumes (``prepare_run``)."""
    from grpo_kit.train import train

    status, _ = prepare_run(session, restart=restart)
    if status == "done":
        return load_finished_run(session.paths.run_dir)
    return train(
        session.preset,
        data=session.sizes.train_data,
        overrides={"max_steps": session.sizes.max_steps},
        output_dir=session.paths.run_dir,
        resume=status == "partial",
        callbacks=callbacks,
    )


def find_trained_adapter(session: NotebookSession, source: str = "", *, train_if_missing: bool = False) -> Path:
    """The LoRA adapter to evaluate or export, found without training unless ``train_if_missing`` says so.

    ``source``: a local folder (an adapter, a run folder holding ``adapter/``, or an export holding ``lora/``), a
    Hugging Face Hub repo id (``user/name``, downloaded with ``hub_token()``), or empty for the session's own run
    (``runs/notebook/<preset>/train``, or on Drive). Nothing found raises ``GrpoKitError`` saying how to get a run;
    ``train_if_missing=True`` (a cell the user sets, or CI's smoke mode) trains/resumes the session's recipe instead.
    """
    if source:
        return _adapter_in(_local_or_hub(source), source)
    run_dir = session.paths.run_dir
    if run_status(run_dir, session.sizes.max_steps) == "done":
        return run_dir / "adapter"
    if not train_if_missing:
        raise GrpoKitError(
            f"No finished run of the '{session.preset.name}' recipe in {run_dir}. Train it in 00_train_grpo_colab.ipynb "
            "(same session folder: on Colab mount Drive in both), or set ADAPTER to an adapter folder or a Hub repo id, "
            f"or set TRAIN_IF_MISSING = True to train it here ({session.sizes.max_steps} steps; "
            f"{expected_minutes(session.preset, session.sizes.max_steps)})."
        )
    print(f"No finished run in {run_dir}: training the '{session.preset.name}' recipe now (TRAIN_IF_MISSING).")
    return Path(train_session(session).adapter_dir)


def _local_or_hub(source: str) -> Path:
    """``source`` as a local path when it exists, else a Hub repo downloaded to the local cache."""
    path = Path(source).expanduser()
    if path.exists():
        return path
    if source.count("/") != 1 or source.startswith(("/", ".", "~")):
        raise GrpoKitError(f"{source} does not exist. Give an adapter folder, or a Hub repo id such as user/grpo-model.")
    from huggingface_hub import snapshot_download

    from grpo_kit.machinery.hub import hub_token

    try:
        return Path(snapshot_download(source, token=hub_token()))
    except Exception as error:  # offline, private without a token, or no such repo
        raise GrpoKitError(
            f"Could not download {source} from the Hugging Face Hub ({type(error).__name__}). Check the repo id, the "
            "network, and for a private repo the HF_TOKEN secret; or give a local adapter folder."
        ) from None


def _adapter_in(folder: Path, source: str) -> Path:
    for candidate in (folder, folder / "adapter", folder / "lora"):
        if (candidate / "adapter_config.json").is_file():
            return candidate
    raise GrpoKitError(
        f"{source} holds no LoRA adapter (no adapter_config.json in it, in adapter/ or in lora/). Point to a run's "
        "adapter/ folder, or to an export made by 05_export.ipynb."
    )


def load_adapter_weights(model, adapter_dir: str | os.PathLike) -> None:
    """Put a saved LoRA adapter's weights into ``model`` (a PEFT model with the same LoRA settings), in place.

    The main notebook uses it when its run is already finished (a second "Run all", or after a disconnect), so the
    model in memory is the trained one without training again.
    """
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    weights = Path(adapter_dir) / "adapter_model.safetensors"
    if not weights.is_file():
        raise GrpoKitError(f"{weights} is missing: {adapter_dir} is not a finished adapter. Train again (RESTART).")
    result = set_peft_model_state_dict(model, load_file(str(weights)))
    missing = [key for key in getattr(result, "unexpected_keys", []) if "lora_" in key]
    if missing:
        raise GrpoKitError(f"{adapter_dir} does not fit this model ({missing[0]} ...): it was trained with other LoRA "
                           "settings. Set RESTART = True to train this recipe from scratch (the old run is kept).")


# ------------------------------------------------------------------------------------------------ data and rewards

#: A question written for this kit, and hand-written completions from useless to perfect, to show what each reward
#: pays for. They continue a ``<think>\n`` prefill (the rewards add the prefill back before scoring).
EXAMPLE_QUESTION = "Mia buys 4 packs of 6 stickers and gives 5 stickers away. How many stickers does she have left?"
EXAMPLE_GOLD = "19"
EXAMPLE_COMPLETIONS = (
    ("no tags, right number", "Mia has 4 * 6 = 24 stickers, then 24 - 5 = 19 are left."),
    ("closes think, no answer tags", "4 * 6 = 24 stickers. 24 - 5 = 19.\n</think>\nShe has 19 stickers left."),
    ("full format, wrong number", "4 * 6 = 24 stickers. 24 - 5 = 18.\n</think>\n<answer>18</answer>"),
    ("full format, right number", "4 * 6 = 24 stickers. 24 - 5 = 19.\n</think>\n<answer>19</answer>"),
)


def score_examples(names, prefill: str, examples=EXAMPLE_COMPLETIONS, gold: str = EXAMPLE_GOLD):
    """A ``pandas.DataFrame``: one row per example completion, one column per reward in ``names``, plus the total.

    ``names``: reward names, reward functions (one written in a notebook cell) or ``(name or function, weight)``.

    The examples are written as the text after ``<think>\n``; each is scored as the completion a model given the
    preset's ``prefill`` would write (with no prefill the completion itself opens ``<think>``), so the table shows
    what this preset's rewards really pay. The total is the weighted sum GRPO sees when ``names`` are
    ``(name, weight)`` pairs (a preset's ``rewards``).
    """
    import pandas as pd

    from grpo_kit.machinery.reward_specs import parse_reward_spec, score_completions

    def as_completion(text: str) -> str:
        full = "<think>\n" + text
        return full[len(prefill):] if full.startswith(prefill) else full

    _, weights, labels = parse_reward_spec(list(names))  # names, functions or (either, weight) pairs
    unweighted = [n[0] if isinstance(n, tuple) else n for n in names]
    scores = score_completions([as_completion(text) for _, text in examples], gold, unweighted, prefill)
    rows = []
    for (label, _), row in zip(examples, scores, strict=True):
        out = {"completion": label}
        out.update({name: row[name] for name in labels})
        out["weighted total"] = round(sum(row[name] * weight for name, weight in zip(labels, weights, strict=True)), 4)
        rows.append(out)
    return pd.DataFrame(rows).set_index("completion")


def preview_prompt(preset, *, data: str = "sample", index: int = 0) -> str:
    """The exact text the model is given for one training question: chat template, few-shot turns and prefill."""
    from grpo_kit.data import format_for_grpo, load_gsm8k
    from grpo_kit.models import load_tokenizer, resolve_model_id

    tokenizer = load_tokenizer(resolve_model_id(preset.model_id))
    rows = load_gsm8k(data, split="train", limit=index + 1, seed=preset.seed)
    formatted, _ = format_for_grpo(rows, tokenizer, few_shot=preset.few_shot, prefill=preset.prefill)
    prompt = formatted[index]["prompt"]
    if isinstance(prompt, str):
        return prompt
    return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)


# ------------------------------------------------------------------------------------------------ evaluation


def eval_questions(session: NotebookSession):
    """The held-out questions of this session: the ``test`` split of ``sizes.eval_data``, a seeded sample."""
    from grpo_kit.data import load_gsm8k

    return load_gsm8k(session.sizes.eval_data, split="test", limit=session.sizes.eval_questions, seed=0)


def evaluate_session(session: NotebookSession, adapter_dir: str | os.PathLike, *, progress: bool = True):
    """Base model vs base + adapter on the session's held-out questions; saves and returns ``(before, after)``.

    Prompts are built as in training (the preset's ``few_shot`` and ``prefill``), decoding is greedy. Results go to
    ``eval_dir/before.json`` and ``eval_dir/after.json`` (plus ``.jsonl`` rows), where notebook 05 finds them.
    """
    from grpo_kit.evaluate import evaluate_before_after

    preset = session.preset
    before, after = evaluate_before_after(
        preset.model_id,
        adapter_dir,
        eval_questions(session),
        max_new_tokens=session.sizes.max_new_tokens,
        few_shot=preset.few_shot,
        prefill=preset.prefill,
        seed=0,
        progress=progress,
    )
    before.save(session.paths.eval_dir / "before.json")
    after.save(session.paths.eval_dir / "after.json")
    return before, after


def saved_evals(paths: NotebookPaths) -> dict[str, Path] | None:
    """``{"before": path, "after": path}`` when notebook 04 saved both results, else None."""
    found = {name: paths.eval_dir / f"{name}.json" for name in ("before", "after")}
    return found if all(path.is_file() for path in found.values()) else None


def side_by_side_html(before, after, n: int = 3, *, prefill: str = "") -> str:
    """An HTML table of the first ``n`` questions: gold answer, then the completion before and after training.

    ``before``/``after`` are ``EvalResult`` objects with rows. Text is escaped (completions contain ``<think>``),
    ``prefill`` is shown in front of each completion, and a mark says whether the strict answer was right.
    """
    import html

    def cell(row: dict) -> str:
        mark = "&#10004; right" if row.get("correct_strict") else "&#10008; wrong"
        text = html.escape(prefill + str(row.get("completion", "")))
        return f'<td style="vertical-align:top"><pre style="white-space:pre-wrap;margin:0">{text}</pre>{mark}</td>'

    lines = [
        '<table style="table-layout:fixed;width:100%">',
        "<tr><th style='width:26%'>question (gold)</th><th>before training</th><th>after training</th></tr>",
    ]
    for old, new in list(zip(before.rows, after.rows, strict=True))[:n]:
        question = html.escape(str(old.get("question", "")))
        gold = html.escape(str(old.get("gold", "")))
        lines.append(f'<tr><td style="vertical-align:top">{question} <b>({gold})</b></td>{cell(old)}{cell(new)}</tr>')
    lines.append("</table>")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ export


def exports_table(results, folder: str | os.PathLike | None = None):
    """A ``pandas.DataFrame`` of verified exports: format, path (relative to ``folder`` when given), size on disk,
    the largest logit difference found and the limit it had to meet."""
    import pandas as pd

    rows = []
    for result in results:
        path = Path(result.path)
        shown = path.relative_to(folder) if folder is not None and _is_under(path, Path(folder)) else path
        rows.append(
            {
                "format": result.format,
                "path": str(shown),
                "size (MB)": round(_size_bytes(path) / 1e6, 1),
                "max |dlogit|": f"{result.max_abs_diff:.2e}",
                "limit": f"{result.tolerance:.2e}",
                "verified": result.max_abs_diff <= result.tolerance,
            }
        )
    return pd.DataFrame(rows).set_index("format")


def _size_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def model_card_preview(export_folder: str | os.PathLike) -> str:
    """The export's ``README.md`` model card without its YAML front matter, ready for ``IPython.display.Markdown``."""
    text = (Path(export_folder) / "README.md").read_text(encoding="utf-8")
    if text.startswith("---\n"):
        end = text.find("\n---", 4)
        if end != -1:
            text = text[end + len("\n---") :].lstrip("\n")
    return text


# ------------------------------------------------------------------------------------------------ plots


def plot_vram_plans(estimates, *, highlight: str | None = None, ax=None, show: bool = True):
    """Stacked bars of the planner's breakdown, one bar per preset; a black tick marks each card's memory.

    ``estimates``: ``{preset name: planner.VramEstimate}``. ``highlight`` puts a star on the chosen preset's label.
    Returns the Axes.
    """
    import matplotlib.pyplot as plt

    parts = (
        ("weights", "weights_gib"),
        ("LoRA + grads + Adam", "lora_gib"),
        ("activations", "activations_gib"),
        ("logits", "logits_gib"),
        ("vLLM KV cache", "vllm_gib"),
        ("CUDA overhead", "overhead_gib"),
    )
    names = list(estimates)
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.6 * len(names) + 1.8))
    left = [0.0] * len(names)
    for label, attr in parts:
        values = [getattr(estimates[name], attr) for name in names]
        ax.barh(names, values, left=left, label=label)
        left = [a + b for a, b in zip(left, values, strict=True)]
    for y, name in enumerate(names):
        card = estimates[name].card_gib
        if card:
            ax.plot([card, card], [y - 0.42, y + 0.42], color="black", linewidth=2.5)
        ax.text(max(left[y], card), y, f" {left[y]:.1f}", va="center", fontsize=8)
    ax.plot([], [], color="black", linewidth=2.5, label="card memory")
    ax.set_yticks(range(len(names)), [f"{n} *" if n == highlight else n for n in names])
    ax.invert_yaxis()
    ax.set(title="VRAM plan per preset (GiB; * = chosen)", xlabel="GiB")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    if show:
        plt.tight_layout()
        plt.show()
    return ax


def plot_exports(results, *, show: bool = True):
    """Two panels for a list of ``export.ExportResult``: size on disk, and max |dlogit| against its limit (log scale).

    Returns the Figure. A difference of exactly 0 (a LoRA reloaded bit for bit) is drawn at 1e-8 and labelled 0.
    """
    import matplotlib.pyplot as plt

    names = [r.format for r in results]
    fig, (ax_size, ax_diff) = plt.subplots(1, 2, figsize=(10, 0.5 * len(names) + 1.8))
    sizes = [_size_bytes(Path(r.path)) / 1e6 for r in results]
    ax_size.barh(names, sizes, color="tab:blue")
    for y, size in enumerate(sizes):
        ax_size.text(size, y, f" {size:.0f} MB", va="center", fontsize=8)
    ax_size.set(title="size on disk", xlabel="MB")
    ax_size.set_xlim(0, max(sizes, default=1) * 1.3 or 1)
    floor = 1e-8
    diffs = [max(r.max_abs_diff, floor) for r in results]
    ax_diff.barh(names, diffs, color="tab:green")
    for y, result in enumerate(results):
        ax_diff.plot([result.tolerance] * 2, [y - 0.42, y + 0.42], color="black", linewidth=2.5)
        label = "0" if result.max_abs_diff == 0 else f"{result.max_abs_diff:.1e}"
        ax_diff.text(max(diffs[y], result.tolerance), y, f"  {label}", va="center", fontsize=8)
    ax_diff.plot([], [], color="black", linewidth=2.5, label="limit")
    ax_diff.set_xscale("log")
    ax_diff.set_xlim(floor / 2, max([*diffs, *(r.tolerance for r in results)], default=1.0) * 300)
    ax_diff.set(title="verification: max |dlogit| vs trained model", xlabel="logit difference (log scale)")
    ax_diff.legend(fontsize=8, loc="upper right")
    for ax in (ax_size, ax_diff):
        ax.invert_yaxis()
    fig.tight_layout()
    if show:
        plt.show()
    return fig


# ------------------------------------------------------------------------------------------------ hygiene


def strip_notebook(path: str | os.PathLike) -> bool:
    """Remove outputs and execution counts from a notebook file in place; returns True when it changed.

    The repository keeps notebooks stripped (tests/test_notebooks.py checks it). Run
    ``python -m grpo_kit.machinery.notebook notebooks/*.ipynb`` before committing a notebook you ran.
    """
    import nbformat

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    changed = False
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        if cell.outputs or cell.execution_count is not None:
            cell.outputs, cell.execution_count = [], None
            changed = True
        for key in ("execution", "collapsed", "scrolled"):
            if key in cell.metadata:
                del cell.metadata[key]
                changed = True
    if changed:
        nbformat.validate(nb)
        nbformat.write(nb, path)
    return changed


def gguf_types(preset) -> str:
    """GGUF types to write: ``q8_0`` on a CPU (the kit's own writer), ``q4_k_m,q8_0,f16`` on a GPU tier (Unsloth's
    llama.cpp route, the types Ollama users pick from; not run on a GPU).

    >>> from grpo_kit.recipes import load_recipe
    >>> gguf_types(load_recipe("cpu")), gguf_types(load_recipe("t4-16gb"))
    ('q8_0', 'q4_k_m,q8_0,f16')
    """
    return "q8_0" if preset.vram_gb == 0 else "q4_k_m,q8_0,f16"


if __name__ == "__main__":
    import sys

    for name in sys.argv[1:]:
        print(f"{'stripped' if strip_notebook(name) else 'clean   '} {name}")
