"""Files and folders written in one piece, and the names of the Trainer's checkpoint folders.

A run, an export or a cached model folder either appears complete under its final name or not at all: it is
written into a hidden staging folder next to the target and renamed into place (a rename within one folder is
atomic). A crash mid-write leaves only the hidden folder; an existing folder is never deleted before its
replacement is complete.

- ``staged_dir(final)``: a context manager yielding the staging folder; renamed to ``final`` when the block ends
  without an error, removed when it raises.
- ``atomic_write_text(path, text)``: the same for one file.
- ``set_aside(folder)``: rename a folder to ``<folder>.old-<time>`` instead of deleting it.
- ``checkpoint_step(folder)`` / ``checkpoints(run_dir)``: the step of a Trainer ``checkpoint-N`` folder.
- ``staging_prefix(name)`` / ``remove_stale_staging(out_dir, name)``: staging names that tell a live writer from a
  killed one, and the clean-up of the killed ones.

>>> checkpoint_step("runs/x/checkpoint-40"), checkpoint_step("runs/x/adapter"), checkpoint_step("damaged-checkpoint-3")
(40, None, None)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from grpo_kit.errors import GrpoKitError


@contextlib.contextmanager
def staged_dir(
    final: str | os.PathLike, *, prefix: str | None = None, name: str | None = None, keep_old: bool = False
) -> Iterator[Path]:
    """Yield an empty folder next to ``final``; when the block ends without an error, rename it to ``final``.

    An error inside the block removes the staging folder and leaves ``final`` as it was. An existing ``final`` is
    renamed aside just before the new folder takes its name and put back if that rename fails; it is then deleted,
    or with ``keep_old`` kept as ``<final>.old-<time>`` (``set_aside``).

    ``prefix``: the staging folder's name before a random part (default ``staging_prefix(final.name)``). ``name``: a
    fixed staging name instead, for callers whose other processes must find the folder (every DeepSpeed rank
    writes into the same one); a leftover of that name from a killed run is removed first.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if name is not None:
        staging = final.parent / name
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
    else:
        staging = Path(tempfile.mkdtemp(prefix=prefix or staging_prefix(final.name), dir=final.parent))
        staging.chmod(0o755)  # mkdtemp makes it private; what lands in final is meant to be shared
    try:
        yield staging
        _promote(staging, final, keep_old)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _promote(staging: Path, final: Path, keep_old: bool) -> None:
    """Rename ``staging`` to ``final``; an existing ``final`` is moved aside first and restored if that fails."""
    old = None
    if final.exists():
        old = set_aside(final) if keep_old else final.with_name(f".{final.name}.old-{time.time_ns()}")
        if not keep_old:
            os.rename(final, old)
    try:
        os.rename(staging, final)
    except OSError:
        if old is not None:
            os.rename(old, final)
        raise
    if old is not None and not keep_old:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` through a sibling temporary file, so a reader never sees half of it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def set_aside(folder: str | os.PathLike) -> Path | None:
    """Rename ``folder`` to ``<folder>.old-<timestamp>`` (never deletes anything); returns the new path or None."""
    folder = Path(folder)
    if not folder.exists():
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = folder.with_name(f"{folder.name}.old-{stamp}")
    suffix = 1
    while target.exists():
        target = folder.with_name(f"{folder.name}.old-{stamp}-{suffix}")
        suffix += 1
    os.rename(folder, target)
    return target


def check_writable(out_dir: Path, *, what: str, option: str) -> None:
    """Create ``out_dir`` and a file in it, or ``GrpoKitError`` naming the folder (permissions, read-only disk)."""
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as error:
        raise GrpoKitError(
            f"Cannot write {what} into {out_dir}: {error.strerror or error}. Choose another {option}, a folder you "
            "can write to."
        ) from None


# --------------------------------------------------------------------------------------------- checkpoints


def checkpoint_step(folder: str | os.PathLike) -> int | None:
    """N of a Trainer ``checkpoint-N`` folder (by its name), else None."""
    prefix, _, number = Path(folder).name.partition("-")
    return int(number) if prefix == "checkpoint" and number.isdigit() else None


def checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every ``checkpoint-N`` folder in ``run_dir``, newest first."""
    found = [(checkpoint_step(folder), folder) for folder in Path(run_dir).glob("checkpoint-*") if folder.is_dir()]
    return sorted(((step, folder) for step, folder in found if step is not None), reverse=True)


# --------------------------------------------------------------------------------------------- stale staging


def staging_prefix(name: str) -> str:
    """Prefix of a staging folder, ``.<name>.partial-<pid>-``: the pid tells a live writer from a dead one.

    >>> staging_prefix("demo").startswith(".demo.partial-")
    True
    """
    return f".{name}.partial-{os.getpid()}-"


def remove_stale_staging(out_dir: str | os.PathLike, name: str) -> list[Path]:
    """Delete ``.<name>.partial-<pid>-*`` folders whose process is gone (killed mid-write); return them.

    A killed merged16 export of an 8B model leaves ~16 GB in such a folder, which would fill a Colab disk on the
    retry. Folders of a process that is still running (another export of the same name) are left alone.
    """
    removed = []
    for folder in sorted(Path(out_dir).glob(f".{name}.partial-*")):
        pid = folder.name[len(f".{name}.partial-") :].split("-", 1)[0]
        if folder.is_dir() and pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def process_alive(pid: int) -> bool:
    """True when a process ``pid`` exists (this one included), whoever owns it."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)  # signal 0: existence check only
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True
