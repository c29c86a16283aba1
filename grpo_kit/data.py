"""GSM8K rows for TRL's GRPOTrainer: loaded from the Hub, the bundled sample, synthetic arithmetic or a local file,
checked row by row, and turned into think/answer prompts.

``load_gsm8k`` returns a ``datasets.Dataset`` with columns ``question``, ``answer`` (the gold as a canonical number
string from ``answers.normalize_number``: ``"1080"``, ``"-5"``, ``"0.5"``) and ``solution`` (the original answer
text, ending in its ``#### N`` line). A bad row never turns into silently wrong data: it raises ``GrpoKitError``
naming the file and row or, with ``lenient=True``, is skipped, counted and announced with ``warnings.warn``.
"""

from __future__ import annotations

import random
import re
import warnings
from decimal import Decimal
from pathlib import Path
from typing import Any

from grpo_kit.answers import GROUPED, MAX_DIGITS, digit_count, normalize_number
from grpo_kit.errors import GrpoKitError, first_line
from grpo_kit.files import check_writable

SYSTEM_PROMPT = (
    "You are a careful math tutor. Solve the problem step by step.\n"
    "First write your reasoning inside <think> </think> tags. Then write only the final number, with no units "
    "or words, inside <answer> </answer> tags. Use exactly this format:\n"
    "<think>\n...\n</think>\n<answer>NUMBER</answer>"
)
#: Worked examples for few-shot prompts: (question, reply in the exact think/answer format). Written by the grpo-kit
#: authors; none of them is in GSM8K or in the bundled sample.
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

HUB_DATASET, HUB_CONFIG = "openai/gsm8k", "main"
#: Local data files: suffix -> (the ``datasets`` loader that reads it, what the file must hold: said when it cannot).
LOCAL_FORMATS = {
    ".jsonl": ("json", "one JSON object per line with 'question' and 'answer', no blank lines, saved as UTF-8"),
    ".json": ("json", "a JSON array of objects with 'question' and 'answer' (or one object per line), saved as UTF-8"),
    ".parquet": ("parquet", "a Parquet table with 'question' and 'answer' columns (re-export it, or use .jsonl)"),
    ".csv": ("csv", "a UTF-8 CSV file whose header line names 'question' and 'answer' (quoted cells may span lines)"),
}
MAX_REASONS = 5  # skip notes a warning shows
#: Synthetic arithmetic (NOT GSM8K) split sizes; the test size gives a 95 % interval of about +-8 points.
ARITHMETIC_SIZES = {"train": 256, "test": 200}
# Exactly one number: optional sign and/or dollar sign, thousands grouped as in a model's answer (commas or spaces),
# decimals ("-$1,200.50", "1 000", "$-5", ".5"); a/b.
_PLAIN_NUMBER = re.compile(r"\s*(?:-\$?|\$-?)?(?:(?:" + GROUPED + r"|\d+)(?:\.\d+)?|\.\d+)\s*|\s*-?\d+\s*/\s*\d+\s*")


def load_gsm8k(
    source: str = "gsm8k", split: str = "train", *, lenient: bool = False, limit: int | None = None, seed: int = 0
):
    """GSM8K-format rows as a ``datasets.Dataset`` with columns ``question``, ``answer``, ``solution``.

    ``source``: ``"gsm8k"`` (Hub ``openai/gsm8k``, config ``main``), ``"sample"`` (bundled; ``split="test"`` is the
    held-out set), ``"arithmetic"`` (synthetic one-step problems, NOT GSM8K), or a local ``.jsonl``/``.json``/
    ``.parquet``/``.csv`` file with ``question`` and ``answer`` fields (``split`` ignored).
    ``limit`` keeps the first N rows after a shuffle seeded by ``seed``. Exact duplicate questions are dropped.
    """
    if limit is not None and limit < 1:
        raise GrpoKitError(f"limit must be a positive number of rows, got {limit}. Leave it out to keep every row.")
    label, records = _records(source, split)
    dataset = _to_dataset(_checked_rows(records, label, lenient), label)
    if limit is not None:
        dataset = dataset.shuffle(seed=seed).take(min(limit, len(dataset))).flatten_indices()
    return dataset


