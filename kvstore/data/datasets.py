"""Question-answering datasets: JSON Lines, CSV, SQuAD-style JSON, or a Hugging Face hub dataset.

A dataset is a list of :class:`Example` rows, each a context (the document whose KV cache gets
built once), a question about it and the accepted answers. Many rows usually share a context;
:meth:`Dataset.contexts` gives the distinct ones in first-seen order, which is what ``build``
prefills.

Formats, picked by extension unless ``format=`` says otherwise:

``.jsonl``
    One JSON object per line: ``{"id": "q1", "context": "...", "question": "...",
    "answers": ["1874", "in 1874"]}``. Blank lines are ignored.
``.csv``
    A header row naming the columns, then one row per question (UTF-8, standard quoting; a cell
    may span lines). An ``answers`` cell holds one answer, or a JSON list such as
    ``["1874", "in 1874"]``.
``.json``
    SQuAD-style ``{"data": [{"title": ..., "paragraphs": [{"context": ..., "qas": [{"id": ...,
    "question": ..., "answers": [{"text": ..., "answer_start": ...}]}]}]}]}``, or a JSON list
    of row objects laid out like the JSON Lines rows.
``hub:NAME`` or ``hub:NAME:SPLIT``
    A Hugging Face hub dataset, only when the optional ``datasets`` package is installed and
    the hub is reachable. Without a split, ``validation`` is used when it exists, else ``test``,
    else the first split.

Field names are configurable (``context_field=`` ...). ``answers`` may be a string, a list of
strings, or SQuAD's ``{"text": [...]}`` / ``[{"text": ...}]`` layouts. A missing ``id`` becomes
``<file stem>-<n>``, where ``n`` is the row's line number (JSON Lines, CSV) or index (JSON), so
it stays the same when other rows change or are skipped. Contexts are kept byte for byte (they
are what gets hashed and cached); questions and answers are stripped of surrounding whitespace.

A malformed row raises :class:`~kvstore.errors.DatasetError` naming ``file:line`` (a JSON path
such as ``file.json:data[0].paragraphs[2].qas[1]`` for SQuAD files); with
``skip_bad_rows=True`` such rows are left out and listed in :attr:`Dataset.problems` instead.
Problems with the file as a whole (missing, unreadable, not JSON, a CSV header without the
context column) always raise.
"""

from __future__ import annotations

import csv
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.errors import DatasetError

FORMATS = ("jsonl", "csv", "json")
HUB_PREFIX = "hub:"
_EXTENSIONS = {".jsonl": "jsonl", ".csv": "csv", ".json": "json"}
# What a hub dataset id looks like ("squad", "rajpurkar/squad_v2"); anything else is a path.
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


@dataclass(frozen=True)
class Example:
    """One question about one context.

    ``question`` is None only for rows loaded with ``require_question=False`` that have none;
    ``answers`` is empty for such rows and for explicitly unanswerable questions (``[]``).
    """

    id: str
    context: str
    question: str | None
    answers: tuple[str, ...]


@dataclass(frozen=True)
class Dataset:
    """The rows of a dataset file, in file order, and the rows that were skipped.

    ``path`` is the path or ``hub:`` name as given; ``format`` is ``jsonl``, ``csv``, ``json``
    or ``hub``; ``problems`` holds one ``file:line: what is wrong`` message per skipped row.
    """

    path: str
    format: str
    examples: tuple[Example, ...]
    problems: tuple[str, ...] = ()

    @property
    def skipped(self) -> int:
        """Number of bad rows left out (only non-zero with ``skip_bad_rows=True``)."""
        return len(self.problems)

    def __len__(self) -> int:
        return len(self.examples)

    def __iter__(self) -> Iterator[Example]:
        return iter(self.examples)

    def contexts(self) -> list[str]:
        """The distinct contexts, in the order they first appear."""
        return list(dict.fromkeys(example.context for example in self.examples))


class _BadRow(Exception):
    """A row that cannot become an Example: ``problem`` goes in the report, ``hint`` in the error."""

    def __init__(self, problem: str, hint: str = "fix the row") -> None:
        super().__init__(problem)
        self.problem = problem
        self.hint = hint


@dataclass(frozen=True)
class _Fields:
    context: str
    question: str
    answers: str
    id: str


# A row source yields (location, generated id, record); the record is a _BadRow when the row
# could not even be parsed into a mapping.
_Row = tuple[str, str, dict | _BadRow]


