"""Run folders and files written in one piece: one process per run folder (a lock), resume from complete checkpoints
only, the final adapter and ``run.json`` written atomically. Nothing is ever deleted to make room: it is set aside.

    run_dir/run.json  metrics.jsonl  checkpoint-N/  adapter/  plots/rewards.png  .grpo-kit.lock

A folder is written into a hidden staging folder next to its target and renamed into place (a rename within one
folder is atomic), so a crash leaves the old target whole and at most a staging folder behind.
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

import psutil  # accelerate's dependency
from filelock import FileLock, Timeout  # datasets' and huggingface_hub's dependency

from grpo_kit.errors import GrpoKitError

#: No LoRA weight trained with Adam at a learning rate below 1 gets near this (they start at |w| < 0.1 and move by
#: about the learning rate per step); beyond it training diverged, finite or not (lr 1e10: |w| ~ 1e10, only EOS).
MAX_ADAPTER_WEIGHT = 1e3
#: A run folder's lock (filelock's) and the PID of the process training there (filelock 3.x empties its own file).
LOCK_NAME = ".grpo-kit.lock"
PID_NAME = ".grpo-kit.pid"


# --------------------------------------------------------------------------------------------- files and folders


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` (folder made) through a sibling temporary file: a reader never sees half of it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException as error:
        with contextlib.suppress(OSError):  # a file where a folder should be: there is no tmp to remove
            tmp.unlink(missing_ok=True)
        if isinstance(error, (FileExistsError, NotADirectoryError)):  # mkdir or open met a file on the way
            raise GrpoKitError(
                f"Cannot write {path}: {error.filename} is a file, not a folder; choose another path."
            ) from None
        if isinstance(error, OSError):  # a full disk: one line, the old file intact
            raise GrpoKitError(
                f"Cannot write {path}: {error.strerror or error}; {path} is as it was (the partial file was "
                "removed). Free disk space there, or choose another path."
            ) from None
        raise
    return path


@contextlib.contextmanager
def staged_dir(final: str | os.PathLike, *, name: str | None = None):
    """Yield an empty folder next to ``final``; when the block ends without an error it takes ``final``'s place.

    An error removes the staging folder and leaves ``final`` as it was; an existing ``final`` is moved away only
    once the new folder is complete (and put back if the rename fails). ``name``: a fixed staging name, so that the
    next attempt finds and replaces a killed one's leftover (``grpo_kit.colab``'s copies to Drive).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if name is None:
        # the PID in the name tells a live writer's staging folder from a killed one's (remove_stale_staging)
        staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-{os.getpid()}-", dir=final.parent))
        staging.chmod(0o755)  # mkdtemp makes it private; what lands in final is meant to be shared
    else:
        staging = final.parent / name
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    try:
        yield staging
        old = final.with_name(f".{final.name}.old-{time.time_ns()}") if final.exists() else None
        if old:
            os.rename(final, old)
        try:
            os.rename(staging, final)
        except OSError:
            if old:
                os.rename(old, final)
            raise
        if old:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def remove_stale_staging(out_dir: str | os.PathLike, name: str) -> None:
    """Delete ``.<name>.partial-<pid>-*`` folders whose process is gone (a killed merged16 export of an 8B model
    leaves ~16 GB, which would fill a Colab disk on the retry); a live process's folder is left alone."""
    for folder in Path(out_dir).glob(f".{name}.partial-*"):
        pid = folder.name[len(f".{name}.partial-") :].split("-", 1)[0]
        if folder.is_dir() and pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def set_aside(folder: str | os.PathLike, *, prefix: str = "") -> Path | None:
    """Rename ``folder`` to ``<prefix><name>.old-<time>-*`` (never deletes anything); the new path, or None if absent.

    A checkpoint is set aside with ``prefix="damaged-"``: a name that no longer starts with ``checkpoint-`` is one
    the Trainer neither resumes from nor deletes when it rotates checkpoints.
    """
    folder = Path(folder)
    if not folder.exists():
        return None
    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(3).hex()}"  # a name nothing else has (two in one second)
    target = folder.with_name(f"{prefix}{folder.name}.old-{stamp}")
    os.rename(folder, target)
    return target


