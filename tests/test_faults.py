"""Fault injection: bad inputs and faults a new user meets, each through the CLI as the user would meet it.

Every case in ``CASES`` runs ``grpo-kit ...`` against a scratch folder prepared by its ``setup`` and checks the four
promises of docs/TROUBLESHOOTING.md ("What the kit does with bad input"):

1. the exit status (2 for a refused input, 0 where the kit can carry on);
2. a short message on stderr that names the problem and the fix (``expect``: texts that must appear in it);
3. no traceback;
4. nothing lost: every file that existed before the command is still there, byte for byte.

Cases whose area is data or settings must be refused before any weights load (``no_model_load`` fails the test
otherwise); export and eval cases use the tiny random Llama of tests/conftest.py, which loads in milliseconds.
The table in docs/TROUBLESHOOTING.md lists the same cases.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from tiny_cli import recorded_values, tiny_train_args

from grpo_kit.cli import main
from grpo_kit.runs import LOCK_NAME, PID_NAME

MAX_ERROR_LINES = 15
GOOD = {"question": "Tom has 3 + 4 apples. How many?", "answer": "3 + 4 = 7\n#### 7"}
TINY = tiny_train_args()
PRELOAD_AREAS = {"data", "settings", "resume", "chat", "output"}  # refused before any weights load


@dataclass(frozen=True)
class Case:
    """One fault: ``argv`` (``{tmp}``, ``{tiny}``, ``{adapter}`` are filled in), what ``setup`` prepares first."""

    id: str
    area: str
    argv: tuple[str, ...]
    expect: tuple[str, ...]
    setup: Callable | None = None
    code: int = 2
    outcome: str = ""  # the one-line outcome for the docs table


# ------------------------------------------------------------------------------------------------ setups


def _jsonl(name, *rows, raw: bytes = b""):
    def make(tmp, env):
        lines = [json.dumps(row).encode() if not isinstance(row, bytes) else row for row in rows]
        (tmp / name).write_bytes(b"\n".join(lines) + b"\n" + raw if lines else raw)

    return make


def _file(name, data: bytes):
    def make(tmp, env):
        (tmp / name).write_bytes(data)

    return make


def _reward_module(name: str, source: str):
    """``<name>.py`` with ``source`` in the folder the command runs from (where a user keeps their rewards)."""

    def make(tmp, env):
        (tmp / f"{name}.py").write_text(source)
        env["monkeypatch"].chdir(tmp)
        env["monkeypatch"].delitem(sys.modules, name, raising=False)

    return make


def _parquet(name, columns: dict):
    def make(tmp, env):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table(columns), tmp / name)

    return make


def _folder(*files):
    def make(tmp, env):
        (tmp / "data").mkdir()
        for name in files:
            (tmp / "data" / name).write_text(json.dumps(GOOD) + "\n")

    return make


def _adapter(damage=None, std: float = 0.05):
    """A LoRA adapter for the tiny model at ``{tmp}/run/adapter`` (its B weights N(0, std)), optionally damaged."""

    def make(tmp, env):
        adapter = env["make_adapter"](env["tiny"], tmp / "run" / "adapter", std=std)
        if damage:
            damage(adapter, env)

    return make


def _truncate(adapter, env):
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:200])


def _nan(adapter, env):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    name = sorted(n for n in tensors if "lora_B" in n)[0]
    tensors[name] = tensors[name] * float("nan")
    save_file(tensors, str(adapter / "adapter_model.safetensors"))


def _names_the_other_base(tmp, env):
    """The adapter of ``_other_base``, its adapter_config.json edited to name the other model (a base re-trained or
    replaced since): the message must not send the user to the model that was just tried."""
    _other_base(tmp, env)
    config_path = tmp / "run" / "adapter" / "adapter_config.json"
    config_path.write_text(
        json.dumps({**json.loads(config_path.read_text()), "base_model_name_or_path": str(tmp / "other")})
    )


def _other_base(tmp, env):
    """A tiny Llama of another width at ``{tmp}/other`` and an adapter made for the tiny model at ``{tmp}/run``."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(env["tiny"])
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(tmp / "other")
    tokenizer.save_pretrained(tmp / "other")
    _adapter()(tmp, env)


def _no_tokenizer_model(tmp, env):
    """A model folder with config and weights but no tokenizer files."""
    import shutil

    shutil.copytree(
        env["tiny"], tmp / "model", ignore=shutil.ignore_patterns("tokenizer*", "special_tokens*", "chat_template*")
    )


def _run_with(*names, steps=None, locked=False, adapter=False):
    """A run folder with ``names`` in it; ``steps``: checkpoints 1..steps (``adapter``: and the final adapter from
    the last); ``locked``: another process holds its lock."""
    import shutil

    def make(tmp, env):
        run = tmp / "run"
        run.mkdir()
        for name in names:
            (run / name).write_text("kept")
        for step in range(1, (steps or 0) + 1):
            env["fake_checkpoint"](run, step)
        if steps:
            (run / "run.json").write_text(json.dumps({"recipe": recorded_values(max_steps=steps), "data": "sample"}))
        if adapter:
            shutil.copytree(run / f"checkpoint-{steps}", run / "adapter")
        if locked:
            env["hold_lock"](run)

    return make


def _damaged_final_adapter(tmp, env):
    """A finished 2-step run whose final adapter file was cut in half (a full disk, a kill during a copy)."""
    _run_with(steps=2, adapter=True)(tmp, env)
    _cut("adapter_model.safetensors")(tmp / "run" / "adapter")


def _damaged_last_checkpoint(damage):
    """A run finished at step 1 whose later checkpoint-2 was damaged by a kill or a full disk (``damage``)."""

    def make(tmp, env):
        _run_with(steps=1, adapter=True)(tmp, env)
        folder = env["fake_checkpoint"](tmp / "run", 2)
        damage(folder)

    return make