def _records(source: str, split: str):
    """(label, iterable of records) for a source name or a local path."""
    if source in ("gsm8k", "sample", "arithmetic") and split not in ("train", "test"):
        raise GrpoKitError(f"The {source!r} data has splits 'train' and 'test', not {split!r}.")
    if source == "gsm8k":
        return f"GSM8K ({HUB_DATASET}, split {split!r})", _hub_records(split)
    if source == "sample":
        name = f"gsm8k_sample_{split}.jsonl"  # by the grpo-kit authors, not GSM8K (see grpo_kit/resources/README.md)
        return f"bundled sample {name}", _file_records(Path(__file__).with_name("resources") / name)
    if source == "arithmetic":  # test: 200 problems from seed 1 whose calculations (so questions) are not in train
        rows = make_arithmetic_dataset(ARITHMETIC_SIZES["train"], seed=0)
        if split == "test":
            rows = make_arithmetic_dataset(ARITHMETIC_SIZES["test"], seed=1, exclude=rows["solution"])
        records = rows.remove_columns("answer").rename_column("solution", "answer")  # read as a file's rows are
        return f"synthetic arithmetic (not GSM8K, split {split!r})", records
    return str(Path(source)), _file_records(Path(source), split)


def _checked_rows(records, label: str, lenient: bool) -> list[dict]:
    """The good rows, exact duplicate questions dropped; a bad row raises, or with ``lenient`` is skipped and
    counted."""
    rows, first_seen, notes, read, skipped = [], {}, [], 0, 0  # first_seen: question -> (where, answer)
    for read, record in enumerate(records, start=1):
        where = f"row {read}"
        try:
            row = _check_record(record)
        except ValueError as err:
            if not lenient:
                raise GrpoKitError(
                    f"{label}, {where}: {err}. Fix that row. (Training can skip bad rows instead, counted "
                    "and reported: grpo-kit train --lenient, or lenient=True in Python.)"
                ) from None
            skipped += 1
            notes.append(f"{where}: {err}")
        else:
            if row["question"] not in first_seen:
                first_seen[row["question"]] = (where, row["answer"])
                rows.append(row)
                continue
            where_first, answer_first = first_seen[row["question"]]
            clash = (
                "" if answer_first == row["answer"] else f" with a DIFFERENT answer ({row['answer']} vs {answer_first})"
            )
            notes.append(f"{where}: duplicate of the question at {where_first}{clash}, dropped")
    if not rows:
        detail = f" First problems: {'; '.join(notes[:MAX_REASONS])}." if notes else ""
        raise GrpoKitError(f"{label} has no usable rows.{detail} Fix the file or point --data at another source.")
    duplicates = read - skipped - len(rows)
    if skipped or duplicates:
        dropped = [f"skipped {skipped} bad row(s)"] if skipped else []
        dropped += [f"dropped {duplicates} duplicate question(s)"] if duplicates else []
        warnings.warn(
            f"{label}: kept {len(rows)} of {read} rows; {', '.join(dropped)}. First notes: "
            f"{'; '.join(notes[:MAX_REASONS])}",
            stacklevel=3,
        )
    return rows


def _check_record(record: dict) -> dict:
    """One row (a dict with both keys: every source's columns are checked first, ``_need_columns``) made canonical."""
    if not isinstance(record["question"], str) or not record["question"].strip():
        raise ValueError("the question is empty or not text")
    answer, solution = _gold_from_field(record["answer"])
    return {"question": record["question"].strip(), "answer": answer, "solution": solution}


