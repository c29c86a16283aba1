"""Where ``load_gsm8k``'s rows come from, and how they are checked (the core is ``grpo_kit.data``).

The Hub (``openai/gsm8k``, with a fast offline fallback to the cache), local ``.jsonl`` / ``.json`` / ``.csv`` /
``.parquet`` files (bad bytes and bad JSON become per-row errors, not crashes), gold parsing (``#### N`` or a plain
number), and the validation that raises on a bad row or, with ``lenient=True``, skips and counts it (``LoadReport``).
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from grpo_kit.answers import normalize_number
from grpo_kit.errors import GrpoKitError

HUB_DATASET = "openai/gsm8k"
HUB_CONFIG = "main"
#: Bundled sample files, written by the grpo-kit authors (not GSM8K; see grpo_kit/resources/README.md).
SAMPLE_FILES = {"train": "gsm8k_sample_train.jsonl", "test": "gsm8k_sample_test.jsonl"}
LOCAL_FORMATS = (".jsonl", ".json", ".parquet", ".csv")
#: How many skip reasons a warning and ``LoadReport.reasons`` keep.
MAX_REASONS = 5

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


# ---------------------------------------------------------------------------------------------------------- reading


def summary(report: LoadReport) -> str:
    parts = []
    if report.skipped:
        parts.append(f"skipped {report.skipped} bad row(s)")
    if report.duplicates:
        parts.append(f"dropped {report.duplicates} duplicate question(s)")
    return (
        f"{report.source}: kept {report.rows_kept} of {report.rows_read} rows; {', '.join(parts)}. "
        f"First notes: {'; '.join(report.reasons)}"
    )


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


def hub_records(split: str) -> Iterator[tuple[str, Any]]:
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


def file_records(path: Path) -> tuple[str, Iterator[tuple[str, Any]]]:
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
    return str(path), jsonl_records(data, str(path))


def jsonl_records(data: bytes, name: str) -> Iterator[tuple[str, Any]]:
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
            yield from jsonl_records(data, name)
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


def validate(records: Iterable[tuple[str, Any]], label: str, *, lenient: bool) -> tuple[list[dict], LoadReport]:
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


def to_dataset(rows: list[dict], label: str):
    from datasets import Dataset, DatasetInfo, Features, Value

    features = Features({"question": Value("string"), "answer": Value("string"), "solution": Value("string")})
    columns = {name: [row[name] for row in rows] for name in features}
    return Dataset.from_dict(columns, features=features, info=DatasetInfo(description=label, features=features))
