"""Held-out accuracy: greedy pass@1 (and optional maj@k) on GSM8K-format questions, before and after training.

Every number comes with its protocol, because the protocol alone moves GSM8K scores by many points:

- **strict**: the number inside the last ``<answer>…</answer>`` block (``answers.extract_tagged_answer``);
- **lenient**: the last number anywhere in the completion (``answers.extract_last_number``);
- both compared to the gold number after normalization (``answers.answers_match``: ``"$1,000"`` == ``"1000.0"``).

Prompts are built exactly as for training (``data.build_messages`` + the chat template via ``data.render_prompt``,
plus the optional ``prefill``), and the prefill counts as part of the answer text when scoring, as the rewards do.

On CPU (and on a GPU without vLLM) generation is batched Hugging Face ``generate`` with left padding and pinned
decoding settings (``machinery.generation.generate_hf``). On a GPU, a model loaded by Unsloth with
``fast_inference=True`` (it has ``fast_generate``) is sampled through vLLM instead, with its LoRA adapter loaded
into the engine (``machinery.generation.engine_lora_request``); that path is small, not run on a GPU, and tested
on CPU with a fake engine. The before/after table, the chart and ``grpo-kit eval`` live in
``machinery.eval_report``.

>>> r = EvalResult(accuracy_strict=0.25, accuracy_lenient=0.5, format_rate=0.75, mean_completion_tokens=40.0,
...                n=4, seed=0, protocol="toy")
>>> r.to_dict()["accuracy_lenient"], "rows" in r.to_dict()
(0.5, False)
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from grpo_kit.answers import answers_match, extract_last_number, extract_tagged_answer, normalize_number
from grpo_kit.errors import GrpoKitError
from grpo_kit.machinery.generation import _use_vllm, engine_lora_request, generate_hf, generate_vllm

#: Sampling temperature for maj@k (greedy pass@1 uses no temperature).
MAJ_TEMPERATURE = 0.7


@dataclass(frozen=True)
class EvalResult:
    """Metrics of one evaluation (fractions in 0..1) plus per-question ``rows``.

    ``rows`` (one dict per question: question, gold, completion, extracted_strict, extracted_lenient,
    correct_strict, correct_lenient, in_format, completion_tokens, and maj fields with maj@k) is kept out of
    ``to_dict()`` and written by ``save`` to a sibling ``.jsonl``.
    """

    accuracy_strict: float
    accuracy_lenient: float
    format_rate: float
    mean_completion_tokens: float
    n: int
    seed: int
    protocol: str
    label: str = ""
    maj_k: int = 0
    maj_accuracy_strict: float | None = None
    maj_accuracy_lenient: float | None = None
    seconds: float = 0.0
    rows: tuple[dict, ...] = field(default=(), repr=False, compare=False)

    def to_dict(self) -> dict:
        """Metrics and protocol as a JSON-ready dict (no rows)."""
        out = asdict(self)
        out.pop("rows")
        return out

    def save(self, path: str | os.PathLike) -> Path:
        """Write metrics+protocol JSON to ``path`` and the rows to ``path`` with suffix ``.jsonl``. Returns ``path``."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        with rows_path(path).open("w", encoding="utf-8") as handle:
            for row in self.rows:
                handle.write(json.dumps(row, ensure_ascii=False) + "\n")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> EvalResult:
        """Read a result written by ``save`` (rows too, when the ``.jsonl`` is there)."""
        path = Path(path)
        data = json.loads(path.read_text(encoding="utf-8"))
        rows_file = rows_path(path)
        rows = tuple(json.loads(line) for line in rows_file.read_text(encoding="utf-8").splitlines() if line.strip()) if rows_file.is_file() else ()
        return cls(**data, rows=rows)

    def summary(self) -> str:
        """One line: ``strict 3.0 % | lenient 12.0 % | format 40.0 % | 88 tokens | n=100``."""
        maj = ""
        if self.maj_k:
            maj = f" | maj@{self.maj_k} strict {100 * self.maj_accuracy_strict:.1f} % lenient {100 * self.maj_accuracy_lenient:.1f} %"
        return (
            f"strict {100 * self.accuracy_strict:.1f} % | lenient {100 * self.accuracy_lenient:.1f} % | "
            f"format {100 * self.format_rate:.1f} % | {self.mean_completion_tokens:.0f} tokens | n={self.n}{maj}"
        )


