"""What the real-Unsloth test tier costs on a CPU: Unsloth's GRPO trainer against plain TRL, its compile pass on and
off.

``make test`` runs tests/test_real_unsloth.py in Unsloth's CPU-only CI mode with Unsloth's torch.compile pass off
(tests/conftest.py). This prints why: each configuration trains a few GRPO steps (G=4, 16 new tokens) in a fresh
process (Unsloth patches TRL for the whole process), and reports the import time, the first step (compiling, caches)
and the median of the later steps.

    .venv/bin/python benchmarks/bench_real_unsloth.py                  # the tiny random Llama the tests use
    .venv/bin/python benchmarks/bench_real_unsloth.py --model embedded # SmolLM2-135M (slower)

Needs the real Unsloth in .venv/unsloth-cpu (``make test`` installs it there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

#: Where ``make test`` installs Unsloth and its CPU dependencies (the Makefile's UNSLOTH_DIR).
UNSLOTH_DIR = os.path.join(sys.prefix, "unsloth-cpu")
CONFIGS = {  # name -> environment of its process
    "trl": {},
    "unsloth": {"UNSLOTH_ALLOW_CPU": "1", "UNSLOTH_COMPILE_DISABLE": "1", "TORCHDYNAMO_DISABLE": "1"},
    "unsloth-compiled": {"UNSLOTH_ALLOW_CPU": "1"},
}


def child(config: str, model_name: str, steps: int) -> dict:
    start = time.perf_counter()
    if config != "trl":
        import unsloth  # noqa: F401  before trl/transformers/peft
        from unsloth.models.rl import patch_trl_rl_trainers

        patch_trl_rl_trainers()  # skipped at import in Unsloth's CPU mode
    import torch
    import trl
    from datasets import Dataset
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, TrainerCallback

    from grpo_kit.embedded import embedded_model_path
    from grpo_kit.models import ensure_logprob_kernel, set_torch_threads

    imported = time.perf_counter() - start
    set_torch_threads()
    ensure_logprob_kernel()
    tokenizer = AutoTokenizer.from_pretrained(embedded_model_path())
    if model_name == "tiny":  # tests/conftest.py's tiny_model_dir
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(
            LlamaConfig(
                vocab_size=len(tokenizer),
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                tie_word_embeddings=True,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(embedded_model_path(), dtype=torch.float32)
    model = get_peft_model(
        model, LoraConfig(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    )
    if config != "trl":  # what Unsloth's loader attaches and its trainer calls (tests/test_real_unsloth.py)
        import functools

        from unsloth.models.llama import FastLlamaModel

        model.for_training = functools.partial(FastLlamaModel.for_training, model)
        model.for_inference = functools.partial(FastLlamaModel.for_inference, model)
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}]} for i in range(16)])

    def length(completions, **kwargs):  # varies within a group: real advantages, a real backward pass
        return [len(c[0]["content"]) / 100 for c in completions]

    times: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            times.append(time.perf_counter() - self.start)

    with tempfile.TemporaryDirectory() as out:
        args = trl.GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=4,
            num_generations=4,
            max_completion_length=16,
            max_steps=steps,
            report_to=[],
            use_cpu=True,
            bf16=False,
            fp16=False,
            loss_type="dapo",
            learning_rate=1e-5,
            save_strategy="no",
        )
        trainer = trl.GRPOTrainer(
            model=model,
            reward_funcs=[length],
            args=args,
            train_dataset=data,
            processing_class=tokenizer,
            callbacks=[Timer()],
        )
        trainer.train()
    return {"import_s": imported, "step_s": times, "trainer": type(trainer).__name__}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("tiny", "embedded"), default="tiny")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.model, args.steps)))
        return 0
    print(
        f"model {args.model}, {args.steps} GRPO steps (G=4, 16 new tokens), torch threads "
        f"{os.environ.get('GRPO_KIT_THREADS', 'default')}"
    )
    print(f"{'config':<18} {'trainer':<20} {'import s':>8} {'first step s':>12} {'median later s':>14}")
    for name in args.configs.split(","):
        with tempfile.TemporaryDirectory() as cache:  # Unsloth's compiled files, never the checkout
            env = {
                **os.environ,
                **CONFIGS[name],
                "UNSLOTH_COMPILE_LOCATION": cache,
                "PYTHONPATH": os.pathsep.join(filter(None, (UNSLOTH_DIR, os.environ.get("PYTHONPATH")))),
            }
            done = subprocess.run(
                [sys.executable, __file__, "--child", name, "--model", args.model, "--steps", str(args.steps)],
                capture_output=True,
                text=True,
                env=env,
                cwd=cache,
            )
        line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            print(f"{name:<18} failed: {done.stderr.strip().splitlines()[-1:]}")
            continue
        result = json.loads(line.removeprefix("RESULT "))
        steps = result["step_s"]
        print(
            f"{name:<18} {result['trainer']:<20} {result['import_s']:>8.1f} {steps[0]:>12.1f} "
            f"{statistics.median(steps[1:] or steps):>14.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