def _to_dataset(rows: list[dict], label: str):
    from datasets import Dataset, DatasetInfo, Features, Value

    features = Features({column: Value("string") for column in ("question", "answer", "solution")})
    return Dataset.from_list(rows, features=features, info=DatasetInfo(description=label, features=features))


# ---------------------------------------------------------------------------------------------------------- gold


def extract_gsm8k_answer(text: str) -> str:
    """Canonical gold number from a GSM8K answer text (after the last ``####``); ``ValueError`` when there is no
    ``####`` or what follows is not one plain number (commas, a leading ``$``, ``3/4`` are fine; ``72 clips`` is not).
    """
    if "####" not in text:
        raise ValueError("the answer has no '#### N' line with the final number")
    tail = text.rsplit("####", 1)[1].strip()
    if not tail:
        raise ValueError("nothing follows '####' (expected the final number, e.g. '#### 72')")
    return _plain_number(tail, "the text after '####'")


def _plain_number(text: str, what: str, otherwise: str = "") -> str:
    """Canonical form of a text that is exactly one number (``"$1,200"``, ``"-$5"``, ``"0.5"``, ``"3/4"``)."""
    if not _PLAIN_NUMBER.fullmatch(text):
        raise ValueError(otherwise or f"{what} is not a number: {text.strip()[:60]!r}")
    canonical = normalize_number(text.replace("$", "", 1))
    if canonical is None:
        raise ValueError(
            f"{what} is a number too large to use ({digit_count(text)} digits; answers are "
            f"compared on at most {MAX_DIGITS}): {text.strip()[:60]!r}"
        )
    return canonical


def _gold_from_field(value: Any) -> tuple[str, str]:
    """(canonical answer, solution text) from an ``answer`` field: a GSM8K text with ``#### N`` or a plain number."""
    if value is None:
        raise ValueError("the answer is missing (null)")
    if isinstance(value, bool):
        raise ValueError(f"the answer is a boolean ({value}), not a number")
    if isinstance(value, (int, float)):  # JSON/Parquet numbers, exactly (0.1 is "0.1")
        exact = Decimal(str(value))  # a float by its shortest repr
        if not exact.is_finite():
            raise ValueError(f"the answer {value!r} is not a finite number")
        if isinstance(value, float) and abs(value) >= 2**53:  # pyarrow reads an integer beyond int64 as a rounded float
            raise ValueError(f"the answer {value!r} is too large to be read exactly as a number; write it as text")
        value = format(exact, "f")  # read below as the plain number it is
    if not isinstance(value, str):
        raise ValueError(f"the answer must be text or a number, got {type(value).__name__}")
    if "####" in value:
        return extract_gsm8k_answer(value), value
    neither = f"the answer is neither a number nor a GSM8K text ending in '#### N': {value.strip()[:60]!r}"
    canonical = _plain_number(value, "the answer", neither)
    return canonical, f"#### {canonical}"


# ---------------------------------------------------------------------------------------------------------- sources


def _check_cache() -> None:
    """``datasets`` writes every file it reads into its cache first: a cache it cannot use is named, not taken for a
    broken data file."""
    import datasets

    check_writable(
        Path(datasets.config.HF_DATASETS_CACHE),
        what="the datasets cache",
        option="HF_HOME (or HF_DATASETS_CACHE), a folder you can write to; unset it for ~/.cache/huggingface",
    )


def _hub_records(split: str):
    import datasets
    from datasets.exceptions import DatasetsError

    _check_cache()
    try:
        return datasets.load_dataset(HUB_DATASET, HUB_CONFIG, split=split)
    except (OSError, DatasetsError) as err:
        why = f"{type(err).__name__}: {err}"
        raise GrpoKitError(
            f"Could not load {HUB_DATASET} (split {split!r}) from the Hub or its cache: {why[:200]}. "
            "Check the network (and HF_HUB_OFFLINE), or use the bundled sample (--data sample) or a local "
            f"{', '.join(LOCAL_FORMATS)} file with 'question' and 'answer' fields (--data FILE)."
        ) from err


