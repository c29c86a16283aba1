"""The kit's GPU-side wiring against the real Unsloth, in Unsloth's CPU-only CI mode: ``pytest -m real_unsloth``.

``make test`` runs these in a pytest process of their own (tests/conftest.py: Unsloth patches transformers, TRL and
PEFT at import). Real here: the pinned ``unsloth``'s import and its patched TRL classes (``trl.GRPOTrainer`` and
``trl.GRPOConfig`` become Unsloth's generated ones, through ``grpo_kit.models.prepare_backend``), the changes its
trainer makes to the config, and its training steps, on the tiny Llama of tests/conftest.py in float32.

Stood in, because Unsloth needs a GPU for it: ``FastLanguageModel.from_pretrained`` and ``get_peft_model`` (Unsloth
asks the device for its properties; its ``get_peft_model`` reads state its loader leaves on the model). The stand-in
loads with transformers + PEFT and gives the model Unsloth's own ``for_training``/``for_inference``, which its
trainer calls. tests/test_gpu_path.py fakes the rest that only a GPU runs: the loader's arguments on a T4, the vLLM
engine and its LoRA requests, server mode with 4-bit weights.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from transformers import TrainerCallback
from trl import GRPOConfig as TRL_GRPO_CONFIG  # taken at collection, before a test lets Unsloth replace them
from trl import GRPOTrainer as TRL_GRPO_TRAINER

from grpo_kit import models
from grpo_kit.config import load_recipe

pytestmark = pytest.mark.real_unsloth

ROOT = Path(__file__).resolve().parents[1]

#: The t4-16gb recipe made small enough for a CPU: the tiny model in float32, one question of G=4 answers of 8 tokens.
#: Everything else (loss, clipping, rewards, scheduler, optimizer, saving) is the T4's.
T4_ON_A_CPU = dict(
    load_in_4bit=False,
    fp16=False,
    use_cpu=True,
    max_completion_length=8,
    max_steps=1,
    use_vllm=False,
    log_completions=False,
    save_steps=1,
)


def pinned(name: str) -> str:
    """The version requirements-colab.txt pins ``name`` to (the Makefile installs the same)."""
    text = (ROOT / "requirements-colab.txt").read_text()
    return re.search(rf"^{re.escape(name)}==(\S+)", text, re.MULTILINE).group(1)


@pytest.fixture
def unsloth_loader(monkeypatch):
    """Unsloth's loader pair, stood in on a CPU (see the module's docstring); returns what each was asked."""
    from peft import LoraConfig, get_peft_model
    from unsloth import FastLanguageModel as Unsloth
    from unsloth.models.llama import FastLlamaModel

    asked = {"load": [], "lora": []}

    def from_pretrained(**kwargs):
        asked["load"].append(kwargs)
        if kwargs["fast_inference"]:
            pytest.fail("vLLM's engine was asked for on a machine without vLLM")
        return models._transformers_load(kwargs["model_name"], "float32", load_in_4bit=False)

    def lora(model, *, use_gradient_checkpointing, random_state, **kwargs):
        asked["lora"].append(kwargs)
        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **kwargs))
        model.for_training = functools.partial(FastLlamaModel.for_training, model)
        model.for_inference = functools.partial(FastLlamaModel.for_inference, model)
        return model

    monkeypatch.setattr(Unsloth, "from_pretrained", staticmethod(from_pretrained))
    monkeypatch.setattr(Unsloth, "get_peft_model", staticmethod(lora))
    return asked


def unsloths_config(cls) -> bool:
    """Unsloth's generated config: a subclass of TRL's ``GRPOConfig`` that takes TRL's name and module (for
    pickling)."""
    return cls.__mro__[1].__qualname__ == cls.__qualname__ == "GRPOConfig" and cls is not cls.__mro__[1]


class KeepArgs(TrainerCallback):
    """Keeps the trainer's ``args``: the config it really trains with."""

    def __init__(self):
        self.args = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.args = args


