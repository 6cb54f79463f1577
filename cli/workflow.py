"""``kvstore build`` and ``kvstore sample``: the main job, end to end.

Both commands load the dataset, the model and the prompt format the same way, so that the
contexts ``build`` stores are exactly the ones ``sample`` looks up.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path

import click

from kvstore import dtypes
from kvstore.cli.common import echo_json, progress_bar, quiet_option, store_option, store_options


@contextlib.contextmanager
def _corrupt_entries_as_warnings(bar):
    """Show each :class:`kvstore.errors.CorruptEntryWarning` (a stored entry that failed
    verification and was treated as a miss) as one ``kvstore: warning: ...`` line on stderr,
    every time; Python's default would print two lines with a source excerpt, once per place."""
    import warnings

    from kvstore.errors import CorruptEntryWarning

    with warnings.catch_warnings():
        warnings.simplefilter("always", CorruptEntryWarning)
        show = warnings.showwarning

        def one_line(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, CorruptEntryWarning):
                bar.write(f"kvstore: warning: {str(message).removeprefix('kvstore: ')}")
            else:
                show(message, category, filename, lineno, file, line)

        warnings.showwarning = one_line
        yield


def emit_summary(title: str, summary: dict, fmt: str) -> None:
    """The closing summary: JSON on stdout with ``--format json``, else aligned lines."""
    if fmt == "json":
        echo_json(summary)
        return
    click.echo(f"{title} summary")
    width = max(len(k) for k in summary)
    tables = {k: v for k, v in summary.items() if isinstance(v, list) and v and isinstance(v[0], dict)}
    for k, v in summary.items():
        if v is None or k in tables:
            continue
        if isinstance(v, bool):
            v = "yes" if v else "no"
        elif isinstance(v, int) and k.endswith("bytes"):
            from kvstore.units import human_bytes

            v = f"{v:,} ({human_bytes(v)})"
        elif isinstance(v, float) and k in ("accuracy", "contains", "exact_match", "f1", "cache_hit_rate"):
            v = f"{v:.1%}"
        elif isinstance(v, int):
            v = f"{v:,}"
        click.echo(f"  {k.replace('_', ' '):<{width}}  {v}")
    for k, table in tables.items():
        click.echo(f"{k.replace('_', ' ')}:")
        _echo_table(table)


def _echo_table(table: list[dict]) -> None:
    """Rows of dicts as aligned columns (fractions as percentages, None as -)."""

    def cell(k: str, v) -> str:
        if v is None:
            return "-"
        if isinstance(v, float) and (k in ("accuracy", "contains", "exact_match", "f1") or k.startswith("agreement")):
            return f"{v:.1%}"
        return str(v)

    keys = list(table[0])
    cells = [[cell(k, r.get(k)) for k in keys] for r in table]
    heads = [k.replace("_", " ") for k in keys]
    widths = [max(len(h), *(len(c[j]) for c in cells)) for j, h in enumerate(heads)]
    click.echo("  " + "  ".join(h.rjust(w) for h, w in zip(heads, widths)))
    for c in cells:
        click.echo("  " + "  ".join(x.rjust(w) for x, w in zip(c, widths)))


def _dataset_options(fn):
    for deco in reversed(
        [
            click.argument("dataset"),
            click.option("--context-field", default="context", show_default=True, help="Field holding the context."),
            click.option("--question-field", default="question", show_default=True, help="Field holding the question."),
            click.option("--answers-field", default="answers", show_default=True, help="Field holding the answer(s)."),
            click.option("--id-field", default="id", show_default=True, help="Field holding the row id (optional)."),
            click.option("--skip-bad-rows", is_flag=True, help="Skip malformed rows (counted) instead of stopping."),
            click.option("--limit", type=click.IntRange(min=1), help="Use only the first N rows."),
        ]
    ):
        fn = deco(fn)
    return fn