def load_dataset(
    path: str | os.PathLike[str],
    *,
    context_field: str = "context",
    question_field: str = "question",
    answers_field: str = "answers",
    id_field: str = "id",
    format: str | None = None,  # noqa: A002 - the natural name for the option
    skip_bad_rows: bool = False,
    require_question: bool = True,
    limit: int | None = None,
) -> Dataset:
    """Read a QA dataset file (``.jsonl``, ``.csv``, ``.json``) or a ``hub:NAME[:SPLIT]`` dataset.

    ``format`` (``"jsonl"``, ``"csv"`` or ``"json"``) overrides the extension.
    ``require_question=False`` accepts rows without a question or answers (building caches
    only needs contexts). ``limit`` stops after that many examples (rows, not distinct
    contexts: to build the first N contexts take ``dataset.contexts()[:N]``); rows after the
    limit are not read, so their problems are not reported.

    Raises :class:`~kvstore.errors.DatasetError` (one line, naming file and line) for a missing,
    unreadable or malformed file, for a bad row unless ``skip_bad_rows`` is set, and when no
    usable row is left.
    """
    name = os.fspath(path)
    if limit is not None and limit < 1:
        raise DatasetError(f"limit must be at least 1, got {limit}")
    if format is not None and format not in FORMATS:
        raise DatasetError(f"unknown dataset format {format!r}; use one of {', '.join(FORMATS)}")
    fields = _Fields(context_field, question_field, answers_field, id_field)

    if name.startswith(HUB_PREFIX):
        fmt, rows = "hub", _hub_rows(name, name[len(HUB_PREFIX) :], failed_file=False)
    else:
        file = Path(name)
        if not file.exists():
            if _looks_like_hub_name(name) and _has_datasets():
                fmt, rows = "hub", _hub_rows(name, name, failed_file=True)
            else:
                raise DatasetError(_missing_file_message(name))
        else:
            if file.is_dir():
                raise DatasetError(f"{name}: is a directory; pass a .jsonl, .csv or .json file")
            fmt = format or _EXTENSIONS.get(file.suffix.lower(), "")
            if not fmt:
                kind = repr(file.suffix) if file.suffix else "(no extension)"
                raise DatasetError(
                    f"{name}: unknown file type {kind}; use .jsonl, .csv or .json, or name the format with --format"
                )
            readers = {"jsonl": _jsonl_rows, "csv": _csv_rows, "json": _json_rows}
            rows = readers[fmt](file, name, fields, require_question)

    examples: list[Example] = []
    problems: list[str] = []
    first_seen: dict[str, str] = {}
    try:
        for where, default_id, record in rows:
            try:
                if isinstance(record, _BadRow):
                    raise record
                example = _example(record, fields, default_id, require_question)
                if example.id in first_seen:
                    raise _BadRow(
                        f"duplicate id {example.id!r} (first at {first_seen[example.id]})",
                        "give each row its own id",
                    )
            except _BadRow as bad:
                if not skip_bad_rows:
                    raise DatasetError(f"{where}: {bad.problem}; {bad.hint}, or pass --skip-bad-rows") from None
                problems.append(f"{where}: {bad.problem}")
                continue
            first_seen[example.id] = where
            examples.append(example)
            if limit is not None and len(examples) >= limit:
                break
    finally:
        close = getattr(rows, "close", None)
        if close is not None:
            close()  # releases the open file when the limit stops reading early

    if not examples:
        if problems:
            raise DatasetError(f"{name}: no usable rows ({len(problems)} skipped; the first: {problems[0]})")
        raise DatasetError(f"{name}: no rows to read; the file is empty or has no questions")
    return Dataset(path=name, format=fmt, examples=tuple(examples), problems=tuple(problems))


# ---------------------------------------------------------------------------------------------
# Turning one record into an Example (shared by every format)


def _example(record: dict, fields: _Fields, default_id: str, require_question: bool) -> Example:
    context = record.get(fields.context)
    if context is None:
        raise _missing(record, fields.context, "--context-field")
    if not isinstance(context, str):
        raise _BadRow(f"field {fields.context!r} must be a string, got {_type_name(context)}")
    if not context.strip():
        raise _BadRow(f"empty context in field {fields.context!r}")

    question = record.get(fields.question)
    if question is not None:
        if not isinstance(question, str):
            raise _BadRow(f"field {fields.question!r} must be a string, got {_type_name(question)}")
        question = question.strip() or None
        if question is None and require_question:
            raise _BadRow(f"empty question in field {fields.question!r}")
    elif require_question:
        raise _missing(record, fields.question, "--question-field")

    raw_answers = record.get(fields.answers)
    if raw_answers is None:
        if require_question:
            raise _missing(record, fields.answers, "--answers-field")
        answers: tuple[str, ...] = ()
    else:
        answers = _answers(raw_answers, fields.answers)

    raw_id = record.get(fields.id)
    if raw_id is None or raw_id == "":
        example_id = default_id
    elif isinstance(raw_id, str):
        example_id = raw_id.strip() or default_id
    elif isinstance(raw_id, int) and not isinstance(raw_id, bool):
        example_id = str(raw_id)
    else:
        raise _BadRow(f"field {fields.id!r} must be a string or an integer, got {_type_name(raw_id)}")
    return Example(id=example_id, context=context, question=question, answers=answers)