def rows_path(path: str | os.PathLike) -> Path:
    """Where ``EvalResult.save(path)`` puts the rows: ``eval.json`` -> ``eval.jsonl``."""
    return Path(path).with_suffix(".jsonl")


# ----------------------------------------------------------------------------------------------------- scoring


def _score_row(completion: str, gold: str, prefill: str = "") -> dict:
    """One completion under both protocols; the prefill is part of the answer text.

    Strict correctness and the format are the training rewards' verdicts (``machinery.reward_specs.score_completions``), so
    "strict" here means exactly what the ``correctness`` reward paid; lenient reads the last number in the text.

    >>> s = _score_row("3 + 4 = 7</think>\\n<answer>7</answer>", "7", prefill="<think>\\n")
    >>> s["correct_strict"], s["correct_lenient"], s["in_format"]
    (True, True, True)
    >>> _score_row("so the answer is 7.", "7")["correct_strict"]
    False
    """
    from grpo_kit.machinery.reward_specs import score_completions

    scores = score_completions([completion], gold, ["correctness", "format"], prefill)[0]
    text = prefill + completion
    lenient = extract_last_number(text)
    return {
        "extracted_strict": extract_tagged_answer(text),
        "extracted_lenient": lenient,
        "correct_strict": scores["correctness"] > 0,
        "correct_lenient": answers_match(lenient, gold),
        "in_format": scores["format"] > 0,
    }


def majority_vote(answers: Sequence[str | None]) -> str | None:
    """Most common normalized number among ``answers`` (None and unreadable ones ignored; ties: first seen).

    >>> majority_vote(["$1,000", "7", "1000.0", None])
    '1000'
    >>> majority_vote([None, "x"]) is None
    True
    """
    numbers = [n for n in (normalize_number(a) if a is not None else None for a in answers) if n is not None]
    if not numbers:
        return None
    counts = Counter(numbers)
    best = max(counts.values())
    return next(n for n in numbers if counts[n] == best)


def describe_protocol(
    *, data: str, n: int, seed: int, few_shot: int, prefill: str, max_new_tokens: int, maj_k: int
) -> str:
    """The sentence stored next to every number: data, prompt, decoding, extraction."""
    text = (
        f"{data}, n={n} (seed {seed}); chat prompt: grpo_kit.data.SYSTEM_PROMPT, few_shot={few_shot}, "
        f"prefill={prefill!r}; greedy decoding, max_new_tokens={max_new_tokens}; "
        "strict = number inside the last <answer></answer>, lenient = last number in the text, "
        "both normalized and compared exactly (grpo_kit.answers)"
    )
    if maj_k:
        text += f"; maj@{maj_k}: {maj_k} samples at temperature {MAJ_TEMPERATURE}, majority over normalized numbers"
    return text


def summarize(rows: Sequence[dict], *, maj_k: int = 0) -> dict:
    """Aggregate metrics from per-question rows (fractions in 0..1).

    >>> summarize([{"correct_strict": True, "correct_lenient": True, "in_format": True, "completion_tokens": 10},
    ...            {"correct_strict": False, "correct_lenient": True, "in_format": False, "completion_tokens": 30}])
    {'accuracy_strict': 0.5, 'accuracy_lenient': 1.0, 'format_rate': 0.5, 'mean_completion_tokens': 20.0}
    """
    n = max(len(rows), 1)
    out = {
        "accuracy_strict": sum(r["correct_strict"] for r in rows) / n,
        "accuracy_lenient": sum(r["correct_lenient"] for r in rows) / n,
        "format_rate": sum(r["in_format"] for r in rows) / n,
        "mean_completion_tokens": sum(r["completion_tokens"] for r in rows) / n,
    }
    if maj_k:
        out["maj_accuracy_strict"] = sum(r["maj_correct_strict"] for r in rows) / n
        out["maj_accuracy_lenient"] = sum(r["maj_correct_lenient"] for r in rows) / n
    return out


# ----------------------------------------------------------------------------------------------------- prompts


def build_prompts(questions: Sequence[str], tokenizer, *, few_shot: int = 0, prefill: str = "") -> list[str]:
    """Prompt strings as training renders them: system + few-shot turns + question, generation prompt, prefill."""
    from grpo_kit.data import build_messages, render_prompt

    return [render_prompt(build_messages(q, few_shot=few_shot), tokenizer, prefill) for q in questions]


# ----------------------------------------------------------------------------------------------------- evaluate