def test_unsloths_grpo_loss_gives_trls_value_on_notebook_02s_t4_batch(monkeypatch):
    """Notebook 02's T4 batch (dapo, beta 0, epsilon_high 0.28, the vLLM factor, 4 accumulation steps) through the
    loss Unsloth's trainer computes on a GPU: unsloth_zoo's grpo_compute_loss, called once per micro-batch with the
    arguments its trainer passes, against TRL's own GRPOTrainer._compute_loss (the notebook's trl_loss).

    bnpo is where they differ: Unsloth divides it, like dapo, by the whole generation batch's token count; TRL 1.15
    by each micro-batch's token count and the accumulation steps. No recipe uses bnpo."""
    import trl
    from test_teaching import notebook_namespace
    from unsloth_zoo.rl_replacements import grpo_compute_loss

    assert TRL_GRPO_TRAINER._compute_loss.__module__ == "trl.trainer.grpo_trainer"
    # The notebook runs on TRL's own classes, as in a process without Unsloth, whichever test patched them first;
    # its load_recipe must not patch them either (prepare_backend would, for every later test).
    monkeypatch.setattr(trl, "GRPOTrainer", TRL_GRPO_TRAINER)
    monkeypatch.setattr(trl, "GRPOConfig", TRL_GRPO_CONFIG)
    monkeypatch.setattr(models, "prepare_backend", lambda backend: "transformers")
    nb = notebook_namespace(every_cell=True)
    t4, steps = nb.t4, nb.t4.gradient_accumulation_steps
    assert (t4.loss_type, t4.beta, t4.epsilon_high, steps) == ("dapo", 0.0, 0.28, 4)

    def unsloth_loss(loss_type):
        total = 0.0
        for rows in torch.arange(nb.logps.size(0)).tensor_split(steps):  # one micro-batch's rows
            mask = nb.mask[rows]
            loss, *_ = grpo_compute_loss(
                None,
                nb.logps[rows],
                nb.old_logps[rows],
                nb.vllm_logps[rows],
                torch.zeros_like(mask).long(),
                mask,
                t4.beta,
                nb.t4_adv[rows],
                loss_type=loss_type,
                epsilon_low=t4.epsilon,
                epsilon_high=t4.epsilon_high,
                max_completion_length=nb.t4_args["max_completion_length"],
                delta=t4.delta,
                importance_sampling_level=t4.importance_sampling_level,
                num_items_in_batch=nb.mask.sum(),
                current_gradient_accumulation_steps=steps,
                steps_per_generation=t4.steps_per_generation,
                num_processes=1,
                use_vllm=t4.use_vllm,
                vllm_importance_sampling_correction=t4.vllm_importance_sampling_correction,
                vllm_importance_sampling_mode=t4.vllm_importance_sampling_mode,
                vllm_importance_sampling_clip_min=t4.vllm_importance_sampling_clip_min,
                vllm_importance_sampling_clip_max=t4.vllm_importance_sampling_clip_max,
                use_bias_correction_kl=t4.use_bias_correction_kl,
            )
            total += loss.item()
        return total

    def trls(loss_type):
        return nb.trl_loss(
            nb.logps,
            nb.old_logps,
            nb.t4_adv,
            nb.mask,
            loss_type,
            is_ratio=nb.t4_ratio,
            gradient_accumulation_steps=steps,
            **nb.t4_args,
        )

    for loss_type in ("dapo", "grpo", "dr_grpo"):
        assert unsloth_loss(loss_type) == pytest.approx(trls(loss_type), abs=1e-6), loss_type
    assert unsloth_loss("bnpo") == pytest.approx(trls("dapo"), abs=1e-6)
    assert abs(unsloth_loss("bnpo") - trls("bnpo")) > 0.5  # measured: -1.564376 against TRL's -0.666948


def test_the_pinned_unsloth_is_imported_and_its_trainer_replaces_trls():
    import trl
    import unsloth

    assert unsloth.__version__ == pinned("unsloth")
    assert models.prepare_backend("auto") == "unsloth"  # Unsloth's CPU mode counts as its backend
    assert trl.GRPOTrainer.__name__ == "UnslothGRPOTrainer" and unsloths_config(trl.GRPOConfig)
    assert type(load_recipe("t4-16gb").grpo) is trl.GRPOConfig  # the recipe builds Unsloth's config


