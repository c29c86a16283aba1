"""GSM8K loading (Hub, local file, bundled sample, synthetic arithmetic) and prompt formatting for TRL's GRPOTrainer.

Every loader returns a ``datasets.Dataset`` with three columns (the data contract in docs/DESIGN.md):

- ``question``: the word problem;
- ``answer``: the gold as a canonical number string from ``answers.normalize_number`` (``"1080"``, ``"-5"``, ``"0.5"``);
- ``solution``: the original answer text, ending in its ``#### N`` line.

>>> extract_gsm8k_answer("She has 1000 + 80 = <<1000+80=1080>>1080.\\n#### 1,080")
'1080'
>>> ds = load_gsm8k("sample", "test")
>>> ds.column_names, ds[0]["answer"]
(['question', 'answer', 'solution'], '8')
>>> [m["role"] for m in build_messages("What is 2 + 2?", few_shot=1)]
['system', 'user', 'assistant', 'user']

Bad input never turns into silently wrong data: a bad row raises ``GrpoKitError`` naming the file and line/row, or,
with ``lenient=True``, is skipped, counted and reported (``warnings.warn`` and ``LoadReport``).
Model-output parsing lives in ``grpo_kit.answers``; ``extract_tagged_answer`` and ``extract_last_number`` are
re-exported here for convenience.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from importlib import resources
from pathlib import Path
from typing import Any

from grpo_kit.answers import extract_last_number, extract_tagged_answer, normalize_number
from grpo_kit.errors import GrpoKitError

__all__ = [
    "FEW_SHOT_EXAMPLES",
    "SYSTEM_PROMPT",
    "build_messages",
    "extract_gsm8k_answer",
    "extract_last_number",
    "extract_tagged_answer",
    "format_for_grpo",
    "load_gsm8k",
    "arithmetic_key",
    "make_arithmetic_dataset",
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

HUB_DATASET = "openai/gsm8k"
HUB_CONFIG = "main"
#: Bundled sample files, written by the grpo-kit authors (not GSM8K; see grpo_kit/resources/README.md).
SAMPLE_FILES = {"train": "gsm8k_sample_train.jsonl", "test": "gsm8k_sample_test.jsonl"}
LOCAL_FORMATS = (".jsonl", ".json", ".parquet", ".csv")
#: How many skip reasons a warning and ``LoadReport.reasons`` keep.
MAX_REASONS = 5
#: Sizes of the synthetic arithmetic splits that ``load_gsm8k("arithmetic", split)`` generates.
ARITHMETIC_SIZES = {"train": 256, "test": 64}
#: Source names of the synthetic arithmetic sets → ``steps`` of ``make_arithmetic_dataset`` (the difficulty).
ARITHMETIC_SOURCES = {"arithmetic": None, "arithmetic-1step": 1, "arithmetic-2step": 2}
#: Test size of the one-kind sets: enough held-out questions for a 95 % interval of about +-8 points.
ARITHMETIC_KIND_TEST_SIZE = 200

# Exactly one number: optional sign and/or dollar sign, thousands commas, decimals ("-$1,200.50", "$-5", ".5").
_PLAIN_NUMBER = re.compile(r"\s*(?:-\$?|\$-?)?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)\s*")
_FRACTION = re.compile(r"\s*-?\d+\s*/\s*\d+\s*")


@dataclass(frozen=True)
class LoadReport:
    """What a load kept and dropped (announced in a warning). ``reasons``: the first ``MAX_REASONS`` notes."""

    source: str
    rows_read: int
    rows_kept: int
    skipped: int = 0
    duplicates: int = 0
    reasons: tuple[str, ...] = ()


# ---------------------------------------------------------------------------------------------------------- gold


def extract_gsm8k_answer(text: str) -> str:
    """Canonical gold number from a GSM8K answer text (the part after the last ``####``).

    Raises ``ValueError`` when there is no ``####`` or what follows it is not one plain number (commas, a leading
    ``$`` and a fraction like ``3/4`` are fine; ``72 clips`` is not).

    >>> [extract_gsm8k_answer(t) for t in ["... #### 1,080", "#### -5", "x\\n#### 0.5", "#### $18.00"]]
    ['1080', '-5', '0.5', '18']
    """
    if not isinstance(text, str):
        raise ValueError(f"expected the answer as text, got {type(text).__name__}")
    if "####" not in text:
        raise ValueError("the answer has no '#### N' line with the final number")
    tail = text.rsplit("####", 1)[1].strip()
    if not tail:
        raise ValueError("nothing follows '####' (expected the final number, e.g. '#### 72')")
    canonical = _plain_number(tail)
    if canonical is None:
        raise ValueError(_not_a_number("the text after '####'", tail))
    return canonical


def _not_a_number(what: str, text: str) -> str:
    """"not a number", or "too large" for a number with more digits than answers are compared on."""
    from grpo_kit.answers import MAX_DIGITS

    if _PLAIN_NUMBER.fullmatch(text) or _FRACTION.fullmatch(text):
        return (f"{what} is a number too large to use ({len(re.sub(r'[^0-9]', '', text))} digits; answers are "
                f"compared on at most {MAX_DIGITS}): {text.strip()[:60]!r}")
    return f"{what} is not a number: {text.strip()[:60]!r}"


def _plain_number(text: str) -> str | None:
    """Canonical form of a text that is exactly one number (``"$1,200"``, ``"-$5"``, ``"0.5"``, ``"3/4"``), else None.

    >>> [_plain_number(t) for t in ["$1,200", "-$5", " 0.50 ", "3/4", "72 clips", "1 2", "--5"]]
    ['1200', '-5', '0.5', '0.75', None, None, None]
    """
    if not (_PLAIN_NUMBER.fullmatch(text) or _FRACTION.fullmatch(text)):
        return None
    return normalize_number(text.replace("$", "", 1))


def _gold_from_field(value: Any) -> tuple[str, str]:
    """(canonical answer, solution text) from an ``answer`` field: a GSM8K text with ``#### N`` or a plain number.

    >>> _gold_from_field("Half of 6 is 3.\\n#### 3"), _gold_from_field(1200), _gold_from_field("1,200")
    (('3', 'Half of 6 is 3.\\n#### 3'), ('1200', '#### 1200'), ('1200', '#### 1200'))
    """
    if value is None:
        raise ValueError("the answer is missing (null)")
    if isinstance(value, bool):
        raise ValueError(f"the answer is a boolean ({value}), not a number")
    if isinstance(value, (int, float)):
        canonical = _number_value(value)
        return canonical, f"#### {canonical}"
    if not isinstance(value, str):
        raise ValueError(f"the answer must be text or a number, got {type(value).__name__}")
    if "####" in value:
        return extract_gsm8k_answer(value), value
    if not value.strip():
        raise ValueError("the answer is empty")
    canonical = _plain_number(value)
    if canonical is None and (_PLAIN_NUMBER.fullmatch(value) or _FRACTION.fullmatch(value)):
        raise ValueError(_not_a_number("the answer", value))
    if canonical is None:
        raise ValueError(f"the answer is neither a number nor a GSM8K text ending in '#### N': {value.strip()[:60]!r}")
    return canonical, f"#### {canonical}"


def _number_value(value: int | float) -> str:
    """Canonical string of a JSON/Parquet number; NaN and infinities are errors (``1e20`` is ``"100000000000000000000"``)."""
    try:
        exact = Decimal(value) if isinstance(value, int) else Decimal(repr(value))
    except InvalidOperation as err:
        raise ValueError(f"the answer {value!r} is not a number") from err
    canonical = normalize_number(format(exact, "f")) if exact.is_finite() else None
    if canonical is None and exact.is_finite():
        raise ValueError(_not_a_number("the answer", format(exact, "f")))
    if canonical is None:
        raise ValueError(f"the answer {value!r} is not a finite number")
    return canonical


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
    ``make_arithmetic_dataset``), or a local ``.jsonl`` / ``.json`` / ``.parquet`` file with ``question`` and
    ``answer`` fields (``split`` is ignored for files). ``limit`` keeps the first N rows after a shuffle seeded by
    ``seed`` (no shuffle without ``limit``). Skipped rows (``lenient=True``) and dropped duplicate questions are
    announced with ``warnings.warn`` (counts and the first notes).

    >>> len(load_gsm8k("sample", "train", limit=5))
    5
    """
    if limit is not None and limit < 1:
        raise GrpoKitError(f"limit must be a positive number of rows, got {limit}. Leave it out to keep every row.")
    label, records = _records(source, split)
    rows, report = _validate(records, label, lenient=lenient)
    if not rows:
        detail = f" First problems: {'; '.join(report.reasons)}." if report.reasons else ""
        raise GrpoKitError(f"{label} has no usable rows.{detail} Fix the file or point --data at another source.")
    if report.skipped or report.duplicates:
        warnings.warn(_summary(report), stacklevel=2)
    dataset = _to_dataset(rows, label)
    if limit is not None:
        dataset = dataset.shuffle(seed=seed).select(range(min(limit, len(dataset))))
        dataset = dataset.flatten_indices()
    return dataset


