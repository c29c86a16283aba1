"""Run folders: one process per run folder (a lock), resume from complete checkpoints only, the final adapter and
``run.json`` written in one piece (``grpo_kit.files``). Nothing is ever deleted to make room: it is set aside.

    run_dir/run.json  metrics.jsonl  checkpoint-N/  adapter/  plots/rewards.png  .grpo-kit.lock
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from pathlib import Path

from filelock import FileLock, Timeout  # datasets' and huggingface_hub's dependency

from grpo_kit.adapters import adapter_problem
from grpo_kit.errors import GrpoKitError
from grpo_kit.files import atomic_write_text, check_writable, remove_stale_staging, set_aside, staged_dir

#: A run folder's lock (filelock's) and the PID of the process training there (filelock 3.x empties its own file).
LOCK_NAME = ".grpo-kit.lock"
PID_NAME = ".grpo-kit.pid"


# --------------------------------------------------------------------------------------------- checkpoints


def checkpoint_step(folder: str | os.PathLike) -> int | None:
    """N of a Trainer ``checkpoint-N`` folder (by its name), else None.

    >>> [checkpoint_step(name) for name in ("runs/x/checkpoint-40", "runs/x/adapter", "damaged-checkpoint-3")]
    [40, None, None]
    """
    match = re.fullmatch(r"checkpoint-(\d+)", Path(folder).name)  # transformers' PREFIX_CHECKPOINT_DIR
    return int(match[1]) if match else None


def checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``checkpoint-N`` folder in ``run_dir``, newest first (transformers' own sort)."""
    from transformers.trainer_utils import sort_checkpoints  # not at import: Unsloth must patch transformers first

    found = [(checkpoint_step(path), Path(path)) for path in sort_checkpoints(str(run_dir))]
    return [(step, folder) for step, folder in reversed(found) if step is not None]


