"""Recipes: flat YAML files of TRL fields, parsed by TRL's own argument machinery; one override route."""

from __future__ import annotations

import re

import pytest
import trl
import yaml

from grpo_kit.cli import main
from grpo_kit.config import load_recipe, parse_set, recipe_names, recipes_dir
from grpo_kit.errors import GrpoKitError

TIERS = ["cpu", "cpu-4bit", "cpu-answers", "rtx-8gb", "rtx-12gb", "t4-16gb", "l4-24gb", "a100-40gb", "a100-80gb"]


def test_every_shipped_recipe_is_trls_own_config_with_the_files_values():
    assert recipe_names() == TIERS  # smallest tier first: auto_recipe walks them in this order
    for name in TIERS:
        raw = yaml.safe_load((recipes_dir() / f"{name}.yaml").read_text())
        recipe = load_recipe(name)
        assert isinstance(recipe.grpo, trl.GRPOConfig) and isinstance(recipe.model, trl.ModelConfig)
        parsed = {**vars(recipe.kit), **vars(recipe.model), **vars(recipe.grpo)}
        # every value in the file arrives unchanged (enum-valued fields compare by their value)
        for key, value in raw.items():
            got = parsed[key]
            assert getattr(got, "value", got) == value, key


def test_t4_trains_fp16_because_a_t4_has_no_bf16():
    recipe = load_recipe("t4-16gb")
    assert (recipe.grpo.fp16, recipe.grpo.bf16) == (True, False)


def test_trl_decides_the_batch_rule():
    # TRL derives the generation batch from steps_per_generation: 1 x 1 x 4 = 4 completions = one group of G=4
    recipe = load_recipe("t4-16gb", gradient_accumulation_steps=3, steps_per_generation=4)
    assert recipe.grpo.generation_batch_size == 4 and recipe.prompts_per_step == 1
    with pytest.raises(
        GrpoKitError, match=r"t4-16gb: generation_batch_size \(3\) must be divisible by num_generations"
    ):
        load_recipe("t4-16gb", gradient_accumulation_steps=3)
    with pytest.raises(GrpoKitError, match="at least 2 generations"):
        load_recipe("cpu", num_generations=1)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"learning_rate": "fast"}, "learning_rate: invalid float value: 'fast'"),
        ({"backend": "jax"}, "backend: invalid choice: 'jax'"),
        ({"lora_target_modules": []}, "lora_target_modules: expected at least one argument"),
        ({"max_steps": [1, 2]}, "max_steps expects one value"),
        ({"learning_rate": float("nan")}, "learning_rate is nan; every number must be finite"),
        ({"learning_rat": 1e-5}, "unknown field.*learning_rat -> learning_rate"),
        ({"reward_weights": [1.0]}, "5 reward_funcs .* but 1 reward_weights"),
        ({"reward_funcs": ["corectness"], "reward_weights": [1.0]}, "unknown reward 'corectness'"),
        ({"max_completion_length": 4096}, "exceeds max_seq_length"),
        ({"use_peft": False}, "use_peft=False cannot work here: grpo-kit trains LoRA adapters"),
        ({"remove_unused_columns": True}, "the rewards read the answer column"),
    ],
)
def test_bad_values_are_refused_in_one_line_naming_the_field(change, message):
    with pytest.raises(GrpoKitError, match=message) as error:
        load_recipe("cpu", **change)
    assert "\n" not in str(error.value)


def test_values_the_user_sets_are_honoured_and_kit_defaults_fill_only_gaps():
    recipe = load_recipe("cpu", output_dir="/tmp/mine", reward_funcs="correctness,format", reward_weights=[2, 1])
    assert recipe.grpo.output_dir == "/tmp/mine"
    assert recipe.rewards == [("correctness", 2.0), ("format", 1.0)] and recipe.grpo.reward_weights == [2.0, 1.0]
    assert recipe.grpo.logging_nan_inf_filter is False and recipe.model.use_peft is True  # kit defaults, unset in file
    assert load_recipe("cpu", logging_nan_inf_filter=True).grpo.logging_nan_inf_filter is True  # the user's wins
    assert "logging_nan_inf_filter" not in load_recipe("cpu").values  # recorded values are the file's, not defaults


