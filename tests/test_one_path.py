"""One training path: notebook 00, notebook 03 and `grpo-kit train` build the same GRPOTrainer with the same recipe."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest
import trl

from grpo_kit.cli import main
from grpo_kit.rewards import REWARDS

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
SMOKE = str(Path(__file__).resolve().parent / "smoke.yaml")
#: Fields that name the run folder: each run has its own.
PER_RUN = {"output_dir", "logging_dir", "run_name"}


class Built(Exception):
    """Raised instead of training: the trainer as built is what these tests compare."""


@pytest.fixture
def built(monkeypatch, tmp_path):
    trainers = []

    def record(self, *args, **kwargs):
        trainers.append(self)
        raise Built

    monkeypatch.setattr(trl.GRPOTrainer, "train", record)
    monkeypatch.setenv("GRPO_KIT_RECIPE", SMOKE)
    import grpo_kit.colab

    monkeypatch.setattr(grpo_kit.colab, "workspace", lambda: tmp_path / "notebook")
    return trainers


def run_notebook(name: str, module: str) -> types.ModuleType:
    """Execute a notebook's code cells in order, as a module named ``module``, until its trainer starts training."""
    cells = [c for c in json.loads((NOTEBOOKS / name).read_text())["cells"] if c["cell_type"] == "code"]
    namespace = types.ModuleType(module)
    sys.modules[module] = namespace  # a reward defined in a cell is recorded (and imported) as module:function
    for cell in cells:
        try:
            exec(compile("".join(cell["source"]), f"{name}", "exec"), namespace.__dict__)
        except Built:
            return namespace
    pytest.fail(f"{name} never started training")


def same_trainer(a, b) -> None:
    args_a, args_b = ({k: v for k, v in t.args.to_dict().items() if k not in PER_RUN} for t in (a, b))
    assert args_a == args_b
    assert a.reward_func_names == b.reward_func_names
    assert a.reward_weights.tolist() == b.reward_weights.tolist()
    assert [type(c).__name__ for c in a.callback_handler.callbacks] == [
        type(c).__name__ for c in b.callback_handler.callbacks
    ]
    assert len(a.train_dataset) == len(b.train_dataset) and a.train_dataset[0]["prompt"] == b.train_dataset[0]["prompt"]


@pytest.mark.slow
def test_notebook_00_builds_the_trainer_grpo_kit_train_builds(built, tmp_path):
    notebook = run_notebook("00_train_grpo_colab.ipynb", "nb00")
    # the cell's own reward, named as TRL names it, is imported by the command line from its module
    rewards = ",".join(name if name in REWARDS else f"nb00:{name}" for name, _ in notebook.recipe.rewards)
    weights = json.dumps([weight for _, weight in notebook.recipe.rewards])
    assert rewards.endswith("semantic_entropy,reflection_rate,nb00:shows_calculation")
    with pytest.raises(Built):
        main(
            [
                "train",
                "--recipe",
                SMOKE,
                "--data",
                "sample",
                "--output",
                str(tmp_path / "cli"),
                "--set",
                f"reward_funcs={rewards}",
                "--set",
                f"reward_weights={weights}",
            ]
        )
    same_trainer(built[0], built[1])
    assert built[0].reward_func_names[-1] == "shows_calculation"


@pytest.mark.slow
def test_notebook_03_trains_through_the_same_calls(built, tmp_path):
    run_notebook("03_train.ipynb", "nb03")
    with pytest.raises(Built):
        main(["train", "--recipe", SMOKE, "--data", "sample", "--output", str(tmp_path / "cli")])
    same_trainer(built[0], built[1])


# ------------------------------------------------------------------------------------------------ notebook 00's values


def notebook_00(*cell_ids: str, **variables) -> dict:
    """Run the named code cells of notebook 00, in order, in one namespace that starts with ``variables``."""
    cells = {
        c["id"]: "".join(c["source"])
        for c in json.loads((NOTEBOOKS / "00_train_grpo_colab.ipynb").read_text())["cells"]
    }
    namespace = dict(variables)
    for cell_id in cell_ids:
        exec(compile(cells[cell_id], f"notebook 00, cell {cell_id}", "exec"), namespace)
    return namespace


def parsed(recipe) -> tuple:
    from dataclasses import asdict

    kit = {k: v for k, v in asdict(recipe.kit).items() if k not in {"name", "description", "vram_gb"}}
    return {k: v for k, v in recipe.grpo.to_dict().items() if k not in PER_RUN}, asdict(recipe.model), kit


