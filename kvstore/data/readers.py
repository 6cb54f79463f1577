"""Reading a dataset's rows, one source per format (JSON Lines, CSV, SQuAD-style JSON, the
Hugging Face hub), before :mod:`kvstore.data.datasets` turns each into an Example.

A row source yields ``(location, generated id, record)``: ``location`` names the row in messages
(``file:line``, a JSON path, ``hub:NAME:SPLIT[i]``), the generated id stands in for a missing
``id``, and ``record`` is the row as a mapping, or a :class:`BadRow` when it could not be parsed
into one. Problems with the file as a whole raise DatasetError at once.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.errors import DatasetError

FORMATS = ("jsonl", "csv", "json")
HUB_PREFIX = "hub:"
EXTENSIONS = {".jsonl": "jsonl", ".csv": "csv", ".json": "json"}
# What a hub dataset id looks like ("squad", "rajpurkar/squad_v2"); anything else is a path.
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


class BadRow(Exception):
    """A row that cannot become an Example: ``problem`` goes in the report, ``hint`` in the error."""

    def __init__(self, problem: str, hint: str = "fix the row") -> None:
        super().__init__(problem)
        self.problem = problem
        self.hint = hint


@dataclass(frozen=True)
class Fields:
    """The record fields that hold each part of an Example (``--context-field``...)."""

    context: str = "context"
    question: str = "question"
    answers: str = "answers"
    id: str = "id"


Row = tuple[str, str, dict | BadRow]  # (location, generated id, record)


def type_name(value: Any) -> str:
    """A JSON value's type as a message names it ("an object", "a list", "null"...)."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _open_error(name: str, exc: OSError) -> DatasetError:
    return DatasetError(f"{name}: cannot read the file ({exc.strerror or exc}); check the path and its permissions")


def jsonl_rows(file: Path, name: str, fields: Fields, require_question: bool) -> Iterator[Row]:
    try:
        handle = file.open("rb")
    except OSError as exc:
        raise _open_error(name, exc) from None
    with handle:
        for lineno, raw in enumerate(handle, start=1):
            where, default_id = f"{name}:{lineno}", f"{file.stem}-{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield where, default_id, BadRow(f"not UTF-8 text (byte {exc.start + 1})", "save the file as UTF-8")
                continue
            if lineno == 1:
                line = line.removeprefix("\ufeff")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                yield where, default_id, BadRow(f"not valid JSON ({exc.msg} at column {exc.colno})")
                continue
            if not isinstance(record, dict):
                yield where, default_id, BadRow(f"expected a JSON object, got {type_name(record)}")
                continue
            yield where, default_id, record


def csv_rows(file: Path, name: str, fields: Fields, require_question: bool) -> Iterator[Row]:
    try:
        handle = file.open("r", encoding="utf-8-sig", newline="")
    except OSError as exc:
        raise _open_error(name, exc) from None
    old_limit = csv.field_size_limit()
    csv.field_size_limit(2**31 - 1)  # the default (128 KiB a cell) is shorter than long documents
    try:
        with handle:
            reader = csv.reader(handle)
            header: list[str] | None = None
            line_end = 0  # line number of the last line read so far
            try:
                for row in reader:
                    line, line_end = line_end + 1, reader.line_num  # a quoted cell may span lines
                    if not row:
                        continue
                    if header is None:
                        header = [cell.strip() for cell in row]
                        _check_header(header, name, line, fields, require_question)
                        continue
                    where, default_id = f"{name}:{line}", f"{file.stem}-{line}"
                    if len(row) != len(header):
                        yield (
                            where,
                            default_id,
                            BadRow(
                                f"{len(row)} cells where the header has {len(header)}",
                                "quote cells that contain commas",
                            ),
                        )
                        continue
                    record: dict[str, Any] = dict(zip(header, row))
                    if fields.answers in record:
                        record[fields.answers] = _csv_answers(record[fields.answers])
                    yield where, default_id, record
            except UnicodeDecodeError:
                raise DatasetError(f"{name}:{line_end + 1}: not UTF-8 text; save the file as UTF-8") from None
            except csv.Error as exc:
                raise DatasetError(f"{name}:{reader.line_num}: malformed CSV ({exc}); fix the file's quoting") from None
    finally:
        csv.field_size_limit(old_limit)


def _check_header(header: list[str], name: str, line: int, fields: Fields, require_question: bool) -> None:
    duplicates = sorted({column for column in header if header.count(column) > 1})
    if duplicates:
        raise DatasetError(f"{name}:{line}: column {duplicates[0]!r} appears twice in the header; rename one")
    needed = [(fields.context, "--context-field")]
    if require_question:
        needed += [(fields.question, "--question-field"), (fields.answers, "--answers-field")]
    for column, option in needed:
        if column not in header:
            raise DatasetError(
                f"{name}:{line}: no column {column!r} in the header (columns: {', '.join(header)}); "
                f"name another column with {option}"
            )


def _csv_answers(cell: str) -> Any:
    """A cell holding a JSON list (``["a", "b"]``) is several answers; anything else is one."""
    text = cell.strip()
    if text.startswith("[") and text.endswith("]"):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            return cell  # an answer that merely looks bracketed, e.g. "[citation needed]"
        if isinstance(parsed, list):
            return parsed
    return cell


