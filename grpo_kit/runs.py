"""The run folder, as one object (``Run``): one process per run folder (a lock), resume from complete checkpoints
only, the final adapter and ``run.json`` written in one piece (``grpo_kit.files``). Nothing is ever deleted to make
room: it is set aside.

    run_dir/run.json  metrics.jsonl  checkpoint-N/  adapter/  eval/<name>.json  plots/rewards.png  .grpo-kit.lock
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import os
import re
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout  # datasets' and huggingface_hub's dependency

from grpo_kit.adapters import adapter_config, adapter_problem, is_adapter
from grpo_kit.errors import GrpoKitError
from grpo_kit.files import (
    check_writable,
    read_json,
    remove_stale_staging,
    set_aside,
    staged_dir,
    write_json,
    write_jsonl,
)
from grpo_kit.rewards import METRICS

#: A run folder's lock (filelock's) and the PID of the process training there (filelock 3.x empties its own file).
LOCK_NAME = ".grpo-kit.lock"
PID_NAME = ".grpo-kit.pid"


# --------------------------------------------------------------------------------------------- errors


class NumericsError(GrpoKitError):
    """A NaN/inf showed up during training; ``step`` is the optimizer step (1-based), ``metric`` what was bad."""

    def __init__(self, message: str, *, step: int | None, metric: str, value: Any = None):
        super().__init__(message)
        self.step, self.metric, self.value = step, metric, value


def resume_hint(run_dir) -> str:
    if run_dir is None:
        return ""
    checkpoint = latest_checkpoint(run_dir)
    if checkpoint is None:
        written = ", ".join(folder.name for folder in checkpoints(run_dir))  # torn, or weights that already broke
        return (
            f" No complete checkpoint in {run_dir}"
            + (f" ({written} cannot be resumed from)" if written else "")
            + ": after the fix, the same command with --resume starts again from step 0 in that folder (what this "
            "attempt left is set aside, not deleted)."
        )
    # complete means finite weights too (adapters.adapter_problem): weights that already broke are never offered
    return (
        f" The last complete checkpoint is {checkpoint}: after the fix, continue with `grpo-kit train ... --output "
        f"{run_dir} --resume` (or train(..., resume=True))."
    )


def numerics_error(
    step: int | None, metric: str, value: Any, run_dir, *, detail: str = "", where: str | None = None
) -> NumericsError:
    if metric.startswith("reward/"):
        fix = (
            f"The reward function '{metric[7:]}' returned {value}; rewards must be finite floats (return None for "
            "'not applicable'). Fix the reward, or leave it out of the recipe's reward_funcs."
        )
    else:
        fix = (
            "The weights or the loss overflowed. Lower the learning rate (--set learning_rate=..., e.g. by 10x), keep "
            "gradient clipping on (--set max_grad_norm=0.1), and on a T4 (fp16) shorten completions or use a bf16 "
            "card; on CPU the 'cpu' recipe trains in fp32."
        )
    where = where or f"at step {step}"  # GuardedReward, the only caller without a step, says where
    message = (
        f"Training stopped: {metric} is {value} {where}. GRPO cannot learn from NaN/inf, so the run was stopped "
        f"instead of training on silently (nothing from this step was saved). {fix}{detail}"
    )
    return NumericsError(message + resume_hint(run_dir), step=step, metric=metric, value=value)


# --------------------------------------------------------------------------------------------- checkpoints


def checkpoint_step(folder: str | os.PathLike) -> int | None:
    """N of a Trainer ``checkpoint-N`` folder (by its name), else None.

    >>> [checkpoint_step(name) for name in ("runs/x/checkpoint-40", "runs/x/adapter", "damaged-checkpoint-3")]
    [40, None, None]
    """
    match = re.fullmatch(r"checkpoint-(\d+)", Path(folder).name)  # transformers' PREFIX_CHECKPOINT_DIR
    return int(match[1]) if match else None


def checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Every ``checkpoint-N`` folder in ``run_dir``, newest first (transformers' own sort; ``checkpoint_step`` is
    its N)."""
    from transformers.trainer_utils import sort_checkpoints  # not at import: Unsloth must patch transformers first

    return [Path(path) for path in reversed(sort_checkpoints(str(run_dir))) if checkpoint_step(path) is not None]


def checkpoint_problem(folder: Path) -> str | None:
    """Why ``folder`` cannot be resumed from, or None when it is complete.

    Complete: a readable ``trainer_state.json`` (the Trainer writes it last), a sound adapter, and the
    optimizer and scheduler state (or DeepSpeed's ``global_step*/``: zero2.yaml); without those the Trainer would
    silently start a fresh optimizer and restart the learning-rate schedule.
    """
    try:
        read_json(folder / "trainer_state.json")
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
    return next((folder for folder in checkpoints(run_dir) if checkpoint_problem(folder) is None), None)


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