def _answers(value: Any, field: str) -> tuple[str, ...]:
    """Accepted answers: a string, a list of strings, SQuAD's {"text": [...]} or [{"text": ...}]."""
    if isinstance(value, dict) and "text" in value:  # hub SQuAD layout
        value = value["text"]
    items = value if isinstance(value, (list, tuple)) else [value]
    texts: list[str] = []
    for item in items:
        if isinstance(item, dict) and "text" in item:  # SQuAD JSON layout
            item = item["text"]
        if isinstance(item, (int, float)) and not isinstance(item, bool):
            item = str(item)
        if not isinstance(item, str):
            got = _type_name(item) + (" in the list" if items is value else "")
            raise _BadRow(f"field {field!r} must be a string or a list of strings, got {got}")
        texts.append(item.strip())
    # Several annotators often give the same answer; order is kept for display.
    return tuple(dict.fromkeys(text for text in texts if text))


def _missing(record: dict, field: str, option: str) -> _BadRow:
    present = [str(key) for key, value in record.items() if value is not None]
    if len(present) > 8:
        present[8:] = ["..."]
    return _BadRow(
        f"missing field {field!r} (fields: {', '.join(present) or 'none'})", f"name another field with {option}"
    )


def _type_name(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


# ---------------------------------------------------------------------------------------------
# Row sources


def _open_error(name: str, exc: OSError) -> DatasetError:
    return DatasetError(f"{name}: cannot read the file ({exc.strerror or exc}); check the path and its permissions")


def _jsonl_rows(file: Path, name: str, fields: _Fields, require_question: bool) -> Iterator[_Row]:
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
                yield where, default_id, _BadRow(f"not UTF-8 text (byte {exc.start + 1})", "save the file as UTF-8")
                continue
            if lineno == 1:
                line = line.removeprefix("\ufeff")
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                yield where, default_id, _BadRow(f"not valid JSON ({exc.msg} at column {exc.colno})")
                continue
            if not isinstance(record, dict):
                yield where, default_id, _BadRow(f"expected a JSON object, got {_type_name(record)}")
                continue
            yield where, default_id, record


def _csv_rows(file: Path, name: str, fields: _Fields, require_question: bool) -> Iterator[_Row]:
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
                            _BadRow(
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


def _check_header(header: list[str], name: str, line: int, fields: _Fields, require_question: bool) -> None:
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


def _json_rows(file: Path, name: str, fields: _Fields, require_question: bool) -> Iterator[_Row]:
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
                yield where, default_id, _BadRow(f"expected a JSON object, got {_type_name(record)}")
        return
    if not (isinstance(top, dict) and isinstance(top.get("data"), list)):
        raise DatasetError(
            f'{name}: expected SQuAD-style JSON ({{"data": [...]}}) or a list of row objects; '
            "for one object per line, use a .jsonl file"
        )
    yield from _squad_rows(top["data"], name, file.stem, fields, require_question)


def _squad_rows(articles: list, name: str, stem: str, fields: _Fields, require_question: bool) -> Iterator[_Row]:
    for a, article in enumerate(articles):
        where = f"{name}:data[{a}]"
        paragraphs = article.get("paragraphs") if isinstance(article, dict) else None
        if not isinstance(paragraphs, list):
            yield where, f"{stem}-{a}", _BadRow("expected an object with a 'paragraphs' list")
            continue
        for p, paragraph in enumerate(paragraphs):
            where = f"{name}:data[{a}].paragraphs[{p}]"
            if not isinstance(paragraph, dict):
                yield where, f"{stem}-{a}-{p}", _BadRow(f"expected an object, got {_type_name(paragraph)}")
                continue
            qas = paragraph.get("qas") or []
            if not isinstance(qas, list):
                yield where, f"{stem}-{a}-{p}", _BadRow(f"field 'qas' must be a list, got {_type_name(qas)}")
                continue
            if not qas and not require_question:
                # A paragraph without questions still has a context worth building.
                yield where, f"{stem}-{a}-{p}", {fields.context: paragraph.get(fields.context)}
            for q, qa in enumerate(qas):
                where = f"{name}:data[{a}].paragraphs[{p}].qas[{q}]"
                if not isinstance(qa, dict):
                    yield where, f"{stem}-{a}-{p}-{q}", _BadRow(f"expected an object, got {_type_name(qa)}")
                    continue
                yield where, f"{stem}-{a}-{p}-{q}", {**qa, fields.context: paragraph.get(fields.context)}


# ---------------------------------------------------------------------------------------------
# Hugging Face hub (optional)


def _has_datasets() -> bool:
    import importlib.util

    return importlib.util.find_spec("datasets") is not None


def _looks_like_hub_name(name: str) -> bool:
    return _HUB_NAME.fullmatch(name) is not None and Path(name).suffix.lower() not in _EXTENSIONS


def _missing_file_message(name: str) -> str:
    if _looks_like_hub_name(name):
        return (
            f"{name}: no such file; for a Hugging Face hub dataset install the optional 'datasets' "
            f"package (pip install 'kvstore[hub]') and pass hub:{name}"
        )
    return f"{name}: no such file; check the path"


def _hub_rows(given: str, spec: str, *, failed_file: bool) -> Iterator[_Row]:
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
        yield where, default_id, dict(record) if isinstance(record, dict) else _BadRow("expected a mapping")
