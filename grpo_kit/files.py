"""Files written in one piece, for every writer in the kit: a text file through a temporary sibling, a folder
through a staging folder renamed into place (a rename within one folder is atomic), so a crash leaves the old target
whole and at most a staging folder behind. Nothing is deleted to make room: it is set aside. Also JSON that stays JSON
(NaN written as null).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil  # accelerate's dependency

from grpo_kit.errors import GrpoKitError


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
        old = set_aside(final, prefix=".")  # moved away only now that the new folder is complete
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
        pid = folder.name.removeprefix(f".{name}.partial-").split("-", 1)[0]
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
    """Create ``out_dir`` and a file in it, or ``GrpoKitError`` naming the folder (a file in its place, permissions,
    a read-only or full disk)."""
    existing = next(path for path in (out_dir, *out_dir.absolute().parents) if path.exists())
    if not existing.is_dir():
        raise GrpoKitError(
            f"Cannot write {what} into {out_dir}: {existing} is a file, not a folder. Nothing was written; choose "
            f"another {option}."
        )
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


def read_json(path: str | os.PathLike) -> Any:
    """The JSON value in the UTF-8 file ``path`` (the errors of ``open`` and ``json.loads`` pass through)."""
    return json.loads(Path(path).read_text(encoding="utf-8"))


def write_json(path: str | os.PathLike, value: Any) -> Path:
    """``value`` as indented JSON (NaN/inf as null, any other object as its ``str``), written in one piece."""
    return atomic_write_text(path, dumps_finite(value, indent=2, ensure_ascii=False, default=str) + "\n")


def write_jsonl(path: str | os.PathLike, rows) -> Path:
    """``rows`` as JSON lines (NaN/inf as null), written in one piece; ``runs.read_metrics`` reads them back."""
    return atomic_write_text(path, "".join(dumps_finite(row, ensure_ascii=False) + "\n" for row in rows))


def dumps_finite(value: Any, **kwargs) -> str:
    """``json.dumps`` that writes NaN/±inf as ``null``: Python's ``NaN``/``Infinity`` are not JSON to other readers."""

    def finite(item):
        if isinstance(item, float):
            return item if math.isfinite(item) else None
        if isinstance(item, dict):
            return {key: finite(v) for key, v in item.items()}
        return [finite(v) for v in item] if isinstance(item, (list, tuple)) else item

    return json.dumps(finite(value), allow_nan=False, **kwargs)
