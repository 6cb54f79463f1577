"""Entry point of the ``kvstore`` command.

Subcommands live in their own modules and are imported only when invoked, so ``kvstore --help``
never imports torch. Errors from the library become one line on stderr and a non-zero exit;
set ``KVSTORE_DEBUG=1`` to see the traceback instead.
"""

from __future__ import annotations

import importlib
import os
import sys

import click

# command name -> (module, attribute, one-line help shown by `kvstore --help`)
COMMANDS: dict[str, tuple[str, str, str]] = {
    "build": ("kvstore.cli.workflow", "build", "Prefill every distinct context of a dataset and store its KV cache."),
    "sample": (
        "kvstore.cli.workflow",
        "sample",
        "Answer a dataset's questions with greedy decoding from stored caches.",
    ),
    "score": (
        "kvstore.cli.score",
        "score",
        "Multiple-choice accuracy (acc, acc_norm) or reference perplexity, from stored contexts.",
    ),
    "quality": (
        "kvstore.cli.quality",
        "quality",
        "Measure lossy codecs against the lossless cache on a dataset (KL, top-1, K/V, answers).",
    ),
    "ls": ("kvstore.cli.manage", "ls", "List the contexts (or chunks) of a store."),
    "stats": ("kvstore.cli.manage", "stats", "Totals of a store per model, dtype and codec; dedupe."),
    "verify": ("kvstore.cli.manage", "verify", "Check every entry's checksum and structure, and every chain."),
    "rm": ("kvstore.cli.manage", "rm", "Remove contexts by key, model or age."),
    "gc": ("kvstore.cli.manage", "gc", "Remove unused chunks, corrupt entries, old contexts; fit a budget."),
    "size": ("kvstore.cli.size", "size", "KV-cache size per model: estimated, and measured in a store."),
    "export": ("kvstore.cli.exchange", "export", "Write a store's contexts as plain safetensors files."),
    "import-llminference": (
        "kvstore.cli.exchange",
        "import_llminference",
        "Import KV caches written by the llminference research code.",
    ),
    "sync": ("kvstore.cli.transfer", "sync", "Copy what one store lacks from another (any backends, e.g. to S3)."),
    "lm-eval": (
        "kvstore.cli.lmeval",
        "lm_eval_command",
        "Run lm-evaluation-harness with the `kvstore` model registered (needs kvstore[eval]).",
    ),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attr, _ = COMMANDS[name]
        return getattr(importlib.import_module(module), attr)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # Help text comes from the table above so that listing commands imports nothing.
        with formatter.section("Commands"):
            formatter.write_dl([(name, help_) for name, (_, _, help_) in COMMANDS.items()])


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvstore", prog_name="kvstore")
def app() -> None:
    """kvstore: build KV caches of your contexts once, answer questions from them exactly.

    \b
    Quick start:
      kvstore build experiments/data/demo.jsonl
      kvstore sample experiments/data/demo.jsonl --chat
    The default model is the bundled SmolLM2-135M-Instruct; the default store is an LMDB
    directory under cache/ (override with --store or $KVSTORE_STORE).
    """


def _one_line_warnings() -> None:
    """Show kvstore's own warnings (kvstore.errors) as ``kvstore: warning: ...`` on stderr."""
    import warnings

    show = warnings.showwarning
    if getattr(show, "kvstore_one_line", False):
        return

    def one_line(message, category, filename, lineno, file=None, line=None):
        if category.__module__ == "kvstore.errors":
            click.echo(f"kvstore: warning: {str(message).removeprefix('kvstore: ')}", err=True)
        else:
            show(message, category, filename, lineno, file, line)

    one_line.kvstore_one_line = True  # type: ignore[attr-defined]
    warnings.showwarning = one_line


def main(argv: list[str] | None = None) -> None:
    """Run the CLI, turning kvstore's errors into one line and an exit code."""
    debug = os.environ.get("KVSTORE_DEBUG", "") not in ("", "0")
    _one_line_warnings()
    try:
        rc = app.main(args=argv, prog_name="kvstore", standalone_mode=False)
        if isinstance(rc, int) and rc:  # ctx.exit(n) returns n when standalone_mode is off
            sys.exit(rc)
    except click.exceptions.Abort:
        click.echo("kvstore: interrupted; everything committed so far is kept.", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        if debug:
            raise
        click.echo("kvstore: interrupted; everything committed so far is kept.", err=True)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - the boundary where errors become one line
        from kvstore.errors import KVStoreError

        if debug:
            raise
        if isinstance(exc, KVStoreError):
            click.echo(f"kvstore: error: {exc}", err=True)
            sys.exit(1)
        if isinstance(exc, (OSError, ValueError)):
            click.echo(f"kvstore: error: {type(exc).__name__}: {exc} (KVSTORE_DEBUG=1 shows the traceback)", err=True)
            sys.exit(1)
        click.echo(
            f"kvstore: internal error: {type(exc).__name__}: {exc} (KVSTORE_DEBUG=1 shows the traceback)", err=True
        )
        sys.exit(2)


if __name__ == "__main__":  # pragma: no cover
    main()