def _model_options(fn):
    for deco in reversed(
        [
            click.option(
                "--model",
                "-m",
                default=None,
                help="Hub id, local directory or .gguf file [default: bundled SmolLM2-135M-Instruct].",
            ),
            click.option(
                "--dtype",
                default="float32",
                show_default=True,
                type=click.Choice(list(dtypes.MODEL_DTYPE_CHOICES)),
                help="Dtype to run the model (and store KV) in.",
            ),
            click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:N or auto."),
            click.option(
                "--batch-size",
                "-b",
                default=None,
                type=click.IntRange(min=1),
                help="Rows per forward pass [default: 8; build on CPU: 1, measured faster there].",
            ),
            click.option(
                "--prefill-chunk",
                default=None,
                type=click.IntRange(min=0),
                help="Run longer prefills in pieces of this many tokens (bounds activation memory; 0: one forward) "
                "[default: 512 with eager attention, 8192 with sdpa/flash].",
            ),
            click.option(
                "--chat/--no-chat",
                default=None,
                help="Wrap prompts in the model's chat template [default: on when the tokenizer has one].",
            ),
            click.option(
                "--template",
                default=None,
                help="Prompt template with {question} (and optionally {context} before it) [default: "
                "'{context}\\nQuestion: {question}\\nAnswer:'].",
            ),
            click.option("--system", default=None, help="System prompt for --chat."),
            click.option(
                "--truncate", is_flag=True, help="Left-truncate contexts longer than the limit instead of failing."
            ),
            click.option(
                "--max-context-tokens",
                type=click.IntRange(min=1),
                default=None,
                help="Context length limit [default: model positions - 256]; use the same value for build and sample.",
            ),
            store_option,
            quiet_option,
            click.option(
                "--format",
                "fmt",
                type=click.Choice(["text", "json"]),
                default="text",
                show_default=True,
                help="Summary format.",
            ),
        ]
    ):
        fn = deco(fn)
    return fn


@dataclass(frozen=True)
class RunOptions:
    """The options ``build`` and ``sample`` share: where the data is, which model, which prompt,
    which store. Built from the command's keyword arguments by :meth:`take`."""

    dataset: str
    context_field: str
    question_field: str
    answers_field: str
    id_field: str
    skip_bad_rows: bool
    limit: int | None
    model: str | None
    dtype: str
    device: str
    batch_size: int | None
    prefill_chunk: int | None
    chat: bool | None
    template: str | None
    system: str | None
    truncate: bool
    max_context_tokens: int | None
    store: str
    quiet: bool
    fmt: str

    @classmethod
    def take(cls, kwargs: dict) -> RunOptions:
        """Remove this object's fields from ``kwargs`` (a command's arguments) and build it."""
        return cls(**{f.name: kwargs.pop(f.name) for f in fields(cls)})


def _load_everything(opts: RunOptions, *, require_question: bool):
    """The dataset, the model in an Adapter, and the prompt format, as both commands need them."""
    from kvstore.data.datasets import load_dataset

    data = load_dataset(
        opts.dataset,
        context_field=opts.context_field,
        question_field=opts.question_field,
        answers_field=opts.answers_field,
        id_field=opts.id_field,
        skip_bad_rows=opts.skip_bad_rows,
        require_question=require_question,
        limit=opts.limit,
    )
    if not data.examples:
        raise click.ClickException(f"{opts.dataset}: no usable rows")
    if not opts.quiet:
        click.echo(f"kvstore: loading model {opts.model or 'SmolLM2-135M-Instruct (bundled)'} ...", err=True)
    from kvstore.data.prompts import PromptFormat
    from kvstore.model.adapter import Adapter

    adapter = Adapter.from_pretrained(opts.model, dtype=opts.dtype, device=opts.device)
    adapter.prefill_chunk_tokens = opts.prefill_chunk
    chat = opts.chat if opts.chat is not None else bool(getattr(adapter.tokenizer, "chat_template", None))
    kwargs = {"template": opts.template} if opts.template else {}
    fmt = (
        PromptFormat.from_chat_template(adapter.tokenizer, system=opts.system, **kwargs)
        if chat
        else PromptFormat.plain(**kwargs)
    )
    return data, adapter, fmt