# --------------------------------------------------------------------------------------------- the run


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
    "use_vllm",  # the kit turns it off where vLLM cannot be imported (models.use_vllm_if_importable)
    "vllm_gpu_memory_utilization",
    "gradient_checkpointing",
)
_SECRET = ("token", "secret", "password", "api_key")  # ``--set hub_token=...`` and the like are never recorded
#: The prompt a model was trained with, in each export folder (``Run.write_prompt``): where ``eval --model``, ``chat
#: --model`` and a user's own code (the model card says how) find it.
PROMPT_FILE = "prompt.json"
PLAIN_PROMPT = {"few_shot": 0, "prefill": "", "system_prompt": None}  # a model without one: the question alone


class Run:
    """One run folder (``dir``) and what the kit keeps in it (the layout above). ``Run.open`` for training,
    ``Run.of`` for what eval, chat and export are given; ``trained`` is the adapter (or exported model) folder asked
    about, else ``dir/adapter``. A training run holds the folder's lock until ``close()``; ``callbacks.TrainingRun``
    adds what its trainer needs (``with TrainingRun.open(...) as run:``).
    """

    def __init__(self, folder, *, trained=None, recipe=None, data=None):
        self.dir, self.recipe, self.data = Path(folder), recipe, data
        self.trained = Path(trained) if trained else self.dir / "adapter"
        self.metrics_path = self.dir / "metrics.jsonl"  # the history: one JSON line per log (callbacks.TrainingRun)
        self.checkpoint = None  # the complete checkpoint training resumes from (trainer.train takes it)
        self._lock = None  # a FileLock while training

    @classmethod
    def of(cls, path):
        """The run behind ``path``: a run folder, its ``adapter/`` or a ``checkpoint-N/`` (or an export's ``lora/``
        or ``merged16/``, whose ``prompt.json`` records the prompt; a Hub id, no folder here, has no run)."""
        path = Path(path)
        return cls(path.resolve().parent if path.is_dir() and not is_run_folder(path) else path, trained=path)

    @classmethod
    def open(cls, folder, *, recipe=None, data=None, resume=False, restart=False, is_main=True):
        """Lock and create the run folder for training; with ``resume``, find the checkpoint to continue from
        (``checkpoint``). ``restart`` sets an existing folder aside (renamed, never deleted) and starts anew. Never
        deletes user data, and a folder that holds files but no run is refused before anything is written there.

        Newer, incomplete checkpoints are named in a warning and set aside as ``damaged-checkpoint-N.old-<time>`` by
        the main process (the Trainer would write into them). Without a complete checkpoint (the run stopped before
        its first one, or every one is damaged) ``resume`` starts again from step 0 in the same folder, what the
        earlier attempt left set aside in ``attempt.old-<time>-*/`` and named in a warning. Only the main process
        locks and moves files. With ``recipe`` (and ``data``), a resume must be the run its ``run.json`` records.
        """
        run = cls(folder, recipe=recipe, data=data)
        if restart:
            resume = False
            if is_main:
                set_aside(run.dir)
        if resume and not run.dir.is_dir():
            raise GrpoKitError(
                f"--resume: there is no run folder {run.dir}. Check --output, or drop --resume to start a new run."
            )
        held = run._files()
        if held and not is_run_folder(run.dir):  # the user's own files: never trained over, never moved
            raise GrpoKitError(
                f"{run.dir} is not a grpo-kit run folder (no run.json or checkpoint-N) and holds other files "
                f"({', '.join(item.name for item in held[:3])}{', ...' if len(held) > 3 else ''}); nothing there was "
                "touched. Choose another --output: a new or empty folder such as runs/my-run."
            )
        if held and not resume:
            if is_main and (run.dir / LOCK_NAME).exists():  # a folder in use says so first, naming its PID
                run.lock()
                run.close()
            raise GrpoKitError(
                f"Run folder {run.dir} already has files. Use --resume to continue it, or choose another --output."
            )
        if resume and recipe is not None:
            run._check_record()
        if is_main:  # only now, so a refused folder is left as it was
            run.lock()  # a second process on this folder stops here, naming the first one's PID
        try:
            run.checkpoint = run._resume_point(is_main) if resume else None
        except BaseException:
            run.close()
            raise
        return run

    # --- the lock

    def lock(self):
        """Take the run folder's lock, or refuse naming the PID that holds it: two processes training into one folder
        would interleave their checkpoints and metrics. An OS lock (flock): the OS drops a killed process's lock, and
        this process's own is taken again (a notebook running its cell again: filelock's singleton is reentrant)."""
        check_writable(self.dir, what="the run", option="--output")  # a file in its place, no permission
        lock = FileLock(self.dir / LOCK_NAME, blocking=False, is_singleton=True)
        try:
            lock.acquire()
        except Timeout:
            holder = (self.dir / PID_NAME).read_text(encoding="utf-8").strip() or "?"  # written once it locked
            raise GrpoKitError(
                f"Run folder {self.dir} is in use by another training process (PID {holder}). Wait for it "
                f"to end, stop it (kill {holder}), or choose another --output."
            ) from None
        (self.dir / PID_NAME).write_text(str(os.getpid()), encoding="utf-8")
        self._lock = lock

    def close(self):
        """Release the run folder's lock (nothing when this object holds none)."""
        if self._lock:
            self._lock.release()
            self._lock = None

    # --- resume

    @property
    def resumed_from(self):
        return checkpoint_step(self.checkpoint) if self.checkpoint else None

    @property
    def finished(self):
        """The run resumes from a checkpoint at its ``max_steps``: nothing is left to train (the Trainer would run
        one step more)."""
        return self.resumed_from is not None and self.resumed_from >= self.recipe.grpo.max_steps

    def _files(self):
        return (
            sorted(item for item in self.dir.iterdir() if item.name not in (LOCK_NAME, PID_NAME))
            if self.dir.is_dir()
            else []
        )

    def _resume_point(self, is_main):
        skipped = []
        for folder in checkpoints(self.dir):  # newest first
            if (problem := checkpoint_problem(folder)) is None:
                if skipped:
                    warnings.warn(
                        f"--resume: skipped {'; '.join(skipped)}. Resuming from {folder.name}, the newest "
                        "complete one, with its optimizer and learning-rate state.",
                        stacklevel=3,
                    )
                return str(folder)
            aside = set_aside(folder, prefix="damaged-") if is_main else None
            skipped.append(f"{folder.name}: {problem}" + (f" (moved to {aside.name})" if aside else ""))
        earlier, moved = self._files(), ""
        if is_main and earlier:
            aside = Path(tempfile.mkdtemp(prefix=f"attempt.old-{time.strftime('%Y%m%d-%H%M%S')}-", dir=self.dir))
            aside.chmod(0o755)  # mkdtemp makes it private; it holds the run's own files, readable as they were
            for item in earlier:
                os.rename(item, aside / item.name)
            moved = f"; what the earlier attempt left is in {aside.name}"
        warnings.warn(
            f"--resume: no complete checkpoint in {self.dir}"
            + (f" ({'; '.join(skipped)})" if skipped else "")
            + f"{moved}. Training starts again from step 0 in the same folder.",
            stacklevel=3,
        )
        return None

    # --- run.json: the record

    @functools.cached_property
    def info(self):
        """``run.json`` as a dict, read once (as it was before ``record`` rewrites it), {} when there is none; one that
        cannot be read is said, never taken for none: it records how the run was trained (recipe, data, prompt)."""
        path = self.dir / "run.json"
        try:
            info = read_json(path)
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            info = f"{type(error).__name__}: {str(error)[:120]}"
        if not isinstance(info, dict):
            raise GrpoKitError(
                f"{path} cannot be read ({info if isinstance(info, str) else 'not a JSON object'}); it records how "
                "the run was trained (recipe, data, prompt), so nothing was done without it. Restore it from a copy, "
                "or train a new run in another folder (--output); the run's checkpoints are untouched."
            )
        return info

    @property
    def recorded(self):
        """The recipe values ``run.json`` records (as set, secrets masked), {} without a record."""
        return self.info.get("recipe") or {}

    def _check_record(self):
        """Refuse to resume with values or data (None: not known, a dataset passed to ``train``) other than
        ``run.json`` records, but for ``RESUMABLE``; values are compared as TRL parses them."""
        from grpo_kit.config import build_recipe

        info, recipe, data = self.info, self.recipe, self.data
        if not info:
            return  # stopped before its record was written: nothing to differ from
        recorded, changed = self.recorded, []
        funcs = list(recipe.kit.reward_funcs)
        if (names := info.get("reward_names", funcs)) != funcs:
            changed.append(f"reward_funcs ({', '.join(names)} -> {', '.join(funcs)})")
        else:  # the same rewards: the recorded values parsed with this recipe's functions (a notebook's are not in
            # JSON), and this recipe's parsed again (a trainer may have changed its GRPOConfig: Unsloth's turns fp16 on)
            then, now = build_recipe({**recorded, "reward_funcs": recipe.reward_funcs}), build_recipe(recipe.values)
            keys = {*recorded, *recipe.values} - {
                *RESUMABLE,
                "output_dir",
                "name",
                "description",
                "reward_funcs",
            }
            for key in sorted(k for k in keys if recorded.get(k) != "***"):
                if (old := then.parsed(key)) != (new := now.parsed(key)):
                    changed.append(f"{key} ({old!r} -> {new!r})")
        if None not in (data, info.get("data")) and Path(info["data"]).resolve() != Path(data).resolve():
            changed.append(f"data ({info['data']} -> {data})")
        if changed:
            raise GrpoKitError(
                f"--resume: {self.dir} is a run of {recorded.get('name', 'another recipe')} whose run.json records "
                f"other values than this command's: {'; '.join(changed)}. A resumed run goes on as it was recorded; "
                f"only {', '.join(RESUMABLE)} may change. Resume with the recorded values (the command line takes "
                "them from run.json when --preset and --data are left out), or start a new run in another folder "
                "(--output)."
            )

    def record(self):
        """Write ``run.json`` atomically, as training begins (``callbacks.TrainingRun``): the recipe's values as set
        (secrets masked; a Python reward by its name), data, rewards, versions, and the step a resumed run continued
        from (its learning rate then follows the schedule for this ``max_steps``)."""
        from importlib.metadata import version

        values = {k: "***" if any(w in k.lower() for w in _SECRET) else v for k, v in self.recipe.values.items()}
        names = list(self.recipe.kit.reward_funcs)
        if "reward_funcs" in values:
            values["reward_funcs"] = names
        info = {
            "recipe": values,
            "data": self.data or "the dataset passed to train()",
            "reward_names": names,
            "resumed_from_step": self.resumed_from,
            "versions": {name: version(name) for name in ("trl", "transformers", "peft")},
        }
        return write_json(self.dir / "run.json", info)

    # --- the history

    @property
    def history(self):
        return read_metrics(self.metrics_path)

    def write_history(self, rows):
        write_jsonl(self.metrics_path, rows)  # NaN/inf: null

    @property
    def steps(self):
        """Optimizer steps behind ``trained``: a ``checkpoint-N``'s N (its global step), else the last logged step."""
        return checkpoint_step(self.trained) or max((row.get("step", 0) for row in self.history), default=None)

    # --- what it was trained with, and its evaluations

    @property
    def base_model(self):
        """The model ``trained`` (an adapter) was trained on: its run's recipe ``model_name_or_path``, else the one its
        ``adapter_config.json`` names, if it is on this machine; None for a folder that is no adapter."""
        if model := self.recorded.get("model_name_or_path"):
            return model
        if not is_adapter(self.trained):
            return None
        recorded = adapter_config(self.trained).base_model_name_or_path
        if recorded and (Path(recorded).exists() or not os.path.isabs(recorded)):
            return recorded
        raise GrpoKitError(
            f"The adapter's base model '{recorded}' is not on this machine and no run.json names it. Pass "
            "--model (the model the adapter was trained on, e.g. embedded or Qwen/Qwen2.5-1.5B-Instruct)."
        )

    @property
    def prompt(self):
        """The ``few_shot``/``prefill``/``system_prompt`` it trained with: its recipe, else the ``prompt.json`` of an
        exported adapter or model; None when neither records it."""
        recipe = self.recorded
        if not recipe and (exported := self.trained / PROMPT_FILE).is_file():
            recipe = read_json(exported)
        return {key: recipe.get(key, default) for key, default in PLAIN_PROMPT.items()} if recipe else None

    def write_prompt(self, folder):
        """``folder/prompt.json``: the training prompt's settings, and for any other code the chat messages that come
        before the question (system prompt, worked examples) and the text the reply starts with; nothing without
        a record of the prompt."""
        from grpo_kit.data import build_messages

        if not (settings := self.prompt):
            return
        messages = build_messages("", system_prompt=settings["system_prompt"], few_shot=settings["few_shot"])[:-1]
        record = {**settings, "messages_before_question": messages, "reply_starts_with": settings["prefill"]}
        # a plain write: export's staging folder is what lands in one piece, and its OSError names the export's fix
        (folder / PROMPT_FILE).write_text(json.dumps(record, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    @property
    def name(self):
        """``runs/x/adapter`` -> ``x``; ``runs/x/checkpoint-40`` -> ``x-checkpoint-40``; else the folder's name."""
        folder = self.trained.resolve()
        name = folder.parent.name if folder.name == "adapter" else folder.name
        return f"{folder.parent.name}-{name}" if checkpoint_step(folder) else name

    @property
    def evaluations(self):
        """``{name: metrics}`` of what was saved in ``eval/<name>.json`` (``EvalResult.save``)."""
        return {path.stem: read_json(path) for path in sorted(self.dir.glob("eval/*.json"))}

    # --- the final adapter

    def restore_adapter(self, is_main=True):
        """``adapter/`` of a run that already reached ``max_steps``: nothing trains, nothing is rewritten, unless the
        adapter is missing (killed between the last checkpoint and the adapter write) or cannot be read (a torn file:
        set aside, never deleted); then it is written again from that checkpoint, which holds the same weights."""
        adapter, checkpoint = self.dir / "adapter", Path(self.checkpoint)
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

    def save_adapter(self, trainer):
        """The final adapter, ``adapter/``: written through a staging folder, so it is never half-written, and sound
        (``check_saved_adapter``) before the run counts as done. Of a finished run (nothing trained), restored
        (``restore_adapter``) and loaded into the trainer's model instead.

        Every process calls this; the main one writes (each process holds the same weights), the others wait for it.
        """
        from peft import load_peft_weights, set_peft_model_state_dict

        adapter, is_main = self.dir / "adapter", trainer.is_world_process_zero()
        if self.finished:
            self.restore_adapter(is_main)
        elif is_main:
            remove_stale_staging(self.dir, "adapter")  # a save killed midway left its staging folder
            with staged_dir(adapter) as staging:
                trainer.save_model(str(staging))
                trainer.processing_class.save_pretrained(str(staging))
        trainer.accelerator.wait_for_everyone()  # no process goes on to read the adapter before it is in place
        if self.finished:
            set_peft_model_state_dict(trainer.model, load_peft_weights(str(adapter)))
        elif is_main:
            self.check_saved_adapter(trainer.state.global_step)
        return adapter

    def check_saved_adapter(self, step):
        """A run is done only when its adapter is sound (``adapters.adapter_problem``): a broken one is set aside (as
        ``damaged-adapter.old-*``, like a damaged checkpoint) and reported.

        The loss of the last step is logged before that step's update, so ``NumericsGuard`` cannot see an update that
        broke the weights (an inf learning rate does exactly that).
        """
        adapter = self.dir / "adapter"
        if problem := adapter_problem(adapter):
            aside = set_aside(adapter, prefix="damaged-")
            raise numerics_error(
                step,
                "the final adapter",
                "unusable",
                self.dir,
                detail=f" ({problem}) The broken adapter was moved to {aside}.",
            )


def is_run_folder(folder: Path) -> bool:
    """True for a folder a training run wrote: its ``run.json`` (written before the first step) or a checkpoint."""
    return (folder / "run.json").exists() or any(checkpoint_step(item) for item in folder.iterdir())


def history_rows(log_history: list[dict]) -> list[dict]:
    """The Trainer's ``log_history`` as the kit's history (``metrics.jsonl``, what the doctor reads): a row per logged
    step, each ``rewards/<name>/mean`` as ``reward/<name>`` (a metric such as ``format_rate`` by its name). ``reward``
    is the one meaning of "total reward" in the kit: TRL's weighted sum of the rewards, averaged over the batch; under
    SEED-GRPO the sum of what they gave, the scaled sum that trains being ``seed_grpo/reward``.

    >>> history_rows([{"rewards/format/mean": 1.0, "reward": 0.5, "reward_unscaled": 1.0, "step": 1}, {"step": 1,
    ...     "train_runtime": 9.0}])
    [{'step': 1, 'reward/format': 1.0, 'reward': 1.0, 'seed_grpo/reward': 0.5}]
    """
    rows = []
    for logged in log_history:
        if "train_runtime" not in logged:  # the Trainer's closing summary is no step
            row = {"step": logged["step"]}  # first, as the Trainer adds it last
            for key, value in logged.items():
                if key.startswith("rewards/") and key.endswith("/mean"):
                    name = key[8:-5]
                    key = name if name in METRICS else f"reward/{name}"
                row[key] = value
            if "reward_unscaled" in row:  # SEED-GRPO (rewards.seed_grpo): `reward` stays what the rewards gave
                row["seed_grpo/reward"], row["reward"] = row["reward"], row.pop("reward_unscaled")
            rows.append(row)
    return rows


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Rows of a ``metrics.jsonl`` (or ``doctor.jsonl``: a JSON object per line); a torn last line from a killed run
    is ignored."""
    rows = []
    with contextlib.suppress(FileNotFoundError):
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                rows.append(json.loads(line))
    return rows
