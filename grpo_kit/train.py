"""Training, one linear path: recipe -> model -> prompts -> rewards -> ``GRPOTrainer`` -> adapter.

``train`` is the sequence of calls notebook 00 shows cell by cell (open-r1's ``grpo.py`` is the model). What keeps a
run safe plugs in around TRL, visibly: the run folder with its lock and resume (``runs``), and as trainer callbacks
and reward wrappers, ``metrics.jsonl`` and the numeric and reward guards (``callbacks``); TRL prints the samples.

    from grpo_kit.config import load_recipe
    from grpo_kit.train import train
    result = train(load_recipe("cpu", max_steps=2), data="sample")
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from grpo_kit import runs
from grpo_kit.errors import GrpoKitError


@dataclass(frozen=True)
class TrainResult:
    run_dir: Path
    adapter_dir: Path
    metrics_path: Path
    steps: int
    seconds: float
    reward_first: float | None  # mean reward over the first few logged steps
    reward_last: float | None  # mean reward over the last few logged steps
    history: list[dict] = field(default_factory=list, repr=False)
    already_finished: bool = False  # ``resume`` found the run at max_steps: nothing was trained or changed
    findings: list[dict] = field(default_factory=list)  # the run doctor's (``doctor.diagnose``)

    @property
    def failed(self) -> bool:
        """The run collapsed or learned nothing: export refuses its adapter, ``grpo-kit train`` exits 1."""
        return any(f["check"] in ("collapsed", "learned-nothing") for f in self.findings)

    def summary(self) -> str:
        start = "n/a" if self.reward_first is None else f"{self.reward_first:.3f}"
        end = "n/a" if self.reward_last is None else f"{self.reward_last:.3f}"
        head = (
            f"run already finished: step {self.steps} of {self.steps}, nothing was changed (pass a larger "
            "--set max_steps=N with --resume to train on)\n"
            if self.already_finished
            else ""
        )
        warnings = "".join(
            f"\nwarning: {f['message']} (seen at step {f['step']})" for f in self.findings if f["level"] == "warning"
        )
        return (
            head
            + f"steps: {self.steps}   time: {self.seconds:.0f} s   reward: {start} -> {end}"
            + (
                " (what the rewards gave; SEED-GRPO trained on them scaled: seed_grpo/ in metrics.jsonl)"
                if any("seed_grpo/reward" in row for row in self.history)
                else ""
            )
            + "\n"
            f"adapter: {self.adapter_dir}\nmetrics: {self.metrics_path}{warnings}"
        )


def train(
    recipe,
    *,
    data: str = "gsm8k",
    dataset=None,
    output_dir: str | os.PathLike | None = None,
    resume: bool = False,
    callbacks: tuple = (),
    lenient: bool = False,
) -> TrainResult:
    """Train a GRPO LoRA adapter with ``recipe`` (``grpo_kit.config.Recipe``) on ``data`` prompts.

    ``dataset`` (question/answer columns) replaces ``data``. The run folder is ``output_dir``, else the recipe's
    ``output_dir``, else ``runs/<recipe>-<time>``. ``resume=True`` continues from the newest complete checkpoint there;
    without it a used run folder is refused, never overwritten. ``lenient`` skips bad data rows (counted). Sampled
    completions with each reward's score are TRL's own table (the recipe's ``log_completions``). Under ``accelerate
    launch`` every process runs this; only the main one writes run files.
    """
    from accelerate import PartialState

    from grpo_kit import models
    from grpo_kit.callbacks import TrainingRun, check_rewards, guard_rewards
    from grpo_kit.data import check_dataset_size, format_for_grpo, load_gsm8k
    from grpo_kit.planner import check_device
    from grpo_kit.rewards import reward_functions, seed_grpo

    # --- Recipe: what this machine cannot run is refused (GPU-only settings on a CPU, bf16 on a T4, a report_to
    # integration not installed; VRAM: warned); the run folder is its output_dir; vLLM that cannot be imported on a
    # GPU is turned off, and said so
    check_device(recipe, models.detect_device())
    recipe = models.use_vllm_if_importable(recipe, output_dir=str(run_folder(recipe, output_dir)))
    config, kit, run_dir = recipe.grpo, recipe.kit, Path(recipe.grpo.output_dir)
    config.run_name = config.run_name or run_dir.name  # the run's name in Trackio and other trackers
    import trl  # after grpo_kit.config imported Unsloth (GPU): this is then Unsloth's patched GRPOTrainer

    models.set_torch_threads()
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # TRL pings telemetry with HF_TOKEN in the request
    models.ensure_logprob_kernel()  # TRL 1.15 on a machine without Triton (any CPU): see grpo_kit/models.py

    # --- Data, prompts and rewards: every input is read and checked before any weights load
    source = data if dataset is None else None  # a dataset object has no name to record or compare on resume
    label = source or "the dataset passed to train()"
    if dataset is None:  # an offline Hub or a bad file is reported here
        dataset = load_gsm8k(data, split="train", lenient=lenient)
    check_dataset_size(len(dataset), config, source=label)
    funcs = seed_grpo(reward_functions(recipe.reward_funcs), recipe)  # module:function rewards are imported now
    # Chat template, worked examples, prefill; over-long prompts dropped (and counted). The tokenizer is the model's
    # own, loaded once (models.load_tokenizer); Unsloth's loader returns it with the same chat template.
    tokenizer = models.load_tokenizer(models.resolve_model_id(recipe.model.model_name_or_path))
    train_set, n_long = format_for_grpo(
        dataset,
        tokenizer,
        few_shot=kit.few_shot,
        prefill=kit.prefill,
        max_prompt_tokens=kit.max_prompt_length,
        system_prompt=kit.system_prompt,
    )
    check_dataset_size(len(train_set), config, source=label, filtered=n_long, max_prompt_tokens=kit.max_prompt_length)
    check_rewards(funcs, train_set[0], tokenizer)  # a reward that raises or returns NaN: told now, not after loading
    is_main = config.process_index == 0
    # a resume must be the run its run.json records; a folder that holds no run is refused untouched. Until the
    # adapter is saved, running out of GPU memory or disk and NaN/inf sampling are errors that say what to do.
    with TrainingRun.open(run_dir, recipe=recipe, data=source, resume=resume, is_main=is_main) as run:
        PartialState().wait_for_everyone()  # every process has checked the run folder before any process writes in it
        if run.finished:  # the Trainer would run one step more
            return _result(run, run.restore_adapter(is_main), run.resumed_from, 0.0, already_finished=True)

        # --- Model: Unsloth's FastLanguageModel on a GPU, transformers + PEFT otherwise; LoRA either way
        policy, tokenizer = models.load_model(recipe)

        # --- The trainer: rewards wrapped so an exception or NaN names the reward; the run's callbacks record it
        # (run.json as training begins, metrics.jsonl: what a resumed checkpoint logged after its step is cut) and
        # guard it (NaN/inf loss, grad_norm or reward: a clear error naming the step)
        trainer = trl.GRPOTrainer(
            model=policy,
            reward_funcs=guard_rewards(funcs, run_dir),
            args=config,
            train_dataset=train_set,
            processing_class=tokenizer,
            callbacks=[*run.callbacks, *callbacks],
        )
        start = time.time()
        trainer.train(resume_from_checkpoint=run.checkpoint)
        seconds = time.time() - start
        # --- Save: the adapter is written atomically and must be finite before the run counts as done
        adapter_dir = run.save_adapter(trainer)
    return _result(run, adapter_dir, trainer.state.global_step, seconds)


def run_folder(recipe, output_dir: str | os.PathLike | None = None) -> Path:
    """``output_dir`` (``--output``), else the recipe's ``output_dir``, else ``runs/<recipe>-<time>``; two that
    disagree are refused rather than one silently winning."""
    recorded = recipe.values.get("output_dir")
    if output_dir and recorded and Path(output_dir).resolve() != Path(recorded).resolve():
        raise GrpoKitError(
            f"The recipe sets output_dir={recorded} but the run folder given is {output_dir}; keep one of them."
        )
    return Path(output_dir or recorded or Path("runs") / f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}")


def _result(run, adapter_dir: Path, steps: int, seconds: float, *, already_finished: bool = False) -> TrainResult:
    from grpo_kit.doctor import diagnose, reward_first_last

    history = run.history
    first, last = reward_first_last(history)
    return TrainResult(
        run_dir=run.dir,
        adapter_dir=adapter_dir,
        metrics_path=run.metrics_path,
        steps=steps,
        seconds=seconds,
        reward_first=first,
        reward_last=last,
        history=history,
        already_finished=already_finished,
        findings=diagnose(history, beta=run.recorded.get("beta", 0)),
    )


# --------------------------------------------------------------------------------------------- CLI


def cli_train(args) -> int:
    """``grpo-kit train``: the recipe (``--preset``/``--recipe``, or the run's own with ``--resume``) and its
    ``--set`` changes, then ``train``, the summary and the curves."""
    from grpo_kit.config import build_recipe, load_recipe, parse_set

    changes = parse_set(args.set)
    if args.resume and not args.output:
        raise GrpoKitError("--resume continues a run: name its folder, --output RUN (e.g. runs/cpu-20261201-101500).")
    if "output_dir" in changes:
        raise GrpoKitError("The run folder is --output DIR (not --set output_dir=DIR).")
    info = runs.Run(args.output).info if args.resume else {}
    recorded = info.get("recipe") or {}
    changes = {**{k: recorded[k] for k in runs.RESUMABLE if k in recorded}, **changes}  # as recorded unless --set
    if recorded and args.preset is None:  # a resumed run goes on with the recipe and data it started with (run.json)
        # the folder may have moved since (Drive), so its recorded output_dir is not kept
        recipe = build_recipe({**{k: v for k, v in recorded.items() if k != "output_dir"}, **changes})
        print(f"recipe: {recipe.name}, as recorded in {Path(args.output) / 'run.json'}")
    elif args.preset in (None, "auto"):
        from grpo_kit.planner import auto_recipe

        name, reason = auto_recipe()
        recipe = load_recipe(name, **changes)
        print(f"recipe: {name} ({reason})")
    else:  # --preset NAME or --recipe PATH: one option, load_recipe takes either
        recipe = load_recipe(args.preset, **changes)
    result = train(
        recipe,
        data=args.data or info.get("data") or "gsm8k",
        output_dir=args.output,
        resume=args.resume,
        lenient=args.lenient,
    )
    from accelerate import PartialState

    from grpo_kit.plots import plot_metrics  # its analyses import transformers: after Unsloth, which train imported

    if PartialState().is_main_process:  # under accelerate launch: one summary and one plot
        # a finished run that only resumed changed nothing, not even the plot
        try:
            plot = None if result.already_finished else plot_metrics(result.metrics_path)  # <run>/plots/rewards.png
        except OSError as error:  # a full disk once the adapter is saved: the run is complete, only the plot is not
            plot = f"not written ({error.strerror or error}); grpo_kit.plots.plot_metrics draws it from metrics.jsonl"
        print("\n" + result.summary() + (f"\nplot: {plot}" if plot else ""))
    return 1 if result.failed else 0
