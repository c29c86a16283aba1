"""The ``grpo-kit`` command (same as ``python -m grpo_kit``).

Each sub-command's arguments are declared here; its work is done by ``cli_<command>`` in the module that owns the
concern (``module``), imported only when that sub-command runs, so ``grpo-kit --help`` never imports torch.
A ``GrpoKitError`` or ``ImportError`` is printed as one line (exit status 2); other exceptions keep their traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys

from grpo_kit import __version__
from grpo_kit.errors import GrpoKitError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grpo-kit",
        description="Teach and run GRPO on GSM8K: presets per VRAM tier, training, evaluation, verified exports.",
    )
    parser.add_argument("--version", action="version", version=f"grpo-kit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("presets", help="list the VRAM-tier presets")
    p.add_argument("--plan", metavar="PRESET", help="show the VRAM planner's estimate for one preset")
    p.set_defaults(module="planner")

    p = sub.add_parser(
        "train",
        help="train a GRPO LoRA adapter from a recipe",
        description="A recipe is a flat YAML file of TRL GRPOConfig / ModelConfig fields plus the kit's "
        "(grpo_kit.config.KitArgs). Change any of them for one run with --set KEY=VALUE, e.g. --set "
        "max_steps=50 --set model_name_or_path=unsloth/Qwen2.5-1.5B-Instruct-bnb-4bit --set use_vllm=false; "
        "--set log_completions=true prints sampled completions with their rewards (TRL's table).",
    )
    p.add_argument(
        "--preset",
        "--recipe",
        metavar="NAME|PATH",
        help="a shipped recipe (see `grpo-kit presets`), 'auto' to detect (the default; with --resume: the run's "
        "own, from its run.json), or your own recipe YAML file (start from recipes/cpu.yaml)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change one recipe field: any GRPOConfig or ModelConfig field (learning_rate=1e-5, lora_r=8) "
        "or a kit field (reward_funcs=correctness,format); repeat for more",
    )
    p.add_argument(
        "--data",
        help="'gsm8k' (Hub, the default; with --resume: the run's own), 'sample' (bundled), or a local "
        ".jsonl/.json/.parquet/.csv file",
    )
    p.add_argument("--output", help="run folder (default: runs/<recipe>-<time>)")
    p.add_argument("--resume", action="store_true", help="continue from the latest complete checkpoint in --output")
    p.add_argument(
        "--lenient", action="store_true", help="skip bad data rows (counted and reported) instead of stopping"
    )
    p.set_defaults(module="train")

    p = sub.add_parser("doctor", help="a run's findings and vital signs: why GRPO is (not) learning")
    p.add_argument("run", help="run folder (finished, stopped or still training)")
    p.set_defaults(module="doctor")

    p = sub.add_parser("eval", help="held-out GSM8K accuracy of a model, optionally with a LoRA adapter")
    p.add_argument("--model", default="embedded", help="model id or folder ('embedded' = SmolLM2-135M)")
    p.add_argument("--adapter", help="LoRA adapter folder to evaluate on top of --model")
    p.add_argument("--compare", action="store_true", help="with --adapter: also evaluate the base model, side by side")
    p.add_argument("--data", default="gsm8k", help="'gsm8k' (Hub test split), 'sample' (bundled held-out), or a path")
    p.add_argument("--limit", type=int, help="evaluate the first N questions (after a seeded shuffle)")
    p.add_argument("--seed", type=int, default=0, help="shuffle seed for --limit")
    p.add_argument("--max-new-tokens", type=int, default=256, help="generation budget per answer")
    p.add_argument("--batch-size", type=int, default=8, help="questions generated together (larger is faster on CPU)")
    p.add_argument("--out", help="write results JSON here (per-question rows go next to it as .jsonl)")
    p.set_defaults(module="evaluate")

    p = sub.add_parser("export", help="export a trained adapter (lora, merged16, gguf), verified by reloading")
    p.add_argument("--adapter", required=True, help="LoRA adapter folder (a run's adapter or a checkpoint)")
    p.add_argument("--model", help="base model (default: the one recorded in the adapter)")
    p.add_argument("--format", default="lora", help="lora | merged16 | gguf (comma-separated for several)")
    p.add_argument(
        "--gguf-type",
        default="q4_k_m",
        help="GGUF type(s), comma-separated: q4_k_m, q5_k_m, q8_0, f16 (llama.cpp via Unsloth: a GPU)",
    )
    p.add_argument("--name", help="export folder name under --out-dir (default: from the adapter)")
    p.add_argument("--out-dir", default="exports", help="parent folder of exports")
    p.add_argument("--overwrite", action="store_true", help="replace an existing export of the same name")
    p.add_argument("--push-to-hub", metavar="REPO", help="also upload to this Hub repo (token from HF_TOKEN)")
    p.add_argument(
        "--check-answers",
        type=int,
        default=0,
        metavar="N",
        help="also compare merged16's answers with "
        "base + adapter's on N bundled questions (loads both models, one after the other)",
    )
    p.set_defaults(module="export")

    p = sub.add_parser("chat", help="ask a model (optionally with a trained adapter) your own question")
    p.add_argument("question", nargs="*", help="the question")
    p.add_argument("--adapter", help="LoRA adapter folder (a run's adapter or a checkpoint)")
    p.add_argument("--model", help="base model (default: the adapter's recorded base, else embedded)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="generation budget per answer")
    p.add_argument("--temperature", type=float, help="sample at this temperature (default: greedy)")
    p.set_defaults(module="evaluate")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 0
    # SIGTERM (what Colab and schedulers send) stops a run as Ctrl-C does: one line, the run folder's lock released
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        result = getattr(importlib.import_module(f"grpo_kit.{args.module}"), f"cli_{args.command}")(args)
        sys.stdout.flush()  # a reader that left (`grpo-kit presets | head -3`) shows up here at the latest
    except BrokenPipeError:  # the reader left: Python's documented recipe, stdout to devnull so the exit flush is quiet
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (GrpoKitError, ImportError) as error:  # ImportError: a missing package (bitsandbytes ...), named in it
        print(f"grpo-kit: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:
        print(f"grpo-kit: {stop.args[0] if stop.args else 'interrupted'}", file=sys.stderr)
        return 143 if stop.args else 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    return int(result or 0)


def _terminated(signum, frame) -> None:
    raise KeyboardInterrupt("stopped by SIGTERM; the run folder keeps its complete checkpoints: --resume continues")
