"""Recipes: YAML files drive every tier; `--set` is the one override route; TRL accepts every grpo section verbatim."""

from __future__ import annotations

import json

import pytest
import yaml

from grpo_kit.cli import main, set_hint
from grpo_kit.errors import GrpoKitError
from grpo_kit.machinery.embedded import EMBEDDED_ID
from grpo_kit.machinery.planner import FALLBACK_MODEL_4BIT, auto_recipe, estimate_vram
from grpo_kit.machinery.presets_table import presets_json, presets_table
from grpo_kit.machinery.recipe_checks import LOSS_VARIANTS, check_grpo_fields
from grpo_kit.machinery.runtime import DeviceInfo
from grpo_kit.recipes import RECIPES, load_recipe, recipes_dir, recorded_settings

GPU_RECIPES = [r for r in RECIPES.values() if r.vram_gb > 0]
TIERS = {"cpu", "cpu-answers", "t4-16gb", "l4-24gb", "a100-40gb", "a100-80gb"}
#: Every field `grpo-kit presets --json` printed before recipes were YAML files: scripts read these names.
PRESET_JSON_FIELDS = {
    "name", "vram_gb", "description", "model", "load_in_4bit", "max_seq_length", "max_prompt_length",
    "max_completion_length", "lora_rank", "lora_alpha", "lora_targets", "num_generations",
    "per_device_train_batch_size", "gradient_accumulation_steps", "optim", "precision", "learning_rate",
    "lr_scheduler_type", "warmup_steps", "weight_decay", "max_grad_norm", "beta", "loss_type", "scale_rewards",
    "temperature", "mask_truncated_completions", "use_vllm", "vllm_gpu_memory_utilization", "gradient_checkpointing",
    "max_steps", "save_steps", "logging_steps", "rewards", "few_shot", "prefill", "seed", "vllm_mode", "backend",
    "generation_batch_size", "prompts_per_step", "estimate_gib",
}  # fmt: skip


def test_each_tier_is_one_yaml_file_with_the_four_sections():
    files = {path.stem: path for path in recipes_dir().glob("*.yaml")}
    assert TIERS == set(files) == set(RECIPES)
    for name, path in files.items():
        data = yaml.safe_load(path.read_text())
        assert data["name"] == name
        assert {"model", "prompt", "rewards", "grpo"} <= set(data)


@pytest.mark.parametrize("recipe", RECIPES.values(), ids=list(RECIPES))
def test_trl_accepts_the_grpo_section_verbatim(recipe, tmp_path):
    import trl

    assert check_grpo_fields(recipe) == recipe  # every key a GRPOConfig field, every value already of TRL's type
    config = trl.GRPOConfig(**{**recipe.grpo, "output_dir": str(tmp_path), "use_cpu": True, "bf16": False,
                               "fp16": False, "report_to": "none"})
    assert config.generation_batch_size == recipe.generation_batch_size
    assert config.generation_batch_size % recipe.grpo["num_generations"] == 0
    assert config.max_steps == recipe.grpo["max_steps"] and config.learning_rate == recipe.grpo["learning_rate"]


@pytest.mark.parametrize("recipe", GPU_RECIPES, ids=[r.name for r in GPU_RECIPES])
def test_gpu_recipes_fit_their_card(recipe):
    estimate = estimate_vram(recipe)
    assert estimate.fits(recipe.vram_gb), estimate.format()
    if recipe.model["load_in_4bit"]:  # vLLM loads a pre-quantised checkpoint as it is
        assert recipe.model_id.startswith("unsloth/") and recipe.model_id.endswith("-bnb-4bit")
    assert estimate.vllm_share_gib - estimate.weights_gib >= estimate.kv_needed_gib


def test_t4_trains_fp16_because_a_t4_has_no_bf16():
    t4 = load_recipe("t4-16gb")
    assert t4.precision == "fp16" and t4.model["load_in_4bit"]
    assert estimate_vram(t4, card_gb=14.7).total_gib <= 14.7


def test_plain_keys_land_in_their_section_and_the_registry_is_untouched():
    changed = load_recipe("cpu", {"max_steps": 3, "lora_rank": 8, "few_shot": 1, "model": "org/name"},
                          lora_targets=["q_proj", "v_proj"])
    assert changed.grpo["max_steps"] == 3 and changed.model["lora_rank"] == 8 and changed.prompt["few_shot"] == 1
    assert changed.model_id == "org/name" and changed.model["lora_targets"] == ("q_proj", "v_proj")
    assert RECIPES["cpu"].grpo["max_steps"] != 3 and RECIPES["cpu"].model_id == EMBEDDED_ID
    with pytest.raises(TypeError):
        changed.grpo["max_steps"] = 5  # sections are read-only: a change goes through with_overrides


def test_dotted_keys_name_the_section():
    r = load_recipe("cpu", {"model.id": "x/y", "prompt.prefill": "", "grpo.beta": 0.04})
    assert (r.model_id, r.prompt["prefill"], r.grpo["beta"]) == ("x/y", "", 0.04)
    with pytest.raises(GrpoKitError, match="model.lora_rank"):
        load_recipe("cpu", {"model.lora_rnak": 8})  # a typo in a known section: refused with the closest key