def evaluate(
    model,
    tokenizer,
    dataset,
    *,
    max_new_tokens: int = 256,
    batch_size: int = 8,
    maj_k: int = 0,
    few_shot: int = 0,
    prefill: str = "",
    seed: int = 0,
    progress: bool = True,
    label: str = "",
    lora_request=None,
) -> EvalResult:
    """Greedy pass@1 (and maj@``maj_k`` when > 0) of ``model`` on ``dataset`` (``question``/``answer`` columns).

    ``model`` is a causal LM (a PEFT wrapper is fine); ``tokenizer`` its tokenizer. Scoring follows the module
    docstring. Takes about 1-2 s per question per 64 new tokens for the 135M embedded model on 2 CPU cores.
    """
    import torch

    for column in ("question", "answer"):
        if column not in dataset.column_names:
            raise GrpoKitError(f"evaluate needs '{column}' in the dataset (use grpo_kit.data.load_gsm8k); found {dataset.column_names}.")
    if len(dataset) == 0:
        raise GrpoKitError("evaluate got an empty dataset; load some questions first (e.g. load_gsm8k('sample', 'test')).")
    if maj_k < 0 or max_new_tokens < 1:
        raise GrpoKitError(f"maj_k must be >= 0 and max_new_tokens >= 1 (got {maj_k}, {max_new_tokens}).")
    questions, golds = list(dataset["question"]), list(dataset["answer"])
    prompts = build_prompts(questions, tokenizer, few_shot=few_shot, prefill=prefill)
    started = time.time()
    torch.manual_seed(seed)
    if _use_vllm(model):  # GPU + Unsloth fast_inference (tested on CPU with a fake engine only)
        with engine_lora_request(model, lora_request) as request:
            greedy = generate_vllm(model, prompts, max_new_tokens=max_new_tokens, seed=seed, lora_request=request)
            samples = generate_vllm(model, prompts, max_new_tokens=max_new_tokens, num_samples=maj_k,
                                    temperature=MAJ_TEMPERATURE, seed=seed, lora_request=request) if maj_k else None
    else:
        greedy = generate_hf(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
                             progress=progress, desc=f"eval {label}".strip())
        samples = generate_hf(model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=max(1, batch_size // maj_k),
                              num_samples=maj_k, temperature=MAJ_TEMPERATURE, progress=progress,
                              desc=f"maj@{maj_k} {label}".strip()) if maj_k else None
    rows = []
    for i, (question, gold) in enumerate(zip(questions, golds, strict=True)):
        completion, n_tokens = greedy[i][0]
        row = {"question": question, "gold": gold, "completion": completion, "completion_tokens": n_tokens}
        row.update(_score_row(completion, gold, prefill))
        if maj_k:
            texts = [prefill + text for text, _ in samples[i]]
            vote_strict = majority_vote([extract_tagged_answer(t) for t in texts])
            vote_lenient = majority_vote([extract_last_number(t) for t in texts])
            row.update(maj_strict=vote_strict, maj_lenient=vote_lenient,
                       maj_correct_strict=answers_match(vote_strict, gold),
                       maj_correct_lenient=answers_match(vote_lenient, gold))
        rows.append(row)
    info = getattr(dataset, "info", None)
    data_label = (getattr(info, "description", "") or "GSM8K-format questions") if info else "GSM8K-format questions"
    protocol = describe_protocol(data=data_label, n=len(rows), seed=seed, few_shot=few_shot, prefill=prefill,
                                 max_new_tokens=max_new_tokens, maj_k=maj_k)
    return EvalResult(**summarize(rows, maj_k=maj_k), n=len(rows), seed=seed, protocol=protocol, label=label,
                      maj_k=maj_k, seconds=round(time.time() - started, 2), rows=tuple(rows))


def evaluate_before_after(model_id: str, adapter_dir: str | os.PathLike, dataset, **kwargs) -> tuple[EvalResult, EvalResult]:
    """Evaluate the base model and base+adapter on the same questions: ``(base_result, tuned_result)``.

    The model is loaded once with the adapter; "base" runs inside PEFT's ``disable_adapter()``, so both share
    exactly the same base weights. ``kwargs`` go to ``evaluate``.
    """
    from grpo_kit.models import load_inference_model

    model, tokenizer = load_inference_model(model_id, adapter_dir)
    with model.disable_adapter():
        base = evaluate(model, tokenizer, dataset, label="base", **kwargs)
    tuned = evaluate(model, tokenizer, dataset, label="tuned", **kwargs)
    return base, tuned
