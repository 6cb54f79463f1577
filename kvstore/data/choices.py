"""Scoring datasets: multiple-choice rows (a context, its options, the right one) and reference rows.

Same files as :mod:`kvstore.data.datasets` (``.jsonl``, ``.csv``, a ``.json`` list of row
objects), other fields:

``choices``
    The options: a JSON list of strings. In a CSV cell, a JSON list (``["Paris", "Rome"]``) or
    the options joined by ``choices_sep`` (default ``|``: ``Paris|Rome|Berlin``); in JSON Lines and
    JSON files a string is an error, never split.
``label``
    The right option's index (0-based; an integer, or a string of digits in CSV), or else
``answer``
    the right option's text, which must be one of the choices.
``reference``
    With ``reference=True`` (``kvstore score --reference``) a row needs this instead of choices:
    the text whose likelihood given the context is measured.

``context`` is required; ``question`` is optional (the prompt template decides where it goes).
A row with neither label nor answer is scored but counts in no accuracy. A malformed row (no or
an empty choice list, a label out of range, an answer that is not a choice) raises
:class:`~kvstore.errors.DatasetError` naming ``file:line``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.data.datasets import missing_field
from kvstore.data.readers import BadRow, Fields, csv_rows, json_rows, jsonl_rows, type_name
from kvstore.errors import DatasetError

_READERS = {".jsonl": jsonl_rows, ".csv": csv_rows, ".json": json_rows}


@dataclass(frozen=True)
class ChoiceRow:
    """One scoring row: ``choices`` (empty in reference mode), ``label`` (the right choice's
    index, None when the row gives none), ``reference`` (reference mode only); ``where`` is
    ``file:line``, for messages."""

    id: str
    context: str
    question: str | None
    choices: tuple[str, ...]
    label: int | None
    reference: str | None
    where: str


@dataclass(frozen=True)
class ChoiceFields:
    """The record fields of a scoring row (``--context-field``, ``--choices-field``...)."""

    context: str = "context"
    question: str = "question"
    choices: str = "choices"
    label: str = "label"
    answer: str = "answer"
    reference: str = "reference"
    id: str = "id"


@dataclass(frozen=True)
class _Spec:
    """How a record becomes a row: its fields, whether it is a reference row or needs choices,
    and a CSV cell's separator of options (None elsewhere)."""

    fields: ChoiceFields
    reference: bool
    need_choices: bool
    sep: str | None


def load_choice_rows(
    path: str | os.PathLike[str],
    fields: ChoiceFields | None = None,
    *,
    reference: bool = False,
    choices_sep: str = "|",
    limit: int | None = None,
    need_choices: bool = True,
) -> list[ChoiceRow]:
    """The rows of a multiple-choice (or, with ``reference``, reference) dataset file, in order;
    ``fields`` (:class:`ChoiceFields`) names the record fields. ``need_choices=False`` (and no
    ``reference``): rows need only a context (documents to score whole).

    Raises DatasetError (one line naming ``file:line``) for an unreadable file, a malformed row,
    a duplicate id, or a file without rows."""
    name = os.fspath(path)
    file = Path(name)
    if not file.is_file():
        raise DatasetError(f"{name}: no such file; pass a .jsonl, .csv or .json file")
    reader = _READERS.get(file.suffix.lower())
    if reader is None:
        raise DatasetError(f"{name}: unknown file type {file.suffix or '(no extension)'!r}; use .jsonl, .csv or .json")
    names = fields if fields is not None else ChoiceFields()
    # the CSV reader turns a cell holding a JSON list in the "answers" column into a list: ours is choices
    read_fields = Fields(names.context, names.question, "\0" if reference else names.choices, names.id)
    sep = choices_sep if reader is csv_rows else None  # options joined by a separator: a CSV cell's form only
    spec = _Spec(names, reference, need_choices, sep)
    out: list[ChoiceRow] = []
    seen: dict[str, str] = {}
    rows = reader(file, name, read_fields, False)
    try:
        for where, default_id, record in rows:
            try:
                if isinstance(record, BadRow):
                    raise record
                row = _row(record, where, default_id, spec)
                if row.id in seen:
                    raise BadRow(f"duplicate id {row.id!r} (first at {seen[row.id]})", "give each row its own id")
            except BadRow as bad:
                raise DatasetError(f"{where}: {bad.problem}; {bad.hint}") from None
            seen[row.id] = where
            out.append(row)
            if limit is not None and len(out) >= limit:
                break
    finally:
        close = getattr(rows, "close", None)
        if close is not None:
            close()
    if not out:
        raise DatasetError(f"{name}: no rows to read; the file is empty")
    return out


