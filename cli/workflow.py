"""``kvstore build`` and ``kvstore sample``: the main job, end to end.

Both commands load the dataset, the model and the prompt format the same way, so that the
contexts ``build`` stores are exactly the ones ``sample`` looks up. Their flags are the shared ones
of :mod:`kvstore.cli.flags` and the few below; each command receives the objects its flags build
(:func:`kvstore.cli.flags.receives`): the library's options object among them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import click

from kvstore.cli import flags
from kvstore.cli.common import CLIError, progress_bar, write_jsonl
from kvstore.cli.flags import ModelChoice, Report, StoreChoice
from kvstore.cli.summary import (
    METRIC_KEYS,
    corrupt_entries_as_warnings,
    emit_summary,
    lossy_copies_hint,
    metrics,
    variant_table,
)
from kvstore.data.prompts import DEFAULT_TEMPLATE
from kvstore.model.keywords import field_default
from kvstore.model.options import BuildOptions, SampleOptions


@dataclass(frozen=True)
class Data:
    """The dataset and its fields (the flags of :func:`_data_flags`)."""

    dataset: str
    context_field: str
    question_field: str
    answers_field: str
    id_field: str
    skip_bad_rows: bool
    limit: int | None

    def load(self, require_question: bool) -> Any:
        """The rows (:func:`kvstore.data.datasets.load_dataset`); ClickException when none is usable."""
        from kvstore.data.datasets import load_dataset
        from kvstore.data.readers import Fields

        fields = Fields(self.context_field, self.question_field, self.answers_field, self.id_field)
        data = load_dataset(self.dataset, fields, skip_bad_rows=self.skip_bad_rows, require_question=require_question,
                            limit=self.limit)  # fmt: skip
        if not data.examples:
            raise click.ClickException(f"{self.dataset}: no usable rows")
        return data


@dataclass(frozen=True)
class Preview:
    """``--dry-run``: print the build's plan, change nothing."""

    dry_run: bool


@contextlib.contextmanager
def _plan_store(store: StoreChoice) -> Iterator[tuple[Any, bool]]:
    """The store a dry run plans against, and whether it exists: the store opened read-only (nothing
    created, upgraded or touched on any backend), or where there is none yet an empty private
    in-memory store with the settings the flags would give a new one (``--codec``,
    ``--chunk-tokens``)."""
    from kvstore.errors import StoreNotFoundError
    from kvstore.store.keyspace import META
    from kvstore.store.kvstore import KVStore

    try:
        kv = dataclasses.replace(store, readonly_store=True).open()
        exists = True
    except StoreNotFoundError:
        kv, exists = KVStore("memory://", codec=store.codec, chunk_tokens=store.chunk_tokens), False
    with kv:
        yield kv, exists and bool(kv.backend.contains(META))


def _print_plan(plan: Any, adapter: Any, fmt: str, settings: dict[str, Any]) -> None:
    """A build's plan (:class:`kvstore.model.plan.build.BuildPlan`): the store's settings (a new
    store's: those it would get), the plan's counts, then one line per context that the build would
    touch (JSON: every context)."""
    summary = settings | plan.summary(adapter.kv_bytes_per_token())
    steps = [
        {"key": s.chain.key, "tokens": s.chain.n_tokens, "stored_chunks": s.depth, "chunks": len(s.chain.keys),
         "action": s.action, "tokens_to_compute": s.tokens_to_compute,
         "presses": [p.name for p in s.presses], "scores": [p.scorer_spec for p in s.scores]}
        for s in plan.steps
    ]  # fmt: skip
    if fmt == "json":
        click.echo(json.dumps({**summary, "steps": steps}, indent=2))
        return
    for row in steps:
        if row["action"] != "skip" or row["presses"] or row["scores"]:
            extra = "".join(f" +press {p}" for p in row["presses"]) + "".join(f" +score {p}" for p in row["scores"])
            click.echo(f"  {row['action']:<8} {row['key'][:16]}  {row['tokens']} tokens, {row['stored_chunks']}/"
                       f"{row['chunks']} chunks stored, {row['tokens_to_compute']} to compute{extra}")  # fmt: skip
    emit_summary("build plan (dry run: nothing changed)", summary, fmt)


