"""Beyond one process: the shipped accelerate configs, TRL's batch rule, a real 2-process CPU run."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_cli import tiny_train_args

from grpo_kit.config import load_recipe
from grpo_kit.errors import GrpoKitError

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs" / "accelerate"


# ------------------------------------------------------------------------------------------------ accelerate configs


@pytest.mark.parametrize(
    ("name", "kind", "stage"),
    [("cpu-2proc", "MULTI_GPU", None), ("ddp", "MULTI_GPU", None), ("zero2", "DEEPSPEED", 2)],
)
def test_shipped_accelerate_configs_load(name, kind, stage):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(CONFIGS / f"{name}.yaml"))  # unknown keys would raise here
    assert config.distributed_type.name == kind
    assert config.num_machines == 1 and config.main_process_port == 0  # 0: accelerate picks a free port
    if stage is not None:
        assert config.deepspeed_config["zero_stage"] == stage
    assert config.use_cpu is (name == "cpu-2proc")


def test_batch_rule_is_trls_and_refused_before_any_weights_load(no_model_load):
    """TRL's rule: the completions of one generation (batch x accumulation x processes) are whole groups of G."""
    with pytest.raises(GrpoKitError, match="divisible by num_generations"):
        load_recipe("cpu", per_device_train_batch_size=1, gradient_accumulation_steps=1, num_generations=4)
    assert (
        load_recipe(
            "cpu", per_device_train_batch_size=1, gradient_accumulation_steps=4, num_generations=4
        ).prompts_per_step
        == 1
    )


# ------------------------------------------------------------------------------------------------ 2 processes on CPU


# The CLI with one extra reward registered: random text from a tiny model earns 0 under every built-in reward, and
# a run where every group is flat has zero gradients, so nothing would show that the two copies trained together.
def weights_digest(tensors) -> str:
    """SHA-256 over each tensor's name and float32 bytes, in name order: equal digests mean equal weights."""
    import hashlib

    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode("utf-8"))
        digest.update(tensors[name].detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def test_weights_digest_tells_equal_weights_from_different_ones():
    import torch

    a = {"x": torch.ones(2), "y": torch.zeros(3)}
    assert weights_digest(a) == weights_digest({"y": torch.zeros(3), "x": torch.ones(2)})
    assert weights_digest(a) != weights_digest({**a, "x": torch.full((2,), 1.0 + 1e-6)})


# Every process calls save_adapter (the main one writes); the launcher makes each first write the digest of its own
# copy of the LoRA weights, so the test can see that the data-parallel copies stayed identical.
LAUNCHER = (
    inspect.getsource(weights_digest)
    + """
import sys

from peft import get_peft_model_state_dict

from grpo_kit import runs
from grpo_kit.cli import main
from grpo_kit.rewards import REWARDS


def save_adapter_and_digest(run, trainer):
    state = get_peft_model_state_dict(trainer.accelerator.unwrap_model(trainer.model))
    (run.dir / f"rank-{trainer.args.process_index}.digest").write_text(weights_digest(state))
    return save_adapter(run, trainer)


def char_codes(completions, **kwargs):
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(map(ord, text)) / 10000 for text in texts]


REWARDS["char_codes"] = char_codes
save_adapter, runs.Run.save_adapter = runs.Run.save_adapter, save_adapter_and_digest
raise SystemExit(main(sys.argv[1:]))
"""
)


@pytest.mark.slow
def test_two_process_cpu_run_trains_identical_copies(tiny_model_dir, tmp_path):
    """`accelerate launch` with 2 CPU processes (gloo): it completes, both ranks end with the same LoRA weights,
    those weights are what the adapter file holds, training moved them, and the run files were written once."""
    from safetensors.torch import load_file

    from grpo_kit.runs import read_metrics

    launcher = tmp_path / "launch_train.py"
    launcher.write_text(LAUNCHER)
    run_dir = tmp_path / "run"
    command = [
        str(Path(sys.executable).with_name("accelerate")),
        "launch",
        "--config_file",
        str(CONFIGS / "cpu-2proc.yaml"),
        str(launcher),
        "train",
        *tiny_train_args(
            "arithmetic",
            model_name_or_path=tiny_model_dir,
            reward_funcs="char_codes",
            reward_weights="[1.0]",
            max_steps=2,
            learning_rate=0.05,
        ),
        "--output",
        str(run_dir),
    ]
    env = {
        **os.environ,
        "GRPO_KIT_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    digests = [(run_dir / f"rank-{rank}.digest").read_text() for rank in (0, 1)]
    adapter = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    assert digests[0] == digests[1] == weights_digest(adapter)
    assert any(t.abs().max() > 0 for name, t in adapter.items() if "lora_B" in name)  # LoRA B starts at zero
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2]  # logged by the main process only
    assert rows[0]["frac_reward_zero_std"] < 1.0  # groups had reward variance, so there was a gradient
    assert json.loads((run_dir / "run.json").read_text())["reward_names"] == ["char_codes"]
    assert not list(run_dir.glob(".adapter.*"))  # no staging folder left behind
    assert done.stdout.count("steps: 2") == 1  # one summary, from the main process


#: TRL hands each process a consecutive slice of the generation batch; here the first group's 4 answers are split
#: between the 2 processes (12, 12, 12 | 14), the second group's are on process 1 alone (5, 6).
ENTROPY_SCRIPT = """
import json, sys
from accelerate import PartialState
from accelerate.utils import gather_object
from grpo_kit.rewards import REWARDS

state = PartialState(cpu=True)
answers = [["12", "12", "12"], ["14", "5", "6"]][state.process_index]
prompts = [["q1", "q1", "q1"], ["q1", "q2", "q2"]][state.process_index]
texts = [f"<think>x</think><answer>{a}</answer>" for a in answers]
mine = REWARDS["semantic_entropy"](texts, prompts=prompts)
everything = gather_object([(state.process_index, mine)])
if state.is_main_process:
    open(sys.argv[1], "w").write(json.dumps(everything))
state.destroy_process_group()  # gloo aborts a process that exits with its group still up
"""


@pytest.mark.slow
def test_semantic_entropy_of_a_group_spread_over_two_processes_is_that_of_one_process(tmp_path):
    """A group's answers split between 2 CPU processes (gloo, `accelerate launch`): each process's completions get the
    figure one process computes for the whole group."""
    from grpo_kit.rewards import REWARDS

    script, out = tmp_path / "entropy.py", tmp_path / "entropy.json"
    script.write_text(ENTROPY_SCRIPT)
    accelerate = str(Path(sys.executable).with_name("accelerate"))
    command = [accelerate, "launch", "--config_file", str(CONFIGS / "cpu-2proc.yaml"), str(script), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    by_rank = dict(json.loads(out.read_text()))
    texts = [f"<think>x</think><answer>{a}</answer>" for a in ("12", "12", "12", "14", "5", "6")]
    whole = REWARDS["semantic_entropy"](texts, prompts=["q1"] * 4 + ["q2"] * 2)
    assert [by_rank[0], by_rank[1]] == [whole[:3], whole[3:]]  # each rank's own completions, as one process
    assert 0 < whole[0] == whole[3] < 1 and whole[4] == 1.0
