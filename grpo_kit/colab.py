"""Where a notebook keeps its files, on Colab (Google Drive) or on this machine, and the copy of an export to Drive.

The layout is the same everywhere, under ``workspace()``::

    runs/<recipe>/      a training run (what ``grpo-kit train --output`` writes: checkpoints, adapter/, metrics)
    exports/<name>/     an export (lora/, merged16/, gguf/, README.md, export.json)

On Colab ``workspace()`` is ``MyDrive/grpo-kit`` on the mounted Drive, so a run survives a disconnected runtime; an
export is large (an 8B model's merged 16-bit copy is 16 GB, more than Drive's free 15 GB), so it is written to the
runtime's own disk (``workspace(drive=False)``) and only the parts asked for are copied to Drive, after a check that
they fit. Nothing here trains, evaluates or exports: the notebooks call those themselves.

NOT RUN ON COLAB: Drive is mounted with ``google.colab.drive.mount``, and its free space is what the mount reports to
``statvfs`` (``shutil.disk_usage``); the tests stub both.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Collection
from pathlib import Path

from grpo_kit.errors import GrpoKitError
from grpo_kit.models import in_colab

#: Where Colab mounts Google Drive, and the kit's folder on it.
DRIVE_MOUNT = Path("/content/drive")
DRIVE_FOLDER = Path("MyDrive") / "grpo-kit"
#: Set it to put the workspace somewhere else (a scratch disk, a test's temporary folder).
WORKSPACE_ENV = "GRPO_KIT_WORKSPACE"
#: Room kept free beyond the copy itself: file-system blocks and metadata, and Drive's own bookkeeping.
SPACE_MARGIN = 256 * 2**20


def mount_drive() -> Path | None:
    """On Colab: mount Google Drive at ``DRIVE_MOUNT`` (Colab asks for permission once) and return the kit's folder
    on it. Elsewhere: None, and nothing happens."""
    if not in_colab():
        return None
    if not (DRIVE_MOUNT / "MyDrive").is_dir():  # mounting twice asks twice; once is enough per runtime
        from google.colab import drive  # importable only on Colab

        drive.mount(str(DRIVE_MOUNT))
    folder = DRIVE_MOUNT / DRIVE_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def workspace(*, drive: bool = True) -> Path:
    """The folder that holds ``runs/`` and ``exports/``: ``$GRPO_KIT_WORKSPACE`` when set; on Colab (and ``drive``)
    ``MyDrive/grpo-kit``, mounting Drive first; else the grpo-kit checkout around the working directory, else the
    working directory itself (on Colab: ``/content``, the runtime's own disk)."""
    if chosen := os.environ.get(WORKSPACE_ENV):
        return Path(chosen).expanduser().resolve()
    if drive and (on_drive := mount_drive()):
        return on_drive
    here = Path.cwd().resolve()  # a notebook runs in notebooks/: its runs go to the checkout's runs/, as the CLI's do
    return next(
        (f for f in (here, *here.parents) if (f / "pyproject.toml").is_file() and (f / "grpo_kit").is_dir()), here
    )


def check_fits(sizes: dict[str, int], dest: str | os.PathLike, *, what: str, fix: str | None = None) -> None:
    """Refuse, in one line naming a smaller choice that fits (or ``fix``), when ``sizes`` (name -> bytes) need more
    than the free space at ``dest`` minus ``SPACE_MARGIN``."""
    existing = Path(dest).resolve()
    while not existing.exists():  # the folder may not exist yet: ask its nearest existing parent's file system
        existing = existing.parent
    free = shutil.disk_usage(existing).free - SPACE_MARGIN
    needed = sum(sizes.values())
    if needed <= free:
        return
    fits, room = [], free
    for name, size in sorted(sizes.items(), key=lambda item: item[1]):  # smallest first: keep as many as fit
        if size <= room:
            fits.append(name)
            room -= size
    smaller = (
        f"copy only what fits, include={tuple(fits)!r} ({_gb(sum(sizes[n] for n in fits))})"
        if fits
        else "nothing of it fits"
    )
    listing = ", ".join(f"{name} {_gb(size)}" for name, size in sizes.items())
    fix = fix or (
        f"Nothing was copied. Either {smaller}, or free space there (on Drive: empty the trash too) and run "
        "the cell again."
    )
    raise GrpoKitError(
        f"Not enough space for {what}: {listing} = {_gb(needed)}, but {dest} has {_gb(max(free, 0))} "
        f"free (kept back: {_gb(SPACE_MARGIN)}). {fix}"
    )


def _gb(size: int) -> str:
    return f"{size / 1e9:.2f} GB"


def copy_to_drive(
    folder: str | os.PathLike, *, include: Collection[str] | None = None, dest: str | os.PathLike | None = None
) -> Path | None:
    """Copy the entries ``include`` (default: all) of an export ``folder`` to ``dest/<folder name>``; ``dest``
    defaults to ``exports/`` in the kit's Drive folder. Returns the copy, or None off Colab with no ``dest``.

    The entries' size is checked against the free space at ``dest`` first (``check_fits``): a copy that would not
    fit is refused with a message, before a byte is written. The copy is assembled beside the target and renamed
    into place, so an interrupted copy never looks finished; an older copy is renamed aside (``<name>.old-<time>``),
    never deleted.
    """
    from grpo_kit.files import set_aside, staged_dir

    folder = Path(folder)
    if not folder.is_dir():
        raise GrpoKitError(f"{folder} is not a folder: export first, then copy the export folder.")
    if dest is None:
        drive_folder = mount_drive()
        if drive_folder is None:
            return None
        dest = drive_folder / "exports"
    entries = [entry for entry in sorted(folder.iterdir()) if include is None or entry.name in include]
    if not entries:
        raise GrpoKitError(
            f"Nothing to copy: {folder} has none of {sorted(include or ())}; it holds "
            f"{sorted(e.name for e in folder.iterdir())}."
        )
    sizes = {entry.name: sum(f.stat().st_size for f in (entry, *entry.rglob("*")) if f.is_file()) for entry in entries}
    check_fits(sizes, dest, what=f"the copy of {folder.name}")  # bytes of each file, or of every file in each folder
    target = Path(dest) / folder.name
    with staged_dir(target, name=f".{target.name}.copying") as staging:  # a fixed name: a killed copy's goes next time
        for entry in entries:
            (shutil.copytree if entry.is_dir() else shutil.copy2)(entry, staging / entry.name)
        set_aside(target)  # before staged_dir's rename, which would delete an older copy
    return target