@pytest.mark.parametrize("tier", ["rtx-8gb", "rtx-12gb", "t4-16gb", "l4-24gb", "a100-40gb", "a100-80gb"])
def test_notebook_00s_written_out_values_are_the_recipe_grpo_kit_train_reads(tier, monkeypatch, tmp_path, capsys):
    import grpo_kit.colab
    from grpo_kit.config import load_recipe

    monkeypatch.setattr(grpo_kit.colab, "workspace", lambda: tmp_path)
    settings = notebook_00("c04")
    notebook = notebook_00("c06", **{**settings, "CPU_RUN": {}, "TIER": tier})
    assert parsed(notebook["recipe"]) == parsed(load_recipe(tier))
    assert notebook["recipe"].grpo.output_dir == str(tmp_path / "runs" / f"{tier}-colab")  # not 03's runs/<tier>


def test_an_8gb_card_trains_its_small_model_unless_another_is_chosen(monkeypatch, tmp_path):
    import grpo_kit.colab

    monkeypatch.setattr(grpo_kit.colab, "workspace", lambda: tmp_path)
    settings = {**notebook_00("c04"), "CPU_RUN": {}, "TIER": "rtx-8gb"}
    assert notebook_00("c06", **settings)["recipe"].name == "rtx-8gb"  # MODEL "auto": Qwen2.5-1.5B
    chosen = notebook_00("c06", **{**settings, "MODEL": "Llama-3.1-8B"})["recipe"]
    assert chosen.name == "rtx-8gb-llama-3.1-8b" and "Llama-3.1-8B" in chosen.model.model_name_or_path


def test_each_model_choice_on_a_t4_fits_the_card(monkeypatch, tmp_path):
    import grpo_kit.colab
    from grpo_kit.planner import estimate_vram

    monkeypatch.setattr(grpo_kit.colab, "workspace", lambda: tmp_path)
    settings = notebook_00("c04")
    notebook = notebook_00("c06", **{**settings, "CPU_RUN": {}, "TIER": "t4-16gb"})
    for model in notebook["MODELS"]:
        chosen = notebook_00("c06", **{**settings, "CPU_RUN": {}, "TIER": "t4-16gb", "MODEL": model})["recipe"]
        assert chosen.model.model_name_or_path.endswith("-bnb-4bit")
        assert estimate_vram(chosen, card_gb=14.7).fits(), model  # the T4 shows 14.7 GiB


def test_notebook_00_on_a_cpu_runs_the_recipe_that_learns_unless_ci_asks_for_smoke_sizes(monkeypatch):
    monkeypatch.delenv("GRPO_KIT_RECIPE", raising=False)
    assert notebook_00("c04", "c04b")["TIER"] == "cpu"
    monkeypatch.setenv("GRPO_KIT_RECIPE", SMOKE)
    assert notebook_00("c04", "c04b")["TIER"] == SMOKE


@pytest.mark.parametrize(("recipe", "budget"), [("cpu", 341), ("t4-16gb", 120)])  # about half the prompts fit
def test_notebook_00s_prompts_are_the_ones_grpo_kit_train_builds(recipe, budget):
    """Worked examples and a prefill (cpu) or the question alone (t4); the budget leaves about half the prompts out."""
    from grpo_kit.config import load_recipe
    from grpo_kit.data import format_for_grpo, load_gsm8k
    from grpo_kit.models import load_tokenizer, resolve_model_id

    kit = load_recipe(recipe, max_prompt_length=budget).kit
    tokenizer = load_tokenizer(resolve_model_id("embedded:smollm2-135m"))
    notebook = notebook_00("c10", kit=kit, tokenizer=tokenizer, DATA="sample")
    expected, too_long = format_for_grpo(
        load_gsm8k("sample"),
        tokenizer,
        few_shot=kit.few_shot,
        prefill=kit.prefill,
        max_prompt_tokens=kit.max_prompt_length,
        system_prompt=kit.system_prompt,
    )
    assert notebook["train_set"]["prompt"] == expected["prompt"]
    assert notebook["train_set"]["prefill"] == expected["prefill"]
    assert 0 < too_long < len(load_gsm8k("sample"))


def test_notebook_00_names_the_choices_when_the_tier_or_model_is_not_one_of_them(monkeypatch, tmp_path):
    import grpo_kit.colab

    monkeypatch.setattr(grpo_kit.colab, "workspace", lambda: tmp_path)
    settings = notebook_00("c04")
    from grpo_kit.errors import GrpoKitError

    with pytest.raises(GrpoKitError, match=r"Unknown recipe 't4'. Shipped: .*t4-16gb"):
        notebook_00("c06", **{**settings, "TIER": "t4"})
    with pytest.raises(ValueError, match=r"MODEL 'llama': choose from \['auto', 'Llama-3.1-8B'"):
        notebook_00("c06", **{**settings, "TIER": "t4-16gb", "MODEL": "llama"})