@dataclass(frozen=True)
class Prompting:
    """How a row becomes the prompt: ``--chat``, ``--template``, ``--system``."""

    chat: bool | None
    template: str | None
    system: str | None

    def format(self, tokenizer: Any) -> Any:
        """The :class:`kvstore.data.prompts.PromptFormat` (chat: when the tokenizer has a template)."""
        from kvstore.data.prompts import PromptFormat

        chat = self.chat if self.chat is not None else bool(getattr(tokenizer, "chat_template", None))
        template = self.template or DEFAULT_TEMPLATE
        if chat:
            return PromptFormat.from_chat_template(tokenizer, template, self.system)
        return PromptFormat.plain(template)


# build and sample: the dataset, the model, the prompt, the options they share, the store
_run_flags = flags.stacked(
    flags.dataset_flags,
    click.option("--answers-field", default="answers", show_default=True, help="Field holding the answer(s)."),
    click.option("--skip-bad-rows", is_flag=True, help="Skip malformed rows (counted) instead of stopping."),
    flags.model_flags,
    click.option(
        "--prefill-chunk", default=None, type=click.IntRange(min=0),
        help="Run longer prefills in pieces of this many tokens (bounds activation memory; 0: one forward) "
        "[default: 512 with eager attention, 8192 with sdpa/flash].",
    ),
    click.option(
        "--chat/--no-chat", default=None, help="Wrap prompts in the model's chat template [default: on when the "
        "tokenizer has one].",
    ),
    click.option(
        "--template", default=None, help="Prompt template with {question} (and optionally {context} before it) "
        f"[default: {DEFAULT_TEMPLATE!r}].",
    ),
    click.option("--system", default=None, help="System prompt for --chat."),
    click.option(
        "--max-context-tokens", type=click.IntRange(min=1), default=None,
        help="Context length limit [default: model positions - 256]; use the same value for build and sample.",
    ),
    flags.summary_flags,
)  # fmt: skip


def _codec_option(help_text: str):
    return click.option("--codec", default=None, help=help_text)


def _build_options(values: flags.Values) -> BuildOptions:
    """``build``'s :class:`BuildOptions`; ``--no-dense`` without ``--press`` refused first, in the
    flags' words."""
    if values["dense"] is False and not values["presses"]:
        if values["scores"]:
            raise CLIError(
                "--no-dense --score without --press would store scores that no stored context keeps (gc removes "
                "them as orphans): drop --no-dense (contexts stored dense are not recomputed), or add the --press "
                "that reads them"
            )
        raise CLIError(
            "--no-dense stores nothing without --press: give --press SPEC (with or without --score), or drop --no-dense"
        )
    return flags.fill(BuildOptions, skip_errors="skip_bad_rows")(values)


def _shard(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, int] | None:
    if value is None:
        return None
    try:
        i, n = (int(x) for x in value.split("/"))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not I/N (e.g. 0/4)") from None
    if not 0 <= i < n:
        raise click.BadParameter(f"{value!r}: need 0 <= I < N")
    return i, n


