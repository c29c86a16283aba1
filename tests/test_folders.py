"""Run folders and files written in one piece: a failure never leaves a half-written target nor loses the old one."""

from __future__ import annotations

import json
import os
from contextlib import closing
from types import SimpleNamespace

import pytest

from grpo_kit import files, runs
from grpo_kit.files import atomic_write_text, staged_dir


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

    monkeypatch.setattr(runs.os, "rename", rename)
    with pytest.raises(OSError), staged_dir(old_export) as staging:
        (staging / "weights.bin").write_text("new")
    assert _tree(old_export) == {"weights.bin": "old"}
    assert [p.name for p in old_export.parent.iterdir()] == ["model"]


def test_a_fixed_staging_name_replaces_a_killed_runs_leftover(tmp_path):
    leftover = tmp_path / ".adapter.tmp"
    leftover.mkdir()
    (leftover / "stale.bin").write_text("from a killed run")
    with staged_dir(tmp_path / "adapter", name=".adapter.tmp") as staging:
        assert staging == leftover and list(staging.iterdir()) == []
        (staging / "adapter.bin").write_text("new")
    assert _tree(tmp_path) == {"adapter/adapter.bin": "new"}


def test_set_aside_renames_and_never_overwrites(tmp_path):
    folder = tmp_path / "train"
    for content in ("first", "second"):
        folder.mkdir()
        (folder / "run.json").write_text(content)
        files.set_aside(folder)
    kept = sorted(tmp_path.glob("train.old-*"))
    assert not folder.exists() and sorted(_tree(p)["run.json"] for p in kept) == ["first", "second"]
    assert files.set_aside(tmp_path / "absent") is None
    (tmp_path / "checkpoint-3").mkdir()
    assert files.set_aside(tmp_path / "checkpoint-3", prefix="damaged-").name.startswith("damaged-checkpoint-3.old-")


def test_atomic_write_text_keeps_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "scores.jsonl"
    atomic_write_text(path, "old\n")
    monkeypatch.setattr(runs.os, "replace", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(runs.GrpoKitError, match=r"scores.jsonl: No space left; .*scores.jsonl is as it was"):
        atomic_write_text(path, "new\n")
    assert [p.name for p in tmp_path.iterdir()] == ["scores.jsonl"] and path.read_text() == "old\n"


def test_checkpoints_are_the_numbered_trainer_folders_newest_first(tmp_path):
    from transformers.trainer_utils import get_last_checkpoint

    for name in (
        "checkpoint-9",
        "checkpoint-10",
        "damaged-checkpoint-12",
        "checkpoint-x",
        "adapter",
        "checkpoint-13.old-20250101-000000",
    ):
        (tmp_path / name).mkdir()
    (tmp_path / "checkpoint-11").write_text("a file, not a checkpoint")
    assert [(runs.checkpoint_step(folder), folder.name) for folder in runs.checkpoints(tmp_path)] == [
        (10, "checkpoint-10"),
        (9, "checkpoint-9"),
    ]
    assert get_last_checkpoint(str(tmp_path)) == str(runs.checkpoints(tmp_path)[0])  # the Trainer's own pick
    assert runs.checkpoints(tmp_path / "missing") == []


def test_check_writable_names_the_folder(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the folder should be")
    with pytest.raises(runs.GrpoKitError, match="Cannot write exports into .*file.*--out-dir"):
        files.check_writable(blocked / "sub", what="exports", option="--out-dir")


def test_run_json_is_written_atomically_with_the_flat_recipe_and_no_secrets(tmp_path, monkeypatch):
    recipe = SimpleNamespace(
        values={"name": "cpu", "lora_r": 8, "hub_token": "hf_SECRET", "learning_rate": 1e-4},
        kit=SimpleNamespace(reward_funcs=["correctness", "format_rate"]),
    )
    written = []
    monkeypatch.setattr(files, "atomic_write_text", lambda path, text: written.append(path) or path.write_text(text))
    runs.Run(tmp_path, recipe=recipe, data="sample").record()
    assert written == [tmp_path / "run.json"]
    info = runs.Run(tmp_path).info
    assert info["recipe"] == {"name": "cpu", "lora_r": 8, "hub_token": "***", "learning_rate": 1e-4}
    assert info["data"] == "sample" and info["reward_names"] == ["correctness", "format_rate"]
    assert {"trl", "transformers", "peft"} <= set(info["versions"])
    assert "hf_SECRET" not in (tmp_path / "run.json").read_text()


def test_run_info_is_empty_without_a_run_json(tmp_path):
    assert runs.Run(tmp_path).info == {} == runs.Run(tmp_path / "no-such-folder").info


@pytest.mark.parametrize("content", [b"{torn", b"\xff\xfe", b"[1, 2]"])
def test_an_unreadable_run_json_is_said_never_taken_for_none(tmp_path, content):
    (tmp_path / "run.json").write_bytes(content)
    with pytest.raises(runs.GrpoKitError, match="run.json cannot be read .*Restore it from a copy"):
        _ = runs.Run(tmp_path).info
    assert (tmp_path / "run.json").read_bytes() == content


def test_a_run_folder_with_files_is_refused_and_a_new_one_locked(tmp_path):
    from filelock import FileLock, Timeout

    run_dir = tmp_path / "run"
    with closing(runs.Run.open(run_dir)) as run:
        assert run.checkpoint is None and (run_dir / runs.PID_NAME).read_text() == str(os.getpid())
        with closing(runs.Run.open(run_dir)) as again:  # this process's own lock: a notebook cell run again
            assert again.checkpoint is None
        with pytest.raises(Timeout):  # still held by the first: any other opener of the lock file is refused
            FileLock(run_dir / runs.LOCK_NAME, blocking=False).acquire()
        (run_dir / "run.json").write_text("{}")
        with pytest.raises(runs.GrpoKitError, match="already has files.*--resume"):
            runs.Run.open(run_dir)
    with FileLock(run_dir / runs.LOCK_NAME, blocking=False):  # released by the object
        assert (run_dir / "run.json").read_text() == "{}"


def test_restored_final_adapter_is_the_checkpoints_weights_without_training_state(tmp_path, fake_checkpoint):
    run = runs.Run(tmp_path)
    run.checkpoint = str(fake_checkpoint(tmp_path, 3))
    adapter = run.restore_adapter()
    assert sorted(p.name for p in adapter.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    before = (adapter / "adapter_model.safetensors").read_bytes()
    run.checkpoint = str(fake_checkpoint(tmp_path, 4))
    assert run.restore_adapter() == adapter  # an adapter is kept
    assert (adapter / "adapter_model.safetensors").read_bytes() == before
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny"
