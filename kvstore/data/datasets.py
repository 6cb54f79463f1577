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

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.data.readers import (
    EXTENSIONS,
    FORMATS,
    HUB_PREFIX,
    BadRow,
    Fields,
    csv_rows,
    has_datasets,
    hub_rows,
    json_rows,
    jsonl_rows,
    looks_like_hub_name,
    missing_file_message,
    type_name,
)
from kvstore.errors import DatasetError
from kvstore.model.compose.spec import Passages


@dataclass(frozen=True)
class Example:
    """One question about one context.

    ``question`` is None only for rows loaded with ``require_question=False`` that have none;
    ``answers`` is empty for such rows and for explicitly unanswerable questions (``[]``).
    ``passages``: the context given as a list of passages (a JSON list of strings in the context
    field), composed in this order (:mod:`kvstore.model.compose`); ``context`` is then their text
    joined (each followed by a blank line), for display. Empty for an ordinary context.
    """

    id: str
    context: str
    question: str | None
    answers: tuple[str, ...]
    passages: tuple[str, ...] = ()

    @property
    def model_context(self) -> Any:
        """What the model is given as this row's context: the text, or its :class:`Passages`."""
        return Passages(self.passages) if self.passages else self.context


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


def _rows_of(name: str, format: str | None, fields: Fields, require_question: bool) -> tuple[str, Any]:  # noqa: A002
    """``(format, rows)`` of the dataset ``name``: a hub dataset, or a file read by its format."""
    if name.startswith(HUB_PREFIX):
        return "hub", hub_rows(name, name[len(HUB_PREFIX) :], failed_file=False)
    file = Path(name)
    if not file.exists():
        if looks_like_hub_name(name) and has_datasets():
            return "hub", hub_rows(name, name, failed_file=True)
        raise DatasetError(missing_file_message(name))
    if file.is_dir():
        raise DatasetError(f"{name}: is a directory; pass a .jsonl, .csv or .json file")
    fmt = format or EXTENSIONS.get(file.suffix.lower(), "")
    if not fmt:
        kind = repr(file.suffix) if file.suffix else "(no extension)"
        raise DatasetError(
            f"{name}: unknown file type {kind}; use .jsonl, .csv or .json, or name the format with --format"
        )
    readers = {"jsonl": jsonl_rows, "csv": csv_rows, "json": json_rows}
    return fmt, readers[fmt](file, name, fields, require_question)


def load_dataset(
    path: str | os.PathLike[str],
    fields: Fields | None = None,
    *,
    format: str | None = None,  # noqa: A002 - the natural name for the option
    skip_bad_rows: bool = False,
    require_question: bool = True,
    limit: int | None = None,
) -> Dataset:
    """Read a QA dataset file (``.jsonl``, ``.csv``, ``.json``) or a ``hub:NAME[:SPLIT]`` dataset.

    ``fields`` (:class:`Fields`) names the record fields holding context, question, answers and id
    (default ``context``, ``question``, ``answers``, ``id``).
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
    fields = fields if fields is not None else Fields()

    fmt, rows = _rows_of(name, format, fields, require_question)
    examples: list[Example] = []
    problems: list[str] = []
    first_seen: dict[str, str] = {}
    try:
        for where, default_id, record in rows:
            try:
                if isinstance(record, BadRow):
                    raise record
                example = _example(record, fields, default_id, require_question)
                if example.id in first_seen:
                    raise BadRow(
                        f"duplicate id {example.id!r} (first at {first_seen[example.id]})",
                        "give each row its own id",
                    )
            except BadRow as bad:
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


def _example(record: dict, fields: Fields, default_id: str, require_question: bool) -> Example:
    context = record.get(fields.context)
    if context is None:
        raise missing_field(record, fields.context, "--context-field")
    passages: tuple[str, ...] = ()
    if isinstance(context, list):  # passages, composed in this order
        if not context or not all(isinstance(p, str) and p.strip() for p in context):
            raise BadRow(f"field {fields.context!r} holds a list: it must be a non-empty list of non-empty strings")
        passages = tuple(context)
        context = Passages(passages).joined()
    if not isinstance(context, str):
        raise BadRow(f"field {fields.context!r} must be a string or a list of strings, got {type_name(context)}")
    if not context.strip():
        raise BadRow(f"empty context in field {fields.context!r}")

    question = record.get(fields.question)
    if question is not None:
        if not isinstance(question, str):
            raise BadRow(f"field {fields.question!r} must be a string, got {type_name(question)}")
        question = question.strip() or None
        if question is None and require_question:
            raise BadRow(f"empty question in field {fields.question!r}")
    elif require_question:
        raise missing_field(record, fields.question, "--question-field")

    raw_answers = record.get(fields.answers)
    if raw_answers is None:
        if require_question:
            raise missing_field(record, fields.answers, "--answers-field")
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
        raise BadRow(f"field {fields.id!r} must be a string or an integer, got {type_name(raw_id)}")
    return Example(id=example_id, context=context, question=question, answers=answers, passages=passages)


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
            got = type_name(item) + (" in the list" if items is value else "")
            raise BadRow(f"field {field!r} must be a string or a list of strings, got {got}")
        texts.append(item.strip())
    # Several annotators often give the same answer; order is kept for display.
    return tuple(dict.fromkeys(text for text in texts if text))


def missing_field(record: dict, field: str, option: str) -> BadRow:
    present = [str(key) for key, value in record.items() if value is not None]
    if len(present) > 8:
        present[8:] = ["..."]
    return BadRow(
        f"missing field {field!r} (fields: {', '.join(present) or 'none'})", f"name another field with {option}"
    )


__all__ = ["Dataset", "Example", "load_dataset"]