def _file_records(path: Path, split: str = "train"):
    """The records of a local file, read by the ``datasets`` loader for its suffix after cheap path checks, or of a
    folder ``save_to_disk`` wrote (a ``DatasetDict``: its ``split``, as from the Hub)."""
    import datasets

    accepted, suffix = ", ".join(LOCAL_FORMATS), path.suffix.lower()
    if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():  # Dataset(Dict).save_to_disk
        table = datasets.load_from_disk(path)
        if isinstance(table, datasets.DatasetDict):
            if split not in table:
                raise GrpoKitError(f"{path} has no {split!r} split, only {', '.join(table)}; save one.")
            table = table[split]
    else:
        if path.is_dir():
            found = sorted(p.name for p in path.iterdir() if p.suffix.lower() in LOCAL_FORMATS)[:5]
            raise GrpoKitError(
                f"--data {path} is a directory; it takes one file ({accepted}) with 'question' and 'answer' "
                "fields"
                + (
                    f", e.g. {path / found[0]} (this folder has {', '.join(found)})."
                    if found
                    else "; this folder holds none."
                )
            )
        if not path.is_file():
            raise GrpoKitError(
                f"Data file not found: {path}. --data takes 'gsm8k' (Hub), 'sample' (bundled), "
                f"'arithmetic' (synthetic) or a path to a {accepted} file with 'question' and 'answer' fields."
            )
        if suffix not in LOCAL_FORMATS:
            raise GrpoKitError(f"{path}: unsupported file type {suffix or '(none)'!r}; use one of {accepted}.")
        loader, shape = LOCAL_FORMATS[suffix]
        if not path.read_bytes().strip():
            raise GrpoKitError(f"{path} is empty. Write {shape}.")
        _check_cache()
        try:  # utf-8-sig: a JSON file saved as "UTF-8 with BOM" (Windows) loads too
            options = {"encoding": "utf-8-sig"} if loader == "json" else {}
            table = datasets.load_dataset(loader, data_files=str(path), split="train", **options)
        except Exception as err:  # the loaders raise ValueError, TypeError, ArrowInvalid, DatasetGenerationError, ...
            cause = err.__cause__ or err  # DatasetGenerationError keeps the parser's own message in its cause
            raise GrpoKitError(f"{path}: could not read it ({first_line(cause)[:200]}). It must be {shape}.") from err
    _need_columns(path, table.column_names)
    return table.select_columns(["question", "answer"]).to_list()


def _need_columns(name, found: list[str]) -> None:
    missing = [column for column in ("question", "answer") if column not in found]
    if missing:
        raise GrpoKitError(
            f"{name}: missing column(s) {missing}; found {found}. GSM8K data needs 'question' and "
            "'answer' (the answer ending in '#### N', or a plain number)."
        )


# ---------------------------------------------------------------------------------------------------------- synthetic

_NAMES = ("Ava", "Ben", "Chloe", "Dev", "Eli", "Fatima", "Gus", "Hiro", "Ines", "Jamal", "Kira", "Luis", "Mei", "Nia")
_ITEMS = ("apples", "marbles", "stickers", "pencils", "cookies", "shells", "cards", "stamps", "beads", "books")
#: One-step problems: operation -> (question, solution line); ``{step}`` is the annotated calculation.
_ONE_STEP = {
    "+": (
        "{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
        "{name} has {step} {item}.",
    ),
    "-": ("{name} has {a} {item} and gives away {b}. How many {item} are left?", "{step} {item} are left."),
    "*": ("{name} has {a} bags with {b} {item} in each bag. How many {item} is that?", "{step} {item}."),
    "/": (
        "{name} shares {a} {item} equally among {b} friends. How many {item} does each friend get?",
        "Each friend gets {step} {item}.",
    ),
}


