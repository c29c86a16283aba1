"""Training, one linear path: recipe -> model -> prompts -> rewards -> ``GRPOConfig`` -> ``GRPOTrainer`` -> adapter.

``train`` reads like the notebook cell that calls it (open-r1's ``grpo.py`` is the model). What keeps a run safe
plugs in from ``grpo_kit.machinery``: the run folder, its lock and resume (``runs``), ``metrics.jsonl``
(``metrics``), numeric and data guards (``guards``) and sampled completions (``watch``) as trainer callbacks.

    from grpo_kit.recipes import load_recipe
    from grpo_kit.train import train
    result = train(load_recipe("cpu", max_steps=2), data="sample")
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from grpo_kit.errors import GrpoKitError
from grpo_kit.machinery import runs


@dataclass(frozen=True)
class TrainResult:
    """What a finished run left behind and how it went."""

    run_dir: Path
    adapter_dir: Path
    metrics_path: Path
    steps: int
    seconds: float
    reward_first: float | None  # mean reward over the first few logged steps
    reward_last: float | None  # mean reward over the last few logged steps
    history: list[dict] = field(default_factory=list, repr=False)
    already_finished: bool = False  # ``resume`` found the run at max_steps: nothing was trained or changed

    def summary(self) -> str:
        start = "n/a" if self.reward_first is None else f"{self.reward_first:.3f}"
        end = "n/a" if self.reward_last is None else f"{self.reward_last:.3f}"
        head = ""
        if self.already_finished:
            head = (f"run already finished: step {self.steps} of {self.steps}, nothing was changed (pass a larger "
                    "--set max_steps=N with --resume to train on)\n")
        return (
            head + f"steps: {self.steps}   time: {self.seconds:.0f} s   reward: {start} -> {end}\n"
            f"adapter: {self.adapter_dir}\nmetrics: {self.metrics_path}"
        )


@runs.releases_run_locks
def train(
    recipe,
    *,
    data: str = "gsm8k",
    dataset=None,
    output_dir: str | os.PathLike | None = None,
    resume: bool = False,
    overrides: dict[str, Any] | None = None,
    callbacks: tuple = (),
    curriculum=None,
    lenient: bool = False,
    show_completions: int = 0,
) -> TrainResult:
    """Train a GRPO LoRA adapter with ``recipe`` (a ``grpo_kit.recipes.Recipe``) on ``data`` prompts.

    ``overrides`` are ``--set`` keys and values (``{"max_steps": 2, "rewards": [my_reward, "correctness"]}``).
    ``dataset`` (question/answer columns) replaces ``data``. ``resume=True`` continues from the newest complete
    checkpoint in ``output_dir``; without it a used run folder is refused, never overwritten. ``curriculum``
    (``grpo_kit.machinery.curriculum.Curriculum``) orders/filters the prompts; ``lenient`` skips bad data rows (counted);
    ``show_completions=N`` prints sampled completions with their rewards every N steps. Under ``accelerate launch``
    every process runs this; only the main one writes run files.
    """
    from grpo_kit import models
    from grpo_kit.machinery.backend import prepare_backend, without_missing_vllm
    from grpo_kit.machinery.recipe_checks import check_grpo_fields
    from grpo_kit.machinery.vllm_server import check_weight_sync

    # --- Recipe, then the backend: Unsloth is imported before TRL/transformers/PEFT (it patches them at import)
    recipe = recipe.with_overrides(overrides)
    if curriculum is not None:  # no shuffling when the order matters (unless --set says otherwise)
        recipe = recipe.with_overrides({k: v for k, v in curriculum.config_overrides().items() if k not in (overrides or {})})
    check_weight_sync(recipe)  # server mode + 4-bit weights cannot work: refused before anything loads
    backend = prepare_backend(recipe)
    recipe = without_missing_vllm(check_grpo_fields(recipe))  # TRL's field names and types, now importable

    import trl

    from grpo_kit.data import format_for_grpo, load_gsm8k
    from grpo_kit.machinery.compat import ensure_logprob_kernel
    from grpo_kit.machinery.guards import (
        NumericsGuard,
        check_dataset_size,
        check_saved_adapter,
        guard_numerics,
        guard_rewards,
    )
    from grpo_kit.machinery.metrics import make_metrics_logger, truncate_metrics
    from grpo_kit.machinery.planner import check_device
    from grpo_kit.machinery.reward_specs import parse_reward_spec
    from grpo_kit.machinery.runtime import detect_device, set_torch_threads
    from grpo_kit.machinery.watch import CompletionSamples
    from grpo_kit.rewards import format_rate

    set_torch_threads()
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # TRL pings telemetry with HF_TOKEN in the request
    ensure_logprob_kernel()  # TRL 1.15 on a machine without Triton (any CPU): see grpo_kit/machinery/compat.py
    check_device(recipe, detect_device())  # GPU-only settings on a CPU, bf16 on a T4: refused; VRAM: warned

    # --- Run folder, config and data: every check runs before any weights load
    run_dir = Path(output_dir or Path("runs") / f"{recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}")
    config = build_grpo_config(recipe, run_dir)
    source = data if dataset is None else "the dataset passed to train()"
    if dataset is None:  # an offline Hub or a bad file is reported here
        dataset = load_gsm8k(data, split="train", lenient=lenient)
    check_dataset_size(len(dataset), config, source=source)
    if recipe.vllm_server:
        from grpo_kit.machinery.vllm_server import check_server

        check_server(recipe, wait=config.vllm_server_timeout)
    is_main = config.process_index == 0
    checkpoint = runs.prepare_run_dir(run_dir, resume, is_main=is_main)
    runs.wait_for_everyone(config)  # every process has checked the run folder before any process writes in it
    if checkpoint is not None and runs.checkpoint_step(checkpoint) >= recipe.grpo["max_steps"]:
        adapter = runs.restore_final_adapter(run_dir, checkpoint, is_main)  # the Trainer would run one step more
        return _result(run_dir, adapter, runs.checkpoint_step(checkpoint), 0.0, already_finished=True)

    # --- Model: Unsloth's FastLanguageModel on a GPU, transformers + PEFT otherwise; LoRA either way
    policy, tokenizer = models.load_model(recipe)
    if backend == "unsloth" and recipe.vllm_colocated and getattr(policy, "vllm_engine", None) is None:
        recipe = recipe.with_overrides(use_vllm=False)  # its engine did not start (load_model said why)
        config = build_grpo_config(recipe, run_dir)

    # --- Prompts: chat template, worked examples, prefill; over-long prompts dropped (and counted)
    prompt = recipe.prompt
    train_set, n_long = format_for_grpo(dataset, tokenizer, few_shot=prompt["few_shot"], prefill=prompt["prefill"],
                                        max_prompt_tokens=prompt["max_prompt_length"],
                                        **({"system_prompt": prompt["system_prompt"]} if "system_prompt" in prompt else {}))
    curriculum_report = None
    if curriculum is not None:
        train_set, curriculum_report = curriculum.apply(train_set)
    check_dataset_size(len(train_set), config, source=source, filtered=n_long, max_prompt_tokens=prompt["max_prompt_length"])

    # --- Rewards: the recipe's, plus format_rate (weight 0: a metric); each guarded against NaN and exceptions
    funcs, _, names = parse_reward_spec(list(recipe.rewards))
    samples = CompletionSamples(every=show_completions)
    reward_funcs = guard_rewards(samples.wrap([*funcs, format_rate]), run_dir)

    # --- Record the run (run.json; metrics after a resumed checkpoint are cut, they will be logged again)
    metrics_path = run_dir / "metrics.jsonl"
    if is_main:
        if checkpoint is not None:
            truncate_metrics(metrics_path, runs.checkpoint_step(checkpoint))
        info = runs.run_info(recipe, data=data, overrides=overrides or {}, reward_names=names, curriculum=curriculum_report)
        (run_dir / "run.json").write_text(json.dumps(info, indent=2, default=str), encoding="utf-8")

    # --- The trainer (looked up now: on the Unsloth backend this is Unsloth's patched GRPOTrainer)
    trainer = trl.GRPOTrainer(
        model=policy,
        reward_funcs=reward_funcs,
        args=config,
        train_dataset=train_set,
        processing_class=tokenizer,
        callbacks=[make_metrics_logger(metrics_path), NumericsGuard(run_dir), samples, *callbacks],
    )
    start = time.time()
    with guard_numerics(trainer, run_dir):  # NaN/inf loss, grad_norm or reward: a clear error naming the step
        trainer.train(resume_from_checkpoint=str(checkpoint) if checkpoint else None)
    seconds = time.time() - start

    # --- Save: the adapter is written atomically and must be finite before the run counts as done
    adapter_dir = runs.save_adapter(trainer, tokenizer, run_dir)
    if is_main:
        check_saved_adapter(adapter_dir, run_dir, trainer.state.global_step)
    runs.write_rank_digest(trainer, run_dir)
    return _result(run_dir, adapter_dir, trainer.state.global_step, seconds)


def build_grpo_config(recipe, output_dir: str | os.PathLike, *, on_cpu: bool | None = None):
    """``GRPOConfig(**recipe.grpo)`` plus what the kit sets: output folder, precision flags from ``model.precision``,
    reward weights (+ 0 for the ``format_rate`` metric), CPU switches. Kit defaults (reporting, saving) come first,
    so a recipe or ``--set`` may change them."""
    import torch
    import trl

    if on_cpu is None:
        on_cpu = not torch.cuda.is_available()
    defaults = {
        "save_strategy": "steps",
        "report_to": ["tensorboard"] if _has_tensorboard() else "none",
        "remove_unused_columns": False,  # rewards read the answer and prefill columns
        "dataloader_num_workers": 0,
        "logging_nan_inf_filter": False,  # a NaN/inf loss must reach the logs, where NumericsGuard stops the run
        "use_cpu": on_cpu,
    }
    fixed = {
        "output_dir": str(output_dir),
        **precision_flags(recipe.model["precision"], on_cpu),
        "reward_weights": [float(w) for _, w in recipe.rewards] + [0.0],
    }
    if recipe.vllm_server:
        from grpo_kit.machinery.vllm_server import server_url

        fixed["vllm_server_base_url"] = server_url(recipe)
    if on_cpu:
        fixed["gradient_checkpointing"] = False  # only slows a CPU run
    return trl.GRPOConfig(**{**defaults, **recipe.grpo, **fixed})


def precision_flags(precision: str, on_cpu: bool) -> dict[str, Any]:
    """GRPOConfig flags for a precision name. TRL 1.x turns bf16 on by default, which breaks CPUs and T4s.

    >>> precision_flags("fp16", on_cpu=False)
    {'bf16': False, 'fp16': True}
    """
    if precision not in {"fp32", "fp16", "bf16"}:
        raise GrpoKitError(f"Unknown precision '{precision}': use fp32, fp16 or bf16.")
    if on_cpu and precision != "fp32":
        raise GrpoKitError(f"Precision {precision} needs a GPU; on CPU use the 'cpu' recipe (fp32).")
    return {"bf16": precision == "bf16", "fp16": precision == "fp16"}


def _has_tensorboard() -> bool:
    import importlib.util

    return importlib.util.find_spec("tensorboard") is not None


def _result(run_dir: Path, adapter_dir: Path, steps: int, seconds: float, *, already_finished: bool = False) -> TrainResult:
    from grpo_kit.machinery.metrics import read_metrics, reward_first_last

    metrics_path = run_dir / "metrics.jsonl"
    history = read_metrics(metrics_path)
    first, last = reward_first_last(history)
    return TrainResult(run_dir=run_dir, adapter_dir=adapter_dir, metrics_path=metrics_path, steps=steps,
                       seconds=seconds, reward_first=first, reward_last=last, history=history,
                       already_finished=already_finished)


# --------------------------------------------------------------------------------------------- CLI
