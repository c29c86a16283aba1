"""Run folders: one process per folder (a lock), complete checkpoints only, resume, and the final adapter written
atomically and checked finite. ``grpo_kit.train`` calls these; nothing here trains.

Run folder layout (docs/DESIGN.md)::

    run_dir/run.json  metrics.jsonl  checkpoint-N/  adapter/  plots/rewards.png  .grpo-kit.lock
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from grpo_kit.errors import GrpoKitError
from grpo_kit.machinery.folders import process_alive

#: The adapter weights file PEFT writes (checkpoints and the final adapter).
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def checkpoint_problem(folder: Path) -> str | None:
    """Why ``folder`` cannot be resumed from, or None when it is complete.

    Complete: a readable ``trainer_state.json``, adapter weights whose file opens, and the optimizer and scheduler
    state (``optimizer.pt``/``scheduler.pt``, or DeepSpeed's ``global_step*/`` folder). Without those, the Trainer
    would silently start a fresh optimizer and restart the learning-rate schedule.
    """
    state = folder / "trainer_state.json"
    if not state.is_file():
        return "no trainer_state.json (killed while saving?)"
    try:
        json.loads(state.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return "trainer_state.json is torn (not valid JSON)"
    weights = adapter_weights_problem(folder)
    if weights:
        return weights
    deepspeed = any(path.is_dir() for path in folder.glob("global_step*"))
    for name, what in (("optimizer.pt", "optimizer"), ("scheduler.pt", "learning-rate scheduler")):
        if not deepspeed and not (folder / name).is_file():
            return f"no {name} (the {what} state is missing)"
    return None


def is_complete_checkpoint(folder: Path) -> bool:
    """True when ``folder`` can be resumed from (see ``checkpoint_problem``)."""
    return checkpoint_problem(folder) is None


def _checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``checkpoint-N`` folder, newest first."""
    found = []
    for folder in run_dir.glob("checkpoint-*"):
        suffix = folder.name.split("-", 1)[1]
        if folder.is_dir() and suffix.isdigit():
            found.append((int(suffix), folder))
    return sorted(found, reverse=True)


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    """The ``checkpoint-N`` with the highest N that is complete, or None."""
    for _, folder in _checkpoints(Path(run_dir)):
        if is_complete_checkpoint(folder):
            return folder
    return None


def resume_checkpoint(run_dir: Path, *, set_aside: bool) -> Path | None:
    """The checkpoint to resume from; newer, incomplete ones are reported loudly and, with ``set_aside``, renamed
    ``damaged-checkpoint-N`` (never deleted: the Trainer would write into them, and nothing in them is lost)."""
    import warnings

    skipped = []
    for _, folder in _checkpoints(run_dir):
        problem = checkpoint_problem(folder)
        if problem is None:
            if skipped:
                warnings.warn(
                    f"--resume: skipped {'; '.join(skipped)}. Resuming from {folder.name}, the newest complete one, "
                    "with its optimizer and learning-rate state.",
                    stacklevel=3,
                )
            return folder
        aside = _set_aside(folder) if set_aside else None
        skipped.append(f"{folder.name}: {problem}" + (f" (moved to {aside.name})" if aside else ""))
    return None


def _set_aside(folder: Path) -> Path:
    target = folder.with_name(f"damaged-{folder.name}")
    n = 1
    while target.exists():
        n += 1
        target = folder.with_name(f"damaged-{folder.name}.{n}")
    os.rename(folder, target)
    return target


#: Run folders whose lock this process took in ``train``; released when ``train`` returns or raises.
_HELD_LOCKS: list[Path] = []


def releases_run_locks(function):
    """Decorator: release the run-folder locks ``function`` took, however it ends."""
    import functools

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        finally:
            if _HELD_LOCKS:
                while _HELD_LOCKS:
                    release_run_lock(_HELD_LOCKS.pop())

    return wrapper


def prepare_run_dir(run_dir: Path, resume: bool, *, is_main: bool = True) -> Path | None:
    """Lock and create the run folder; on resume return the checkpoint to continue from. Never deletes user data.

    Only the main process locks and sets damaged checkpoints aside (the others run on the same folder).
    """
    no_checkpoint = GrpoKitError(
        f"--resume: no complete checkpoint-N folder in {run_dir}. Check --output points at the run folder, "
        "or drop --resume to start a new run."
    )
    if resume and not run_dir.is_dir():
        raise no_checkpoint
    if is_main:
        acquire_run_lock(run_dir)  # a second process on this folder stops here, naming the first one's PID
        _HELD_LOCKS.append(run_dir)
    if resume:
        checkpoint = resume_checkpoint(run_dir, set_aside=is_main)
        if checkpoint is None:
            raise no_checkpoint
        return checkpoint
    if run_dir.exists() and any(item.name != LOCK_NAME for item in run_dir.iterdir()):
        raise GrpoKitError(
            f"Run folder {run_dir} already has files. Use --resume to continue it, or choose another --output."
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    return None


def restore_final_adapter(run_dir: Path, checkpoint: Path, is_main: bool) -> Path:
    """``run_dir/adapter`` of a run that already reached ``max_steps``: nothing trains, nothing is rewritten.

    Only when the final adapter is missing (killed between the last checkpoint and the adapter write) is it
    written, from that checkpoint's adapter files.
    """
    adapter = run_dir / "adapter"
    if is_main and not (adapter / "adapter_config.json").is_file():
        staging = run_dir / ".adapter.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(checkpoint, staging, ignore=shutil.ignore_patterns(
            "optimizer.pt", "scheduler.pt", "rng_state*", "trainer_state.json", "training_args.bin", "global_step*"))
        os.rename(staging, adapter)
    return adapter