def _summary(report: LoadReport) -> str:
    parts = []
    if report.skipped:
        parts.append(f"skipped {report.skipped} bad row(s)")
    if report.duplicates:
        parts.append(f"dropped {report.duplicates} duplicate question(s)")
    return (
        f"{report.source}: kept {report.rows_kept} of {report.rows_read} rows; {', '.join(parts)}. "
        f"First notes: {'; '.join(report.reasons)}"
    )


def _records(source: str, split: str) -> tuple[str, Iterator[tuple[str, Any]]]:
    """(label, iterator of (where, record-or-exception)) for a source name or a local path."""
    if source == "gsm8k":
        if split not in ("train", "test"):
            raise GrpoKitError(f"GSM8K has splits 'train' and 'test', not {split!r}.")
        return f"GSM8K ({HUB_DATASET}, split {split!r})", _hub_records(split)
    if source == "sample":
        if split not in SAMPLE_FILES:
            raise GrpoKitError(f"The bundled sample has splits 'train' and 'test', not {split!r}.")
        name = SAMPLE_FILES[split]
        text = resources.files("grpo_kit").joinpath("resources", name).read_bytes()
        return f"bundled sample {name}", _jsonl_records(text, name)
    if source in ARITHMETIC_SOURCES:
        if split not in ARITHMETIC_SIZES:
            raise GrpoKitError(f"The {source} set has splits 'train' and 'test', not {split!r}.")
        steps = ARITHMETIC_SOURCES[source]
        return f"synthetic {source} (not GSM8K, split {split!r})", _arithmetic_records(split, steps)
    return _file_records(Path(source))


