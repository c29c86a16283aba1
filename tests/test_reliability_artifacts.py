"""Reliability, issue 7 parts 1 (exports) and 6: what the kit writes is safe to share and never half-written.

One real tiny run goes train -> export (lora, merged16) -> a failing Hub push -> a failing model load, with a fake
``HF_TOKEN`` in the environment and every byte of output captured (stdout, stderr, C-level writes to the file
descriptors, and log records). The token must not appear in that output nor in any file of the run or export
folders, checkpoints included. Weights are safetensors only. An export SIGKILLed mid-write leaves no folder that
looks complete, and the next export cleans up after it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
from tiny_cli import SIGNAL, tiny_train_args

from grpo_kit.cli import main
from grpo_kit.export import export

FAKE_TOKEN = "hf_GrpoKitReliabilityFAKE0123456789abcdefXYZ"
#: Files HF Trainer writes into checkpoints that are training state, not weights (optimizer moments, LR schedule,
#: RNG state, the pickled TrainingArguments). Weights themselves must be safetensors.
TRAINING_STATE = {"optimizer.pt", "scheduler.pt", "rng_state.pth", "scaler.pt", "training_args.bin"}
PICKLE_SUFFIXES = {".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle"}
LOGGERS = ("", "grpo_kit", "transformers", "trl", "peft", "accelerate", "datasets", "huggingface_hub")


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(level=logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.name}: {record.getMessage()}")


@contextlib.contextmanager
def capture_everything(fd_file: Path):
    """Collect Python-level stdout/stderr, writes to fds 1 and 2, and log records (as text) while the block runs."""
    text = io.StringIO()
    records = _Records()
    loggers = [logging.getLogger(name) for name in LOGGERS]
    for logger in loggers:
        logger.addHandler(records)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(fd_file, "wb") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                yield lambda: text.getvalue() + fd_file.read_text(errors="replace") + "\n".join(records.lines)
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
            for logger in loggers:
                logger.removeHandler(records)


def _files(*folders: Path) -> list[Path]:
    return sorted(path for folder in folders for path in folder.rglob("*") if path.is_file())


@pytest.fixture(scope="module")
def shared(tiny_model_dir, tmp_path_factory):
    """The whole user journey with a fake token set; returns the folders, the exit codes and everything printed."""
    root = tmp_path_factory.mktemp("journey")
    run_dir, exports = root / "run", root / "exports"
    tiny = tiny_train_args(  # its event files are scanned too
        "arithmetic",
        model_name_or_path=tiny_model_dir,
        **SIGNAL,
        save_steps=1,
        max_steps=2,
        report_to="tensorboard",
    )

    def leaky_create_repo(api, repo_id, **kwargs):  # a server error that echoes the credentials back
        raise RuntimeError(f"401 Client Error for url https://huggingface.co/api/repos/create (token={api.token})")

    with pytest.MonkeyPatch.context() as patch:
        from huggingface_hub import HfApi

        patch.setenv("HF_TOKEN", FAKE_TOKEN)
        patch.setattr(HfApi, "create_repo", leaky_create_repo)
        with capture_everything(root / "fd-output.txt") as output:
            codes = {
                "train": main(["train", *tiny, "--output", str(run_dir)]),
                "export": main(
                    [
                        "export",
                        "--adapter",
                        str(run_dir / "adapter"),
                        "--format",
                        "lora,merged16",
                        "--out-dir",
                        str(exports),
                        "--name",
                        "tiny",
                    ]
                ),
                "push": main(
                    [
                        "export",
                        "--adapter",
                        str(run_dir / "adapter"),
                        "--out-dir",
                        str(exports),
                        "--name",
                        "pushed",
                        "--push-to-hub",
                        "someone/grpo-kit-test",
                    ]
                ),
                "bad_model": main(
                    [
                        "train",
                        *tiny[:2],
                        "--set",
                        "model_name_or_path=someone/private-model",
                        "--data",
                        "sample",
                        "--output",
                        str(root / "never"),
                    ]
                ),
            }
            printed = output()
    return SimpleNamespace(run_dir=run_dir, exports=exports, codes=codes, printed=printed)


@pytest.mark.slow
def test_hf_token_appears_in_no_output_and_no_file(shared):
    assert shared.codes == {"train": 0, "export": 0, "push": 2, "bad_model": 2}, shared.printed[-3000:]
    printed = shared.printed
    assert "verified" in printed and "401 Client Error" in printed and "token=***" in printed  # the paths ran
    assert FAKE_TOKEN not in printed
    files = _files(shared.run_dir, shared.exports)
    names = {path.name for path in files}
    assert {"trainer_state.json", "optimizer.pt", "run.json", "metrics.jsonl", "README.md", "export.json"} <= names
    if importlib.util.find_spec("tensorboard") is not None:  # the event files are scanned too
        assert any(path.name.startswith("events.out.tfevents") for path in files)
    for path in files:  # text and binary alike: checkpoints, pickled args, tensorboard events, model cards
        assert FAKE_TOKEN.encode() not in path.read_bytes(), path


@pytest.mark.slow
def test_weights_are_safetensors_only(shared):
    for path in _files(shared.exports):  # what users share: no pickle at all
        assert path.suffix not in PICKLE_SUFFIXES, path
    weights = []
    for path in _files(shared.run_dir):
        if path.suffix in PICKLE_SUFFIXES:
            assert path.name in TRAINING_STATE, f"{path} is a pickle file that is not training state"
        if path.suffix == ".safetensors":
            weights.append(path.relative_to(shared.run_dir).as_posix())
    assert "adapter/adapter_model.safetensors" in weights and "checkpoint-2/adapter_model.safetensors" in weights
    merged = {p.name for p in (shared.exports / "tiny" / "merged16").iterdir()}
    assert "model.safetensors" in merged and not merged & {"pytorch_model.bin", "adapter_model.bin"}


def test_trust_remote_code_is_never_on(monkeypatch):
    """Every loader leaves a model's own Python code unrun: no trust_remote_code=True reaches from_pretrained."""
    import grpo_kit.models as models
    from grpo_kit.config import load_recipe

    seen = []

    class Stop(Exception):
        pass

    def record(cls, model_id, **kwargs):
        seen.append(kwargs.get("trust_remote_code", False))
        raise Stop

    monkeypatch.setattr(models, "_from_pretrained", record)
    for load in (
        lambda: models.load_inference_model("someone/model"),
        lambda: models.load_tokenizer("someone/model"),
        lambda: models.load_model(load_recipe("cpu", model_name_or_path="someone/model")),
    ):
        with pytest.raises(Stop):
            load()
    assert seen == [False, False, False]