@pytest.mark.parametrize("name", ["cpu", "rtx-8gb", "rtx-12gb", "t4-16gb", "l4-24gb", "a100-40gb", "a100-80gb"])
def test_each_recipe_builds_unsloths_config_with_its_own_values(name):
    """Unsloth's GRPOConfig replaces TRL defaults (no vLLM importance-sampling correction; epsilon_high 0.28 and
    truncated completions masked for an explicit dapo where they are unset). A recipe trains the values it states on
    every machine, and one silent on epsilon_high gets TRL's default (epsilon), as on a CPU without Unsloth."""
    recipe = load_recipe(name)
    assert unsloths_config(type(recipe.grpo))
    stated = {key: value for key, value in recipe.values.items() if hasattr(recipe.grpo, key)}
    assert {key: getattr(recipe.grpo, key) for key in stated} == stated
    if "epsilon_high" not in stated:
        assert recipe.grpo.loss_type == "dapo" and recipe.grpo.epsilon_high == recipe.grpo.epsilon == 0.2


def test_train_runs_the_t4_recipe_through_unsloths_trainer_and_resumes(unsloth_loader, tiny_model_dir, tmp_path):
    """What ``grpo-kit train --preset t4-16gb`` does on a GPU, through Unsloth's own trainer: one step, then a resume
    from its checkpoint to a second step."""
    from grpo_kit.train import train

    recipe = load_recipe("t4-16gb", model_name_or_path=str(tiny_model_dir), **T4_ON_A_CPU)
    keep = KeepArgs()
    result = train(recipe, data="sample", output_dir=tmp_path / "run", callbacks=(keep,))
    assert result.steps == 1 and (result.adapter_dir / "adapter_model.safetensors").is_file()
    assert unsloths_config(type(keep.args))
    assert (keep.args.loss_type, keep.args.epsilon_high, keep.args.beta) == ("dapo", 0.28, 0.0)  # the T4's, kept
    (load,) = unsloth_loader["load"]
    assert load["max_lora_rank"] == 32 and unsloth_loader["lora"][0]["r"] == 32

    resumed = train(recipe.replace(max_steps=2), data="sample", output_dir=tmp_path / "run", resume=True)
    assert resumed.steps == 2
    assert json.loads((tmp_path / "run" / "run.json").read_text())["resumed_from_step"] == 1


def test_seed_grpo_scales_the_rewards_unsloths_trainer_learns_from(unsloth_loader, tiny_model_dir, tmp_path):
    """SEED-GRPO through Unsloth's patched trainer: a reward of 1 for every completion, in groups whose answers all
    differ (a random model writes no number: every answer a cluster of its own, semantic entropy 1), reaches the
    trainer as 1 / (1 + alpha * 1) = 0.5 at alpha 1, and the semantic entropy is logged as a metric."""
    from grpo_kit.runs import read_metrics
    from grpo_kit.train import train

    def ones(completions, **kwargs):
        return [1.0] * len(completions)

    recipe = load_recipe(
        "t4-16gb",
        model_name_or_path=str(tiny_model_dir),
        **T4_ON_A_CPU,
        reward_funcs=[ones, "semantic_entropy"],
        reward_weights=[1.0, 0.0],
        seed_grpo_alpha=1.0,
        scale_rewards="none",
    )
    result = train(recipe, data="sample", output_dir=tmp_path / "run")
    (row,) = read_metrics(result.metrics_path)
    assert row["semantic_entropy"] == 1.0 and row["reward/ones"] == 1.0 == row["reward"]  # what the reward gave
    assert row["reward/seed_grpo/ones"] == pytest.approx(0.5) == row["seed_grpo/reward"]  # what trained