@click.command()
@_run_flags
@flags.work_flags(BuildOptions)
@_codec_option(
    "Codec for new entries: lossless zstd-split[:LEVEL[:BITS]], raw, zstd[:LEVEL] or zstd-shuffle[:LEVEL] "
    "[default: the store's; new stores zstd-split:1:16 on a CPU, raw on CUDA], or lossy int8[:G], int4[:G], fp8, "
    "int4r, int8r, ecq[:STEP], int4h or kvh[:KB/VB...] (optionally +PACKING): lossy entries are found only by "
    "sample --codec with the same codec."
)
@click.option(
    "--shard",
    metavar="I/N",
    default=None,
    callback=_shard,
    help="Build only the contexts whose key (first 16 hex digits as a number) is I modulo N; run N of these "
    "(I = 0..N-1), anywhere, into one store.",
)
@click.option(
    "--chunk-tokens",
    type=click.IntRange(min=1, max=1 << 20),
    default=None,
    help="Chunk size of a new store [default: 512]; an existing store keeps its own.",
)
@click.option(
    "--press",
    "presses",
    multiple=True,
    metavar="SPEC",
    callback=flags.each(flags.press_spec),
    help="Also store each context's pressed cache under this press (kvzip:0.75; repeatable), with --codec; "
    "sample --press SPEC with the same codec then reads it (docs/presses.md).",
)
@click.option(
    "--score",
    "scores",
    multiple=True,
    metavar="SCORER",
    callback=flags.each(flags.scorer_spec),
    help="Also store each context's scores under this query-agnostic scorer once (kvzip, expected_attention, "
    "snapkv:window=32: a press without its ratio; repeatable): any ratio of it then runs no scoring forward.",
)
@click.option(
    "--dense/--no-dense",
    "dense",
    default=None,
    help="With --no-dense, keep only what --press and --score store: the dense caches are computed in memory "
    "and dropped (a variant that needs one computes it, as for any miss) [default: --dense].",
)
@flags.build_compose_flag
@click.option("--dry-run", is_flag=True, help="Print what the build would do per context (its plan); change nothing.")
@flags.receives(
    data=Data,
    model=ModelChoice,
    prompting=Prompting,
    options=_build_options,
    store=StoreChoice,
    report=Report,
    preview=Preview,
)
def build(
    data: Data, model: ModelChoice, prompting: Prompting, options: BuildOptions, store: StoreChoice, report: Report,
    preview: Preview,
) -> None:  # fmt: skip
    """Prefill every distinct context of DATASET once and store its KV cache.

    Contexts already in the store are skipped, so an interrupted build resumes where it stopped.
    DATASET is a .jsonl, .csv or SQuAD-style .json file. --shard I/N splits the work over N
    jobs (e.g. a SLURM array writing into one s3:// store); each is idempotent like a build.
    --press and --score also store pressed caches and scores beside each context; --dry-run
    prints the plan (per context: skip, record, migrate, compute; what it lacks) and stops.
    """
    store.check_codec()
    rows = data.load(require_question=False)
    adapter = model.load(report.quiet)
    prompt = prompting.format(adapter.tokenizer)
    first: dict[str, Any] = {}
    for ex in rows.examples:
        first.setdefault(ex.context, ex)
    contexts = [first[c].model_context for c in rows.contexts()]  # passage rows: their composed ids' chains
    labels = [f"{data.dataset}: context of row {first[c].id}" for c in rows.contexts()]
    if preview.dry_run:
        with _plan_store(store) as (kv, exists):
            plan = adapter.plan_build(contexts, kv, options, prompt=prompt, labels=labels)
            settings = {"store": store.store, "store_exists": exists, "codec": kv.codec.spec,
                        "chunk_tokens": kv.chunk_tokens, "rows": len(rows.examples), "compose": options.compose,
                        "bad_rows_skipped": rows.skipped}  # fmt: skip
        for problem in list(rows.problems) + list(plan.errors):
            click.echo(f"kvstore: would skip: {problem}", err=True)
        _print_plan(plan, adapter, report.fmt, settings)
        return
    with store.open_for_build(adapter) as kv:
        with progress_bar(len(contexts), "build", report.quiet, unit="ctx", rate="tok") as bar:
            built = adapter.build(contexts, kv, options, prompt=prompt, labels=labels, progress=bar)
    shard = options.shard
    summary = {
        "dataset": data.dataset,
        "store": str(kv.url),
        "model": adapter.name,
        "dtype": adapter.dtype_name,
        "codec": kv.codec.spec,
        "lossy": not kv.codec.lossless,
        "rows": len(rows.examples),
        "bad_rows_skipped": rows.skipped,
        "shard": f"{shard[0]}/{shard[1]}" if shard else None,
        "contexts": built.distinct,
        "other_shards": built.other_shards if shard else None,
        "built": built.built,
        "skipped": built.skipped,
        "failed": built.failed,
        "tokens_computed": built.tokens,
        "tokens_reused": built.tokens_reused,
        "migrated": built.migrated,
        "chunks_written": built.chunks_written,
        "raw_bytes": built.raw_bytes,
        "stored_bytes": built.stored_bytes,
        "ratio": round(built.ratio, 4),
        "seconds": round(built.seconds, 3),
        "store_seconds": round(built.store_seconds, 3),
        "tokens_per_second": round(built.tokens_per_second, 1),
        "dense": options.dense,
        "compose": options.compose or None,
        "pressed_written": built.pressed_written if options.presses else None,
        "scores_written": built.scores_written if options.presses or options.scores else None,
        "derived_bytes": built.derived_bytes if options.presses or options.scores else None,
        "scoring_tokens_computed": built.scoring_tokens if options.presses or options.scores else None,
    }
    for problem in list(rows.problems) + built.errors:
        click.echo(f"kvstore: skipped: {problem}", err=True)
    emit_summary("build", summary, report.fmt)