_KILLED_EXPORT = textwrap.dedent(
    """
    import os, signal, sys
    import grpo_kit.export as ex

    def dying(base_path, adapter_dir, tokenizer, folder):
        folder.mkdir(parents=True)
        with open(folder / "model.safetensors", "wb") as handle:
            handle.write(b"\\0" * 4096)  # half of the weights are on disk...
            handle.flush()
            os.kill(os.getpid(), signal.SIGKILL)  # ...when the Colab runtime disconnects

    ex._write_merged16 = dying
    ex.export(sys.argv[1], ("lora", "merged16"), out_dir=sys.argv[2], name="cut")
    """
)


@pytest.mark.slow
def test_sigkilled_export_leaves_nothing_that_looks_complete(shared, tmp_path):
    out = tmp_path / "exports"
    env = {**os.environ, "GRPO_KIT_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    adapter = shared.run_dir / "adapter"
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_EXPORT, str(adapter), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    left = sorted(p.name for p in out.iterdir())
    assert "cut" not in left  # no folder at the export's name
    assert len(left) == 1 and left[0].startswith(".cut.partial-")  # only the hidden staging folder remains
    assert (out / left[0] / "merged16" / "model.safetensors").stat().st_size == 4096

    results = export(adapter, ("lora", "merged16"), out_dir=out, name="cut")  # the retry
    assert [r.format for r in results] == ["lora", "merged16"]
    assert sorted(p.name for p in out.iterdir()) == ["cut"]  # the dead export's staging folder is gone
    assert (out / "cut" / "export.json").is_file()
    assert (out / "cut" / "merged16" / "model.safetensors").stat().st_size > 4096


def test_staging_of_a_live_export_is_left_alone(tmp_path):
    from grpo_kit.files import remove_stale_staging

    live = tmp_path / f".x.partial-{os.getpid()}-abc"  # this process: alive (as staged_dir names it)
    dead = tmp_path / ".x.partial-999999999-abc"  # no such pid
    other = tmp_path / ".xy.partial-999999999-abc"  # another export's name
    for folder in (live, dead, other):
        folder.mkdir()
    remove_stale_staging(tmp_path, "x")
    assert live.is_dir() and other.is_dir() and not dead.exists()