def test_set_values_are_converted_or_refused_by_name():
    r = load_recipe("cpu", {"learning_rate": "1e-4", "max_steps": 3.0, "use_vllm": "false"})
    assert (r.grpo["learning_rate"], r.grpo["max_steps"], r.grpo["use_vllm"]) == (1e-4, 3, False)
    assert type(r.grpo["max_steps"]) is int
    for key, value in (("max_steps", 1.5), ("learning_rate", "abc"), ("learning_rate", float("nan")),
                       ("lora_rank", "big")):
        with pytest.raises(GrpoKitError, match=key):
            load_recipe("cpu", {key: value})


def test_unknown_grpo_field_is_refused_with_the_closest_name_before_weights_load():
    recipe = load_recipe("cpu", {"learnin_rate": 1e-3})  # not a model/prompt key: checked against TRL
    with pytest.raises(GrpoKitError, match="learnin_rate \\(did you mean learning_rate\\?\\)"):
        check_grpo_fields(recipe)
    converted = check_grpo_fields(load_recipe("cpu", {"epsilon": "0.3", "num_iterations": 2.0}))
    assert converted.grpo["epsilon"] == 0.3 and type(converted.grpo["num_iterations"]) is int  # TRL's annotations


def test_batch_rule_violation_names_the_fix():
    with pytest.raises(GrpoKitError, match=r"gradient_accumulation_steps=4") as error:
        load_recipe("t4-16gb", gradient_accumulation_steps=3)
    assert "num_generations (4)" in str(error.value)
    with pytest.raises(GrpoKitError, match="divisors of 4"):
        load_recipe("t4-16gb", num_generations=8, gradient_accumulation_steps=1, per_device_train_batch_size=4)


@pytest.mark.parametrize(("change", "message"), [
    ({"max_completion_length": 4096}, "max_seq_length"),
    ({"num_generations": 1, "per_device_train_batch_size": 1}, "at least 2"),
    ({"precision": "fp8"}, "precision"),
    ({"vllm_gpu_memory_utilization": 1.5}, "fraction"),
    ({"rewards": {"correctnes": 1.0}}, "correctness"),
    ({"loss_type": "gspo"}, "importance_sampling_level=sequence"),
    ({"vllm_mode": "server"}, "use_vllm=true"),
])  # fmt: skip
def test_invalid_values_are_explained(change, message):
    with pytest.raises(GrpoKitError, match=message):
        load_recipe("cpu", change)


def test_rewards_take_names_weights_and_functions():
    def brevity(completions, **kwargs):
        return [-len(c) / 100 for c in completions]

    r = load_recipe("cpu", rewards="correctness:2,format")
    assert r.rewards == (("correctness", 2.0), ("format", 1.0))
    r = load_recipe("cpu", rewards=[(brevity, 0.5), "correctness"])
    assert r.rewards == ((brevity, 0.5), ("correctness", 1.0))  # a notebook's function stays a function
    assert r.flat()["rewards"] == [["brevity", 0.5], ["correctness", 1.0]]


def test_a_users_recipe_file_loads_and_bad_files_say_what_to_fix(tmp_path):
    own = RECIPES["cpu"].to_dict()
    own["name"], own["grpo"]["max_steps"] = "mine", 2
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(own))
    mine = load_recipe(str(path), max_steps=1)
    assert (mine.name, mine.grpo["max_steps"], mine.path) == ("mine", 1, str(path))
    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    with pytest.raises(GrpoKitError, match="not valid YAML"):
        load_recipe(str(tmp_path / "bad.yaml"))
    (tmp_path / "extra.yaml").write_text(yaml.safe_dump({**own, "grpoo": {}}))
    with pytest.raises(GrpoKitError, match="grpoo → grpo"):
        load_recipe(str(tmp_path / "extra.yaml"))
    del own["grpo"]["learning_rate"]
    (tmp_path / "short.yaml").write_text(yaml.safe_dump(own))
    with pytest.raises(GrpoKitError, match="missing grpo.learning_rate"):
        load_recipe(str(tmp_path / "short.yaml"))
    with pytest.raises(GrpoKitError, match="Cannot read recipe file"):
        load_recipe(str(tmp_path / "absent.yaml"))


def test_unknown_recipe_name_lists_the_shipped_ones():
    with pytest.raises(GrpoKitError) as error:
        load_recipe("t4")
    assert all(name in str(error.value) for name in RECIPES) and "--recipe" in str(error.value)


def test_recorded_settings_read_back_what_run_info_wrote(tmp_path):
    from grpo_kit.machinery.runs import run_info

    recipe = load_recipe("cpu", max_steps=5, few_shot=1)
    info = run_info(recipe, data="sample", overrides={"hub_token": "secret"}, reward_names=["tag_progress"])
    (tmp_path / "run.json").write_text(json.dumps(info, default=str))
    recorded = recorded_settings(tmp_path)
    assert (recorded["max_steps"], recorded["few_shot"], recorded["model"]) == (5, 1, EMBEDDED_ID)
    assert "secret" not in (tmp_path / "run.json").read_text()
    assert recorded_settings(tmp_path / "nowhere") == {}