def test_replace_is_the_one_route_and_parses_again():
    base = load_recipe("cpu")
    changed = base.replace(lora_r=8, few_shot=1, beta=0.04)
    assert (changed.model.lora_r, changed.kit.few_shot, changed.grpo.beta) == (8, 1, 0.04)
    assert base.model.lora_r == 16  # recipes are values: the original is untouched
    with pytest.raises(GrpoKitError, match="invalid int value"):
        base.replace(lora_r="eight")


def brevity(completions, **kwargs):
    return [-len(str(c)) / 100 for c in completions]


def test_a_reward_function_is_named_as_trl_names_it():
    recipe = load_recipe("cpu", reward_funcs=[brevity, "correctness"], reward_weights=[0.5, 1.0])
    assert recipe.rewards == [("brevity", 0.5), ("correctness", 1.0)] and recipe.reward_funcs[0] is brevity


def test_a_users_recipe_file_loads_and_bad_files_say_what_to_fix(tmp_path):
    own = {**yaml.safe_load((recipes_dir() / "cpu.yaml").read_text()), "name": "mine", "max_steps": 2}
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(own))
    mine = load_recipe(str(path), max_steps=1)
    assert (mine.name, mine.grpo.max_steps) == ("mine", 1)
    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    with pytest.raises(GrpoKitError, match="not valid YAML"):
        load_recipe(str(tmp_path / "bad.yaml"))
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(GrpoKitError, match="must hold a mapping"):
        load_recipe(str(tmp_path / "list.yaml"))
    (tmp_path / "old.yaml").write_text(yaml.safe_dump({"model": {"id": "x"}, "grpo": {"beta": 0}}))
    with pytest.raises(GrpoKitError, match="unknown field"):
        load_recipe(str(tmp_path / "old.yaml"))
    with pytest.raises(GrpoKitError, match="Cannot read recipe file"):
        load_recipe(str(tmp_path / "absent.yaml"))


def test_unknown_recipe_name_lists_the_shipped_ones():
    with pytest.raises(GrpoKitError) as error:
        load_recipe("t4")
    assert all(name in str(error.value) for name in TIERS) and "--recipe" in str(error.value)


def test_set_values_are_read_as_json_else_text():
    assert parse_set(["beta=0.1", "loss_type=grpo", "log_completions=false", "reward_funcs=a,b"]) == {
        "beta": 0.1,
        "loss_type": "grpo",
        "log_completions": False,
        "reward_funcs": "a,b",
    }
    with pytest.raises(GrpoKitError, match="KEY=VALUE"):
        parse_set(["beta"])


def test_recipe_fields_are_not_command_line_flags(capsys):
    with pytest.raises(SystemExit) as exit_info:  # one command-line route for recipe fields: --set KEY=VALUE
        main(["train", "--preset", "cpu", "--max-steps", "3"])
    assert exit_info.value.code == 2 and "unrecognized arguments: --max-steps 3" in capsys.readouterr().err


def test_cli_set_output_dir_is_refused_in_favour_of_output(capsys):
    assert main(["train", "--preset", "cpu", "--set", "output_dir=/tmp/x"]) == 2
    assert "--output DIR" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"reward_weights": [1.0, float("nan"), 0.0]}, "reward_weights is nan; every number must be finite"),
        ({"reward_weights": [0.0] * 5}, "every reward weight is 0"),
        ({"learning_rate": 1e10}, "learning_rate=10000000000.0 cannot be meant"),
    ],
)
def test_values_no_run_can_mean_are_refused(changes, message):
    with pytest.raises(GrpoKitError, match=re.escape(message)):
        load_recipe("cpu", **changes)


@pytest.mark.parametrize("field", ["load_in_8bit", "use_dora", "bnb_4bit_quant_type", "attn_implementation"])
def test_a_model_field_the_loader_would_ignore_is_refused_not_dropped(field):
    value = {"load_in_8bit": True, "use_dora": True, "bnb_4bit_quant_type": "fp4", "attn_implementation": "eager"}
    with pytest.raises(GrpoKitError, match=f"{field} would be ignored: models load through FastLanguageModel"):
        load_recipe("cpu", **{field: value[field]})