def hub_reachable(timeout: float = 3.0) -> bool:
    """True when a TCP connection to the Hub's endpoint opens within ``timeout`` seconds.

    Without it, an unplugged machine spends ~30 s in the Hub client's retries before ``--data gsm8k`` fails.
    """
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
    except OSError:
        return False
    return True


@contextlib.contextmanager
def _offline_hub():
    """Make ``datasets`` and ``huggingface_hub`` use their caches only (read at call time by both libraries)."""
    import datasets
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved


def _hub_records(split: str) -> Iterator[tuple[str, Any]]:
    import datasets
    from datasets.exceptions import DatasetsError

    unreachable = not datasets.config.HF_HUB_OFFLINE and not hub_reachable()
    try:
        with _offline_hub() if unreachable else contextlib.nullcontext():  # a cached copy still loads at once
            hub = datasets.load_dataset(HUB_DATASET, HUB_CONFIG, split=split)
    except (OSError, DatasetsError) as err:
        why = "the Hub is unreachable from this machine and no cached copy was found" if unreachable else (
            f"{type(err).__name__}: {str(err)[:200]}")
        raise GrpoKitError(
            f"Could not load {HUB_DATASET} (config {HUB_CONFIG!r}, split {split!r}) from the Hugging Face Hub or "
            f"its cache: {why}\n"
            "Check your network connection (and that HF_HUB_OFFLINE / HF_DATASETS_OFFLINE are not set), or work "
            "without the Hub:\n"
            f"  - the bundled sample:  --data sample   (load_gsm8k('sample', {split!r}))\n"
            "  - a local file:        --data path/to/train.jsonl   (.jsonl, .json, .parquet or .csv with 'question' "
            "and 'answer' fields, the answer ending in '#### N')"
        ) from err
    for index, row in enumerate(hub, start=1):
        yield f"row {index}", row


def _arithmetic_records(split: str, steps: int | None = None) -> Iterator[tuple[str, Any]]:
    """Train: 256 problems from seed 0. Test: problems from seed 1 that are not in the train split: for the mix, 64
    whose question differs; for one kind (``steps``), ``ARITHMETIC_KIND_TEST_SIZE`` whose calculations differ too."""
    rows = make_arithmetic_dataset(ARITHMETIC_SIZES["train"], seed=0, steps=steps).to_list()
    if split == "test" and steps is not None:
        seen = [row["solution"] for row in rows]
        rows = make_arithmetic_dataset(ARITHMETIC_KIND_TEST_SIZE, seed=1, steps=steps, exclude=seen).to_list()
    elif split == "test":
        seen = {row["question"] for row in rows}
        fresh = make_arithmetic_dataset(ARITHMETIC_SIZES["test"] * 2, seed=1).to_list()
        rows = [row for row in fresh if row["question"] not in seen][: ARITHMETIC_SIZES["test"]]
    for index, row in enumerate(rows, start=1):
        yield f"row {index}", {"question": row["question"], "answer": row["solution"]}


