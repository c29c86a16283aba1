"""GSM8K accuracy under lm-evaluation-harness's own tasks, for numbers that sit next to a paper's.

The kit's protocol (``grpo_kit.evaluate``: zero-shot chat prompt, ``<answer>`` tags, strict/lenient) measures what
GRPO trains. Published GSM8K figures come from other protocols, most often lm-evaluation-harness's tasks:

- ``gsm8k``: 5 examples drawn from the train split, "Question: … Answer:" prompts, scored on ``#### N``;
- ``gsm8k_cot``: 8 fixed chain-of-thought examples, "Q: … A:" prompts, scored on "The answer is N".

Each reports ``exact_match`` under two filters: **strict-match** (only the formats above) and **flexible-extract**
(the last number-like string). Numbers from the two protocols are not comparable with each other; every number this
module returns carries its protocol sentence. lm-eval is an optional extra (``pip install grpo-kit[harness]``) and
is imported only here.

Offline use: ``data`` may be a local GSM8K-format file instead of the Hub's ``openai/gsm8k``. The task's dataset is
then replaced by a JSON file of the selected questions (lm-eval's ``dataset_path: json`` with ``data_files``);
``gsm8k`` also needs the train split for its examples (``fewshot_data``).

>>> print(harness_protocol("gsm8k_cot", n=50, max_new_tokens=256, version="0.4.13"))
lm-evaluation-harness 0.4.13 task gsm8k_cot (8 fixed chain-of-thought examples, 'Q: ... A:' prompts, no chat template), n=50, greedy, max_gen_toks=256; strict-match = 'The answer is N', flexible-extract = last number-like string; exact_match
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from grpo_kit.errors import GrpoKitError

#: lm-eval task name -> how its prompt is built and what its strict filter reads.
HARNESS_TASKS = {
    "gsm8k": ("5 examples from the train split, 'Question: ... Answer:' prompts, no chat template", "'#### N'"),
    "gsm8k_cot": ("8 fixed chain-of-thought examples, 'Q: ... A:' prompts, no chat template", "'The answer is N'"),
}
#: The lm-eval release the protocol sentences and task overrides were written against (the ``harness`` extra).
LM_EVAL_VERSION = "0.4.13"
_METRIC = "exact_match"
_FILTERS = ("strict-match", "flexible-extract")


@dataclass(frozen=True)
class HarnessResult:
    """lm-eval's exact_match under its two filters (fractions in 0..1), labelled with the protocol."""

    task: str
    strict_match: float
    flexible_extract: float
    n: int
    protocol: str
    label: str = ""
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        """One line: ``gsm8k_cot: strict-match 2.0 % | flexible-extract 6.0 % | n=50``."""
        return (
            f"{self.task}: strict-match {100 * self.strict_match:.1f} % | "
            f"flexible-extract {100 * self.flexible_extract:.1f} % | n={self.n}"
        )

    def save(self, path: str | os.PathLike) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        return path


def harness_protocol(task: str, *, n: int, max_new_tokens: int, version: str) -> str:
    """The sentence stored next to every harness number."""
    prompt, strict = HARNESS_TASKS[task]
    return (
        f"lm-evaluation-harness {version} task {task} ({prompt}), n={n}, greedy, max_gen_toks={max_new_tokens}; "
        f"strict-match = {strict}, flexible-extract = last number-like string; {_METRIC}"
    )


def check_task(task: str) -> None:
    if task not in HARNESS_TASKS:
        raise GrpoKitError(f"Unknown harness task {task!r}. Choose one of: {', '.join(HARNESS_TASKS)}.")


def _import_lm_eval():
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError as error:
        raise GrpoKitError(
            "--harness needs lm-evaluation-harness, an optional extra: pip install 'grpo-kit[harness]' "
            f"(lm-eval=={LM_EVAL_VERSION}). The kit's own protocol needs nothing more: leave out --harness."
        ) from error
    return lm_eval, HFLM, TaskManager


def write_questions(dataset, path: Path) -> Path:
    """The selected questions as GSM8K-format JSON lines (``question``, ``answer``) for lm-eval's json loader."""
    with path.open("w", encoding="utf-8") as handle:
        for question, answer in zip(dataset["question"], dataset["answer"], strict=True):
            handle.write(json.dumps({"question": question, "answer": str(answer)}, ensure_ascii=False) + "\n")
    return path


