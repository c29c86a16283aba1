"""GSM8K loading (Hub, local file, bundled sample, synthetic arithmetic) and prompt formatting for TRL's GRPOTrainer.

Every loader returns a ``datasets.Dataset`` with three columns (the data contract in docs/DESIGN.md):

- ``question``: the word problem;
- ``answer``: the gold as a canonical number string from ``answers.normalize_number`` (``"1080"``, ``"-5"``, ``"0.5"``);
- ``solution``: the original answer text, ending in its ``#### N`` line.

>>> ds = load_gsm8k("sample", "test")
>>> ds.column_names, ds[0]["answer"]
(['question', 'answer', 'solution'], '8')
>>> [m["role"] for m in build_messages("What is 2 + 2?", few_shot=1)]
['system', 'user', 'assistant', 'user']

Bad input never turns into silently wrong data: a bad row raises ``GrpoKitError`` naming the file and line/row, or,
with ``lenient=True``, is skipped, counted and reported (``warnings.warn`` and ``LoadReport``). Readers, gold parsing
and checks live in ``grpo_kit.machinery.data_sources``, the synthetic set in ``grpo_kit.machinery.arithmetic``.
Model-output parsing lives in ``grpo_kit.answers``; ``extract_tagged_answer`` and ``extract_last_number`` are
re-exported here for convenience.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from importlib import resources
from pathlib import Path
from typing import Any

from grpo_kit.answers import extract_last_number, extract_tagged_answer
from grpo_kit.errors import GrpoKitError
from grpo_kit.machinery.arithmetic import ARITHMETIC_SIZES, ARITHMETIC_SOURCES, arithmetic_records
from grpo_kit.machinery.data_sources import (
    HUB_DATASET,
    SAMPLE_FILES,
    file_records,
    hub_records,
    jsonl_records,
    summary,
    to_dataset,
    validate,
)

__all__ = [
    "FEW_SHOT_EXAMPLES",
    "SYSTEM_PROMPT",
    "build_messages",
    "extract_last_number",
    "extract_tagged_answer",
    "format_for_grpo",
    "load_gsm8k",
    "render_prompt",
]

SYSTEM_PROMPT = (
    "You are a careful math tutor. Solve the problem step by step.\n"
    "First write your reasoning inside <think> </think> tags. Then write only the final number, with no units "
    "or words, inside <answer> </answer> tags. Use exactly this format:\n"
    "<think>\n...\n</think>\n<answer>NUMBER</answer>"
)

#: Worked examples for few-shot prompts: (question, assistant reply in the exact think/answer format).
#: Written by the grpo-kit authors; none of them is in GSM8K or in the bundled sample.
FEW_SHOT_EXAMPLES: tuple[tuple[str, str], ...] = (
    (
        "A box has 3 red pens and 5 blue pens. How many pens are in 4 such boxes?",
        "<think>\nOne box has 3 + 5 = 8 pens.\nFour boxes have 4 * 8 = 32 pens.\n</think>\n<answer>32</answer>",
    ),
    (
        "The temperature was 5 degrees in the evening and fell by 9 degrees overnight. What is the temperature now?",
        "<think>\nIt fell from 5 by 9 degrees: 5 - 9 = -4.\n</think>\n<answer>-4</answer>",
    ),
    (
        "A ribbon 9 meters long is cut into 6 equal pieces. How long is each piece, in meters?",
        "<think>\nEach piece is 9 / 6 = 1.5 meters long.\n</think>\n<answer>1.5</answer>",
    ),
    (
        "A shop sells 250 mugs a week and each mug costs $6. How much money does the shop take in over 8 weeks?",
        "<think>\nIn 8 weeks it sells 250 * 8 = 2000 mugs.\nThey bring in 2000 * 6 = 12000 dollars.\n</think>\n"
        "<answer>12000</answer>",
    ),
)


# ---------------------------------------------------------------------------------------------------------- loading


def load_gsm8k(
    source: str = "gsm8k",
    split: str = "train",
    *,
    lenient: bool = False,
    limit: int | None = None,
    seed: int = 0,
):
    """GSM8K-format rows as a ``datasets.Dataset`` with columns ``question``, ``answer``, ``solution``.

    ``source``: ``"gsm8k"`` (Hub ``openai/gsm8k``, config ``main``), ``"sample"`` (bundled, written by the kit's
    authors; ``split="test"`` is the held-out set), ``"arithmetic"`` (synthetic, NOT GSM8K; see
    ``machinery.arithmetic.make_arithmetic_dataset``), or a local ``.jsonl`` / ``.json`` / ``.parquet`` file with
    ``question`` and ``answer`` fields (``split`` is ignored for files). ``limit`` keeps the first N rows after a
    shuffle seeded by ``seed`` (no shuffle without ``limit``). Skipped rows (``lenient=True``) and dropped duplicate
    questions are announced with ``warnings.warn`` (counts and the first notes).

    >>> len(load_gsm8k("sample", "train", limit=5))
    5
    """
    if limit is not None and limit < 1:
        raise GrpoKitError(f"limit must be a positive number of rows, got {limit}. Leave it out to keep every row.")
    label, records = _records(source, split)
    rows, report = validate(records, label, lenient=lenient)
    if not rows:
        detail = f" First problems: {'; '.join(report.reasons)}." if report.reasons else ""
        raise GrpoKitError(f"{label} has no usable rows.{detail} Fix the file or point --data at another source.")
    if report.skipped or report.duplicates:
        warnings.warn(summary(report), stacklevel=2)
    dataset = to_dataset(rows, label)
    if limit is not None:
        dataset = dataset.shuffle(seed=seed).select(range(min(limit, len(dataset))))
        dataset = dataset.flatten_indices()
    return dataset


def _records(source: str, split: str) -> tuple[str, Iterator[tuple[str, Any]]]:
    """(label, iterator of (where, record-or-exception)) for a source name or a local path."""
    if source == "gsm8k":
        if split not in ("train", "test"):
            raise GrpoKitError(f"GSM8K has splits 'train' and 'test', not {split!r}.")
        return f"GSM8K ({HUB_DATASET}, split {split!r})", hub_records(split)
    if source == "sample":
        if split not in SAMPLE_FILES:
            raise GrpoKitError(f"The bundled sample has splits 'train' and 'test', not {split!r}.")
        name = SAMPLE_FILES[split]
        text = resources.files("grpo_kit").joinpath("resources", name).read_bytes()
        return f"bundled sample {name}", jsonl_records(text, name)
    if source in ARITHMETIC_SOURCES:
        if split not in ARITHMETIC_SIZES:
            raise GrpoKitError(f"The {source} set has splits 'train' and 'test', not {split!r}.")
        steps = ARITHMETIC_SOURCES[source]
        return f"synthetic {source} (not GSM8K, split {split!r})", arithmetic_records(split, steps)
    return file_records(Path(source))


# ---------------------------------------------------------------------------------------------------------- prompts


def build_messages(question: str, *, system_prompt: str = SYSTEM_PROMPT, few_shot: int = 0) -> list[dict]:
    """Chat messages: system, then ``few_shot`` worked examples as user/assistant turns, then the question.

    >>> msgs = build_messages("What is 6 * 7?", few_shot=2)
    >>> [m["role"] for m in msgs], msgs[-1]["content"]
    (['system', 'user', 'assistant', 'user', 'assistant', 'user'], 'What is 6 * 7?')
    """
    if not 0 <= few_shot <= len(FEW_SHOT_EXAMPLES):
        raise GrpoKitError(f"few_shot must be between 0 and {len(FEW_SHOT_EXAMPLES)}, got {few_shot}.")
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for example_question, reply in FEW_SHOT_EXAMPLES[:few_shot]:
        messages += [{"role": "user", "content": example_question}, {"role": "assistant", "content": reply}]
    return [*messages, {"role": "user", "content": question}]


def _auto_prefix_ids(tokenizer) -> list[int]:
    """Token ids the tokenizer adds in front of plain text on its own (e.g. ``[bos]`` for Llama 3, ``[]`` for SmolLM2)."""
    with_special = tokenizer("a")["input_ids"]
    without = tokenizer("a", add_special_tokens=False)["input_ids"]
    if without and with_special[len(with_special) - len(without) :] == without:
        return list(with_special[: len(with_special) - len(without)])
    return []


def render_prompt(messages: list[dict], tokenizer, prefill: str = "") -> str:
    """The chat template rendered with the generation prompt, plus ``prefill``, ready for TRL as a plain string.

    TRL 1.15 tokenizes a plain-string prompt with ``processing_class(text=prompts)``, i.e. with
    ``add_special_tokens=True``, whereas it renders conversational prompts with ``apply_chat_template`` (which adds
    no special tokens beyond the template's). Templates that start with the BOS token (Llama 3, Gemma) would then get
    a second BOS, so the template's leading BOS text is removed when the tokenizer adds that BOS by itself. For
    SmolLM2/Qwen (no automatic BOS) the string is left as rendered. Result: TRL's ids equal the template's ids
    followed by the prefill's.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    bos = getattr(tokenizer, "bos_token", None)
    if bos and text.startswith(bos) and tokenizer.bos_token_id in _auto_prefix_ids(tokenizer):
        text = text[len(bos) :]
    return text + prefill


def _prompt_tokens(prompt, tokenizer) -> int:
    """Prompt length in tokens, counted the way TRL's GRPOTrainer tokenizes it."""
    if isinstance(prompt, str):
        return len(tokenizer(prompt)["input_ids"])
    ids = tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=True)
    return len(ids["input_ids"])