def test_a_colocated_vllm_that_cannot_be_imported_trains_without_it(
    unsloth_loader, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """Colab with a CUDA 12 torch: the installer leaves vLLM out. The T4 recipe asks for it; the run trains without
    it through Unsloth's trainer (which turns use_vllm on for any model carrying a ``vllm_engine`` attribute), and
    resumes so."""
    from grpo_kit.train import train

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    # a T4 to the device check (on a CPU it refuses vLLM before anything is imported)
    monkeypatch.setattr(models, "detect_device", lambda: models.DeviceInfo("cuda", "Tesla T4", 14.7, False))
    recipe = load_recipe("t4-16gb", model_name_or_path=str(tiny_model_dir), **{**T4_ON_A_CPU, "use_vllm": True})
    keep = KeepArgs()
    result = train(recipe, data="sample", output_dir=tmp_path / "run", callbacks=(keep,))
    assert result.steps == 1 and keep.args.use_vllm is False
    assert [load["fast_inference"] for load in unsloth_loader["load"]] == [False]
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("vLLM off:")]
    assert "cannot be imported" in line and "restart the runtime" in line

    resumed = train(
        recipe.replace(max_steps=2), data="sample", output_dir=tmp_path / "run", resume=True, callbacks=(keep,)
    )  # after a disconnect, on the same runtime: from its checkpoint, without vLLM
    assert resumed.steps == 2 and keep.args.use_vllm is False


def test_notebook_00_trains_its_t4_values_with_unsloths_trainer_and_says_what_unsloth_changed(
    unsloth_loader, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """Notebook 00's values, model, data, reward, trainer and train cells with the T4 run (scaled to a CPU): the
    trainer is Unsloth's, one step trains, and the trainer cell names each value Unsloth's trainer changed. It does
    change one here: the recipe trains in float32 (fp16 and bf16 off) and the stand-in loader does not mark the model
    as float32 on request as Unsloth's own does, so Unsloth's trainer turns on fp16 mixed precision."""
    import trl

    import grpo_kit.colab

    monkeypatch.setattr(grpo_kit.colab, "workspace", lambda drive=True: tmp_path)
    notebook = ROOT / "notebooks" / "00_train_grpo_colab.ipynb"
    cells = {c["id"]: "".join(c["source"]) for c in json.loads(notebook.read_text())["cells"]}
    changes = {**T4_ON_A_CPU, "model_name_or_path": str(tiny_model_dir), "use_vllm": True}
    kernel = types.ModuleType("notebook_00")  # the cells' functions (its rewards) are importable, as from __main__
    monkeypatch.setitem(sys.modules, kernel.__name__, kernel)
    namespace = vars(kernel)
    namespace.update(TIER="t4-16gb", MODEL="Llama-3.1-8B", CHANGES=changes, DATA="sample", CPU_RUN={}, RESTART=False)
    monkeypatch.setitem(sys.modules, "vllm", None)  # and vLLM missing, as on a CUDA 12 Colab
    for cell in ("c06", "c08", "c10", "c12a", "c12", "c13c", "c16"):
        exec(compile(cells[cell], cell, "exec"), namespace)
    trainer, recipe = namespace["trainer"], namespace["recipe"]
    assert isinstance(trainer, trl.GRPOTrainer) and type(trainer).__name__ == "UnslothGRPOTrainer"
    assert trainer.state.global_step == 1 and trainer.args.use_vllm is False
    changed = {
        key
        for key, value in recipe.values.items()
        if hasattr(trainer.args, key) and getattr(trainer.args, key) != value
    }
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("trainer.args")]
    assert "fp16" in changed and line.startswith("trainer.args changed")
    assert all(f"'{key}'" in line for key in changed) and "'fp16': (False, True)" in line

    # A crash before the first checkpoint, then the cells run again (RESTART still False): the run starts over from
    # step 0 in its folder, the attempt's files set aside, nothing deleted.
    run_dir = namespace["run_dir"]
    for folder in (run_dir / "checkpoint-1", run_dir / "adapter"):
        shutil.rmtree(folder)
    for cell in ("c16",):
        exec(compile(cells[cell], cell, "exec"), namespace)
    assert namespace["trainer"].state.global_step == 1 and (run_dir / "adapter").is_dir()
    (aside,) = run_dir.glob("attempt.old-*")
    assert (aside / "run.json").is_file() and (aside / "metrics.jsonl").is_file()
