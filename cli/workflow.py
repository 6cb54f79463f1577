"""``kvstore build`` and ``kvstore sample``: the main job, end to end.

Both commands load the dataset, the model and the prompt format the same way, so that the
contexts ``build`` stores are exactly the ones ``sample`` looks up.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click

from kvstore import dtypes
from kvstore.cli.common import progress_bar, quiet_option, store_option, store_options
from kvstore.cli.summary import (
    METRIC_KEYS,
    corrupt_entries_as_warnings,
    emit_summary,
    metrics,
    parse_variants,
    variant_option,
    variant_table,
)


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
    which store (the parameters of :func:`_dataset_options` and :func:`_model_options`, in order)."""

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


def _load_everything(opts: RunOptions, *, require_question: bool):
    """The dataset, the model in an Adapter, and the prompt format, as both commands need them."""
    from kvstore.data.datasets import load_dataset
    from kvstore.data.readers import Fields

    data = load_dataset(
        opts.dataset,
        Fields(opts.context_field, opts.question_field, opts.answers_field, opts.id_field),
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
    "[default: the store's; new stores zstd-split:1:16], or lossy int8[:G], int4[:G], fp8, int4r, int8r or ecq[:STEP] "
    "(optionally +PACKING): lossy entries are found only by sample --codec with the same codec."
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
def build(
    dataset: str, context_field: str, question_field: str, answers_field: str, id_field: str, skip_bad_rows: bool,
    limit: int | None, model: str | None, dtype: str, device: str, batch_size: int | None, prefill_chunk: int | None,
    chat: bool | None, template: str | None, system: str | None, truncate: bool, max_context_tokens: int | None,
    store: str, quiet: bool, fmt: str, codec: str | None, shard: tuple[int, int] | None, chunk_tokens: int | None,
) -> None:  # fmt: skip
    """Prefill every distinct context of DATASET once and store its KV cache.

    Contexts already in the store are skipped, so an interrupted build resumes where it stopped.
    DATASET is a .jsonl, .csv or SQuAD-style .json file. --shard I/N splits the work over N
    jobs (e.g. a SLURM array writing into one s3:// store); each is idempotent like a build.
    """
    from kvstore.model.options import BuildOptions
    from kvstore.store.kvstore import KVStore

    opts = RunOptions(
        dataset, context_field, question_field, answers_field, id_field, skip_bad_rows, limit, model, dtype, device,
        batch_size, prefill_chunk, chat, template, system, truncate, max_context_tokens, store, quiet, fmt,
    )  # fmt: skip
    _check_codec(codec)
    data, adapter, prompt = _load_everything(opts, require_question=False)
    dataset = opts.dataset
    contexts = data.contexts()
    first_id = {}
    for ex in data.examples:
        first_id.setdefault(ex.context, ex.id)
    labels = [f"{dataset}: context of row {first_id[c]}" for c in contexts]
    options = BuildOptions(
        batch_size=opts.batch_size, truncate=opts.truncate, max_context_tokens=opts.max_context_tokens,
        skip_errors=opts.skip_bad_rows, shard=shard,
    )  # fmt: skip
    with KVStore(opts.store, codec=codec, chunk_tokens=chunk_tokens, **store_options()) as kv:
        with progress_bar(len(contexts), "build", opts.quiet, unit="ctx", rate="tok") as bar:
            report = adapter.build(contexts, kv, options, prompt=prompt, labels=labels, progress=bar)
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
@click.option("--load-ahead/--no-load-ahead", default=True, hidden=True, help="Benchmarks: load the next batch early.")
@click.option(
    "--compile",
    "compile_steps",
    is_flag=True,
    help="Decode with fixed shapes under torch.compile (compiled once per batch size and 256-slot length bucket; "
    "the first batch of each shape pays the compile). Same tokens; see the README for when it pays.",
)
@_codec_option(
    "Answer from caches stored with this codec. Lossless codecs are interchangeable (the default: the store's); "
    "a lossy one (int8[:G], int4[:G], fp8, int4r, int8r, ecq) uses only entries built with it, and stores missing "
    "contexts with it."
)
@variant_option
def sample(
    dataset: str, context_field: str, question_field: str, answers_field: str, id_field: str, skip_bad_rows: bool,
    limit: int | None, model: str | None, dtype: str, device: str, batch_size: int | None, prefill_chunk: int | None,
    chat: bool | None, template: str | None, system: str | None, truncate: bool, max_context_tokens: int | None,
    store: str, quiet: bool, fmt: str, max_new_tokens: int, no_cache: bool, output: str | None, readonly_store: bool,
    stop_strings: tuple[str, ...], max_batch_tokens: int | None, load_ahead: bool, compile_steps: bool,
    codec: str | None, variants: tuple[str, ...],
) -> None:  # fmt: skip
    """Answer every question of DATASET with greedy decoding from stored context caches.

    Missing contexts are computed, stored and used. --no-cache runs the same decoding without
    the store (the reference): both give the same predictions. --variant (or its aliases --press
    and --decode-attention) answers under presses and decode-time attention (docs/presses.md,
    docs/hooks.md); repeated, every batch is loaded once and answered under each.
    """
    from kvstore.data.metrics import clean_prediction, contains_match, lenient_match
    from kvstore.model.options import SampleOptions
    from kvstore.store.kvstore import KVStore

    opts = RunOptions(
        dataset, context_field, question_field, answers_field, id_field, skip_bad_rows, limit, model, dtype, device,
        batch_size, prefill_chunk, chat, template, system, truncate, max_context_tokens, store, quiet, fmt,
    )  # fmt: skip
    stop_strings = tuple(s.replace("\\n", "\n").replace("\\t", "\t") for s in stop_strings)
    _check_codec(codec)
    chosen = parse_variants(variants, compile_steps)  # a bad spec fails here, before the model loads
    data, adapter, prompt = _load_everything(opts, require_question=True)
    dataset = opts.dataset
    examples = data.examples
    contexts = [ex.context for ex in examples]
    questions = [ex.question for ex in examples]
    labels = [f"{dataset}: row {ex.id}" for ex in examples]
    kv = None if no_cache else KVStore(opts.store, readonly=readonly_store, codec=codec, **store_options())
    lossy = kv is not None and not kv.codec.lossless
    bar = progress_bar(len(examples), "sample", opts.quiet, unit="q", rate="tok")
    t0 = time.perf_counter()
    options = SampleOptions(
        num_new_tokens=max_new_tokens, use_cache=not no_cache, batch_size=opts.batch_size or 8,
        max_batch_tokens=max_batch_tokens, stop_strings=stop_strings, truncate=opts.truncate,
        max_context_tokens=opts.max_context_tokens, steps="compiled" if compile_steps else "dynamic",
        load_ahead=load_ahead,
    )  # fmt: skip
    common = dict(store=kv, prompt=prompt, labels=labels, progress=bar)
    try:
        with corrupt_entries_as_warnings(bar):
            if chosen:
                results = list(adapter.sweep(contexts, questions, options, variants=chosen, **common).values())
            else:
                results = [adapter.sample(contexts, questions, options, **common)]
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
            if chosen:
                row["variant"] = res.variant
                row["kept_tokens"] = res.kept_tokens[i]
            rows.append(row)
    if output:
        out = Path(output)
        with out.open("w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
    n = len(examples)
    summary = {
        "dataset": dataset,
        "model": adapter.name,
        "mode": "no-cache" if no_cache else "cache",
        "compiled": compile_steps,
        "questions": n,
        "bad_rows_skipped": data.skipped,
        **(dict.fromkeys(METRIC_KEYS) if chosen else metrics(rows[:n])),  # a sweep's metrics are per variant
        "seconds": round(seconds, 3),
        "questions_per_second": round(n / seconds, 3) if seconds else None,
        "cache_hit_rate": round(sum(result.cache_hit) / n, 4) if n else None,
        "codec": kv.codec.spec if kv is not None else None,
        "lossy": lossy,
        "prefill_tokens_saved": result.prefill_tokens_saved,
        "prefill_tokens_computed": result.prefill_tokens_computed,
        "window_tokens_computed": result.window_tokens_computed if chosen else None,
        "output": output,
    }
    if chosen:
        summary["variants"] = variant_table(results, rows, n)
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