def check_writable(out_dir: Path, *, what: str, option: str) -> None:
    """Create ``out_dir`` and a file in it, or ``GrpoKitError`` naming the folder (permissions, read-only disk)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir) as probe:
            probe.write(b"x")  # a full disk still lets empty files be made
            probe.flush()
    except OSError as error:
        raise GrpoKitError(
            f"Cannot write {what} into {out_dir}: {error.strerror or error}. Nothing was written; free disk space "
            f"there, or choose another {option}, a folder you can write to."
        ) from None


# --------------------------------------------------------------------------------------------- checkpoints


def checkpoint_step(folder: str | os.PathLike) -> int | None:
    """N of a Trainer ``checkpoint-N`` folder (by its name), else None.

    >>> checkpoint_step("runs/x/checkpoint-40"), checkpoint_step("runs/x/adapter"), checkpoint_step("damaged-checkpoint-3")
    (40, None, None)
    """
    match = re.fullmatch(r"checkpoint-(\d+)", Path(folder).name)  # transformers' PREFIX_CHECKPOINT_DIR
    return int(match[1]) if match else None


def checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``checkpoint-N`` folder in ``run_dir``, newest first (transformers' own sort)."""
    from transformers.trainer_utils import sort_checkpoints  # not at import: Unsloth must patch transformers first

    found = [(checkpoint_step(path), Path(path)) for path in sort_checkpoints(str(run_dir))]
    return [(step, folder) for step, folder in reversed(found) if step is not None]


def adapter_problem(adapter_dir: str | os.PathLike) -> str | None:
    """Why the LoRA adapter in ``adapter_dir`` cannot be used, or None when it is sound: no ``adapter_config.json``,
    a weights file that is missing or does not load (safetensors refuses a file whose size does not match its
    header), or NaN/inf weights or weights beyond ``MAX_ADAPTER_WEIGHT``: a NaN adapter would otherwise be exported
    and "verified" (NaN compares false with any limit) or evaluated as a model.
    """
    import torch
    from safetensors.torch import load_file

    path = Path(adapter_dir) / "adapter_model.safetensors"  # what PEFT writes, in checkpoints and the final adapter
    if not (Path(adapter_dir) / "adapter_config.json").is_file():
        return "no adapter_config.json"
    try:
        tensors = load_file(str(path))
    except Exception as error:  # SafetensorError, OSError: a missing, torn or foreign file
        return f"{path} cannot be read ({str(error).splitlines()[0][:120]}; truncated by a kill or a full disk?)"
    bad = sorted(
        name
        for name, tensor in tensors.items()
        if not bool((torch.nan_to_num(tensor.float(), nan=torch.inf).abs() <= MAX_ADAPTER_WEIGHT).all())
    )
    if bad:
        return (
            f"the adapter in {adapter_dir} has NaN/inf weights or weights beyond {MAX_ADAPTER_WEIGHT:g} "
            f"({len(bad)} tensor(s), e.g. {bad[0]}); training diverged"
        )
    return None


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


def write_run_info(run_dir: Path, recipe, *, data: str, curriculum=None, resumed_from: int | None = None) -> Path:
    """``run.json``, atomically: the recipe's values as set (secrets masked), data, rewards, curriculum, versions, and
    the step a resumed run continued from (its learning rate then follows the schedule for this ``max_steps``)."""
    from importlib.metadata import version

    secret = ("token", "secret", "password", "api_key")  # ``--set hub_token=...`` and the like are never recorded
    values = {k: "***" if any(w in k.lower() for w in secret) else v for k, v in recipe.values.items()}
    info = {
        "recipe": values,
        "data": data,
        "reward_names": list(recipe.kit.reward_funcs),
        "curriculum": curriculum,
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
