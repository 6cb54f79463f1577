"""The flags ``build``, ``sample`` and ``score`` share, and the decorator that turns a command's flag
values into the few objects it takes.

A command is written as a function of values, not of flags::

    @click.command()
    @dataset_flags
    @model_flags
    @work_flags(SampleOptions)
    ...
    @receives(data=Data, model=ModelChoice, options=fill(SampleOptions), sweep=sweep_of, ...)
    def sample(data, model, options, sweep, ...): ...

Click hands every flag's value to :func:`receives`, which builds each keyword's object from the
values named as its fields: a record of the CLI (:func:`gather`: every field from the flag of its
name) or a library options class (:func:`fill`: a flag left out, None, keeps the field's default,
which lives in the options class only). Every value must reach an object (a flag that reaches none
is a wiring error). So adding an option to ``sample`` is a field of ``SampleOptions`` and a flag
whose name is the field (``click.option("--max-new-tokens", "-n", "num_new_tokens", ...)``).

``--press``, ``--decode-attention`` and ``--variant`` are parsed here once, by the library's
parsers, into the values the library takes: ``--press`` and ``--decode-attention`` fill the options'
``press`` and ``decode_attention`` (one variant, as the keywords do), ``--variant`` the sweep.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import click

from kvstore import dtypes
from kvstore.cli.common import CLIError, quiet_option, store_option
from kvstore.model.keywords import field_default
from kvstore.model.options import Spelling, attention_of, press_of
from kvstore.model.press.registry import budget_names, press_names

FLAGS = Spelling("--press", "--decode-attention", "--variant", flags=True)


# -- from flag values to objects ------------------------------------------------------------------
class Values(dict):
    """A command's flag values by name, remembering which were read."""

    def __init__(self, values: Mapping[str, Any]):
        super().__init__(values)
        self.read: set[str] = set()

    def __getitem__(self, name: str) -> Any:
        self.read.add(name)
        return super().__getitem__(name)


Builder = Callable[[Values], Any]


def gather(cls: type) -> Builder:
    """A record of the CLI from the values named as its fields (a field with a default may have no
    flag in a command)."""

    def build(values: Values) -> Any:
        fields = dataclasses.fields(cls)
        return cls(**{f.name: values[f.name] for f in fields if f.name in values})

    return build


def fill(cls: type, **renamed: str) -> Builder:
    """A library options object from the values named as its fields (``renamed``: field -> the
    value that fills it); a value that is None (a flag left out) keeps the field's default."""

    def build(values: Values) -> Any:
        given = {}
        for f in dataclasses.fields(cls):
            name = renamed.get(f.name, f.name)
            if name in values and values[name] is not None:
                given[f.name] = values[name]
        return cls(**given)

    return build