def json_rows(file: Path, name: str, fields: Fields, require_question: bool) -> Iterator[Row]:
    try:
        text = file.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as exc:
        raise DatasetError(f"{name}: not UTF-8 text (byte {exc.start + 1}); save the file as UTF-8") from None
    except OSError as exc:
        raise _open_error(name, exc) from None
    try:
        top = json.loads(text)
    except json.JSONDecodeError as exc:
        hint = "fix the file"
        if exc.msg == "Extra data":
            hint = "for one object per line, name the file .jsonl or pass --format jsonl"
        raise DatasetError(f"{name}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno}); {hint}") from None

    if isinstance(top, list):
        for index, record in enumerate(top):
            where, default_id = f"{name}:[{index}]", f"{file.stem}-{index}"
            if isinstance(record, dict):
                yield where, default_id, record
            else:
                yield where, default_id, BadRow(f"expected a JSON object, got {type_name(record)}")
        return
    if not (isinstance(top, dict) and isinstance(top.get("data"), list)):
        raise DatasetError(
            f'{name}: expected SQuAD-style JSON ({{"data": [...]}}) or a list of row objects; '
            "for one object per line, use a .jsonl file"
        )
    yield from _squad_rows(top["data"], name, file.stem, fields, require_question)


def _squad_rows(articles: list, name: str, stem: str, fields: Fields, require_question: bool) -> Iterator[Row]:
    for a, article in enumerate(articles):
        where = f"{name}:data[{a}]"
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            yield where, f"{stem}-{a}", BadRow("expected an object with a 'paragraphs' list")
            continue
        for p, paragraph in enumerate(paragraphs):
            where = f"{name}:data[{a}].paragraphs[{p}]"
            if not isinstance(paragraph, dict):
                yield where, f"{stem}-{a}-{p}", BadRow(f"expected an object, got {type_name(paragraph)}")
                continue
            qas = paragraph.get("qas") or []
            if not isinstance(qas, list):
                yield where, f"{stem}-{a}-{p}", BadRow(f"field 'qas' must be a list, got {type_name(qas)}")
                continue
            if not qas and not require_question:
                # A paragraph without questions still has a context worth building.
                yield where, f"{stem}-{a}-{p}", {fields.context: paragraph.get(fields.context)}
            for q, qa in enumerate(qas):
                where = f"{name}:data[{a}].paragraphs[{p}].qas[{q}]"
                if not isinstance(qa, dict):
                    yield where, f"{stem}-{a}-{p}-{q}", BadRow(f"expected an object, got {type_name(qa)}")
                    continue
                yield where, f"{stem}-{a}-{p}-{q}", {**qa, fields.context: paragraph.get(fields.context)}


# ---------------------------------------------------------------------------------------------
# Hugging Face hub (optional)


def has_datasets() -> bool:
    import importlib.util

    return importlib.util.find_spec("datasets") is not None


def looks_like_hub_name(name: str) -> bool:
    return _HUB_NAME.fullmatch(name) is not None and Path(name).suffix.lower() not in EXTENSIONS


def missing_file_message(name: str) -> str:
    if looks_like_hub_name(name):
        return (
            f"{name}: no such file; for a Hugging Face hub dataset install the optional 'datasets' "
            f"package (pip install 'kvstore[hub]') and pass hub:{name}"
        )
    return f"{name}: no such file; check the path"


def hub_rows(given: str, spec: str, *, failed_file: bool) -> Iterator[Row]:
    """Rows of ``NAME`` or ``NAME:SPLIT`` from the hub, through the optional ``datasets`` package."""
    hub_name, _, split = spec.partition(":")
    prefix = f"{given}: no such file, and" if failed_file else f"{given}:"
    if not hub_name:
        raise DatasetError(f"{given}: no dataset name after 'hub:'; write hub:NAME or hub:NAME:SPLIT")
    try:
        import datasets as hf_datasets  # optional dependency
    except ImportError:
        raise DatasetError(
            f"{given}: hub datasets need the optional 'datasets' package; pip install 'kvstore[hub]', "
            "or download the data and pass a .jsonl, .csv or .json file"
        ) from None
    try:
        if not split:
            splits = list(hf_datasets.get_dataset_split_names(hub_name))
            split = next((s for s in ("validation", "test") if s in splits), splits[0] if splits else "train")
        rows: Iterable[dict] = hf_datasets.load_dataset(hub_name, split=split)
    except Exception as exc:  # noqa: BLE001 - network, auth, missing name: all end the same way
        detail = (str(exc).strip().splitlines() or [""])[0][:200]
        raise DatasetError(
            f"{prefix} loading it from the Hugging Face hub failed ({type(exc).__name__}: {detail}); "
            "check the name and the network, or pass a local .jsonl, .csv or .json file"
        ) from None
    stem = hub_name.replace("/", "-")
    for index, record in enumerate(rows):
        where, default_id = f"{HUB_PREFIX}{hub_name}:{split}[{index}]", f"{stem}-{split}-{index}"
        yield where, default_id, dict(record) if isinstance(record, dict) else BadRow("expected a mapping")


__all__ = [
    "EXTENSIONS",
    "FORMATS",
    "HUB_PREFIX",
    "BadRow",
    "Fields",
    "Row",
    "csv_rows",
    "has_datasets",
    "hub_rows",
    "json_rows",
    "jsonl_rows",
    "looks_like_hub_name",
    "missing_file_message",
    "type_name",
]