def checkpoint_problem(folder: Path) -> str | None:
    """Why ``folder`` cannot be resumed from, or None when it is complete.

    Complete: a readable ``trainer_state.json`` (the Trainer writes it last), a sound adapter, and the
    optimizer and scheduler state (or DeepSpeed's ``global_step*/``: zero2.yaml); without those the Trainer would
    silently start a fresh optimizer and restart the learning-rate schedule.
    """
    try:
        json.loads((folder / "trainer_state.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "no trainer_state.json (killed while saving?)"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return "trainer_state.json is torn (not valid JSON)"
    if problem := adapter_problem(folder):
        return problem
    if not any(path.is_dir() for path in folder.glob("global_step*")):
        for name, what in (("optimizer.pt", "optimizer"), ("scheduler.pt", "learning-rate scheduler")):
            if not (folder / name).is_file():
                return f"no {name} (the {what} state is missing)"
    return None


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    return next((folder for _, folder in checkpoints(run_dir) if checkpoint_problem(folder) is None), None)


def disk_full(error: Exception, run_dir: Path, step: int) -> GrpoKitError | None:
    """The error to report when training stopped because a file could not be written at ``step`` (a full disk:
    ``OSError``, or ``torch.save``'s zip writer's ``RuntimeError``), else None. The checkpoint it was writing is
    incomplete (the Trainer writes ``trainer_state.json`` last) and is removed to give the space back; the complete
    ones before it are untouched, so ``--resume`` continues from the newest."""
    if getattr(error, "errno", None) not in (errno.ENOSPC, errno.EDQUOT) and "inline_container" not in str(error):
        return None
    partial = run_dir / f"checkpoint-{step}"
    removed = partial.is_dir() and checkpoint_problem(partial) is not None
    if removed:
        shutil.rmtree(partial, ignore_errors=True)
    last = latest_checkpoint(run_dir)
    return GrpoKitError(
        f"Training stopped at step {step}: a file in {run_dir} could not be written "
        f"({getattr(error, 'strerror', None) or str(error).splitlines()[0][:120]})"
        + (f"; the partial {partial.name} was removed" if removed else "")
        + (f". {last.name} is complete and intact" if last else ". No checkpoint was complete yet")
        + ". Free disk space (checkpoints hold the optimizer state: `du -sh` the run folder), then run the same "
        + "command with --resume"
        + (f" to continue from {last.name}." if last else " (it starts again from step 0).")
    )


# --------------------------------------------------------------------------------------------- the run folder

#: The run-folder locks this process holds; released when ``train`` returns or raises (``releases_run_locks``).
_HELD_LOCKS: dict[Path, FileLock] = {}


def acquire_run_lock(run_dir: Path) -> None:
    """Take the run folder's lock, or refuse naming the PID that holds it: two processes training into one folder
    would interleave their checkpoints and metrics. An OS lock (flock): the OS drops a killed process's lock, and
    this process's own is taken again."""
    if held := _HELD_LOCKS.pop(run_dir.resolve(), None):  # this process's own (a notebook running its cell again)
        held.release()
    check_writable(run_dir, what="the run", option="--output")  # a file in its place, no permission
    lock = FileLock(run_dir / LOCK_NAME, blocking=False)
    try:
        lock.acquire()
    except Timeout:
        holder = (run_dir / PID_NAME).read_text(encoding="utf-8").strip() or "?"  # written once it locked
        raise GrpoKitError(
            f"Run folder {run_dir} is in use by another training process (PID {holder}). Wait for it "
            f"to end, stop it (kill {holder}), or choose another --output."
        ) from None
    (run_dir / PID_NAME).write_text(str(os.getpid()), encoding="utf-8")
    _HELD_LOCKS[run_dir.resolve()] = lock


@contextlib.contextmanager
def releases_run_locks():
    """Release the run-folder locks taken inside (``prepare_run_dir``), however it ends; also a decorator."""
    try:
        yield
    finally:
        while _HELD_LOCKS:
            _HELD_LOCKS.popitem()[1].release()


def is_run_folder(folder: Path) -> bool:
    """True for a folder a training run wrote: its ``run.json`` (written before the first step) or a checkpoint."""
    return (folder / "run.json").exists() or any(checkpoint_step(item) is not None for item in folder.iterdir())


def prepare_run_dir(
    run_dir: Path, resume: bool, *, is_main: bool = True, recipe=None, data: str | None = None
) -> Path | None:
    """Lock and create the run folder; with ``resume``, the checkpoint to continue from. Never deletes user data,
    and a folder that holds files but no run is refused before anything is written there.

    Newer, incomplete checkpoints are named in a warning and set aside as ``damaged-checkpoint-N.old-<time>`` by the
    main process (the Trainer would write into them). Without a complete checkpoint (the run stopped before its first
    one, or every one is damaged) ``resume`` starts again from step 0 in the same folder, what the earlier attempt
    left set aside in ``attempt.old-<time>-*/`` and named in a warning. Only the main process locks and moves files.
    With ``recipe`` (and ``data``), a resume must be the run its ``run.json`` records (``check_resume``).
    """
    if resume and not run_dir.is_dir():
        raise GrpoKitError(
            f"--resume: there is no run folder {run_dir}. Check --output, or drop --resume to start a new run."
        )
    held = (
        [item.name for item in run_dir.iterdir() if item.name not in (LOCK_NAME, PID_NAME)] if run_dir.is_dir() else []
    )
    if held and not is_run_folder(run_dir):  # the user's own files: never trained over, never moved
        raise GrpoKitError(
            f"{run_dir} is not a grpo-kit run folder (no run.json or checkpoint-N) and holds other files "
            f"({', '.join(sorted(held)[:3])}{', ...' if len(held) > 3 else ''}); nothing there was touched. Choose "
            "another --output: a new or empty folder such as runs/my-run."
        )
    if held and not resume:
        if is_main and (run_dir / LOCK_NAME).exists():  # a folder in use says so first, naming the PID training there
            acquire_run_lock(run_dir)
        raise GrpoKitError(
            f"Run folder {run_dir} already has files. Use --resume to continue it, or choose another --output."
        )
    if resume and recipe is not None:
        check_resume(run_dir, recipe, data)
    if is_main:  # only now, so a refused folder is left as it was
        acquire_run_lock(run_dir)  # a second process on this folder stops here, naming the first one's PID
    if not resume:
        return None
    skipped = []
    for _, folder in checkpoints(run_dir):  # newest first
        if (problem := checkpoint_problem(folder)) is None:
            if skipped:
                warnings.warn(
                    f"--resume: skipped {'; '.join(skipped)}. Resuming from {folder.name}, the newest "
                    "complete one, with its optimizer and learning-rate state.",
                    stacklevel=2,
                )
            return folder
        aside = set_aside(folder, prefix="damaged-") if is_main else None
        skipped.append(f"{folder.name}: {problem}" + (f" (moved to {aside.name})" if aside else ""))
    earlier = sorted(item for item in run_dir.iterdir() if item.name not in (LOCK_NAME, PID_NAME))
    if is_main and earlier:
        aside = Path(tempfile.mkdtemp(prefix=f"attempt.old-{time.strftime('%Y%m%d-%H%M%S')}-", dir=run_dir))
        aside.chmod(0o755)  # mkdtemp makes it private; it holds the run's own files, readable as they were
        for item in earlier:
            os.rename(item, aside / item.name)
    moved = f"; what the earlier attempt left is in {aside.name}" if is_main and earlier else ""
    warnings.warn(
        f"--resume: no complete checkpoint in {run_dir}"
        + (f" ({'; '.join(skipped)})" if skipped else "")
        + f"{moved}. Training starts again from step 0 in the same folder.",
        stacklevel=2,
    )
    return None


# --------------------------------------------------------------------------------------------- adapters


def restore_final_adapter(run_dir: Path, checkpoint: Path, is_main: bool) -> Path:
    """``run_dir/adapter`` of a run that already reached ``max_steps``: nothing trains, nothing is rewritten, unless
    the adapter is missing (killed between the last checkpoint and the adapter write) or cannot be read (a torn
    file: set aside, never deleted); then it is written again from that checkpoint, which holds the same weights."""
    adapter = run_dir / "adapter"
    if is_main and (problem := adapter_problem(adapter)):
        aside = set_aside(adapter, prefix="damaged-")
        warnings.warn(
            f"{adapter}: {problem}" + (f" (moved to {aside.name})" if aside else "") + f"; written again "
            f"from {checkpoint.name}, the run's last checkpoint.",
            stacklevel=2,
        )
        with staged_dir(adapter) as staging:
            shutil.copytree(
                checkpoint,
                staging,
                dirs_exist_ok=True,
                ignore=shutil.ignore_patterns(
                    "optimizer.pt",
                    "scheduler.pt",
                    "rng_state*",
                    "trainer_state.json",
                    "training_args.bin",
                    "global_step*",
                ),
            )
    return adapter


def save_adapter(trainer, tokenizer, run_dir: Path) -> Path:
    """Write the final adapter to ``run_dir/adapter`` through a staging folder, so it is never half-written.

    Every process calls this; the main one writes (each process holds the same weights), the others wait for it.
    """
    if trainer.is_world_process_zero():
        remove_stale_staging(run_dir, "adapter")  # a save killed midway left its staging folder
        with staged_dir(run_dir / "adapter") as staging:
            trainer.save_model(str(staging))
            tokenizer.save_pretrained(str(staging))
    trainer.accelerator.wait_for_everyone()  # no process goes on to read the adapter before it is in place
    return run_dir / "adapter"


# --------------------------------------------------------------------------------------------- run.json


#: The values a resumed run may change: how long it trains, what it logs and saves, and memory settings that leave the
#: computation as it was. Any other (G, the batch shape, the learning rate and its schedule, the model, the rewards,
#: the data) would continue the run as another run while run.json claimed the old one, or rewrite that claim.
RESUMABLE = (
    "max_steps",
    "save_steps",
    "save_total_limit",
    "logging_steps",
    "log_completions",
    "num_completions_to_print",
    "report_to",
    "use_vllm",  # the kit turns it off where vLLM cannot be imported (models.without_missing_vllm)
    "vllm_gpu_memory_utilization",
    "gradient_checkpointing",
)
_SECRET = ("token", "secret", "password", "api_key")  # ``--set hub_token=...`` and the like are never recorded


def check_resume(run_dir: Path, recipe, data: str | None) -> None:
    """Refuse to resume the run in ``run_dir`` with values or data (None: not known, a dataset passed to ``train``)
    other than its ``run.json`` records, but for ``RESUMABLE``; values are compared as TRL parses them."""
    from grpo_kit.config import build_recipe

    info = read_run_info(run_dir)
    if not info:
        return  # stopped before its record was written: nothing to differ from
    recorded, changed = info.get("recipe") or {}, []
    names = info.get("reward_names", list(recipe.kit.reward_funcs))
    if names != list(recipe.kit.reward_funcs):
        changed.append(f"reward_funcs ({', '.join(names)} -> {', '.join(recipe.kit.reward_funcs)})")
    else:  # the same rewards: the recorded values parsed with this recipe's functions (a notebook's are not in JSON),
        # and this recipe's parsed again (a trainer may have changed its GRPOConfig: Unsloth's turns fp16 on)
        then, now = build_recipe({**recorded, "reward_funcs": recipe.reward_funcs}), build_recipe(recipe.values)
        keys = (set(recorded) | set(recipe.values)) - {*RESUMABLE, "output_dir", "name", "description", "reward_funcs"}
        for key in sorted(k for k in keys if recorded.get(k) != "***"):
            if (old := then.parsed(key)) != (new := now.parsed(key)):
                changed.append(f"{key} ({old!r} -> {new!r})")
    if None not in (data, info.get("data")) and Path(info["data"]).resolve() != Path(data).resolve():
        changed.append(f"data ({info['data']} -> {data})")
    if changed:
        raise GrpoKitError(
            f"--resume: {run_dir} is a run of {recorded.get('name', 'another recipe')} whose run.json records other "
            f"values than this command's: {'; '.join(changed)}. A resumed run goes on as it was recorded; only "
            f"{', '.join(RESUMABLE)} may change. Resume with the recorded values (the command line takes them from "
            "run.json when --preset and --data are left out), or start a new run in another folder (--output)."
        )


def write_run_info(run_dir: Path, recipe, *, data: str, resumed_from: int | None = None) -> Path:
    """``run.json``, atomically: the recipe's values as set (secrets masked; a Python reward by its name), data,
    rewards, versions, and the step a resumed run continued from (its learning rate then follows the schedule for
    this ``max_steps``)."""
    from importlib.metadata import version

    values = {k: "***" if any(w in k.lower() for w in _SECRET) else v for k, v in recipe.values.items()}
    if "reward_funcs" in values:
        values["reward_funcs"] = list(recipe.kit.reward_funcs)
    info = {
        "recipe": values,
        "data": data,
        "reward_names": list(recipe.kit.reward_funcs),
        "resumed_from_step": resumed_from,
        "versions": {name: version(name) for name in ("trl", "transformers", "peft")},
    }
    return atomic_write_text(Path(run_dir) / "run.json", json.dumps(info, indent=2, default=str))


def read_run_info(run_dir: str | os.PathLike) -> dict:
    """``run_dir/run.json`` as a dict, {} when there is none; one that cannot be read is said, never taken for none:
    it records how the run was trained (recipe, data, prompt)."""
    path = Path(run_dir) / "run.json"
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (FileNotFoundError, NotADirectoryError):
        return {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        info = f"{type(error).__name__}: {str(error)[:120]}"
    if not isinstance(info, dict):
        raise GrpoKitError(
            f"{path} cannot be read ({info if isinstance(info, str) else 'not a JSON object'}); it records how the "
            "run was trained (recipe, data, prompt), so nothing was done without it. Restore it from a copy, or "
            "train a new run in another folder (--output); the run's checkpoints are untouched."
        )
    return info


def reward_first_last(history: list[dict], window: int = 3) -> tuple[float | None, float | None]:
    """Mean ``reward`` over the first and the last ``window`` logged steps."""
    values = [row["reward"] for row in history if isinstance(row.get("reward"), (int, float))]
    if not values:
        return None, None
    window = max(1, min(window, len(values) // 2 or 1))
    return sum(values[:window]) / window, sum(values[-window:]) / window