def receives(**targets: type | Builder) -> Callable[[Callable], Callable]:
    """Decorator of a click command's function (the innermost one): the command takes every flag's
    value, builds one object per keyword of ``targets`` from them (a class: :func:`gather`; else a
    builder, e.g. :func:`fill`) and calls the function with those objects only."""

    def deco(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def command(**values: Any) -> Any:
            seen = Values(values)
            built = {name: (gather(make) if isinstance(make, type) else make)(seen) for name, make in targets.items()}
            unused = sorted(set(values) - seen.read)
            if unused:
                raise AssertionError(f"{fn.__name__}: the values of {', '.join(unused)} reach no object")
            return fn(**built)

        return command

    return deco


def stacked(*decorators: Callable[[Callable], Callable]) -> Callable[[Callable], Callable]:
    """The decorators applied as if written one above the other, in this order."""

    def deco(fn: Callable) -> Callable:
        for d in reversed(decorators):
            fn = d(fn)
        return fn

    return deco


# -- records the commands share --------------------------------------------------------------------
@dataclass(frozen=True)
class ModelChoice:
    """Which model, in which dtype, on which device (``--model``, ``--dtype``, ``--device``; build
    and sample also ``--prefill-chunk``)."""

    model: str | None
    dtype: str
    device: str
    prefill_chunk: int | None = None

    def load(self, quiet: bool) -> Any:
        """The model in an :class:`kvstore.model.adapter.Adapter` (imports torch)."""
        from kvstore.model.adapter import Adapter

        if not quiet:
            click.echo(f"kvstore: loading model {self.model or 'SmolLM2-135M-Instruct (bundled)'} ...", err=True)
        adapter = Adapter.from_pretrained(self.model, dtype=self.dtype, device=self.device)
        adapter.prefill_chunk_tokens = self.prefill_chunk
        return adapter


@dataclass(frozen=True)
class StoreChoice:
    """The store (``--store`` and its tier) and how it is written: ``--codec``, ``--readonly-store``,
    ``--chunk-tokens`` (each where the command has it)."""

    store: str
    codec: str | None = None
    readonly_store: bool = False
    chunk_tokens: int | None = None

    def check_codec(self) -> None:
        """Reject a bad codec before anything is loaded (CodecError: one line, exit 1)."""
        from kvstore.store.codecs import get_codec

        get_codec(self.codec)

    def open(self, device_type: str | None = None) -> Any:
        """The :class:`kvstore.store.kvstore.KVStore` (imports torch). ``device_type``: where the
        caches are computed (``build``): a store created without ``--codec`` gets the codec chosen
        for it (:func:`kvstore.store.codecs.choice.choose_codec`)."""
        from kvstore.cli.common import store_options
        from kvstore.store.kvstore import KVStore

        default = None
        if device_type is not None and self.codec is None:
            from kvstore.model.io.device_zstd import nvcomp_importable
            from kvstore.store.codecs.choice import choose_codec

            default = choose_codec(device_type, device_decoder=device_type == "cuda" and nvcomp_importable())
        return KVStore(self.store, readonly=self.readonly_store, codec=self.codec, chunk_tokens=self.chunk_tokens,
                       default_codec=default, **store_options())  # fmt: skip

    @contextlib.contextmanager
    def open_for_build(self, adapter: Any) -> Iterator[Any]:
        """The store ``build`` writes, opened for the device its caches are computed on
        (:func:`build_device`); when this build creates it, its chosen codec and the reason printed once."""
        with self.open(build_device(adapter)) as kv:
            if kv.meta.new and kv.meta.codec_reason:
                click.echo(f"kvstore: new store {kv.url}: codec {kv.codec.spec} ({kv.meta.codec_reason})", err=True)
            yield kv


def build_device(adapter: Any) -> str:
    """The type of the device ``build`` computes on (``cuda``, ``cpu``...): what a new store's codec
    is chosen for (the seam the codec-choice tests replace)."""
    return adapter.handle.device.type


@dataclass(frozen=True)
class Report:
    """What the command prints and writes: ``--quiet``, ``--format``, ``--output`` (where it has it)."""

    quiet: bool
    fmt: str
    output: str | None = None


# -- the shared flags --------------------------------------------------------------------------------
dataset_flags = stacked(
    click.argument("dataset"),
    click.option("--context-field", default="context", show_default=True, help="Field holding the context."),
    click.option("--question-field", default="question", show_default=True, help="Field holding the question."),
    click.option("--id-field", default="id", show_default=True, help="Field holding the row id (optional)."),
    click.option("--limit", type=click.IntRange(min=1), help="Use only the first N rows."),
)
"""DATASET and the fields every dataset command reads (``build``, ``sample``, ``score``)."""

model_flags = stacked(
    click.option(
        "--model", "-m", default=None,
        help="Hub id, local directory or .gguf file [default: bundled SmolLM2-135M-Instruct].",
    ),
    click.option(
        "--dtype", default="float32", show_default=True, type=click.Choice(list(dtypes.MODEL_DTYPE_CHOICES)),
        help="Dtype to run the model (and store KV) in.",
    ),
    click.option("--device", default="auto", show_default=True, help="cpu, cuda, cuda:N or auto."),
)  # fmt: skip
"""``--model``, ``--dtype``, ``--device``: a :class:`ModelChoice`."""

summary_flags = stacked(
    store_option,
    quiet_option,
    click.option(
        "--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True,
        help="Summary format.",
    ),
)  # fmt: skip
"""``--store`` (and its tier), ``--quiet``, ``--format text|json``."""


def work_flags(cls: type) -> Callable[[Callable], Callable]:
    """``--batch-size``, ``--max-batch-tokens`` and ``--truncate``: fields of the options class
    ``cls``, whose defaults they show."""
    batch = field_default(cls, "batch_size")
    budget = field_default(cls, "max_batch_tokens")
    return stacked(
        click.option(
            "--batch-size", "-b", default=None, type=click.IntRange(min=1),
            help="Rows per forward pass [default: "
            + (f"{batch}]." if batch is not None else "1 on CPU, where it measured faster than padded batches; 8 on "
               "accelerators]."),
        ),
        click.option(
            "--max-batch-tokens", type=click.IntRange(min=1), default=None,
            help="Memory budget: at most this many padded tokens (context + question + new) x rows per batch "
            f"[default: {budget or 'no limit'}].",
        ),
        click.option(
            "--truncate", is_flag=True, default=field_default(cls, "truncate"),
            help="Drop a too long context's first tokens instead of failing (lm-eval's rule).",
        ),
    )  # fmt: skip


def cache_flags(cls: type) -> Callable[[Callable], Callable]:
    """``--no-cache`` (the options' ``use_cache``) and ``--readonly-store``."""
    return stacked(
        click.option(
            "--no-cache", "use_cache", is_flag=True, flag_value=False, default=field_default(cls, "use_cache"),
            help="Reference path: context and question (or option) through the model in one forward; the store is "
            "not used.",
        ),
        click.option("--readonly-store", is_flag=True, help="Do not store contexts computed for missing entries."),
    )  # fmt: skip


def output_flag(per: str) -> Callable[[Callable], Callable]:
    """``--output/-o FILE``: one JSON object per ``per`` (question, row)."""
    return click.option(
        "--output", "-o", type=click.Path(dir_okay=False, writable=True), help=f"Write one JSON object per {per} here."
    )


# -- variants -----------------------------------------------------------------------------------------
def _once(parse: Callable[[str, Spelling], Any], flag: str) -> Callable:
    """The callback of a flag that may be given once: its one value parsed (None when absent); a
    repeated one is refused (two presses or attentions do not compose; a sweep is --variant)."""

    def callback(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> Any:
        if ctx.resilient_parsing or not values:
            return None
        if len(values) > 1:
            raise CLIError(
                f"{flag} given {len(values)} times ({', '.join(values)}): it takes one value, which composes with the "
                "other of --press/--decode-attention into one variant; to sweep, repeat --variant (e.g. "
                f"{' '.join(f'--variant {v}' for v in values)})"
            )
        return parse(values[0], FLAGS)

    return callback


def each(parse: Callable[[str], Any]) -> Callable:
    """The callback of a repeatable flag: every value parsed once (a bad one: one line, exit 1)."""

    def callback(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple:
        if ctx.resilient_parsing:
            return ()
        return tuple(parse(v) for v in values)

    return callback


def stop_strings(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple[str, ...]:
    """``--stop`` strings with their typed ``\\n`` and ``\\t`` made a newline and a tab."""
    return tuple(s.replace("\\n", "\n").replace("\\t", "\t") for s in values)


def press_spec(value: str) -> Any:
    """A ``build --press`` value: one press, no decode attention."""
    return press_of(value, FLAGS)


def scorer_spec(value: str) -> Any:
    """A ``build --score`` value: a query-agnostic scorer (a press without its ratio)."""
    from kvstore.model.press.spec import check_storable, parse_scorer

    scorer = parse_scorer(value)
    check_storable(scorer)
    return scorer


def _variants(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> tuple:
    """``--variant`` values, each parsed once into a Variant (HookError / PressError: one line)."""
    if ctx.resilient_parsing or not values:
        return ()
    from kvstore.model.variants.variant import variants

    return tuple(variants(list(values)))


def compose_of(ctx: click.Context, param: click.Parameter, value: str | None) -> Any:
    """``--compose POLICY`` parsed once (a bad policy: one line naming the policies)."""
    from kvstore.errors import ComposeError
    from kvstore.model.compose.spec import parse_compose

    try:
        return parse_compose(value)
    except ComposeError as exc:
        raise click.BadParameter(str(exc)) from None


build_compose_flag = click.option(
    "--compose", "compose", is_flag=True,
    help="For rows whose context is a list of passages: store each distinct passage once and the prompt's head "
    "(what sample --compose POLICY reads: it then computes no passage) instead of each row's exact prefix chain "
    "(what sample without --compose reads). Build both ways into one store for both (docs/composing.md).",
)  # fmt: skip


def variant_flags(verb: str, done: str) -> Callable[[Callable], Callable]:
    """``--press`` and ``--decode-attention`` (the options' ``press`` and ``decode_attention``: one
    variant, as the keywords compose them) and ``--variant`` (repeated: a sweep, :func:`sweep_of`);
    ``verb`` and ``done``: what the command does under them (answer, answered)."""
    presses, budgets = ", ".join(press_names()), ", ".join(budget_names())
    return stacked(
        click.option(
            "--press", multiple=True, metavar="SPEC", callback=_once(press_of, "--press"),
            help=f"{verb.capitalize()} after pressing each context: NAME:RATIO[:q][:BUDGET][:K=V] ({presses}; "
            f"budgets {budgets}; docs/presses.md). Composes with --decode-attention into one variant, as press= "
            "and decode_attention= do. Given once: to sweep, repeat --variant.",
        ),
        click.option(
            "--decode-attention", multiple=True, metavar="SPEC", callback=_once(attention_of, "--decode-attention"),
            help=f"{verb.capitalize()} under this decode-time attention: topk:K, sparq:R:K or a plug-in "
            "module:function (dense: the model's own; docs/hooks.md). Composes with --press into one variant. Given "
            "once: to sweep, repeat --variant.",
        ),
        click.option(
            "--variant", "variants", multiple=True, metavar="SPEC", callback=_variants,
            help=f"Repeat to sweep: every batch is loaded once and {done} under each variant: dense, a press "
            "(snapkv:0.5), a decode attention (topk:64) or PRESS+ATTENTION, one composed variant (snapkv:0.5+topk:64). "
            "One output row per row and variant, a summary row per variant. Not with --press/--decode-attention.",
        ),
    )  # fmt: skip


def sweep_of(values: Values) -> tuple:
    """The ``--variant`` sweep (``()``: none). CLIError when it is mixed with ``--press`` or
    ``--decode-attention`` (a variant of a sweep composes them itself: ``--variant PRESS+ATTENTION``)."""
    chosen = values["variants"]
    if chosen and (values["press"] is not None or values["decode_attention"] is not None):
        raise CLIError(
            "give --variant (a sweep) or --press/--decode-attention (one variant), not both; a sweep's variant "
            "composes a press and a decode attention itself: --variant PRESS+ATTENTION (e.g. snapkv:0.5+topk:64)"
        )
    return chosen


__all__ = [
    "FLAGS",
    "ModelChoice",
    "Report",
    "StoreChoice",
    "Values",
    "build_compose_flag",
    "build_device",
    "compose_of",
    "cache_flags",
    "dataset_flags",
    "fill",
    "gather",
    "model_flags",
    "output_flag",
    "receives",
    "stacked",
    "summary_flags",
    "sweep_of",
    "variant_flags",
    "work_flags",
]