@pytest.mark.parametrize(
    ("device", "expected", "precision"),
    [
        (DeviceInfo("cpu", "cpu", 0.0, False), "cpu", "fp32"),
        (DeviceInfo("cuda", "Tesla T4", 14.74, False), "t4-16gb", "fp16"),
        (DeviceInfo("cuda", "Tesla T4", 14.7, False), "t4-16gb", "fp16"),
        (DeviceInfo("cuda", "NVIDIA L4", 22.0, True), "l4-24gb", "bf16"),
        (DeviceInfo("cuda", "NVIDIA A100-SXM4-40GB", 39.39, True), "a100-40gb", "bf16"),
        (DeviceInfo("cuda", "NVIDIA A100-SXM4-80GB", 79.15, True), "a100-80gb", "bf16"),
        (DeviceInfo("cuda", "NVIDIA H100 80GB HBM3", 79.1, True), "a100-80gb", "bf16"),
        (DeviceInfo("cuda", "Tesla V100-SXM2-32GB", 31.7, False), "l4-24gb", "fp16"),
    ],
)
def test_auto_recipe_picks_the_tier(device, expected, precision):
    recipe, reason = auto_recipe(device)
    assert recipe.name == expected
    assert recipe.precision == precision
    assert expected in reason and "\n" not in reason
    if device.kind == "cuda":
        assert device.name in reason and f"{device.vram_gb:.1f} GiB" in reason
        assert "Warning" not in reason  # every tier fits the cards it is picked for


def test_auto_recipe_on_a_small_gpu_uses_the_fallback_model():
    recipe, reason = auto_recipe(DeviceInfo("cuda", "NVIDIA GeForce RTX 3060", 11.6, True))
    assert recipe.name == "t4-16gb" and recipe.model_id == FALLBACK_MODEL_4BIT
    assert "fallback" in reason and "Warning" not in reason


def test_presets_json_keeps_every_field_scripts_read():
    rows = presets_json()
    assert [row["name"] for row in rows] == list(RECIPES)
    for row in rows:
        assert PRESET_JSON_FIELDS <= set(row), PRESET_JSON_FIELDS - set(row)
        assert row["generation_batch_size"] % row["num_generations"] == 0
    t4 = next(row for row in rows if row["name"] == "t4-16gb")
    assert 0 < t4["estimate_gib"] <= 14.7 and t4["model"] == RECIPES["t4-16gb"].model_id
    assert json.loads(json.dumps(rows)) == rows


def test_presets_table_is_aligned_and_lists_every_tier():
    lines = presets_table().splitlines()
    assert len(lines) == len(RECIPES) + 1
    assert all(line.split()[0] in RECIPES for line in lines[1:])
    column = lines[0].index("model")
    assert all(line[column - 2 : column] == "  " for line in lines)  # columns line up


def test_cli_presets_table_json_and_plan(capsys):
    assert main(["presets", "--json"]) == 0
    assert TIERS <= {row["name"] for row in json.loads(capsys.readouterr().out)}
    assert main(["presets"]) == 0
    table = capsys.readouterr().out
    assert all(name in table for name in RECIPES)
    assert main(["presets", "--plan", "t4-16gb"]) == 0
    out = capsys.readouterr().out
    assert "weights (4-bit)" in out and "fits in 14.7 GiB" in out


def test_cli_plan_with_a_local_model_folder(tmp_path, capsys):
    config = {"num_hidden_layers": 28, "hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
              "num_key_value_heads": 4, "vocab_size": 152064, "model_type": "qwen2"}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["presets", "--plan", "a100-40gb", "--model", str(tmp_path)]) == 0
    assert "weights (16-bit)" in capsys.readouterr().out


def test_cli_presets_errors_exit_2(capsys):
    assert main(["presets", "--plan", "no-such-tier"]) == 2
    assert "Shipped:" in capsys.readouterr().err
    assert main(["presets", "--model", "x"]) == 2
    assert "--plan" in capsys.readouterr().err


def test_old_knob_flags_are_refused_with_their_set_spelling(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--preset", "cpu", "--max-steps", "3", "--model", "org/name", "--no-vllm"])
    err = capsys.readouterr().err
    assert "--set max_steps=3 --set model.id=org/name --set use_vllm=false" in err
    assert set_hint(["--learning-rate=1e-5"]) == ". Recipe values change with --set: --set learning_rate=1e-5"


@pytest.mark.parametrize("name", list(LOSS_VARIANTS))
def test_each_loss_variant_is_set_keys_trl_accepts(name, tmp_path):
    from grpo_kit.train import build_grpo_config

    fields, explanation = LOSS_VARIANTS[name]
    config = build_grpo_config(check_grpo_fields(load_recipe("cpu", fields)), tmp_path, on_cpu=True)
    assert all(getattr(config, key) == value for key, value in fields.items())
    assert explanation and "\n" not in explanation