# ------------------------------------------------------------------------------------------------ notebook 00's group


def group_table(out: str) -> tuple[list[tuple[float, float]], float]:
    """(reward, advantage) per answer, and frac_reward_zero_std, from what notebook 00's show_group printed."""
    lines = out[out.index(" reward  advantage  answer") :].splitlines()
    rows = []
    for line in lines[1:]:
        if line.startswith("frac_reward_zero_std"):
            return rows, float(line.split()[1])
        numbers = line[: min(i for i in (line.find(" '"), line.find(' "')) if i >= 0)].split()
        rows.append((float(numbers[-2]), float(numbers[-1])))
    raise AssertionError(f"no frac_reward_zero_std line in {out!r}")


@pytest.mark.slow
def test_notebook_00_shows_one_group_with_its_rewards_and_advantages(monkeypatch, tmp_path, capsys):
    """G answers, their rewards and TRL's group-relative advantages: they sum to 0, follow the rewards' order, and
    are all 0 exactly when every reward is equal, which the frac_reward_zero_std line then says."""
    import grpo_kit.colab

    monkeypatch.setenv("GRPO_KIT_RECIPE", SMOKE)
    monkeypatch.setattr(grpo_kit.colab, "workspace", lambda: tmp_path)
    kernel = types.ModuleType("nb00_group")  # the cells' rewards are importable, as from __main__
    monkeypatch.setitem(sys.modules, kernel.__name__, kernel)
    cells = {
        c["id"]: "".join(c["source"])
        for c in json.loads((NOTEBOOKS / "00_train_grpo_colab.ipynb").read_text())["cells"]
    }
    namespace = vars(kernel)
    for cell_id in (
        "c04",
        "c04b",
        "c06",
        "c08",
        "c10",
        "c12a",
        "c12",
        "c13c",
        "c14h",
    ):  # settings to rewards, then the group
        exec(compile(cells[cell_id], f"notebook 00, cell {cell_id}", "exec"), namespace)
    rows, zero_std = group_table(capsys.readouterr().out)
    assert len(rows) == namespace["config"].num_generations == 8
    rewards, advantages = zip(*rows, strict=True)
    assert sum(advantages) == pytest.approx(0.0, abs=0.05)
    assert all((r1 - r2) * (a1 - a2) >= 0 for r1, a1 in rows for r2, a2 in rows)  # a higher reward, a higher advantage
    assert zero_std == float(len(set(rewards)) == 1)
    assert zero_std == 0.0 or set(advantages) == {0.0}


def test_notebook_00s_literal_grpo_config_is_the_t4_recipe(monkeypatch, tmp_path):
    """Every keyword of the GRPOConfig(...) call written out in notebook 00 is the value recipes/t4-16gb.yaml resolves
    to, and every GRPOConfig field the file sets is written out; built with TRL, it is the recipe's GRPOConfig."""
    import ast

    import grpo_kit.colab
    from grpo_kit.config import load_recipe

    monkeypatch.setattr(grpo_kit.colab, "workspace", lambda: tmp_path)
    cells = {
        c["id"]: "".join(c["source"])
        for c in json.loads((NOTEBOOKS / "00_train_grpo_colab.ipynb").read_text())["cells"]
    }
    (call,) = [
        node
        for node in ast.walk(ast.parse(cells["c13c"]))
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "GRPOConfig"
    ]
    written = {kw.arg: kw.value for kw in call.keywords}
    run = notebook_00("c06", **{**notebook_00("c04"), "TIER": "t4-16gb"})
    expressions = {"output_dir": run["run_dir"], "run_name": run["run_dir"].name}  # the run folder's, per run
    t4 = load_recipe("t4-16gb", output_dir=str(run["run_dir"]), run_name=run["run_dir"].name)
    values = {}
    for key, node in written.items():
        if key == "reward_weights":  # the recipe's weights, and 1.0 for the notebook's own reward (cell c12)
            assert ast.unparse(node) == "recipe.grpo.reward_weights"
            values[key] = t4.grpo.reward_weights
        elif key in expressions:
            values[key] = eval(compile(ast.Expression(node), "c13c", "eval"), {"run_dir": run["run_dir"], "str": str})
        else:
            values[key] = ast.literal_eval(node)
        assert values[key] == getattr(t4.grpo, key), key
    assert {k for k in t4.values if hasattr(t4.grpo, k)} - set(written) == set()  # none of the file's left out
    built = trl.GRPOConfig(**values, use_cpu=True)  # this machine's only kit default: no CUDA
    assert built.to_dict() == t4.grpo.to_dict()