def _text(record: dict, field: str, option: str, *, required: bool) -> str | None:
    value = record.get(field)
    if value is None:
        if required:
            raise missing_field(record, field, option)
        return None
    if not isinstance(value, str):
        raise BadRow(f"field {field!r} must be a string, got {type_name(value)}")
    return value


def _row(record: dict, where: str, default_id: str, spec: _Spec) -> ChoiceRow:
    fields = spec.fields
    context = _text(record, fields.context, "--context-field", required=True)
    assert context is not None
    if not context.strip():
        raise BadRow(f"empty context in field {fields.context!r}")
    question = _text(record, fields.question, "--question-field", required=False)
    raw_id = record.get(fields.id)
    row_id = str(raw_id).strip() if isinstance(raw_id, (str, int)) and not isinstance(raw_id, bool) else ""
    row_id = row_id or default_id
    if spec.reference:
        ref = _text(record, fields.reference, "--reference-field", required=True)
        assert ref is not None
        if not ref.strip():
            raise BadRow(f"empty reference in field {fields.reference!r}")
        return ChoiceRow(row_id, context, question, (), None, ref, where)
    if not spec.need_choices:
        return ChoiceRow(row_id, context, question, (), None, None, where)
    choices = _choices(record, fields.choices, spec.sep)
    label = _label(record, fields.label, fields.answer, choices)
    return ChoiceRow(row_id, context, question, choices, label, None, where)


def _choices(record: dict, field: str, sep: str | None) -> tuple[str, ...]:
    """The options of a row. ``sep``: a CSV cell's separator (None for JSON, where a string is no
    list of options: splitting it would guess)."""
    value = record.get(field)
    if value is None:
        raise missing_field(record, field, "--choices-field")
    if isinstance(value, str) and sep is not None:  # a CSV cell that is not a JSON list
        value = value.split(sep) if value.strip() else []
    if isinstance(value, str):
        raise BadRow(
            f"field {field!r} must be a list of strings, got a string",
            'give a JSON list such as ["Paris", "Rome"] (options joined by a separator only in a CSV cell)',
        )
    if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
        raise BadRow(f"field {field!r} must be a list of strings, got {type_name(value)}")
    if not value:
        raise BadRow(f"empty choice list in field {field!r}", "give the row at least one choice")
    if any(not c.strip() for c in value):
        raise BadRow(f"an empty choice in field {field!r}", "remove it")
    return tuple(value)


def _label(record: dict, label_field: str, answer_field: str, choices: tuple[str, ...]) -> int | None:
    value: Any = record.get(label_field)
    if value is not None and value != "":
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool):
            raise BadRow(f"field {label_field!r} must be a choice's index, got {type_name(value)}")
        if not 0 <= value < len(choices):
            raise BadRow(
                f"label {value} is out of range for {len(choices)} choices (0..{len(choices) - 1})",
                "labels are 0-based indices",
            )
        return value
    answer = record.get(answer_field)
    if answer is None or answer == "":
        return None
    if not isinstance(answer, str):
        raise BadRow(f"field {answer_field!r} must be a string, got {type_name(answer)}")
    if answer not in choices:
        stripped = [c.strip() for c in choices]
        if answer.strip() in stripped:
            return stripped.index(answer.strip())
        raise BadRow(f"answer {answer!r} is not among the choices", "give one of the choices, or a label index")
    return choices.index(answer)


__all__ = ["ChoiceFields", "ChoiceRow", "load_choice_rows"]
