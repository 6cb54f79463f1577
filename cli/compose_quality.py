"""``kvstore quality --compose POLICY``: the composition policies' quality gate on passage rows.

Each row whose context is a list of passages is composed as ``sample --compose`` composes it (no
prompt template, as the codecs' gate: the model's BOS where it uses one, the passages, then the
question's text) and every ``--compose`` policy is measured against the full prefill of the same
ids (:func:`kvstore.model.compose.quality.compose_quality`): next-token KL and top-1, identical
answers and their common prefix, the share of passage tokens recomputed. Nothing is stored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import click

from kvstore.cli.common import CLIError, emit, progress_bar


def _policy(value: str) -> Any:
    from kvstore.errors import ComposeError
    from kvstore.model.compose.spec import parse_compose

    try:
        return parse_compose(value)
    except ComposeError as exc:
        raise click.BadParameter(str(exc)) from None


compose_option = click.option(
    "--compose", "compose", multiple=True, metavar="POLICY",
    callback=lambda ctx, param, values: () if ctx.resilient_parsing else tuple(_policy(v) for v in values),
    help="For rows whose context is a list of passages: measure this composition policy (none, last:N, "
    "blend:R; repeatable) against the full prefill of the same ids instead of codecs (docs/composing.md).",
)  # fmt: skip


@dataclass(frozen=True)
class Composing:
    """``--compose`` (repeatable): the policies ``kvstore quality`` measures on passage rows."""

    compose: tuple[Any, ...]

    def run(self, source: Any, model: Any, new_tokens: int, fmt: str, quiet: bool) -> None:
        """Load the passage rows of ``source``, measure every policy, print one row per policy."""
        from kvstore.data.datasets import load_dataset
        from kvstore.data.readers import Fields
        from kvstore.model.compose.quality import compose_quality
        from kvstore.model.compose.rows import compose_inputs
        from kvstore.model.io.chains import Keying

        fields = Fields(source.context_field, source.question_field, id=source.id_field)
        data = load_dataset(source.dataset, fields, require_question=False, limit=source.limit)
        if not data.examples or any(not e.question for e in data.examples):
            raise CLIError(f"{source.dataset}: --compose needs a question on every row (--question-field)")
        adapter = model.load(quiet)
        contexts = [e.model_context for e in data.examples]
        composed = compose_inputs(adapter.handle, None, contexts, [e.question for e in data.examples], Keying())
        if composed is None:
            raise CLIError(f"{source.dataset}: --compose measures rows whose context is a list of passages")
        questions = [adapter.handle.encode_question(q) for q in composed.questions or ()]
        bar = progress_bar(len(composed.rows) * len(self.compose), "quality", quiet)
        results = compose_quality(adapter, composed.rows, questions, self.compose, new_tokens=new_tokens,
                                  progress=bar.update)  # fmt: skip
        bar.close()
        n = len(composed.rows)
        if fmt == "table":
            click.echo(f"{n} passage rows, {new_tokens} new tokens each; against the full prefill")
        emit([q.record() for q in results], fmt, columns={
            "compose": "policy", "recomputed": "recomputed", "identical": "identical", "common_prefix": "prefix",
            "kl": "KL", "top1": "top-1",
        }, formatters={
            "recomputed": "{:.1%}".format, "common_prefix": "{:.1%}".format, "identical": lambda v: f"{v}/{n}",
            "kl": "{:.5f}".format, "top1": "{:.3f}".format,
        })  # fmt: skip