def _one_step(rng: random.Random) -> tuple[str, str, int]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(2, 20), rng.randint(2, 12)
    op = rng.choice(tuple(_ONE_STEP))
    a = {"-": a + b, "/": a * b}.get(op, a)  # whole, positive results
    result = {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]
    step = f"{a} {op} {b} = <<{a}{op}{b}={result}>>{result}"  # as GSM8K annotates a calculation
    question, line = _ONE_STEP[op]
    return question.format(name=name, a=a, b=b, item=item), line.format(name=name, step=step, item=item), result


def make_arithmetic_dataset(n: int = 64, seed: int = 0, *, exclude=()):
    """SYNTHETIC, NOT GSM8K: ``n`` distinct one-step word problems with small integers, in GSM8K format (a warm-up
    set for small models: the embedded SmolLM2-135M, greedy, gets about a third right), the same for a ``seed``;
    columns as ``load_gsm8k``. ``exclude``: solutions whose calculations must not come back, so a held-out split
    never repeats a training calculation.
    """
    banned = {arithmetic_key(item) for item in exclude}
    rng = random.Random(seed)
    rows: dict[str, dict] = {}
    for _ in range(n * 50):
        if len(rows) == n:
            break
        question, line, result = _one_step(rng)
        solution = f"{line}\n#### {result}"
        if arithmetic_key(solution) not in banned:
            rows.setdefault(question, {"question": question, "answer": str(result), "solution": solution})
    if len(rows) < n:
        raise GrpoKitError(f"Could only generate {len(rows)} distinct arithmetic problems; ask for n <= {len(rows)}.")
    return _to_dataset(list(rows.values()), f"synthetic arithmetic (not GSM8K), n={n}, seed={seed}")


def arithmetic_key(solution: str) -> str:
    """The calculations of a synthetic solution (its ``<<...>>`` annotations): equal keys = the same arithmetic."""
    return ";".join(re.findall(r"<<(.*?)>>", solution)) or solution


# ---------------------------------------------------------------------------------------------------------- prompts


def build_messages(question: str, *, system_prompt: str | None = SYSTEM_PROMPT, few_shot: int = 0) -> list[dict]:
    """Chat messages: system (None: ``SYSTEM_PROMPT``, "": none), ``few_shot`` worked examples, then the question."""
    if not 0 <= few_shot <= len(FEW_SHOT_EXAMPLES):
        raise GrpoKitError(f"few_shot must be between 0 and {len(FEW_SHOT_EXAMPLES)}, got {few_shot}.")
    system_prompt = SYSTEM_PROMPT if system_prompt is None else system_prompt
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    for example, reply in FEW_SHOT_EXAMPLES[:few_shot]:
        messages += [{"role": "user", "content": example}, {"role": "assistant", "content": reply}]
    return [*messages, {"role": "user", "content": question}]


