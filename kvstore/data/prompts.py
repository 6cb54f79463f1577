"""Turning a (context, question) pair into the two texts that get tokenized.

The prompt is cut in two at the end of the context:

* the **context part** (everything up to and including the context) is what gets prefilled and
  cached, once per context, so it must not depend on the question;
* the **question part** (the rest: the question, and in chat mode the end of the user turn and
  the assistant header) is tokenized without special tokens and run on top of the cache.

The two parts are tokenized separately and their ids concatenated, both when answering from a
cache and when running without one, so both paths see the same tokens.

Plain mode fills a template: ``DEFAULT_TEMPLATE`` puts the context first, then
``"\\nQuestion: {question}\\nAnswer:"``. A template must contain ``{question}`` once and may
contain ``{context}`` once, before it (text before ``{context}`` joins the cached part); without
``{context}`` the template is appended to the context. Other braces are kept as they are.
The context part is tokenized *with* the tokenizer's special tokens (e.g. a BOS if the model
adds one).

Chat mode (instruct models) puts the filled template in one user message and renders the
tokenizer's chat template once, with markers in place of context and question, then cuts the
rendered text at the markers. The context part then already holds the template's special
tokens as text (``<|im_start|>system ...``, a default system prompt if the template injects one),
so it is tokenized with ``add_special_tokens=False``; :attr:`PromptFormat.add_special_tokens`
says which. Usage::

    fmt = PromptFormat.from_chat_template(tokenizer) if chat else PromptFormat.plain()
    context_ids = tokenizer(fmt.context_part(context), add_special_tokens=fmt.add_special_tokens).input_ids
    question_ids = tokenizer(fmt.question_part(question), add_special_tokens=False).input_ids
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvstore.errors import DatasetError, ModelError

__all__ = ["DEFAULT_TEMPLATE", "PromptFormat"]

DEFAULT_TEMPLATE = "{context}\nQuestion: {question}\nAnswer:"

# Stand-ins rendered through the chat template, then located in its output. Plain word
# characters, so that no template escapes or trims them.
_CONTEXT_MARKER = "KVSTORE_CONTEXT_MARKER_5d1c"
_QUESTION_MARKER = "KVSTORE_QUESTION_MARKER_5d1c"
# Rendered once more to check that the template passes message text through untouched.
_PROBE_CONTEXT = "Probe context: {braces}, <b>tags</b> & 'quotes'.\n\nA second paragraph."
_PROBE_QUESTION = 'Probe question about "it"?'


@dataclass(frozen=True)
class PromptFormat:
    """How a (context, question) pair becomes the cached context part and the question part.

    Build one with :meth:`plain` or :meth:`from_chat_template`. ``template``, ``chat`` and
    ``system`` record what was asked for; ``head``, ``middle`` and ``tail`` are the resolved
    texts, so that ``context part = head + context`` and
    ``question part = middle + question + tail``.
    """

    template: str
    chat: bool
    system: str | None
    head: str
    middle: str
    tail: str

    @classmethod
    def plain(cls, template: str = DEFAULT_TEMPLATE) -> PromptFormat:
        """Fill ``template`` with context and question, no chat markup.

        Raises :class:`~kvstore.errors.DatasetError` when the template lacks ``{question}`` or
        places ``{context}`` wrongly.
        """
        head, middle, tail = _parse_template(template)
        return cls(template=template, chat=False, system=None, head=head, middle=middle, tail=tail)

    @classmethod
    def from_chat_template(
        cls, tokenizer: Any, template: str = DEFAULT_TEMPLATE, system: str | None = None
    ) -> PromptFormat:
        """Put the filled ``template`` in a user turn (after ``system``, if given) of ``tokenizer``'s chat template.

        Works with any tokenizer that has ``chat_template`` and ``apply_chat_template``.
        Raises :class:`~kvstore.errors.ModelError` when the tokenizer has no chat template, the
        template fails to render (e.g. it refuses a system message), or it alters message text
        so that the prompt cannot be cut at the context; :class:`~kvstore.errors.DatasetError`
        for a malformed ``template``.
        """
        before, between, after = _parse_template(template)
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        if not getattr(tokenizer, "chat_template", None):
            raise ModelError(f"tokenizer {name} has no chat template; drop --chat to use plain prompts")

        def render(context: str, question: str) -> str:
            messages = [{"role": "system", "content": system}] if system is not None else []
            messages.append({"role": "user", "content": before + context + between + question + after})
            try:
                text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            except Exception as exc:  # noqa: BLE001 - jinja errors, raise_exception() in templates
                detail = (str(exc).strip().splitlines() or [""])[0]
                raise ModelError(
                    f"the chat template of {name} failed to render ({type(exc).__name__}: {detail}); "
                    + ("try without --system, or " if system is not None else "")
                    + "drop --chat to use plain prompts"
                ) from None
            if not isinstance(text, str):
                raise ModelError(
                    f"the chat template of {name} did not render to text; drop --chat to use plain prompts"
                )
            return text

        rendered = render(_CONTEXT_MARKER, _QUESTION_MARKER)
        at_context, at_question = rendered.find(_CONTEXT_MARKER), rendered.find(_QUESTION_MARKER)
        if (
            rendered.count(_CONTEXT_MARKER) != 1
            or rendered.count(_QUESTION_MARKER) != 1
            or not 0 <= at_context < at_question
        ):
            raise ModelError(
                f"the chat template of {name} does not show the user message once and in order, so the "
                "prompt cannot be cut after the context; drop --chat to use plain prompts"
            )
        fmt = cls(
            template=template,
            chat=True,
            system=system,
            head=rendered[:at_context],
            middle=rendered[at_context + len(_CONTEXT_MARKER) : at_question],
            tail=rendered[at_question + len(_QUESTION_MARKER) :],
        )
        if "".join(fmt.split(_PROBE_CONTEXT, _PROBE_QUESTION)) != render(_PROBE_CONTEXT, _PROBE_QUESTION):
            raise ModelError(
                f"the chat template of {name} rewrites message text, so the prompt cannot be cut after the "
                "context; drop --chat to use plain prompts"
            )
        return fmt

    @property
    def add_special_tokens(self) -> bool:
        """Value for ``add_special_tokens`` when tokenizing the context part.

        True in plain mode (the tokenizer adds its own BOS, if any); False in chat mode, where
        the rendered template already holds the special tokens as text. The question part is
        always tokenized with ``add_special_tokens=False``.
        """
        return not self.chat

    def context_part(self, context: str) -> str:
        """The text that gets prefilled and cached: everything up to and including the context."""
        return self.head + context

    def question_part(self, question: str) -> str:
        """The text run after the cached context: question, then template (and chat) text up to the answer."""
        return self.middle + question + self.tail

    def split(self, context: str, question: str) -> tuple[str, str]:
        """``(context_part(context), question_part(question))``; joined they are the whole prompt."""
        return self.context_part(context), self.question_part(question)


def _parse_template(template: str) -> tuple[str, str, str]:
    """(text before the context, text between context and question, text after the question)."""
    if template.count("{question}") != 1:
        raise DatasetError(f"prompt template must contain {{question}} exactly once: {template!r}")
    contexts = template.count("{context}")
    if contexts == 0:
        before, between_and_rest = "", template
    elif contexts == 1 and template.index("{context}") < template.index("{question}"):
        before, between_and_rest = template.split("{context}")
    else:
        raise DatasetError(f"prompt template may contain {{context}} once, before {{question}}: {template!r}")
    between, after = between_and_rest.split("{question}")
    return before, between, after