def _cut(name, keep=None):
    def damage(folder):
        path = folder / name
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2 if keep is None else keep])

    return damage


def _drop(name):
    return lambda folder: (folder / name).unlink()


def _export_exists(tmp, env):
    _adapter()(tmp, env)
    (tmp / "exports" / "run").mkdir(parents=True)
    (tmp / "exports" / "run" / "export.json").write_text('{"old": true}')


def _read_only(path_name, inner=None):
    """``{tmp}/<path_name>`` refuses new entries. Simulated at ``os.mkdir``/``os.open``: chmod does not stop root."""

    def make(tmp, env):
        import errno

        if inner:
            inner(tmp, env)
        folder = tmp / path_name
        folder.mkdir()
        real_mkdir, real_open = os.mkdir, os.open

        def inside(path) -> bool:
            return Path(path).resolve().is_relative_to(folder.resolve())

        def mkdir(path, *args, **kwargs):
            if inside(path):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real_mkdir(path, *args, **kwargs)

        def open_(path, flags, *args, **kwargs):
            if inside(path) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real_open(path, flags, *args, **kwargs)

        env["monkeypatch"].setattr(os, "mkdir", mkdir)
        env["monkeypatch"].setattr(os, "open", open_)

    return make


def _disk_full(tmp, env):
    import errno

    import grpo_kit.export as export_module

    _adapter()(tmp, env)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    env["monkeypatch"].setattr(export_module.shutil, "copy2", no_space)


def _upload_fails(tmp, env):
    from huggingface_hub import HfApi

    _adapter()(tmp, env)
    env["monkeypatch"].setenv("HF_TOKEN", "hf_FAKEtoken0123456789SECRET")

    def refuse(api, repo_id, **kwargs):
        raise RuntimeError(f"403 Forbidden for {repo_id} with {api.token}")

    env["monkeypatch"].setattr(HfApi, "create_repo", lambda api, repo, exist_ok: f"https://hf.co/{repo}")
    env["monkeypatch"].setattr(HfApi, "upload_folder", refuse)


def _no_token(tmp, env):
    _adapter()(tmp, env)
    env["monkeypatch"].delenv("HF_TOKEN", raising=False)


def _hub_unreachable(tmp, env):
    import datasets

    def unreachable(*args, **kwargs):  # what datasets raises, after its retries, with no network and no cached copy
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)")

    env["monkeypatch"].setattr(datasets, "load_dataset", unreachable)


def _no_space(target, name: str, *, when):
    """``target.<name>`` raises what a full disk raises when ``when(args, kwargs)`` holds: no root needed."""
    import errno

    def make(tmp, env):
        real = getattr(target, name)

        def full(*args, **kwargs):
            if when(args, kwargs):
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(*args, **kwargs)

        env["monkeypatch"].setattr(target, name, full)

    return make


def _checkpoint_save_fails(tmp, env):
    """torch.save fails as it does on a full disk: its zip writer's RuntimeError, not an OSError."""
    import torch

    def full(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1536 vs 1474")

    env["monkeypatch"].setattr(torch, "save", full)


def _collapsed_run(tmp, env):
    """An adapter whose run logged a collapse (issue 37: learning_rate=0.9), its weights small and finite."""
    _adapter()(tmp, env)
    rows = [
        {"step": 1, "reward": 0.25, "completions/clipped_ratio": 0.625, "grad_norm": 0.46},
        {"step": 2, "reward": 0.0, "completions/clipped_ratio": 1.0, "grad_norm": 0.0},
    ]
    (tmp / "run" / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def _killed_lock_holder(tmp, env):
    """A finished run whose lock holder was SIGKILLed (a Colab disconnect): its PID file stays behind."""
    _run_with(steps=2, adapter=True)(tmp, env)
    env["hold_lock"](tmp / "run")
    env["hold_lock"].kill()


def _datasets_cache_under_a_file(tmp, env):
    """HF_HOME names a file: ``datasets`` reads its cache folder from it when imported, so its value is set here."""
    import datasets

    (tmp / "hf").write_text("a file")
    env["monkeypatch"].setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp / "hf" / "datasets"))


def _merged_export(tmp, env):
    """An export of the adapter at ``{tmp}/run/adapter``: ``{tmp}/exports/run/merged16`` (the tiny model standing in
    for the merge) and its export.json, which names the base the LoRA was merged from."""
    import shutil

    _adapter()(tmp, env)
    shutil.copytree(env["tiny"], tmp / "exports" / "run" / "merged16")
    (tmp / "exports" / "run" / "export.json").write_text(json.dumps({"lora_base": str(env["tiny"])}))


def _saved_to_disk(splits=None):
    """``{tmp}/ds``: two GOOD-like rows as ``Dataset.save_to_disk`` writes them, or a ``DatasetDict`` of ``splits``."""

    def make(tmp, env):
        from datasets import Dataset, DatasetDict

        rows = Dataset.from_list([GOOD, {"question": "Half of 8?", "answer": "#### 4"}])
        (DatasetDict({split: rows for split in splits}) if splits else rows).save_to_disk(str(tmp / "ds"))

    return make


def _chain(*setups):
    def make(tmp, env):
        for setup in setups:
            setup(tmp, env)

    return make


# ------------------------------------------------------------------------------------------------ the table