@click.command()
@_run_flags
@flags.work_flags(SampleOptions)
@click.option(
    "--max-new-tokens",
    "-n",
    "num_new_tokens",
    default=field_default(SampleOptions, "num_new_tokens"),
    show_default=True,
    type=click.IntRange(min=1),
    help="Tokens to generate per answer.",
)
@flags.cache_flags(SampleOptions)
@flags.output_flag("question")
@click.option(
    "--stop",
    "stop_strings",
    multiple=True,
    callback=flags.stop_strings,
    help="End an answer once its text contains this string (repeatable; \\n and \\t are newline and tab), "
    "e.g. --stop '\\n'.",
)
@click.option(
    "--compose",
    default=None,
    metavar="POLICY",
    callback=flags.compose_of,
    help="For rows whose context is a list of passages: compose each row's context of its passages, each stored "
    "once and placed at its offset, under POLICY: full (exact: the no-cache answer), none, last:N (recompute the "
    "last N tokens) or blend:R (recompute the share R of passage tokens that deviate most). All but full are "
    "approximate (docs/composing.md); each output row names its policy.",
)
@click.option(
    "--load-ahead/--no-load-ahead",
    default=field_default(SampleOptions, "load_ahead"),
    hidden=True,
    help="Benchmarks: load the next batch early.",
)
@click.option(
    "--compile",
    "steps",
    is_flag=True,
    flag_value="compiled",
    default=field_default(SampleOptions, "steps"),
    help="Decode with fixed shapes under torch.compile (compiled once per batch size and 256-slot length bucket; "
    "the first batch of each shape pays the compile). Same tokens; see the README for when it pays.",
)
@_codec_option(
    "Answer from caches stored with this codec. Lossless codecs are interchangeable (the default: the store's); "
    "a lossy one (int8[:G], int4[:G], fp8, int4r, int8r, ecq, int4h, kvh) uses only entries built with it, "
    "and stores missing contexts with it."
)
@flags.variant_flags("answer", "answered")
@flags.receives(data=Data, model=ModelChoice, prompting=Prompting, options=flags.fill(SampleOptions),
                sweep=flags.sweep_of, store=StoreChoice, report=Report)  # fmt: skip
