"""Folders and files written in one piece: a failure never leaves a half-written target nor loses the old one."""

from __future__ import annotations

import os

import pytest

from grpo_kit.machinery import folders
from grpo_kit.machinery.folders import atomic_write_text, staged_dir


def _tree(folder):
    return {p.relative_to(folder).as_posix(): p.read_text() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def old_export(tmp_path):
    final = tmp_path / "out" / "model"
    final.mkdir(parents=True)
    (final / "weights.bin").write_text("old")
    return final


def test_a_failure_inside_leaves_no_final_folder_and_no_staging(tmp_path):
    final = tmp_path / "out" / "model"
    with pytest.raises(RuntimeError), staged_dir(final) as staging:
        (staging / "weights.bin").write_text("half")
        raise RuntimeError("disk full")
    assert list(final.parent.iterdir()) == []


def test_a_failure_inside_keeps_the_existing_folder_as_it_was(old_export):
    with pytest.raises(KeyboardInterrupt), staged_dir(old_export) as staging:
        (staging / "weights.bin").write_text("new")
        raise KeyboardInterrupt
    assert _tree(old_export) == {"weights.bin": "old"}
    assert [p.name for p in old_export.parent.iterdir()] == ["model"]


def test_the_old_folder_stays_in_place_until_the_new_one_is_complete(old_export):
    with staged_dir(old_export) as staging:
        (staging / "weights.bin").write_text("new")
        assert _tree(old_export) == {"weights.bin": "old"}  # still whole while the new one is written
    assert _tree(old_export) == {"weights.bin": "new"}
    assert [p.name for p in old_export.parent.iterdir()] == ["model"]  # staging and the old copy are gone


def test_a_failed_rename_puts_the_old_folder_back(old_export, monkeypatch):
    real_rename = os.rename

    def rename(src, dst):
        if ".partial-" in os.fspath(src):  # the staging folder taking the final name
            raise OSError(28, "No space left on device")
        return real_rename(src, dst)

    monkeypatch.setattr(folders.os, "rename", rename)
    with pytest.raises(OSError), staged_dir(old_export) as staging:
        (staging / "weights.bin").write_text("new")
    assert _tree(old_export) == {"weights.bin": "old"}
    assert [p.name for p in old_export.parent.iterdir()] == ["model"]


def test_keep_old_sets_the_previous_folder_aside_instead_of_deleting_it(old_export):
    with staged_dir(old_export, keep_old=True) as staging:
        (staging / "weights.bin").write_text("new")
    kept = [p for p in old_export.parent.iterdir() if p.name.startswith("model.old-")]
    assert _tree(old_export) == {"weights.bin": "new"} and [_tree(p) for p in kept] == [{"weights.bin": "old"}]


def test_a_fixed_staging_name_replaces_a_killed_runs_leftover(tmp_path):
    leftover = tmp_path / ".adapter.tmp"
    leftover.mkdir()
    (leftover / "stale.bin").write_text("from a killed run")
    with staged_dir(tmp_path / "adapter", name=".adapter.tmp") as staging:
        assert staging == leftover and list(staging.iterdir()) == []
        (staging / "adapter.bin").write_text("new")
    assert _tree(tmp_path) == {"adapter/adapter.bin": "new"}


def test_atomic_write_text_keeps_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "scores.jsonl"
    atomic_write_text(path, "old\n")
    monkeypatch.setattr(folders.os, "replace", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(OSError):
        atomic_write_text(path, "new\n")
    assert [p.name for p in tmp_path.iterdir()] == ["scores.jsonl"] and path.read_text() == "old\n"


def test_checkpoints_are_the_numbered_trainer_folders_newest_first(tmp_path):
    for name in ("checkpoint-9", "checkpoint-10", "damaged-checkpoint-12", "checkpoint-x", "adapter"):
        (tmp_path / name).mkdir()
    (tmp_path / "checkpoint-11").write_text("a file, not a checkpoint")
    assert [(step, folder.name) for step, folder in folders.checkpoints(tmp_path)] == [
        (10, "checkpoint-10"), (9, "checkpoint-9")
    ]