def save_adapter(trainer, tokenizer, run_dir: Path) -> Path:
    """Write the final adapter to ``run_dir/adapter`` via a temporary folder, so it is never half-written.

    Every process calls ``save_model`` (DeepSpeed ZeRO-3 gathers the weights collectively); only the main one writes.
    """
    final = run_dir / "adapter"
    staging = run_dir / ".adapter.tmp"
    is_main = trainer.is_world_process_zero()
    if is_main:
        shutil.rmtree(staging, ignore_errors=True)
    trainer.accelerator.wait_for_everyone()
    trainer.save_model(str(staging))
    if is_main:
        tokenizer.save_pretrained(str(staging))
        if final.exists():
            old = run_dir / ".adapter.old"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
            os.rename(staging, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, final)
    trainer.accelerator.wait_for_everyone()
    return final


def wait_for_everyone(config) -> None:
    """A barrier across the processes of ``accelerate launch``/``torchrun``; nothing in a single process."""
    state = getattr(config, "distributed_state", None)
    if state is not None:
        state.wait_for_everyone()


#: Set to "1" to make every process write ``rank-<i>.digest`` (SHA-256 of its LoRA weights) into the run folder
#: after training: equal files prove the data-parallel copies stayed identical (tests/test_scaling.py checks it).
RANK_DIGEST_ENV = "GRPO_KIT_RANK_DIGEST"


def weights_digest(tensors: dict) -> str:
    """SHA-256 over each tensor's name and float32 bytes, in name order: equal digests mean equal weights."""
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode("utf-8"))
        digest.update(tensors[name].detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def write_rank_digest(trainer, run_dir: Path) -> None:
    if os.environ.get(RANK_DIGEST_ENV) != "1":
        return
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(trainer.accelerator.unwrap_model(trainer.model))  # the adapter file's keys
    (run_dir / f"rank-{trainer.args.process_index}.digest").write_text(weights_digest(state), encoding="utf-8")


def checkpoint_step(checkpoint: Path) -> int:
    return int(checkpoint.name.split("-", 1)[1])


#: Lock file in a run folder: holds the PID of the process training in it.
LOCK_NAME = ".grpo-kit.lock"


def _lock_holder(lock: Path) -> int | None:
    try:
        text = lock.read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def acquire_run_lock(run_dir: str | os.PathLike) -> Path:
    """Take the run folder's lock (creating the folder), or refuse with the PID of the process that holds it.

    Two processes training into one folder interleave their checkpoints and metrics. A lock whose process is gone
    (killed, crashed) is taken over; one held by this very process (a notebook re-running ``train``) is kept.
    Released by ``release_run_lock``, and at the latest when this process exits.
    """
    import atexit

    run_dir = Path(run_dir)
    lock = run_dir / LOCK_NAME
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # a file where the folder should be, no write permission, a read-only disk
        raise GrpoKitError(_unusable_run_dir(run_dir, error)) from None
    for _ in range(3):  # lost races with another process taking over a stale lock are retried
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _lock_holder(lock)
            if holder is not None and process_alive(holder) and holder != os.getpid():
                raise GrpoKitError(
                    f"Run folder {run_dir} is in use by another training process (PID {holder}). Wait for it to end, "
                    f"stop it (kill {holder}), or choose another --output. If no such process runs, delete {lock}."
                ) from None
            if holder == os.getpid():
                return lock
            lock.unlink(missing_ok=True)  # stale: its process is gone
            continue
        except OSError as error:
            raise GrpoKitError(_unusable_run_dir(run_dir, error)) from None
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(str(os.getpid()))
        atexit.register(release_run_lock, run_dir)
        return lock
    raise GrpoKitError(f"Could not take the lock {lock}: other processes keep replacing it. Choose another --output.")


def _unusable_run_dir(run_dir: Path, error: OSError) -> str:
    return (
        f"{run_dir} cannot be used as a run folder: {error.strerror or error} ({error.filename or run_dir}). "
        "Choose another --output, a folder you can write to."
    )


def release_run_lock(run_dir: str | os.PathLike) -> None:
    """Remove the run folder's lock if this process holds it (never another process's lock)."""
    lock = Path(run_dir) / LOCK_NAME
    if _lock_holder(lock) == os.getpid():
        lock.unlink(missing_ok=True)


def adapter_weights_problem(adapter_dir: str | os.PathLike) -> str | None:
    """Why the adapter's weights file cannot be used (missing, truncated/unreadable), or None when it opens.

    Only the header is read (cheap): safetensors refuses a file whose size does not match its header.
    """
    from safetensors import safe_open

    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not path.is_file():
        return f"{path} is missing"
    try:
        with safe_open(str(path), framework="pt") as handle:
            handle.keys()
    except Exception as error:  # SafetensorError, OSError: a torn or foreign file
        return f"{path} cannot be read ({str(error).splitlines()[0][:120]}; truncated by a kill or a full disk?)"
    return None


def _is_secret(key: str) -> bool:
    """Keys whose values never go into run.json (``--set hub_token=...`` and the like)."""
    return any(word in key.lower() for word in ("token", "secret", "password", "api_key"))


def run_info(recipe, *, data: str, overrides: dict, reward_names: list[str], curriculum=None) -> dict:
    """``run.json``: the recipe as trained (its sections), data, rewards, ``--set`` values (secrets masked), versions."""
    import peft
    import transformers
    import trl

    recorded = recipe.to_dict()
    recorded["grpo"] = {k: ("***" if _is_secret(k) else v) for k, v in recorded["grpo"].items()}
    return {
        "recipe": recorded,
        "model": recipe.model_id,
        "data": data,
        "rewards": reward_names,
        "overrides": {k: ("***" if _is_secret(k) else v) for k, v in overrides.items()},
        "curriculum": curriculum,
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "peft": peft.__version__},
    }