def _file_records(path: Path) -> tuple[str, Iterator[tuple[str, Any]]]:
    accepted = ", ".join(LOCAL_FORMATS)
    suffix = path.suffix.lower()
    if path.is_dir():
        found = sorted(p.name for p in path.iterdir() if p.suffix.lower() in LOCAL_FORMATS)[:5]
        raise GrpoKitError(
            f"--data {path} is a directory; it takes one file ({accepted}) with 'question' and 'answer' fields"
            + (f", e.g. {path / found[0]} (this folder has {', '.join(found)})." if found else
               "; this folder holds none.")
        )
    if not path.is_file():
        raise GrpoKitError(
            f"Data file not found: {path}. --data takes 'gsm8k' (Hub), 'sample' (bundled), 'arithmetic', "
            f"'arithmetic-1step', 'arithmetic-2step' (synthetic) or a path to a {accepted} file with 'question' and 'answer' fields."
        )
    if suffix not in LOCAL_FORMATS:
        raise GrpoKitError(f"{path}: unsupported file type {suffix or '(none)'!r}; use one of {accepted}.")
    if suffix == ".parquet":
        return str(path), _parquet_records(path)
    data = path.read_bytes()
    if not data.strip():
        raise GrpoKitError(f"{path} is empty. Write one JSON object per line with 'question' and 'answer'.")
    if suffix == ".json":
        return str(path), _json_records(data, str(path))
    if suffix == ".csv":
        return str(path), _csv_records(data, str(path))
    return str(path), _jsonl_records(data, str(path))


def _jsonl_records(data: bytes, name: str) -> Iterator[tuple[str, Any]]:
    """One (\"line N\", record or exception) per non-blank line; bad bytes or JSON become exceptions, not crashes."""
    for number, raw in enumerate(data.split(b"\n"), start=1):
        where = f"line {number}"
        try:
            line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a BOM (Windows "UTF-8 with BOM") is fine
        except UnicodeDecodeError as err:
            yield where, ValueError(f"bytes that are not UTF-8 at column {err.start + 1}; save the file as UTF-8")
            continue
        if not line.strip():
            continue
        try:
            yield where, json.loads(line)
        except json.JSONDecodeError as err:
            yield where, ValueError(f"not valid JSON ({err.msg} at column {err.colno})")