def render_prompt(messages: list[dict], tokenizer, prefill: str = "") -> str:
    """The chat template rendered with the generation prompt, plus ``prefill``, ready for TRL as a plain string.

    TRL 1.15 tokenizes a plain-string prompt with ``processing_class(text=prompts)``, i.e. with
    ``add_special_tokens=True``. Templates that start with the BOS token (Llama 3, Gemma) would then get a second
    BOS, so the template's leading BOS text is removed when the tokenizer adds that BOS by itself (SmolLM2/Qwen add
    none). Result: TRL's ids equal the template's ids followed by the prefill's.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    bos = tokenizer.bos_token
    if bos and text.startswith(bos) and tokenizer("a")["input_ids"][:1] == [tokenizer.bos_token_id]:  # adds its own
        text = text[len(bos) :]
    return text + prefill


def format_for_grpo(
    dataset,
    tokenizer=None,
    *,
    system_prompt: str | None = SYSTEM_PROMPT,
    few_shot: int = 0,
    prefill: str = "",
    max_prompt_tokens: int | None = None,
):
    """Turn a ``load_gsm8k`` dataset into GRPOTrainer input; returns ``(dataset, n_filtered)``.

    Columns: ``prompt``, ``answer``, ``question``, ``prefill``. Without ``prefill`` the prompt is the message list
    (TRL applies the chat template). With ``prefill`` (e.g. ``"<think>\\n"``) it is a plain string from
    ``render_prompt``, since TRL 1.15 cannot continue an assistant turn. Prompts longer than ``max_prompt_tokens``
    tokens, counted as TRL tokenizes them, are dropped and counted (TRL 1.x has no ``max_prompt_length``).
    """
    from datasets import Dataset

    _need_columns("format_for_grpo's dataset", dataset.column_names)
    if len(dataset) == 0:
        raise GrpoKitError("format_for_grpo got an empty dataset; load some rows first.")
    if tokenizer is None and (prefill or max_prompt_tokens is not None):
        raise GrpoKitError(f"{'prefill' if prefill else 'max_prompt_tokens'} needs the tokenizer; pass tokenizer=...")
    rows, lengths = [], []
    for question, answer in zip(dataset["question"], dataset["answer"], strict=True):
        messages = build_messages(question, system_prompt=system_prompt, few_shot=few_shot)
        if max_prompt_tokens is not None:  # render_prompt's text tokenizes to exactly the ids TRL will see
            lengths.append(len(tokenizer(render_prompt(messages, tokenizer, prefill))["input_ids"]))
            if lengths[-1] > max_prompt_tokens:
                continue
        prompt = render_prompt(messages, tokenizer, prefill) if prefill else messages
        rows.append({"prompt": prompt, "answer": answer, "question": question, "prefill": prefill})
    if not rows:
        raise GrpoKitError(
            f"All {len(lengths)} prompts are longer than the prompt budget of {max_prompt_tokens} tokens "
            f"(the longest has {max(lengths)}). Raise it (--set max_prompt_length={max(lengths)}), or use "
            "fewer few-shot examples (--set few_shot=0)."
        )
    return Dataset.from_list(rows), len(dataset) - len(rows)


def check_dataset_size(
    n_prompts: int, config, *, source: str, filtered: int = 0, max_prompt_tokens: int | None = None
) -> None:
    """Refuse a dataset that cannot fill one optimizer step (TRL would run 0 steps); warn about dropped prompts.

    Counted from the ``GRPOConfig``: TRL's generation batch spans every process, and its ``RepeatSampler`` drops an
    incomplete batch, so fewer prompts than one batch's yield no step at all.
    """
    needed, batch = config.generation_batch_size // config.num_generations, config.per_device_train_batch_size
    processes = config.world_size  # TRL's generation batch spans them
    dropped = f" after dropping {filtered} prompt(s) longer than max_prompt_length={max_prompt_tokens} tokens"
    if n_prompts < needed:  # steps_per_generation is TRL's: gradient_accumulation_steps unless the recipe sets it
        raise GrpoKitError(
            f"The training data '{source}' has {n_prompts} usable prompt(s){dropped if filtered else ''}, but one "
            f"optimizer step needs {needed} distinct prompts (generation batch {config.generation_batch_size} = "
            f"per_device_train_batch_size {batch} x steps_per_generation {config.steps_per_generation}"
            + (f" x {processes} processes" if processes > 1 else "")
            + f", in groups of num_generations="
            f"{config.num_generations}); TRL would train 0 steps. Use more data (--data sample has 50 questions, "
            "--data arithmetic 256), or lower --set per_device_train_batch_size / gradient_accumulation_steps"
            + (", or raise --set max_prompt_length." if filtered else ".")
        )
    if filtered:
        warnings.warn(
            f"{source}: {filtered} prompt(s) longer than max_prompt_length={max_prompt_tokens} tokens were "
            f"left out of training ({n_prompts} kept). Raise max_prompt_length (--set max_prompt_length=N) "
            "to keep them.",
            stacklevel=2,
        )
