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


def prepare_run_dir(run_dir: Path, resume: bool, *, is_main: bool = True) -> Path | None:
    """Lock and create the run folder; with ``resume``, the checkpoint to continue from. Never deletes user data.

    Newer, incomplete checkpoints are named in a warning and set aside as ``damaged-checkpoint-N.old-<time>`` by the
    main process (the Trainer would write into them). Without a complete checkpoint (the run stopped before its first
    one, or every one is damaged) ``resume`` starts again from step 0 in the same folder, what the earlier attempt
    left set aside in ``attempt.old-<time>-*/`` and named in a warning. Only the main process locks and moves files.
    """
    if resume and not run_dir.is_dir():
        raise GrpoKitError(
            f"--resume: there is no run folder {run_dir}. Check --output, or drop --resume to start a new run."
        )
    if is_main:
        acquire_run_lock(run_dir)  # a second process on this folder stops here, naming the first one's PID
    if not resume:
        if any(item.name not in (LOCK_NAME, PID_NAME) for item in run_dir.iterdir()) if run_dir.exists() else False:
            raise GrpoKitError(
                f"Run folder {run_dir} already has files. Use --resume to continue it, or choose another --output."
            )
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


def write_run_info(run_dir: Path, recipe, *, data: str, resumed_from: int | None = None) -> Path:
    """``run.json``, atomically: the recipe's values as set (secrets masked), data, rewards, versions, and
    the step a resumed run continued from (its learning rate then follows the schedule for this ``max_steps``)."""
    from importlib.metadata import version

    secret = ("token", "secret", "password", "api_key")  # ``--set hub_token=...`` and the like are never recorded
    values = {k: "***" if any(w in k.lower() for w in secret) else v for k, v in recipe.values.items()}
    info = {
        "recipe": values,
        "data": data,
        "reward_names": list(recipe.kit.reward_funcs),
        "resumed_from_step": resumed_from,
        "versions": {name: version(name) for name in ("trl", "transformers", "peft")},
    }
    return atomic_write_text(Path(run_dir) / "run.json", json.dumps(info, indent=2, default=str))


def read_run_info(run_dir: str | os.PathLike) -> dict:
    """``run_dir/run.json`` as a dict; {} when it is missing or unreadable."""
    try:
        info = json.loads((Path(run_dir) / "run.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return info if isinstance(info, dict) else {}


def reward_first_last(history: list[dict], window: int = 3) -> tuple[float | None, float | None]:
    """Mean ``reward`` over the first and the last ``window`` logged steps."""
    values = [row["reward"] for row in history if isinstance(row.get("reward"), (int, float))]
    if not values:
        return None, None
    window = max(1, min(window, len(values) // 2 or 1))
    return sum(values[:window]) / window, sum(values[-window:]) / window


def collapse(history: list[dict]) -> str | None:
    """What the last logged step shows when the model no longer answers, else None: the reward fell to 0, and every
    completion was cut at max_completion_length where some used to end, with no gradient left. A learning rate far too
    high does that while every weight stays finite and small, so ``adapters.adapter_problem`` cannot see it; the
    run's own log can. (A budget too short for any answer clips every completion from the start: that is no
    collapse.)

    >>> collapse([{"step": 1, "reward": 0.25, "completions/clipped_ratio": 0.625}, {"step": 2, "reward": 0.0,
    ...     "completions/clipped_ratio": 1.0, "grad_norm": 0.0}])
    'at step 2 the reward fell from 0.250 to 0, every completion was cut at max_completion_length and grad_norm was 0'
    """
    rows = [row for row in history if isinstance(row.get("reward"), (int, float))]
    if not rows:
        return None
    last, best = rows[-1], max(row["reward"] for row in rows)
    ended = min(row.get("completions/clipped_ratio", 1) for row in rows) < 1  # some completions ended before
    clipped, still = last.get("completions/clipped_ratio") == 1, last.get("grad_norm") == 0
    if last["reward"] == 0 < best and ended and clipped and still:
        return (
            f"at step {last.get('step')} the reward fell from {best:.3f} to 0, every completion was cut at "
            "max_completion_length and grad_norm was 0"
        )
    return None