TRAIN = ("train", *TINY, "--output", "{tmp}/run")
ON_TINY = ("--set", "model_name_or_path={tiny}")  # trains for real in about a second
RESUME = (*TRAIN, "--data", "sample", "--resume")
#: Reward functions in the forms Python offers, each a module attribute that ``module:name`` imports; the scores
#: differ between completions (a hash), so the run has something to learn and ends with exit 0.
FORMS = """import functools, zlib

def _score(completions, scale=1.0, **kwargs):
    return [scale * zlib.crc32(str(c).encode()) / 2**32 for c in completions]

class Scorer:
    def __call__(self, completions, **kwargs):
        return _score(completions)

by_lambda = lambda completions, **kwargs: _score(completions)  # noqa: E731
by_partial = functools.partial(_score, scale=0.5)
by_object = Scorer()
"""
EXPORT = ("export", "--adapter", "{tmp}/run/adapter", "--model", "{tiny}", "--out-dir", "{tmp}/exports")
EVAL = (
    "eval",
    "--model",
    "{tiny}",
    "--adapter",
    "{tmp}/run/adapter",
    "--data",
    "sample",
    "--limit",
    "1",
    "--max-new-tokens",
    "4",
)
BIG = "1" * 40

CASES = [
    # data
    Case("empty-jsonl", "data", (*TRAIN, "--data", "{tmp}/d.jsonl"), ("is empty",), _file("d.jsonl", b"\n")),
    Case(
        "non-utf8-jsonl",
        "data",
        (*TRAIN, "--data", "{tmp}/d.jsonl"),
        ("{tmp}/d.jsonl", "saved as UTF-8"),
        _jsonl("d.jsonl", GOOD, b'{"question": "caf\xe9", "answer": "#### 1"}'),
    ),
    Case(
        "missing-field",
        "data",
        (*TRAIN, "--data", "{tmp}/d.jsonl"),
        ("{tmp}/d.jsonl", "missing column", "answer"),
        _jsonl("d.jsonl", {"question": "q"}),
    ),
    Case(
        "answer-in-words",
        "data",
        (*TRAIN, "--data", "{tmp}/d.jsonl"),
        ("'forty'", "not a number"),
        _jsonl("d.jsonl", {"question": "q", "answer": "#### forty"}),
    ),
    Case(
        "answer-40-digits",
        "data",
        (*TRAIN, "--data", "{tmp}/d.jsonl"),
        ("too large", "40 digits", "at most 30"),
        _jsonl("d.jsonl", {"question": "q", "answer": f"#### {BIG}"}),
    ),
    Case(
        "answer-40-digit-number",
        "data",
        (*TRAIN, "--data", "{tmp}/d.jsonl"),
        ("too large",),
        _jsonl("d.jsonl", {"question": "q", "answer": int(BIG)}),
    ),
    Case(
        "answer-nan",
        "data",
        (*TRAIN, "--data", "{tmp}/d.jsonl"),
        ("not a finite number",),
        _jsonl("d.jsonl", b'{"question": "q", "answer": NaN}'),
    ),
    Case(
        "answer-boolean",
        "data",
        (*TRAIN, "--data", "{tmp}/d.jsonl"),
        ("boolean",),
        _jsonl("d.jsonl", {"question": "q", "answer": True}),
    ),
    Case(
        "empty-question",
        "data",
        (*TRAIN, "--data", "{tmp}/d.jsonl"),
        ("question is empty",),
        _jsonl("d.jsonl", {"question": " ", "answer": "#### 1"}),
    ),
    Case(
        "torn-json-line",
        "data",
        (*TRAIN, "--data", "{tmp}/d.jsonl"),
        ("{tmp}/d.jsonl", "one JSON object per line"),
        _jsonl("d.jsonl", GOOD, b'{"question": "q", "ans'),
    ),
    Case(
        "json-not-rows",
        "data",
        (*TRAIN, "--data", "{tmp}/d.json"),
        ("{tmp}/d.json", "a JSON array of objects"),
        _file("d.json", b'"q #### 1"'),
    ),
    Case(
        "directory-as-data",
        "data",
        (*TRAIN, "--data", "{tmp}/data"),
        ("is a directory", "train.jsonl"),
        _folder("train.jsonl", "test.jsonl"),
    ),
    Case(
        "empty-directory-as-data", "data", (*TRAIN, "--data", "{tmp}/data"), ("is a directory", "holds none"), _folder()
    ),
    Case("missing-file", "data", (*TRAIN, "--data", "{tmp}/nope.jsonl"), ("not found", "'sample'")),
    Case(
        "text-file",
        "data",
        (*TRAIN, "--data", "{tmp}/d.txt"),
        ("unsupported file type '.txt'", ".csv"),
        _file("d.txt", b"question,answer\n"),
    ),
    Case(
        "csv-missing-column",
        "data",
        (*TRAIN, "--data", "{tmp}/d.csv"),
        ("missing column", "answer"),
        _file("d.csv", b"question,solution\nq,#### 1\n"),
    ),
    Case(
        "csv-bad-row",
        "data",
        (*TRAIN, "--data", "{tmp}/d.csv"),
        ("row 2", "not a number"),
        _file("d.csv", b'question,answer\nq1,"#### 1"\nq2,"#### many"\n'),
    ),
    Case(
        "csv-non-utf8",
        "data",
        (*TRAIN, "--data", "{tmp}/d.csv"),
        ("{tmp}/d.csv", "UTF-8 CSV"),
        _file("d.csv", b"question,answer\ncaf\xe9,1\n"),
    ),
    Case(
        "parquet-wrong-columns",
        "data",
        (*TRAIN, "--data", "{tmp}/d.parquet"),
        ("missing column", "question"),
        _parquet("d.parquet", {"text": ["q"], "answer": ["#### 1"]}),
    ),
    Case(
        "parquet-garbage",
        "data",
        (*TRAIN, "--data", "{tmp}/d.parquet"),
        ("{tmp}/d.parquet", "a Parquet table"),
        _file("d.parquet", b"PAR1 this is not parquet"),
    ),
    Case(
        "too-few-prompts",
        "data",
        (*TRAIN, "--data", "{tmp}/d.csv", "--set", "gradient_accumulation_steps=4"),
        ("1 usable prompt", "one optimizer step"),
        _file("d.csv", b"question,answer\nq1,7\n"),
    ),
    Case("hub-unreachable", "data", (*TRAIN, "--data", "gsm8k"), ("Couldn't reach", "--data sample"), _hub_unreachable),
    Case(
        "hf-home-is-a-file",
        "data",
        (*TRAIN, "--data", "sample"),
        ("the datasets cache", "{tmp}/hf is a file, not a folder", "HF_HOME"),
        _datasets_cache_under_a_file,
    ),
    Case(
        "eval-bad-row-no-eval-lenient",
        "data",
        ("eval", "--data", "{tmp}/d.jsonl", "--limit", "1"),
        ("row 1", "Fix that row", "Training can skip"),
        _jsonl("d.jsonl", {"question": "q", "answer": "#### x"}),
    ),
    Case("eval-limit-zero", "data", ("eval", "--data", "sample", "--limit", "0"), ("limit must be a positive",)),
    Case(
        "100k-rows-bad-last",
        "data",
        (*TRAIN, "--data", "{tmp}/d.jsonl"),
        ("row 100000", "not a number"),
        _jsonl("d.jsonl", *[GOOD] * 99_999, {"question": "q", "answer": "#### many"}),
    ),
    Case(
        "question-17k-tokens",
        "prompts",
        (*TRAIN, "--data", "{tmp}/d.jsonl"),
        ("All 1 prompts are longer than the prompt budget of 512 tokens", "--set max_prompt_length="),
        _jsonl("d.jsonl", {"question": "How many apples? " * 4_000, "answer": "#### 7"}),
    ),
    Case(
        "parquet-boolean-answers",
        "data",
        (*TRAIN, "--data", "{tmp}/d.parquet"),
        ("boolean",),
        _parquet("d.parquet", {"question": ["q1", "q2"], "answer": [True, False]}),
    ),
    # settings
    Case(
        "unknown-preset",
        "settings",
        ("train", "--preset", "tiny-gpu", "--data", "sample"),
        ("'tiny-gpu'", "Shipped:", "--recipe"),
    ),
    Case(
        "bad-reward-weight",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "reward_weights=two,1,0"),
        ("reward_weights", "invalid float value: 'two'"),
    ),
    Case(
        "reward-weights-count",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "reward_weights=[5,5]"),
        ("5 reward_funcs", "2 reward_weights", "one weight per reward"),
    ),
    Case(
        "unknown-reward",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "reward_funcs=corect", "--set", "reward_weights=[1]"),
        ("'corect'", "correctness"),
    ),
    Case(
        "reward-raises",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "reward_funcs=fault_raises:bad", "--set", "reward_weights=[1]"),
        ("'bad' raised KeyError", "before any weights loaded", "fault_raises.py, line 2"),
        _reward_module(
            "fault_raises", "def bad(completions, answer, **kwargs):\n    return [{}['x'] for _ in completions]\n"
        ),
    ),
    Case(
        "reward-wrong-length",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "reward_funcs=fault_short:short", "--set", "reward_weights=[1]"),
        ("'short' raised ValueError", "returned 1 scores for 3 completions"),
        _reward_module("fault_short", "def short(completions, **kwargs):\n    return [0.0]\n"),
    ),
    Case(
        "reward-is-a-builtin",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "reward_funcs=os:system", "--set", "reward_weights=[1]"),
        ("os.system", "builtins and classes cannot be rewards"),
    ),
    Case(
        "save-steps-zero",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "save_steps=0"),
        ("save_steps=0", "positive number of steps"),
    ),
    Case("bf16-on-cpu", "settings", (*TRAIN, "--data", "sample", "--set", "bf16=true"), ("needs a CUDA GPU", "bf16")),
    Case(
        "max-steps-huge",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "max_steps=99999999999999999999"),
        ("max_steps=99999999999999999999", "at most 10,000,000"),
    ),
    Case(
        "log-completions-not-a-bool",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "log_completions=maybe"),
        ("log_completions", "got maybe", "true/false"),
    ),
    Case(
        "recipe-bad-yaml",
        "settings",
        ("train", "--recipe", "{tmp}/bad.yaml", "--data", "sample"),
        ("bad.yaml, line 3, column 1", "not valid YAML"),
        _file("bad.yaml", b"name: bad\nlearning_rate: [1, 2\n"),
    ),
    Case(
        "unknown-set-field",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "learnin_rate=0.1"),
        ("learnin_rate", "learning_rate"),
    ),
    Case("set-without-value", "settings", (*TRAIN, "--data", "sample", "--set", "beta"), ("KEY=VALUE",)),
    Case(
        "gpu-preset-on-cpu",
        "settings",
        ("train", "--preset", "t4-16gb", "--data", "sample", "--output", "{tmp}/run"),
        ("needs a CUDA GPU", "--preset cpu", "T4 GPU"),
    ),
    Case("fp16-on-cpu", "settings", (*TRAIN, "--data", "sample", "--set", "fp16=true"), ("needs a CUDA GPU", "fp16")),
    Case(
        "batch-not-divisible",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "num_generations=3"),
        ("num_generations (3)", "divisible"),
    ),
    Case(
        "max-steps-zero",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "max_steps=0"),
        ("max_steps must be positive",),
    ),
    Case(
        "max-steps-negative",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "max_steps=-5"),
        ("max_steps must be positive",),
    ),
    Case(
        "learning-rate-zero", "settings", (*TRAIN, "--data", "sample", "--set", "learning_rate=0"), ("learning_rate",)
    ),
    Case(
        "learning-rate-inf",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "learning_rate=inf"),
        ("learning_rate is inf", "finite"),
    ),
    Case(
        "learning-rate-nan",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "learning_rate=nan"),
        ("learning_rate is nan", "finite"),
    ),
    Case("temperature-negative", "settings", (*TRAIN, "--data", "sample", "--set", "temperature=-1"), ("temperature",)),
    Case("beta-negative", "settings", (*TRAIN, "--data", "sample", "--set", "beta=-0.5"), ("beta",)),
    Case(
        "set-learning-rate-text",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "learning_rate=abc"),
        ("learning_rate: invalid float value: 'abc'",),
    ),
    Case(
        "set-learning-rate-infinity",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "learning_rate=Infinity"),
        ("learning_rate is inf", "finite"),
    ),
    Case(
        "set-max-steps-fraction",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "max_steps=1.5"),
        ("max_steps: invalid int value: '1.5'",),
    ),
    Case(
        "set-length-text",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "max_completion_length=abc"),
        ("max_completion_length: invalid int value: 'abc'",),
    ),
    Case("set-bool-text", "settings", (*TRAIN, "--data", "sample", "--set", "use_vllm=maybe"), ("use_vllm", "maybe")),
    Case(
        "set-trl-field-text",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "epsilon=wide"),
        ("epsilon: invalid float value: 'wide'",),
    ),
    Case(
        "vllm-share-above-one",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "vllm_gpu_memory_utilization=1.5"),
        ("vllm_gpu_memory_utilization",),
    ),
    Case(
        "num-generations-zero",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "num_generations=0"),
        ("num_generations=0 cannot be meant", "must be positive"),
    ),
    Case(
        "batch-size-zero",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "per_device_train_batch_size=0"),
        ("per_device_train_batch_size=0 cannot be meant", "must be positive"),
    ),
    Case(
        "accumulation-zero",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "gradient_accumulation_steps=0"),
        ("gradient_accumulation_steps=0 cannot be meant", "must be positive"),
    ),
    Case(
        "reward-builtins-len",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "reward_funcs=builtins:len", "--set", "reward_weights=[1]"),
        ("builtins.len", "builtins and classes cannot be rewards"),
    ),
    Case(
        "reward-returns-bool",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "reward_funcs=fault_bool:passed", "--set", "reward_weights=[1]"),
        ("'passed' returned True (a bool, not a number)", "Return a float"),
        _reward_module("fault_bool", "def passed(completions, **kwargs):\n    return [True for _ in completions]\n"),
    ),
    # rewards that train
    Case(
        "rewards-lambda-partial-object",
        "rewards",
        (
            *TRAIN,
            *ON_TINY,
            "--data",
            "sample",
            "--set",
            "max_steps=1",
            "--set",
            "reward_funcs=fault_forms:by_lambda,fault_forms:by_partial,fault_forms:by_object",
            "--set",
            "reward_weights=[1,1,1]",
        ),
        ("steps: 1",),
        _reward_module("fault_forms", FORMS),
        code=0,
    ),
    Case(
        "reward-always-none",
        "rewards",
        (
            *TRAIN,
            *ON_TINY,
            "--data",
            "sample",
            "--set",
            "max_steps=2",
            "--set",
            "reward_funcs=fault_none:abstain",
            "--set",
            "reward_weights=[1]",
        ),
        ("warning: the run learned nothing", "no reward was given at any of 2 logged steps", "export refuses it"),
        _reward_module("fault_none", "def abstain(completions, **kwargs):\n    return [None for _ in completions]\n"),
        code=1,
    ),
    Case(
        "rewards-all-equal",
        "rewards",
        (
            *TRAIN,
            *ON_TINY,
            "--data",
            "sample",
            "--set",
            "max_steps=2",
            "--set",
            "reward_funcs=format",
            "--set",
            "reward_weights=[1]",
        ),
        ("warning: the run learned nothing", "grad_norm was 0 at all 2 logged steps", "tell a group's completions"),
        code=1,
    ),
    # resume and run folders
    Case("resume-no-folder", "resume", (*TRAIN, "--data", "sample", "--resume"), ("there is no run folder",)),
    Case(
        "output-not-a-run",
        "resume",
        (*TRAIN, "--data", "sample"),
        ("not a grpo-kit run folder", "notes.txt", "Choose another --output"),
        _run_with("notes.txt"),
    ),
    Case(
        "resume-not-a-run",
        "resume",
        RESUME,
        ("not a grpo-kit run folder", "notes.txt", "nothing there was touched"),
        _run_with("notes.txt", "data.json"),
    ),
    Case(
        "output-is-a-run", "resume", (*TRAIN, "--data", "sample"), ("already has files", "--resume"), _run_with(steps=1)
    ),
    Case(
        "resume-other-group-size",
        "resume",
        (*RESUME, "--set", "num_generations=4", "--set", "per_device_train_batch_size=4"),
        ("num_generations (2 -> 4)", "per_device_train_batch_size (2 -> 4)", "only max_steps", "another folder"),
        _run_with(steps=1, adapter=True),
    ),
    Case(
        "resume-other-learning-rate",
        "resume",
        (*RESUME, "--set", "learning_rate=1e-4"),
        ("learning_rate (0.0005 -> 0.0001)",),
        _run_with(steps=1, adapter=True),
    ),
    Case(
        "resume-other-preset",
        "resume",
        ("train", "--preset", "cpu-4bit", *TINY[2:], "--data", "sample", "--output", "{tmp}/run", "--resume"),
        ("model_name_or_path ('embedded:smollm2-135m' -> 'embedded:smollm2-135m-bnb-4bit')",),
        _run_with(steps=1, adapter=True),
    ),
    Case(
        "resume-other-data",
        "resume",
        (*TRAIN, "--data", "arithmetic", "--resume"),
        ("data (sample -> arithmetic)", "--data are left out"),
        _run_with(steps=1, adapter=True),
    ),
    Case(
        "resume-torn-run-json",
        "resume",
        ("train", "--output", "{tmp}/run", "--resume"),
        ("run.json cannot be read", "Restore it from a copy", "checkpoints are untouched"),
        _chain(_run_with(steps=1, adapter=True), lambda tmp, env: _cut("run.json", keep=20)(tmp / "run")),
    ),
    Case(
        "resume-as-recorded",
        "resume",
        ("train", "--output", "{tmp}/run", "--resume"),
        ("as recorded in", "already finished: step 1 of 1"),
        _run_with(steps=1, adapter=True),
        code=0,
    ),
    Case("output-in-use", "resume", (*TRAIN, "--data", "sample"), ("in use", "PID"), _run_with(locked=True)),
    Case(
        "resume-while-running",
        "resume",
        (*TRAIN, "--data", "sample", "--resume"),
        ("in use", "PID"),
        _run_with(steps=1, locked=True),
    ),
    Case(
        "resume-finished-run",
        "resume",
        (*TRAIN, "--data", "sample", "--resume"),
        ("already finished: step 2 of 2",),
        _run_with(steps=2, adapter=True),
        code=0,
    ),
    Case(
        "truncated-final-adapter",
        "resume",
        (*TRAIN, "--data", "sample", "--resume"),
        ("already finished: step 2 of 2",),
        _damaged_final_adapter,
        code=0,
    ),
    Case(
        "killed-during-checkpoint-save",
        "resume",
        (*TRAIN, "--data", "sample", "--resume"),
        ("already finished: step 1 of 1",),
        _damaged_last_checkpoint(_drop("trainer_state.json")),
        code=0,
    ),
    Case(
        "torn-trainer-state",
        "resume",
        (*TRAIN, "--data", "sample", "--resume"),
        ("already finished: step 1 of 1",),
        _damaged_last_checkpoint(_cut("trainer_state.json")),
        code=0,
    ),
    Case(
        "checkpoint-without-optimizer",
        "resume",
        (*TRAIN, "--data", "sample", "--resume"),
        ("already finished: step 1 of 1",),
        _damaged_last_checkpoint(_drop("optimizer.pt")),
        code=0,
    ),
    Case(
        "truncated-checkpoint-adapter",
        "resume",
        (*TRAIN, "--data", "sample", "--resume"),
        ("already finished: step 1 of 1",),
        _damaged_last_checkpoint(_cut("adapter_model.safetensors")),
        code=0,
    ),
    Case(
        "output-is-a-file",
        "resume",
        (*TRAIN, "--data", "sample"),
        ("Cannot write the run into", "is a file, not a folder", "--output"),
        _file("run", b"a file, not a folder"),
    ),
    Case(
        "output-read-only",
        "resume",
        ("train", *TINY, "--data", "sample", "--output", "{tmp}/ro/run"),
        ("Cannot write the run into", "Permission denied"),
        _read_only("ro"),
    ),
    Case(
        "killed-lock-holder",
        "resume",
        (*TRAIN, "--data", "sample", "--resume"),
        ("already finished: step 2 of 2",),
        _killed_lock_holder,
        code=0,
    ),
    Case(
        "run-folder-disk-full",
        "resume",
        (*TRAIN, "--data", "sample"),
        ("Cannot write the run into {tmp}/run", "No space left", "free disk space"),
        _no_space(tempfile, "TemporaryFile", when=lambda args, kwargs: "run" in Path(kwargs.get("dir", "")).parts),
    ),
    # a full disk while training
    Case(
        "checkpoint-disk-full",
        "disk",
        (*TRAIN, "--data", "sample", "--set", "max_steps=1", "--set", "save_steps=1"),
        ("Training stopped at step 1", "No checkpoint was complete yet", "Free disk space", "--resume"),
        _checkpoint_save_fails,
    ),
    # export
    Case("export-not-an-adapter", "export", ("export", "--adapter", "{tmp}"), ("not a LoRA adapter folder",)),
    Case(
        "export-run-folder",
        "export",
        ("export", "--adapter", "{tmp}/run"),
        ("not a LoRA adapter folder", "{tmp}/run/adapter"),
        _adapter(),
    ),
    Case(
        "export-unknown-format", "export", (*EXPORT, "--format", "onnx"), ("onnx", "lora, merged16, gguf"), _adapter()
    ),
    Case("export-bad-gguf-type", "export", (*EXPORT, "--format", "gguf", "--gguf-type", "q2_k"), ("q2_k",), _adapter()),
    Case("export-existing-name", "export", EXPORT, ("already exists", "--overwrite"), _export_exists),
    Case("export-nan-adapter", "export", EXPORT, ("NaN/inf weights", "--set learning_rate="), _adapter(_nan)),
    Case("export-truncated-adapter", "export", EXPORT, ("cannot be read", "checkpoint-N"), _adapter(_truncate)),
    Case(
        "export-other-base",
        "export",
        (
            "export",
            "--adapter",
            "{tmp}/run/adapter",
            "--model",
            "{tmp}/other",
            "--format",
            "merged16",
            "--out-dir",
            "{tmp}/exports",
        ),
        ("trained on {tiny}", "--model", "size mismatch"),
        _other_base,
    ),
    Case("export-disk-full", "export", EXPORT, ("No space left", "nothing was changed"), _disk_full),
    Case(
        "export-read-only-out-dir",
        "export",
        (*EXPORT[:-1], "{tmp}/ro"),
        ("Cannot write exports", "Permission denied"),
        _read_only("ro", _adapter()),
    ),
    Case(
        "export-lora-changes-nothing",
        "export",
        EXPORT,
        ("its LoRA changes nothing", "every lora_B is still 0", "learned nothing"),
        _adapter(std=0.0),
    ),
    Case(
        "export-out-dir-is-a-file",
        "export",
        (*EXPORT[:-1], "{tmp}/afile"),
        ("{tmp}/afile is a file, not a folder", "--out-dir"),
        _chain(_adapter(), _file("afile", b"kept")),
    ),
    Case(
        "export-collapsed-run",
        "export",
        EXPORT,
        ("its run collapsed", "earlier checkpoint-N", "learning_rate"),
        _collapsed_run,
    ),
    Case(
        "export-upload-fails",
        "export",
        (*EXPORT, "--push-to-hub", "me/model"),
        ("Upload", "failed", "complete and verified on disk"),
        _upload_fails,
    ),
    Case(
        "export-push-without-token",
        "export",
        (*EXPORT, "--push-to-hub", "me/model"),
        ("No Hugging Face token", "complete"),
        _no_token,
    ),
    # eval
    Case("eval-missing-adapter", "eval", EVAL, ("not a LoRA adapter folder",)),
    Case("eval-batch-size-zero", "eval", ("eval", "--data", "sample", "--batch-size", "0"), ("--batch-size", "got 0")),
    Case("chat-empty-question", "chat", ("chat", " "), ("The question is empty",)),
    Case(
        "chat-max-new-tokens-zero",
        "chat",
        ("chat", "--max-new-tokens", "0", "What is 2+2?"),
        ("--max-new-tokens must be at least 1 (got 0)",),
    ),
    Case(
        "chat-max-new-tokens-negative",
        "chat",
        ("chat", "--max-new-tokens", "-5", "What is 2+2?"),
        ("--max-new-tokens must be at least 1 (got -5)",),
    ),
    Case(
        "chat-temperature-negative",
        "chat",
        ("chat", "--temperature", "-1", "What is 2+2?"),
        ("--temperature must be a number above 0", "got -1.0", "greedy"),
    ),
    Case(
        "chat-temperature-nan",
        "chat",
        ("chat", "--temperature", "nan", "What is 2+2?"),
        ("--temperature must be a number above 0", "got nan"),
    ),
    Case(
        "eval-out-disk-full",
        "eval",
        (*EVAL, "--out", "{tmp}/out/e.json"),
        ("Cannot write {tmp}/out/e.jsonl", "No space left", "Free disk space"),
        _chain(_adapter(), _no_space(Path, "write_text", when=lambda args, kwargs: "out" in args[0].parts)),
    ),
    Case(
        "eval-out-under-a-file",
        "eval",
        (*EVAL, "--out", "{tmp}/afile/e.json"),
        ("{tmp}/afile is a file, not a folder", "another path"),
        _chain(_adapter(), _file("afile", b"kept")),
    ),
    Case("eval-compare-without-adapter", "eval", ("eval", "--data", "sample", "--compare"), ("--adapter DIR",)),
    Case(
        "eval-out-beside-its-data",
        "output",
        ("eval", "--data", "{tmp}/mine.jsonl", "--out", "{tmp}/mine.json"),
        ("would overwrite {tmp}/mine.jsonl, which grpo-kit eval did not write", "Choose another --out"),
        _jsonl("mine.jsonl", GOOD),
    ),
    Case(
        "eval-out-over-a-run-log",
        "output",
        ("eval", "--adapter", "{tmp}/run/adapter", "--compare", "--out", "{tmp}/run/metrics.json"),
        ("would overwrite {tmp}/run/metrics.jsonl",),
        _run_with("metrics.jsonl", steps=1, adapter=True),
    ),
    Case(
        "eval-out-is-a-folder",
        "output",
        ("eval", "--data", "sample", "--out", "{tmp}/data"),
        ("name a .json file", "--out {tmp}/data/eval.json"),
        _folder(),
    ),
    Case(
        "eval-out-not-json", "output", ("eval", "--out", "{tmp}/r.jsonl"), ("name a .json file", "--out {tmp}/r.json")
    ),
    Case(
        "gold-grouped-by-spaces",
        "eval",
        ("eval", "--model", "{tiny}", "--data", "{tmp}/d.jsonl", "--max-new-tokens", "2"),
        ("n=1",),
        _jsonl("d.jsonl", {"question": "How many?", "answer": "#### 1 000"}),
        code=0,
    ),
    Case("eval-truncated-adapter", "eval", EVAL, ("cannot be read", "checkpoint-N"), _adapter(_truncate)),
    Case("eval-nan-adapter", "eval", EVAL, ("NaN/inf weights",), _adapter(_nan)),
    Case(
        "eval-other-base",
        "eval",
        ("eval", "--model", "{tmp}/other", "--adapter", "{tmp}/run/adapter", "--data", "sample", "--limit", "1"),
        ("trained on {tiny}", "--model", "size mismatch"),
        _other_base,
    ),
    Case(
        "eval-adapter-names-this-model",
        "eval",
        ("eval", "--model", "{tmp}/other", "--adapter", "{tmp}/run/adapter", "--data", "sample", "--limit", "1"),
        ("yet adapter_config.json names {tmp}/other", "size mismatch"),
        _names_the_other_base,
    ),
    Case(
        "eval-model-missing",
        "eval",
        ("eval", "--model", "{tmp}/nope", "--data", "sample"),
        ("No model folder", "--model embedded"),
    ),
    Case(
        "eval-model-not-a-model",
        "eval",
        ("eval", "--model", "{tmp}/data", "--data", "sample"),
        ("not a complete model", "--model embedded"),
        _folder("notes.jsonl"),
    ),
    Case(
        "eval-model-without-tokenizer",
        "eval",
        ("eval", "--model", "{tmp}/model", "--data", "sample", "--limit", "1"),
        ("tokenizer",),
        _no_tokenizer_model,
    ),
    # round 6: settings checked before loading, advice that fits
    Case(
        "report-to-not-installed",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "report_to=wandb"),
        ("report_to=wandb", "pip install wandb", "--set report_to=none"),
    ),
    Case(
        "report-to-unknown",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "report_to=wandbb"),
        ("wandbb is not supported", "--set report_to=none"),
    ),
    Case(
        "vllm-on-cpu",
        "settings",
        (*TRAIN, "--data", "sample", "--set", "use_vllm=true"),
        ("needs a CUDA GPU for use_vllm", "--set use_vllm=false"),
    ),
    Case(
        "recipe-duplicate-key",
        "settings",
        ("train", "--recipe", "{tmp}/twice.yaml", "--data", "sample", "--output", "{tmp}/run"),
        ("twice.yaml: max_steps is set on lines [2, 4]",),
        _file("twice.yaml", b"name: twice\nmax_steps: 1\nlora_r: 8\nmax_steps: 3\n"),
    ),
    Case(
        "used-output-in-use",
        "resume",
        (*TRAIN, "--data", "sample"),
        ("in use by another training process", "PID"),
        _run_with(steps=1, locked=True),
    ),
    Case("resume-without-output", "resume", ("train", "--resume"), ("--resume continues a run", "--output RUN")),
    Case(
        "eval-compare-merged",
        "eval",
        ("eval", "--model", "{tmp}/exports/run/merged16", "--data", "sample", "--compare"),
        ("a LoRA merged in", "--model {tiny} --adapter ADAPTER --compare", "--check-answers N"),
        _merged_export,
    ),
    Case(
        "eval-adapter-on-its-merge",
        "eval",
        ("eval", "--model", "{tmp}/exports/run/merged16", "--adapter", "{tmp}/run/adapter", "--data", "sample"),
        ("with a LoRA merged in", "goes on {tiny} itself", "--model {tiny} --adapter ADAPTER --compare"),
        _merged_export,
    ),
    Case(
        "data-saved-to-disk",
        "eval",
        ("eval", "--model", "{tiny}", "--data", "{tmp}/ds", "--max-new-tokens", "2"),
        ("n=2",),
        _saved_to_disk(),
        code=0,
    ),
    Case(
        "data-saved-to-disk-no-test-split",
        "data",
        ("eval", "--data", "{tmp}/ds"),
        ("{tmp}/ds has no 'test' split, only train",),
        _saved_to_disk(["train"]),
    ),
]