def sample(
    data: Data, model: ModelChoice, prompting: Prompting, options: SampleOptions, sweep: tuple, store: StoreChoice,
    report: Report,
) -> None:  # fmt: skip
    """Answer every question of DATASET with greedy decoding from stored context caches.

    Missing contexts are computed, stored and used. --no-cache runs the same decoding without
    the store (the reference): both give the same predictions. --press and --decode-attention
    answer under one variant composed of both (docs/presses.md, docs/hooks.md); --variant,
    repeated, sweeps: every batch is loaded once and answered under each.
    """
    from kvstore.model.variants.hooks import check_steps

    store.check_codec()
    variant = options.variant()  # built once: checked here and named in the rows
    check_steps(list(sweep) or [variant], options.steps)  # refused before the model loads
    rows = data.load(require_question=True)
    adapter = model.load(report.quiet)
    prompt = prompting.format(adapter.tokenizer)
    examples = rows.examples
    contexts = [ex.model_context for ex in examples]
    questions = [ex.question for ex in examples]
    kv = store.open() if options.use_cache else None
    bar = progress_bar(len(examples), "sample", report.quiet, unit="q", rate="tok")
    t0 = time.perf_counter()
    common = dict(store=kv, prompt=prompt, labels=[f"{data.dataset}: row {ex.id}" for ex in examples], progress=bar)
    try:
        results = _sample_results(adapter, (contexts, questions), options, sweep, common, bar)
    finally:
        bar.close()
        if kv is not None:
            kv.close()
    seconds = time.perf_counter() - t0
    named = bool(sweep) or not variant.dense  # rows say which variant answered them
    out_rows = _answer_rows(adapter, examples, results, options.use_cache, named)
    if report.output:
        write_jsonl(report.output, out_rows)
    result, n = results[0], len(examples)
    summary = {
        "dataset": data.dataset,
        "model": adapter.name,
        "mode": "cache" if options.use_cache else "no-cache",
        "compiled": options.steps == "compiled",
        "compose": result.compose,
        "variant": result.variant if named and not sweep else None,
        "questions": n,
        "bad_rows_skipped": rows.skipped,
        **(dict.fromkeys(METRIC_KEYS) if sweep else metrics(out_rows[:n])),  # a sweep's metrics are per variant
        "seconds": round(seconds, 3),
        "questions_per_second": round(n / seconds, 3) if seconds else None,
        "cache_hit_rate": round(sum(result.cache_hit) / n, 4) if n else None,
        "codec": kv.codec.spec if kv is not None else None,
        "lossy": kv is not None and not kv.codec.lossless,
        "prefill_tokens_saved": result.prefill_tokens_saved,
        "prefill_tokens_computed": result.prefill_tokens_computed,
        # the time batches waited for the next batch's load (run ahead on a worker): idle between batches
        "load_wait_seconds": round(result.load_wait_seconds, 3) if options.use_cache else None,
        "idle_share": round(result.load_wait_seconds / seconds, 4) if options.use_cache and seconds else None,
        "window_tokens_computed": result.window_tokens_computed if named else None,
        "replay_tokens_computed": result.replay_tokens_computed if named else None,
        "scoring_tokens_computed": result.scoring_tokens_computed if named else None,
        "output": report.output,
    }
    if sweep:
        context_tokens = result.prefill_tokens_saved + result.prefill_tokens_computed  # every row's context
        summary["variants"] = variant_table(results, out_rows, n, context_tokens * adapter.kv_bytes_per_token())
    _echo_answers(out_rows, summary, report)
    lossy_copies_hint(result.lossy_copies, store.readonly_store)
    emit_summary("sample", summary, report.fmt)
    sys.stdout.flush()


def _sample_results(adapter: Any, rows: tuple, options: SampleOptions, sweep: tuple, common: dict, bar: Any) -> list:
    """Each variant's ``SampleResult`` of ``rows`` (contexts, questions): a sweep's in turn, or the
    options' one variant's; a corrupt entry is a warning printed above the bar."""
    contexts, questions = rows
    with corrupt_entries_as_warnings(bar):
        if sweep:
            return list(adapter.sweep(contexts, questions, options, variants=sweep, **common).values())
        return [adapter.sample(contexts, questions, options, **common)]


def _answer_rows(adapter: Any, examples: list, results: list, use_cache: bool, named: bool) -> list[dict]:
    """One output row per question and variant (the variants' rows in turn)."""
    from kvstore.data.metrics import clean_prediction, contains_match, lenient_match

    out = []
    for res in results:
        for i, ex in enumerate(examples):
            text = adapter.decode(res.tokens[i][: res.lengths[i]])
            pred = clean_prediction(text)
            row = {
                "id": ex.id,
                "question": ex.question,
                "prediction": pred,
                "answers": list(ex.answers),
                "correct": bool(ex.answers) and lenient_match(pred, ex.answers),
                "contains_answer": bool(ex.answers) and contains_match(pred, ex.answers),
                "cache_hit": bool(res.cache_hit[i]),
                "cached_tokens": res.cached_tokens[i] if use_cache else 0,
                "codec": res.codecs[i] if use_cache else None,
                "raw_output": text,
            }
            if named:
                row["variant"] = res.variant
                row["kept_tokens"] = res.kept_tokens[i]
            if res.compose is not None:  # approximate unless full
                row["compose"] = res.compose
            out.append(row)
    return out


def _echo_answers(rows: list[dict], summary: dict, report: Report) -> None:
    """The first answers (text summaries without --output), and the lossy-codec remark, on stderr."""
    if not report.output and report.fmt == "text" and not report.quiet:
        for r in rows[:5]:
            verdict = "correct" if r["correct"] else "wrong"
            click.echo(f"  {r['id']}: {r['question']!r} -> {r['prediction']!r} ({verdict})", err=True)
    if summary["lossy"]:
        click.echo(
            f"kvstore: answers came from lossy {summary['codec']} caches (quantized keys and values, not the model's "
            "own); see the codec table in the README for how often they differ",
            err=True,
        )
