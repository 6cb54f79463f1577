"""``kvstore score``: multiple-choice accuracy, and the likelihood of reference texts, from stored contexts.

Each row's prompt (its context and question through ``--template``) is scored with every choice
after it (``--delimiter`` between them, lm-eval's ``target_delimiter``): the options of a row share
one stored context, loaded or computed once. ``acc`` picks the option with the highest
log-likelihood, ``acc_norm`` the highest log-likelihood per character of the option's text,
``acc_bytes`` per UTF-8 byte (lm-eval's definitions). ``--reference`` scores each row's reference
text instead (perplexity, bits per character); ``--rolling`` the whole context as a document
(lm-eval's rolling windows).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import click

from kvstore.cli import flags
from kvstore.cli.common import CLIError, progress_bar, write_jsonl
from kvstore.cli.flags import ModelChoice, Report, StoreChoice
from kvstore.cli.summary import corrupt_entries_as_warnings, emit_summary
from kvstore.data.prompts import DEFAULT_TEMPLATE
from kvstore.model.options import ScoreOptions

LN2 = math.log(2)


def _prompt(template: str | None, context: str, question: str | None) -> str:
    if template is None:
        return DEFAULT_TEMPLATE.format(context=context, question=question) if question else context
    return template.format(context=context, question=question or "")


@dataclass(frozen=True)
class ChoiceSource:
    """The scoring dataset and its fields."""

    dataset: str
    context_field: str
    question_field: str
    choices_field: str
    label_field: str
    answer_field: str
    reference_field: str
    id_field: str
    choices_sep: str
    limit: int | None

    def load(self, mode: str) -> list:
        """The rows (:func:`kvstore.data.choices.load_choice_rows`) for ``mode``."""
        from kvstore.data.choices import ChoiceFields, load_choice_rows

        fields = ChoiceFields(self.context_field, self.question_field, self.choices_field, self.label_field,
                              self.answer_field, self.reference_field, self.id_field)  # fmt: skip
        return load_choice_rows(self.dataset, fields, reference=mode == "reference", choices_sep=self.choices_sep,
                                limit=self.limit, need_choices=mode == "choices")  # fmt: skip


def _template(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    if value is not None:
        try:
            value.format(context="", question="")
        except (KeyError, IndexError, ValueError) as exc:
            raise click.BadParameter(
                f"{value!r}: {exc!r}; use {{context}} and {{question}} (and {{{{ }}}} for a literal brace)"
            ) from None
    return value


@dataclass(frozen=True)
class Scoring:
    """What is scored: ``mode`` (choices, ``--reference``, ``--rolling``), the prompt ``template``
    and the ``delimiter`` before each option."""

    mode: str | None
    template: str | None
    delimiter: str


@click.command()
@flags.dataset_flags
@click.option("--choices-field", default="choices", show_default=True, help="Field holding the options (a list).")
@click.option("--label-field", default="label", show_default=True, help="Field holding the right option's index.")
@click.option("--answer-field", default="answer", show_default=True, help="Or: field holding the right option's text.")
@click.option("--reference-field", default="reference", show_default=True, help="Field holding the reference text.")
@click.option("--choices-sep", default="|", show_default=True, help="Separator of options in a CSV cell.")
@click.option(
    "--reference", "mode", flag_value="reference", help="Score each row's reference text: perplexity, bits per char."
)
@click.option(
    "--rolling", "mode", flag_value="rolling", help="Score each row's context as a whole document (lm-eval rolling)."
)
@click.option(
    "--template", default=None, callback=_template,
    help=f"Prompt with {{context}} and {{question}} [default: {DEFAULT_TEMPLATE!r} for rows with a question, else "
    "'{context}'].",
)  # fmt: skip
@click.option(
    "--delimiter", default=" ", show_default=True, help="Text between the prompt and each option or reference."
)
@flags.model_flags
@flags.work_flags(ScoreOptions)
@flags.cache_flags(ScoreOptions)
@flags.variant_flags("score", "scored")
@flags.output_flag("row")
@flags.summary_flags
@flags.receives(source=ChoiceSource, model=ModelChoice, scoring=Scoring, options=flags.fill(ScoreOptions),
                sweep=flags.sweep_of, store=StoreChoice, report=Report)  # fmt: skip
def score(
    source: ChoiceSource, model: ModelChoice, scoring: Scoring, options: ScoreOptions, sweep: tuple,
    store: StoreChoice, report: Report,
) -> None:  # fmt: skip
    """Score DATASET's multiple-choice rows (acc, acc_norm) or reference texts from stored contexts.

    DATASET is a .jsonl, .csv or .json file of rows with a context, optionally a question, and
    choices with a label index or answer text (or, with --reference, a reference text). Missing
    contexts are computed and stored; --no-cache gives the same scores without the store.
    --press and --decode-attention score under one variant composed of both; --variant, repeated,
    sweeps from one load.
    """
    mode = scoring.mode or "choices"
    if len(sweep) > 1 and mode == "rolling":
        raise CLIError("--rolling scores under one variant at a time: give one --variant or --press/--decode-attention")
    rows = source.load(mode)
    adapter = model.load(report.quiet)
    kv = store.open() if options.use_cache else None
    if mode == "rolling" and sweep:  # one variant: the options' press and decode attention
        options = ScoreOptions.of(options, press=sweep[0].press, decode_attention=sweep[0].decode_attention)
        sweep = ()
    run = _ScoreSettings(mode, scoring.template, scoring.delimiter, report.quiet, kv)
    t0 = time.perf_counter()
    try:
        if mode == "rolling":
            out_rows, summary = _rolling(adapter, rows, options, run)
        else:
            out_rows, summary = _scored(adapter, rows, options, sweep, run)
    finally:
        if kv is not None:
            kv.close()
    seconds = time.perf_counter() - t0
    # as sample's: the time batches waited for the next batch's load (run ahead on a worker), and its share
    wait = summary.get("load_wait_seconds")
    summary["idle_share"] = round(wait / seconds, 4) if wait is not None and seconds else None
    if report.output:
        write_jsonl(report.output, out_rows)
    variant = ", ".join(v.name for v in sweep) or options.variant().name
    head = {"dataset": source.dataset, "model": adapter.name, "dtype": adapter.dtype_name, "mode": mode,
            "cache": "on" if options.use_cache else "off", "variant": variant, "rows": len(rows)}  # fmt: skip
    emit_summary("score", head | summary | {"seconds": round(seconds, 3), "output": report.output}, report.fmt)


@dataclass(frozen=True)
class _ScoreSettings:
    """How ``kvstore score`` scores: its mode, prompt template, delimiter, quietness and store."""

    mode: str
    template: str | None
    delimiter: str
    quiet: bool
    store: object


def _scored(adapter, rows, options, sweep: tuple, run: _ScoreSettings) -> tuple[list[dict], dict]:
    """Multiple-choice or reference rows through :meth:`Adapter.score` (one variant: the options')
    or :meth:`Adapter.score_sweep` (``sweep``)."""
    contexts, conts, labels, owner = [], [], [], []
    for n, row in enumerate(rows):
        prompt = _prompt(run.template, row.context, row.question)
        texts = row.choices if run.mode == "choices" else (row.reference,)
        for j, text in enumerate(texts):
            contexts.append(prompt)
            conts.append(run.delimiter + text)
            labels.append(f"{row.where}" + (f" choice {j}" if run.mode == "choices" else ""))
            owner.append(n)
    store = run.store if options.use_cache else None
    documents = _shared_documents(run.template, rows, store)
    head = _head(run.template) or None  # a fixed head (few-shot block): stored once for every prompt
    if head and store is not None and not store.readonly:
        documents.insert(0, head)  # stored before any prompt runs, so that every prompt finds it
    built = 0
    with progress_bar(len(conts), "score", run.quiet, unit="opt", rate="tok") as bar:
        with corrupt_entries_as_warnings(bar):
            if documents:  # the head, and documents that begin several prompts: stored once, loaded by each
                report = adapter.build(documents, store, truncate=options.truncate, prefix=head)
                built = report.tokens
            common = dict(store=store, labels=labels, progress=bar, prefix=head)
            if sweep:
                results = adapter.score_sweep(contexts, conts, options, variants=sweep, **common)
            else:
                results = {options.variant().name: adapter.score(contexts, conts, options, **common)}
    first = next(iter(results.values()))
    computed = first.prefill_tokens_computed + built
    no_cache_tokens = first.prefill_tokens_computed + first.prefill_tokens_saved
    counts = {"prefill_tokens_computed": computed, "prefill_tokens_saved": no_cache_tokens - computed,
              "load_wait_seconds": round(first.load_wait_seconds, 3) if store is not None else None}  # fmt: skip
    if sweep or not options.variant().dense:
        counts["window_tokens_computed"] = first.window_tokens_computed
        counts["replay_tokens_computed"] = first.replay_tokens_computed
        counts["scoring_tokens_computed"] = first.scoring_tokens_computed
    graded: dict[str, tuple[list[dict], dict]] = {}
    for name, result in results.items():
        per_row: list[list] = [[] for _ in rows]
        for i, scored in enumerate(result.rows):
            per_row[owner[i]].append((conts[i], scored))
        if run.mode == "reference":
            graded[name] = _reference_rows(rows, per_row, run.delimiter), _reference_summary(per_row)
        else:
            graded[name] = _choice_rows(rows, per_row)
        graded[name][1]["kept_tokens"] = sum(result.kept_tokens)
        graded[name][1]["cache_bytes"] = result.cache_bytes
    if len(graded) == 1:
        out, summary = graded[name]
        return out, summary | counts
    table = _sweep_table(graded, run.mode)
    return _sweep_rows(graded), {"options": len(first.rows)} | counts | {"variants": table}


def _sweep_rows(graded: dict[str, tuple[list[dict], dict]]) -> list[dict]:
    """Every variant's rows, each with its ``variant`` (rows of one variant together, in order)."""
    return [{"variant": name} | item for name, (items, _) in graded.items() for item in items]


def _sweep_table(graded: dict[str, tuple[list[dict], dict]], mode: str) -> list[dict]:
    """A summary row per variant: its figures, and (multiple choice, with a ``dense`` variant) the
    fraction of rows whose ``acc`` prediction is the dense one's."""
    from kvstore.model.variants.variant import DENSE

    dense = graded.get(DENSE.name)
    table = []
    for name, (items, summary) in graded.items():
        row = {"variant": name}
        if mode == "reference":
            row |= {k: summary[k] for k in ("perplexity", "bits_per_char", "nll_per_token")}
        else:
            row |= {k: summary[k] for k in ("acc", "acc_norm", "acc_bytes")}
            same = None
            if dense is not None and items:
                same = sum(a["prediction"] == b["prediction"] for a, b in zip(items, dense[0])) / len(items)
            row["agreement_with_dense"] = None if same is None else round(same, 4)
        row |= {"kept_tokens": summary["kept_tokens"], "cache_bytes": summary["cache_bytes"]}
        table.append(row)
    return table


def _choice_rows(rows, per_row) -> tuple[list[dict], dict]:
    """Per multiple-choice row: each option's log-likelihood (and per character / byte), the
    predictions by lm-eval's ``acc``, ``acc_norm`` and ``acc_bytes``; and their accuracies."""
    out: list[dict] = []
    hits = {"acc": 0, "acc_norm": 0, "acc_bytes": 0}
    graded = 0
    for row, options in zip(rows, per_row):
        lls = [s.logprob for _, s in options]
        # lm-eval's normalizations: by the choice's length in characters (acc_norm) and UTF-8 bytes (acc_bytes)
        per_char = [ll / len(c) for ll, c in zip(lls, row.choices)]
        per_byte = [ll / len(c.encode("utf-8")) for ll, c in zip(lls, row.choices)]
        preds = {k: max(range(len(v)), key=v.__getitem__) for k, v in
                 (("acc", lls), ("acc_norm", per_char), ("acc_bytes", per_byte))}  # fmt: skip
        item = {"id": row.id, "label": row.label, "prediction": preds["acc"], "prediction_norm": preds["acc_norm"],
                "prediction_bytes": preds["acc_bytes"]}  # fmt: skip
        if row.label is not None:
            graded += 1
            for k, p in preds.items():
                hits[k] += p == row.label
            item |= {"correct": preds["acc"] == row.label, "correct_norm": preds["acc_norm"] == row.label,
                     "correct_bytes": preds["acc_bytes"] == row.label}  # fmt: skip
        item["choices"] = [
            {"text": c, "logprob": s.logprob, "logprob_per_char": pc, "logprob_per_byte": pb, "n_tokens": s.n_tokens,
             "is_greedy": s.is_greedy}
            for c, (_, s), pc, pb in zip(row.choices, options, per_char, per_byte)
        ]  # fmt: skip
        item["cached_tokens"] = options[0][1].cached_tokens
        out.append(item)
    summary: dict[str, int | float | None] = {"options": sum(len(o) for o in per_row), "graded": graded}
    summary |= {k: (round(v / graded, 4) if graded else None) for k, v in hits.items()}
    return out, summary


def _head(template: str | None) -> str | None:
    """The template's fixed text before ``{context}`` (e.g. a few-shot block; ``""`` for none),
    or None when it has no ``{context}`` or puts the question before it."""
    text = template if template is not None else DEFAULT_TEMPLATE
    if "{context}" not in text:
        return None
    head = text.split("{context}", 1)[0]
    return None if "{question}" in head else head.format()


def _shared_documents(template: str | None, rows, store) -> list[str]:
    """The documents (the prompt up to the end of ``{context}``) that begin more than one distinct
    prompt, when the prompt puts the question after the context and the store can be written.
    Stored first, each ends a chain the longer prompts continue (the store cuts their chains
    where a stored shorter context ends), so every question loads the whole document; else each
    question after the first would recompute the document's last, partial chunk."""
    head = _head(template)
    if store is None or store.readonly or head is None:
        return []
    prompts: dict[str, set[str]] = {}
    for row in rows:
        if row.question is not None or template is not None:
            prompts.setdefault(head + row.context, set()).add(_prompt(template, row.context, row.question))
    return [doc for doc, ps in prompts.items() if len(ps) > 1 and all(p != doc for p in ps)]


def _reference_rows(rows, per_row, delimiter: str) -> list[dict]:
    out = []
    for row, ((text, s),) in zip(rows, per_row):
        out.append({
            "id": row.id, "logprob": s.logprob, "n_tokens": s.n_tokens, "n_chars": len(text),
            "nll_per_token": -s.logprob / s.n_tokens, "perplexity": math.exp(-s.logprob / s.n_tokens),
            "bits_per_char": -s.logprob / (len(text) * LN2), "is_greedy": s.is_greedy, "cached_tokens": s.cached_tokens,
        })  # fmt: skip
    return out


def _reference_summary(per_row) -> dict:
    """Corpus figures: token- and character-weighted (sums over every row, not means of rows)."""
    nll = -math.fsum(s.logprob for options in per_row for _, s in options)
    tokens = sum(s.n_tokens for options in per_row for _, s in options)
    chars = sum(len(t) for options in per_row for t, _ in options)
    nbytes = sum(len(t.encode("utf-8")) for options in per_row for t, _ in options)
    return {
        "tokens_scored": tokens,
        "nll_per_token": round(nll / tokens, 6),
        "perplexity": round(math.exp(nll / tokens), 4),
        "bits_per_char": round(nll / (chars * LN2), 6),
        "bits_per_byte": round(nll / (nbytes * LN2), 6),
    }


def _rolling(adapter, rows, options, run: _ScoreSettings) -> tuple[list[dict], dict]:
    """Each row's context as a whole document through :meth:`Adapter.score_rolling`."""
    texts = [row.context for row in rows]
    with progress_bar(None, "score", run.quiet, unit="win", rate="tok") as bar:
        with corrupt_entries_as_warnings(bar):
            docs = adapter.score_rolling(texts, options, store=run.store if options.use_cache else None, progress=bar)
    out = [
        {"id": row.id, "logprob": d.logprob, "n_tokens": d.n_tokens, "n_chars": d.n_chars, "windows": d.windows,
         "perplexity": d.perplexity, "bits_per_char": d.bits_per_char, "cached_tokens": d.cached_tokens}
        for row, d in zip(rows, docs)
    ]  # fmt: skip
    nll = -math.fsum(d.logprob for d in docs)
    tokens = sum(d.n_tokens for d in docs)
    chars = sum(d.n_chars or 0 for d in docs)
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    return out, {
        "tokens_scored": tokens,
        "nll_per_token": round(nll / tokens, 6) if tokens else None,
        "perplexity": round(math.exp(nll / tokens), 4) if tokens else None,
        "bits_per_char": round(nll / (chars * LN2), 6) if chars else None,
        "bits_per_byte": round(nll / (nbytes * LN2), 6) if nbytes else None,
        "prefill_tokens_computed": docs.prefill_tokens_computed,
        "prefill_tokens_saved": docs.prefill_tokens_saved,
        "load_wait_seconds": round(docs.load_wait_seconds, 3) if options.use_cache else None,
    }