def _codec_option(help_text: str):
    return click.option("--codec", default=None, help=help_text)


def _check_codec(spec: str | None) -> None:
    """Reject a bad codec before anything is loaded (CodecError: one line, exit 1)."""
    from kvstore.store.codecs import get_codec

    get_codec(spec)


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
@_dataset_options
@_model_options
@_codec_option(
    "Codec for new entries: lossless zstd-split[:LEVEL[:BITS]], raw, zstd[:LEVEL] or zstd-shuffle[:LEVEL] "
    "[default: the store's; new stores zstd-split:1:16], or lossy int8[:G], int4[:G] or fp8 (optionally "
    "+PACKING): lossy entries are found only by "
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
def build(**kwargs):
    """Prefill every distinct context of DATASET once and store its KV cache.

    Contexts already in the store are skipped, so an interrupted build resumes where it stopped.
    DATASET is a .jsonl, .csv or SQuAD-style .json file. --shard I/N splits the work over N
    jobs (e.g. a SLURM array writing into one s3:// store); each is idempotent like a build.
    """
    from kvstore.store.kvstore import KVStore

    opts = RunOptions.take(kwargs)
    codec = kwargs.pop("codec")
    shard = kwargs.pop("shard")
    chunk_tokens = kwargs.pop("chunk_tokens")
    _check_codec(codec)
    data, adapter, prompt = _load_everything(opts, require_question=False)
    dataset = opts.dataset
    contexts = data.contexts()
    first_id = {}
    for ex in data.examples:
        first_id.setdefault(ex.context, ex.id)
    labels = [f"{dataset}: context of row {first_id[c]}" for c in contexts]
    texts = [prompt.context_part(c) for c in contexts]
    with KVStore(opts.store, codec=codec, chunk_tokens=chunk_tokens, **store_options()) as kv:
        with progress_bar(len(texts), "build", opts.quiet, unit="ctx", rate="tok") as bar:
            report = adapter.generate_kv_cache(
                texts,
                kv,
                batch_size=opts.batch_size,
                special_tokens=prompt.add_special_tokens,
                truncate=opts.truncate,
                max_context_tokens=opts.max_context_tokens,
                skip_errors=opts.skip_bad_rows,
                labels=labels,
                progress=bar,
                prefix=prompt.head or None,
                shard=shard,
            )
    summary = {
        "dataset": dataset,
        "store": str(kv.url),
        "model": adapter.name,
        "dtype": adapter.dtype_name,
        "codec": kv.codec.spec,
        "lossy": not kv.codec.lossless,
        "rows": len(data.examples),
        "bad_rows_skipped": data.skipped,
        "shard": f"{shard[0]}/{shard[1]}" if shard else None,
        "contexts": report.distinct,
        "other_shards": report.other_shards if shard else None,
        "built": report.built,
        "skipped": report.skipped,
        "failed": report.failed,
        "tokens_computed": report.tokens,
        "tokens_reused": report.tokens_reused,
        "migrated": report.migrated,
        "chunks_written": report.chunks_written,
        "raw_bytes": report.raw_bytes,
        "stored_bytes": report.stored_bytes,
        "ratio": round(report.ratio, 4),
        "seconds": round(report.seconds, 3),
        "store_seconds": round(report.store_seconds, 3),
        "tokens_per_second": round(report.tokens_per_second, 1),
    }
    for problem in list(data.problems) + report.errors:
        click.echo(f"kvstore: skipped: {problem}", err=True)
    emit_summary("build", summary, opts.fmt)


@click.command()
@_dataset_options
@_model_options
@click.option(
    "--max-new-tokens",
    "-n",
    default=20,
    show_default=True,
    type=click.IntRange(min=1),
    help="Tokens to generate per answer.",
)
@click.option(
    "--no-cache", is_flag=True, help="Reference path: run context + question through the model, ignore the store."
)
@click.option(
    "--output", "-o", type=click.Path(dir_okay=False, writable=True), help="Write one JSON object per question here."
)
@click.option("--readonly-store", is_flag=True, help="Do not store contexts computed for missing entries.")
@click.option(
    "--stop",
    "stop_strings",
    multiple=True,
    help="End an answer once its text contains this string (repeatable; \\n and \\t are newline and tab), "
    "e.g. --stop '\\n'.",
)
@click.option(
    "--max-batch-tokens",
    type=click.IntRange(min=1),
    default=None,
    help="Memory budget: at most this many padded tokens (context + question + new) x rows per batch.",
)
@click.option(
    "--compile",
    "compile_steps",
    is_flag=True,
    help="Decode with fixed shapes under torch.compile (compiled once per batch size and 256-slot length bucket; "
    "the first batch of each shape pays the compile). Same tokens; see the README for when it pays.",
)
@_codec_option(
    "Answer from caches stored with this codec. Lossless codecs are interchangeable (the default: the store's); "
    "a lossy one (int8[:G], int4[:G], fp8) uses only entries built with it, and stores missing contexts with it."
)
@click.option(
    "--decode-attention",
    "decode_attention",
    multiple=True,
    metavar="SPEC",
    help="Answer with this attention for the question and answer steps (contexts stay dense): dense, topk:K, "
    "sparq:R:K or a plug-in module:function. Repeat it to sweep: every batch is loaded once and answered under "
    "each variant (one output row per question and variant, a summary row per variant).",
)
def sample(**kwargs):
    """Answer every question of DATASET with greedy decoding from stored context caches.

    Missing contexts are computed, stored and used. --no-cache runs the same decoding without
    the store (the reference): both give the same predictions. --decode-attention answers under
    decode-time attention variants (see docs/hooks.md).
    """
    from kvstore.data.metrics import clean_prediction, contains_match, lenient_match, score
    from kvstore.store.kvstore import KVStore

    opts = RunOptions.take(kwargs)
    max_new_tokens, no_cache, output, readonly_store, codec, stop_strings, max_batch_tokens, compile_steps = (
        kwargs.pop(k)
        for k in ("max_new_tokens", "no_cache", "output", "readonly_store", "codec", "stop_strings", "max_batch_tokens",
                  "compile_steps")
    )  # fmt: skip
    specs = kwargs.pop("decode_attention")
    stop_strings = tuple(s.replace("\\n", "\n").replace("\\t", "\t") for s in stop_strings)
    _check_codec(codec)
    variants = _check_variants(specs, compile_steps)  # a bad spec fails here, before the model loads
    data, adapter, prompt = _load_everything(opts, require_question=True)
    dataset = opts.dataset
    examples = data.examples
    contexts = [prompt.context_part(ex.context) for ex in examples]
    questions = [prompt.question_part(ex.question) for ex in examples]
    labels = [f"{dataset}: row {ex.id}" for ex in examples]
    kv = None if no_cache else KVStore(opts.store, readonly=readonly_store, codec=codec, **store_options())
    lossy = kv is not None and not kv.codec.lossless
    bar = progress_bar(len(examples), "sample", opts.quiet, unit="q", rate="tok")
    t0 = time.perf_counter()
    common = dict(
        use_cache=not no_cache,
        store=kv,
        batch_size=opts.batch_size or 8,
        special_tokens=prompt.add_special_tokens,
        truncate=opts.truncate,
        max_context_tokens=opts.max_context_tokens,
        labels=labels,
        progress=bar,
        prefix=prompt.head or None,
        stop_strings=stop_strings,
        max_batch_tokens=max_batch_tokens,
        compile=compile_steps,
    )
    try:
        with _corrupt_entries_as_warnings(bar):
            if variants:
                results = list(adapter.sweep(contexts, questions, max_new_tokens, variants=variants, **common).values())
            else:
                results = [adapter.greedy_sample(contexts, questions, max_new_tokens, return_details=True, **common)]
    finally:
        bar.close()
        if kv is not None:
            kv.close()
    seconds = time.perf_counter() - t0
    result = results[0]
    rows = []
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
                "cached_tokens": res.cached_tokens[i] if not no_cache else 0,
                "codec": res.codecs[i] if not no_cache else None,
                "raw_output": text,
            }
            if variants:
                row["variant"] = res.variant
            rows.append(row)
    if output:
        out = Path(output)
        with out.open("w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    n = len(examples)
    answered = [r for r in rows[:n] if r["answers"]]
    scores = score([r["prediction"] for r in answered], [r["answers"] for r in answered]) if answered else {}
    summary = {
        "dataset": dataset,
        "model": adapter.name,
        "mode": "no-cache" if no_cache else "cache",
        "compiled": compile_steps,
        "questions": n,
        "bad_rows_skipped": data.skipped,
        **{k: (round(scores[k], 4) if answered else None) for k in ("accuracy", "contains", "exact_match", "f1")},
        "seconds": round(seconds, 3),
        "questions_per_second": round(n / seconds, 3) if seconds else None,
        "cache_hit_rate": round(sum(result.cache_hit) / n, 4) if n else None,
        "codec": kv.codec.spec if kv is not None else None,
        "lossy": lossy,
        "prefill_tokens_saved": result.prefill_tokens_saved,
        "prefill_tokens_computed": result.prefill_tokens_computed,
        "output": output,
    }
    if variants:  # the metrics are per variant
        for k in ("accuracy", "contains", "exact_match", "f1"):
            summary[k] = None
        summary["variants"] = variant_table(adapter, results, rows, n)
    if not output and opts.fmt == "text" and not opts.quiet:
        for r in rows[:5]:
            click.echo(
                f"  {r['id']}: {r['question']!r} -> {r['prediction']!r} ({'correct' if r['correct'] else 'wrong'})",
                err=True,
            )
    if lossy:
        click.echo(
            f"kvstore: answers came from lossy {kv.codec.spec} caches (quantized keys and values, not the model's "
            "own); see the codec table in the README for how often they differ",
            err=True,
        )
    emit_summary("sample", summary, opts.fmt)
    sys.stdout.flush()


def _check_variants(specs: tuple[str, ...], compile_steps: bool) -> list[str]:
    """The ``--decode-attention`` values, each checked (HookError: one line); none: a plain run."""
    from kvstore.model.hooks import check_steps, variants

    if specs:
        check_steps(variants(list(specs)), "compiled" if compile_steps else "dynamic")
    return list(specs)


def variant_table(adapter, results, rows: list[dict], n: int) -> list[dict]:
    """Per variant of a sweep: task metrics over its ``n`` rows, tokens/s of its decoding, and
    agreement with the ``dense`` variant (rows with the same tokens; None without a dense one)."""
    from kvstore.data.metrics import score

    dense = next((r for r in results if r.variant == "dense"), None)
    table = []
    for v, res in enumerate(results):
        mine = [r for r in rows[v * n : (v + 1) * n] if r["answers"]]
        s = score([r["prediction"] for r in mine], [r["answers"] for r in mine]) if mine else {}
        agree = None
        if dense is not None:
            same = sum(
                res.lengths[i] == dense.lengths[i] and bool((res.tokens[i] == dense.tokens[i]).all()) for i in range(n)
            )
            agree = round(same / n, 4) if n else None
        generated = sum(res.lengths)
        table.append(
            {
                "variant": res.variant,
                **{k: (round(s[k], 4) if mine else None) for k in ("accuracy", "contains", "exact_match", "f1")},
                "agreement_with_dense": agree,
                "generated_tokens": generated,
                "decode_seconds": round(res.decode_seconds, 3),
                "tokens_per_second": round(generated / res.decode_seconds, 1) if res.decode_seconds else None,
            }
        )
    return table
