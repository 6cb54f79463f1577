"""``kvstore lm-eval ARGS...``: lm-evaluation-harness's own command line, with the ``kvstore``
model registered (see :mod:`kvstore.lm_eval`).

Every argument goes to lm-eval unchanged (``kvstore lm-eval --help`` shows lm-eval's help), e.g.::

    kvstore lm-eval --model kvstore --model_args pretrained=DIR,store=cache/store \\
        --tasks my_task --include_path tasks/

lm-eval is the optional ``kvstore[eval]`` extra; without it the command says how to install it.
"""

from __future__ import annotations

import sys

import click

from kvstore.cli.common import CLIError


@click.command(
    "lm-eval",
    context_settings={"ignore_unknown_options": True, "allow_extra_args": True, "help_option_names": []},
    add_help_option=False,
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def lm_eval_command(args: tuple[str, ...]) -> None:
    """Run lm-evaluation-harness with the `kvstore` model registered (lm-eval's arguments)."""
    try:
        import lm_eval.__main__ as harness

        import kvstore.lm_eval  # noqa: F401 - registers the model name "kvstore"
    except ImportError as exc:
        raise CLIError(f"lm-eval is not installed ({exc}); install it with: pip install 'kvstore[eval]'") from None
    saved = sys.argv
    sys.argv = ["lm-eval", *args]
    try:
        harness.cli_evaluate()
    finally:
        sys.argv = saved