def format_for_grpo(
    dataset,
    tokenizer=None,
    *,
    system_prompt: str = SYSTEM_PROMPT,
    few_shot: int = 0,
    prefill: str = "",
    max_prompt_tokens: int | None = None,
):
    """Turn a ``load_gsm8k`` dataset into GRPOTrainer input; returns ``(dataset, n_filtered)``.

    Columns: ``prompt``, ``answer``, ``question``, ``prefill``. Without ``prefill`` the prompt is the message list
    (TRL applies the chat template with the generation prompt). With ``prefill`` (e.g. ``"<think>\\n"``) the prompt
    is a plain string from ``render_prompt`` (TRL 1.15 always renders conversational prompts with
    ``add_generation_prompt=True`` and cannot continue an assistant turn), so ``tokenizer`` is required. Prompts
    longer than ``max_prompt_tokens`` tokens (counted as TRL tokenizes them) are dropped; the count is returned
    (TRL 1.x has no ``max_prompt_length``).

    >>> ds, dropped = format_for_grpo(load_gsm8k("sample", "test", limit=2))
    >>> ds.column_names, ds[0]["prompt"][0]["role"], ds[0]["prefill"], dropped
    (['prompt', 'answer', 'question', 'prefill'], 'system', '', 0)
    """
    from datasets import Dataset

    missing = [column for column in ("question", "answer") if column not in dataset.column_names]
    if missing:
        raise GrpoKitError(
            f"format_for_grpo needs columns 'question' and 'answer' (from load_gsm8k); missing {missing}."
        )
    if len(dataset) == 0:
        raise GrpoKitError("format_for_grpo got an empty dataset; load some rows first.")
    if tokenizer is None and prefill:
        raise GrpoKitError(f"prefill={prefill!r} needs the tokenizer to render the chat template; pass tokenizer=...")
    if tokenizer is None and max_prompt_tokens is not None:
        raise GrpoKitError("max_prompt_tokens needs the tokenizer to count tokens; pass tokenizer=...")
    columns: dict[str, list] = {"prompt": [], "answer": [], "question": [], "prefill": []}
    filtered = 0
    longest = 0
    for question, answer in zip(dataset["question"], dataset["answer"], strict=True):
        messages = build_messages(question, system_prompt=system_prompt, few_shot=few_shot)
        prompt = render_prompt(messages, tokenizer, prefill) if prefill else messages
        if max_prompt_tokens is not None:
            length = _prompt_tokens(prompt, tokenizer)
            longest = max(longest, length)
            if length > max_prompt_tokens:
                filtered += 1
                continue
        for key, value in (("prompt", prompt), ("answer", answer), ("question", question), ("prefill", prefill)):
            columns[key].append(value)
    if not columns["prompt"]:
        raise GrpoKitError(
            f"All {filtered} prompts are longer than the prompt budget of {max_prompt_tokens} tokens (the longest has "
            f"{longest}). Raise it (--set max_prompt_length={longest}), or use fewer few-shot examples "
            "(--set few_shot=0)."
        )
    return Dataset.from_dict(columns), filtered