def task_config(task: str, task_manager, test_file: Path, fewshot_file: str | os.PathLike | None) -> dict[str, Any]:
    """lm-eval's registered config of ``task`` with its dataset replaced by local JSON files (no Hub access)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    entry = task_manager.task_index.get(task)
    if entry is None or entry.yaml_path is None:
        raise GrpoKitError(f"The installed lm-eval has no task {task!r}; install lm-eval=={LM_EVAL_VERSION}.")
    config = load_yaml(entry.yaml_path, resolve_func=True)
    data_files = {config["test_split"]: str(test_file)}
    for key in ("training_split", "fewshot_split"):
        split = config.get(key)
        if split and split not in data_files:
            if fewshot_file is None:
                raise GrpoKitError(
                    f"lm-eval's {task} draws its examples from the GSM8K train split: pass --fewshot-data with a "
                    "local copy of it (GSM8K format, answers with their '#### N' solutions), or use --harness "
                    "gsm8k_cot, whose examples are part of the task."
                )
            if not Path(fewshot_file).is_file():
                raise GrpoKitError(f"Few-shot data file not found: {fewshot_file}. Pass the GSM8K train split.")
            data_files[split] = str(fewshot_file)
    config.update(dataset_path="json", dataset_name=None, dataset_kwargs={"data_files": data_files})
    return config


def _scores(results: dict, task: str) -> tuple[float, float]:
    row = results["results"][task]
    return tuple(float(row[f"{_METRIC},{name}"]) for name in _FILTERS)


def evaluate_harness(
    model: str,
    dataset,
    *,
    task: str = "gsm8k_cot",
    adapter: str | os.PathLike | None = None,
    fewshot_data: str | os.PathLike | None = None,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    label: str = "",
) -> HarnessResult:
    """lm-eval's ``task`` on the questions of ``dataset`` for ``model`` (+ ``adapter``), on GPU when there is one.

    ``model`` is a Hub id or a folder (``grpo_kit.models.resolve_model_id`` maps ``embedded``); lm-eval loads it
    itself (``HFLM``, PEFT adapter via ``peft=``), float32 on CPU, the checkpoint's dtype on a GPU (not run on a GPU).
    """
    import torch

    from grpo_kit.models import resolve_model_id

    check_task(task)
    lm_eval, HFLM, TaskManager = _import_lm_eval()
    if adapter is not None and not (Path(adapter) / "adapter_config.json").is_file():
        raise GrpoKitError(f"{adapter} is not a LoRA adapter folder (no adapter_config.json).")
    cuda = torch.cuda.is_available()
    lm = HFLM(
        pretrained=resolve_model_id(model),
        peft=str(adapter) if adapter is not None else None,
        device="cuda" if cuda else "cpu",
        dtype="auto" if cuda else "float32",
        batch_size=batch_size,
    )
    started = time.time()
    # Index only lm-eval's gsm8k folder: scanning every built-in task takes longer than a short CPU run.
    manager = TaskManager(include_path=str(Path(lm_eval.__file__).parent / "tasks" / "gsm8k"), include_defaults=False)
    with tempfile.TemporaryDirectory(prefix="grpo-kit-harness-") as folder:
        test_file = write_questions(dataset, Path(folder) / "test.jsonl")
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=[task_config(task, manager, test_file, fewshot_data)],
            task_manager=manager,
            gen_kwargs={"max_gen_toks": max_new_tokens},
            log_samples=False,
            bootstrap_iters=0,
        )
    strict, flexible = _scores(results, task)
    protocol = harness_protocol(task, n=len(dataset), max_new_tokens=max_new_tokens, version=lm_eval.__version__)
    return HarnessResult(task, strict, flexible, len(dataset), protocol, label, round(time.time() - started, 2))


def _runs(args) -> dict[str, str | None]:
    """Which models to evaluate: name -> adapter (None = the base model), as ``grpo-kit eval`` names them."""
    if args.adapter and args.compare:
        return {"base": None, "tuned": args.adapter}
    return {"tuned": args.adapter} if args.adapter else {"base": None}


def _out_path(out: Path, name: str, runs: dict) -> Path:
    """``--out`` for the tuned (or only) result; ``<stem>-base.json`` beside it for the base one with --compare."""
    return out if len(runs) == 1 or name == "tuned" else out.with_name(f"{out.stem}-{name}{out.suffix or '.json'}")


def cli_harness(args, dataset) -> int:
    """``grpo-kit eval --harness TASK``: lm-eval's task on the base model, on base+adapter, or both (--compare)."""
    check_task(args.harness)
    if args.maj:
        raise GrpoKitError("--maj belongs to the kit's protocol; lm-eval's gsm8k tasks are greedy. Leave out --maj.")
    options = dict(
        task=args.harness,
        fewshot_data=args.fewshot_data,
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
    )
    runs = _runs(args)
    started = time.time()
    for name, adapter in runs.items():
        result = evaluate_harness(args.model, dataset, adapter=adapter, label=name, **options)
        print(f"{name}: {result.summary()}")
        if args.out:
            print(f"wrote {result.save(_out_path(Path(args.out), name, runs))}")
    print(f"protocol: {result.protocol}")
    print(f"wall time {time.time() - started:.0f} s")
    return 0