def _decode_utf8(data: bytes, name: str, save_as: str) -> str:
    """The file's text (a UTF-8 byte-order mark is dropped), or an error naming the first line that is not UTF-8."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise GrpoKitError(f"{name}, line {line}: bytes that are not UTF-8. Save the file as {save_as}.") from err


def _json_records(data: bytes, name: str) -> Iterator[tuple[str, Any]]:
    """A JSON array of objects (or ``{"data": [...]}``); a file that is really JSON lines is read as such."""
    text = _decode_utf8(data, name, "UTF-8")
    try:
        document = json.loads(text)
    except json.JSONDecodeError as err:
        if err.msg == "Extra data":  # several top-level values: JSON lines saved as .json
            yield from _jsonl_records(data, name)
            return
        raise GrpoKitError(f"{name}, line {err.lineno}: not valid JSON ({err.msg} at column {err.colno}).") from err
    if isinstance(document, dict) and isinstance(document.get("data"), list):
        document = document["data"]
    if not isinstance(document, list):
        raise GrpoKitError(
            f"{name}: expected a JSON array of objects with 'question' and 'answer' (or JSON lines), "
            f"got a {type(document).__name__}."
        )
    for index, record in enumerate(document, start=1):
        yield f"row {index}", record


def _csv_records(data: bytes, name: str) -> Iterator[tuple[str, Any]]:
    """Rows of a CSV file with a header line naming 'question' and 'answer' (quoted multi-line cells are fine)."""
    import csv
    import io

    text = _decode_utf8(data, name, "UTF-8 CSV")
    reader = csv.DictReader(io.StringIO(text, newline=""))
    missing = [column for column in ("question", "answer") if column not in (reader.fieldnames or [])]
    if missing:
        raise GrpoKitError(
            f"{name}: missing column(s) {missing}; the header line has {reader.fieldnames}. A GSM8K CSV needs the "
            "columns 'question' and 'answer' (the answer ending in '#### N', or a plain number)."
        )
    try:
        for record in reader:
            yield f"line {reader.line_num}", {"question": record["question"], "answer": record["answer"]}
    except csv.Error as err:
        raise GrpoKitError(f"{name}, line {reader.line_num}: not valid CSV ({err}).") from err


def _parquet_records(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise GrpoKitError(f"{path}: not a readable Parquet file ({err}). Re-export it, or use .jsonl.") from err
    missing = [column for column in ("question", "answer") if column not in table.column_names]
    if missing:
        raise GrpoKitError(
            f"{path}: missing column(s) {missing}; found {table.column_names}. "
            "A GSM8K file needs 'question' and 'answer' (the answer ending in '#### N', or a plain number)."
        )
    for index, record in enumerate(table.select(["question", "answer"]).to_pylist(), start=1):
        yield f"row {index}", record


def _validate(records: Iterable[tuple[str, Any]], label: str, *, lenient: bool) -> tuple[list[dict], LoadReport]:
    """Check each record, keep the good ones, drop exact duplicate questions; raise or count the bad ones."""
    rows: list[dict] = []
    first_seen: dict[str, tuple[str, str]] = {}  # question -> (where, answer)
    notes: list[str] = []
    read = skipped = duplicates = 0
    for where, record in records:
        read += 1
        try:
            row = _check_record(record)
        except ValueError as err:
            if not lenient:
                raise GrpoKitError(
                    f"{label}, {where}: {err}. Fix that row. (Training can skip bad rows instead, counted and "
                    "reported: grpo-kit train --lenient, or lenient=True in Python.)"
                ) from None
            skipped += 1
            notes.append(f"{where}: {err}")
            continue
        if row["question"] in first_seen:
            duplicates += 1
            where_first, answer_first = first_seen[row["question"]]
            clash = (
                "" if answer_first == row["answer"] else f" with a DIFFERENT answer ({row['answer']} vs {answer_first})"
            )
            notes.append(f"{where}: duplicate of the question at {where_first}{clash}, dropped")
            continue
        first_seen[row["question"]] = (where, row["answer"])
        rows.append(row)
    report = LoadReport(label, read, len(rows), skipped, duplicates, tuple(notes[:MAX_REASONS]))
    return rows, report


def _check_record(record: Any) -> dict:
    if isinstance(record, Exception):
        raise ValueError(str(record))
    if not isinstance(record, dict):
        raise ValueError(f"expected an object with 'question' and 'answer', got {type(record).__name__}")
    missing = [key for key in ("question", "answer") if key not in record]
    if missing:
        raise ValueError(f"missing field(s) {missing} (found {sorted(record)[:8]})")
    question = record["question"]
    if not isinstance(question, str) or not question.strip():
        raise ValueError("the question is empty or not text")
    answer, solution = _gold_from_field(record["answer"])
    return {"question": question.strip(), "answer": answer, "solution": solution}


def _to_dataset(rows: list[dict], label: str):
    from datasets import Dataset, DatasetInfo, Features, Value

    features = Features({"question": Value("string"), "answer": Value("string"), "solution": Value("string")})
    columns = {name: [row[name] for row in rows] for name in features}
    return Dataset.from_dict(columns, features=features, info=DatasetInfo(description=label, features=features))


# ---------------------------------------------------------------------------------------------------------- synthetic

_NAMES = ("Ava", "Ben", "Chloe", "Dev", "Eli", "Fatima", "Gus", "Hiro", "Ines", "Jamal", "Kira", "Luis", "Mei", "Nia")
_ITEMS = ("apples", "marbles", "stickers", "pencils", "cookies", "shells", "cards", "stamps", "beads", "books")


def _one_step(rng: random.Random) -> tuple[str, list[str], int]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b = rng.randint(2, 20), rng.randint(2, 12)
    kind = rng.choice(("add", "sub", "mul", "div"))
    if kind == "add":
        return (
            f"{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?",
            [f"{name} has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} {item}."],
            a + b,
        )
    if kind == "sub":
        a += b
        return (
            f"{name} has {a} {item} and gives away {b}. How many {item} are left?",
            [f"{a} - {b} = <<{a}-{b}={a - b}>>{a - b} {item} are left."],
            a - b,
        )
    if kind == "mul":
        return (
            f"{name} has {a} bags with {b} {item} in each bag. How many {item} is that?",
            [f"{a} * {b} = <<{a}*{b}={a * b}>>{a * b} {item}."],
            a * b,
        )
    total = a * b
    return (
        f"{name} shares {total} {item} equally among {b} friends. How many {item} does each friend get?",
        [f"Each friend gets {total} / {b} = <<{total}/{b}={a}>>{a} {item}."],
        a,
    )


def _two_step(rng: random.Random) -> tuple[str, list[str], int]:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 15)
    if rng.random() < 0.5:
        return (
            f"{name} buys {a} boxes of {item} with {b} in each box, and already had {c}. How many {item} does "
            f"{name} have now?",
            [
                f"The boxes hold {a} * {b} = <<{a}*{b}={a * b}>>{a * b} {item}.",
                f"{name} has {a * b} + {c} = <<{a * b}+{c}={a * b + c}>>{a * b + c} {item}.",
            ],
            a * b + c,
        )
    c = min(c, a * b - 1)
    return (
        f"{name} has {a} packs of {item} with {b} in each pack and gives away {c}. How many {item} are left?",
        [
            f"{name} has {a} * {b} = <<{a}*{b}={a * b}>>{a * b} {item}.",
            f"{a * b} - {c} = <<{a * b}-{c}={a * b - c}>>{a * b - c} {item} are left.",
        ],
        a * b - c,
    )


#: ``steps`` values of ``make_arithmetic_dataset``: the difficulty knob. Measured on the embedded SmolLM2-135M with the
#: ``cpu`` prompt (greedy, n=120 of the mix): one-step problems are answered right about a third of the time,
#: two-step ones almost never (it stops after the first operation).
ARITHMETIC_STEPS = {None: "one- and two-step problems, half each", 1: "one-step problems only", 2: "two-step only"}


def make_arithmetic_dataset(n: int = 64, seed: int = 0, *, steps: int | None = None, exclude=()):
    """SYNTHETIC, NOT GSM8K: ``n`` short one- or two-step word problems with small integers, in GSM8K format.

    An easier warm-up set for small models. Deterministic for a ``seed``; questions are distinct. Columns as
    ``load_gsm8k``: ``question``, ``answer`` (canonical), ``solution`` (steps with ``<<a*b=c>>`` and ``#### N``).
    ``steps`` (``ARITHMETIC_STEPS``) sets the difficulty: ``None`` mixes one- and two-step problems, ``1`` or ``2``
    keeps one kind. ``exclude``: solutions (or ``arithmetic_key`` values) whose calculations must not come back, so a
    held-out split never repeats a training calculation under another name.

    >>> ds = make_arithmetic_dataset(3, seed=0)
    >>> len(ds), ds[0]["solution"].endswith("#### " + ds[0]["answer"])
    (3, True)
    >>> all("\\n" not in s.split("####")[0].strip() for s in make_arithmetic_dataset(5, steps=1)["solution"])
    True
    """
    if n < 1:
        raise GrpoKitError(f"make_arithmetic_dataset needs n >= 1, got {n}.")
    if steps not in ARITHMETIC_STEPS:
        raise GrpoKitError(f"steps must be one of {list(ARITHMETIC_STEPS)} ({ARITHMETIC_STEPS}), got {steps!r}.")
    banned = {arithmetic_key(item) for item in exclude}
    rng = random.Random(seed)
    rows: dict[str, dict] = {}
    for _ in range(n * 50):
        if len(rows) == n:
            break
        one_step = rng.random() < 0.5 if steps is None else steps == 1
        question, lines, result = (_one_step if one_step else _two_step)(rng)
        solution = "\n".join([*lines, f"#### {result}"])
        if banned and arithmetic_key(solution) in banned:
            continue
        rows.setdefault(question, {"question": question, "answer": str(result), "solution": solution})
    if len(rows) < n:
        raise GrpoKitError(f"Could only generate {len(rows)} distinct arithmetic problems; ask for n <= {len(rows)}.")
    label = f"synthetic arithmetic (not GSM8K), n={n}, seed={seed}" + (f", {steps}-step" if steps else "")
    return _to_dataset(list(rows.values()), label)


def arithmetic_key(solution: str) -> str:
    """The calculations of a synthetic solution (its ``<<...>>`` annotations): equal keys = the same arithmetic.

    >>> arithmetic_key("Ava has 3 + 4 = <<3+4=7>>7 apples.\\n#### 7")
    '3+4=7'
    """
    return ";".join(re.findall(r"<<(.*?)>>", solution)) or solution


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