# ------------------------------------------------------------------------------------------------ the test


@pytest.fixture
def hold_lock():
    """``hold_lock(run_dir)``: another process takes the run folder's lock as ``train`` does and keeps it."""
    import subprocess

    started = []

    def hold(run_dir):
        code = (
            "import sys, time; from pathlib import Path; from grpo_kit import runs; "
            "run = runs.Run(Path(sys.argv[1])); run.lock(); print('locked', flush=True); time.sleep(600)"
        )
        started.append(subprocess.Popen([sys.executable, "-c", code, str(run_dir)], stdout=subprocess.PIPE, text=True))
        assert started[-1].stdout.readline() == "locked\n"

    def kill():
        for process in started:
            process.kill()
            process.wait()

    hold.kill = kill
    yield hold
    kill()


def _snapshot(folder: Path) -> dict:
    """Every readable file but the lock's PID file: the kit's own, rewritten by whoever takes the lock next."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and os.access(p, os.R_OK) and p.name != PID_NAME)
    return {p: p.read_bytes() for p in files}


def _locks(folder: Path) -> set[Path]:
    return {path for path in folder.rglob("*") if path.name in (LOCK_NAME, PID_NAME)}


def _fill(argv, tmp, tiny) -> list[str]:
    return [arg.replace("{tmp}", str(tmp)).replace("{tiny}", str(tiny)) for arg in argv]


@pytest.mark.parametrize("case", [pytest.param(c, id=c.id) for c in CASES])
def test_fault(case, tmp_path, capsys, monkeypatch, tiny_model_dir, make_adapter, fake_checkpoint, hold_lock, request):
    if case.area in PRELOAD_AREAS:
        request.getfixturevalue("no_model_load")
    env = {
        "tiny": tiny_model_dir,
        "make_adapter": make_adapter,
        "fake_checkpoint": fake_checkpoint,
        "monkeypatch": monkeypatch,
        "hold_lock": hold_lock,
    }
    if case.setup:
        case.setup(tmp_path, env)
    before, locks = _snapshot(tmp_path), _locks(tmp_path)
    code = main(_fill(case.argv, tmp_path, tiny_model_dir))
    captured = capsys.readouterr()
    stream = captured.err if case.code == 2 else captured.out  # 1: a run that trained, and failed (its summary says)
    assert code == case.code, f"exit {code}\nstdout: {captured.out[-2000:]}\nstderr: {captured.err[-2000:]}"
    assert "Traceback" not in captured.err + captured.out
    if case.code == 2:
        assert "grpo-kit: error: " in stream and stream.count("\n") < MAX_ERROR_LINES, stream
        if case.area != "disk":  # refused: a run folder is left as it was, no lock files either
            assert _locks(tmp_path) <= locks, _locks(tmp_path) - locks
    for text in _fill(case.expect, tmp_path, tiny_model_dir):
        assert text in stream, (text, stream)
    if case.area in {"data", "settings"}:
        assert not (tmp_path / "run").exists(), "a run folder was created for a run that cannot start"
    after = _snapshot(tmp_path)
    kept = [(_original(path), data) for path, data in after.items()]
    lost = [str(path) for path, data in before.items() if (path, data) not in kept]
    assert not lost, f"changed or removed: {lost}"


def _original(path: Path) -> Path:
    """Where a file was before resume set its damaged checkpoint aside (``damaged-checkpoint-N.old-<time>/``)."""
    return Path(re.sub(r"/damaged-(checkpoint-\d+|adapter)\.old-[^/]+/", r"/\1/", str(path)))


# ------------------------------------------------------------------------------------------------ beyond the table


def test_csv_data_is_read_with_the_same_checks(tmp_path):
    from grpo_kit.data import load_gsm8k

    path = tmp_path / "train.csv"
    path.write_text(
        'question,answer\n"Tom has 3 + 4 apples, how many?","3 + 4 = 7\n#### 7"\nHalf of 8?,4\n', encoding="utf-8"
    )
    data = load_gsm8k(str(path))
    assert data["answer"] == ["7", "4"] and data["question"][0] == "Tom has 3 + 4 apples, how many?"
