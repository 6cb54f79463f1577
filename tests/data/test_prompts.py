"""kvstore.data.prompts: plain templates, and chat templates cut after the context."""

from __future__ import annotations

import json

import pytest

from helpers.paths import DEMO
from kvstore.data.prompts import DEFAULT_TEMPLATE, PromptFormat
from kvstore.errors import DatasetError, ModelError

TINY_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def full_render(tokenizer, messages: list[dict]) -> str:  # noqa: ANN001
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# --------------------------------------------------------------------------------------------
# Plain templates


def test_plain_default() -> None:
    fmt = PromptFormat.plain()
    assert fmt.template == DEFAULT_TEMPLATE and not fmt.chat and fmt.add_special_tokens
    assert fmt.split("The bridge opened in 1874.", "When did it open?") == (
        "The bridge opened in 1874.",
        "\nQuestion: When did it open?\nAnswer:",
    )
    assert fmt.context_part("C") == "C" and fmt.question_part("Q") == "\nQuestion: Q\nAnswer:"


def test_plain_template_with_text_before_the_context() -> None:
    fmt = PromptFormat.plain("Read this:\n{context}\n\nQ ({json: 1}): {question}\nA:")
    context, question = fmt.split("C {question}", "Q {context}?")  # placeholders in data stay text
    assert context == "Read this:\nC {question}"
    assert question == "\n\nQ ({json: 1}): Q {context}?\nA:"


def test_template_without_context_placeholder_follows_the_context() -> None:
    assert PromptFormat.plain("\nQuestion: {question}\nAnswer:").split("C", "Q") == PromptFormat.plain().split("C", "Q")


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("Question: {q}\nAnswer:", "must contain {question} exactly once"),
        ("{question} or {question}", "must contain {question} exactly once"),
        ("Q: {question}\n{context}", "before {question}"),
        ("{context}{context}\nQ: {question}", "before {question}"),
    ],
)
def test_bad_templates(template: str, match: str) -> None:
    with pytest.raises(DatasetError, match=match) as info:
        PromptFormat.plain(template)
    assert "\n" not in str(info.value)  # the template is shown with escapes, on one line


# --------------------------------------------------------------------------------------------
# Chat templates with a tiny tokenizer built in code


@pytest.fixture(scope="module")
def tiny_tokenizer():  # noqa: ANN201
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = "the bridge opened in 1874 . when did it open ? question : answer help briefly".split()
    vocab = {
        token: i for i, token in enumerate(["[UNK]", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", *words])
    }
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    # Adds a BOS with add_special_tokens=True, as Llama tokenizers do.
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="[UNK]",
        additional_special_tokens=["<|user|>", "<|assistant|>", "<|system|>"],
    )
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


@pytest.mark.parametrize("system", [None, "Help briefly."])
def test_chat_split_equals_the_full_conversation(tiny_tokenizer, system: str | None) -> None:  # noqa: ANN001
    fmt = PromptFormat.from_chat_template(tiny_tokenizer, system=system)
    assert fmt.chat and not fmt.add_special_tokens and fmt.system == system
    for context, question in [("The bridge opened in 1874.", "When did it open?"), (" x\n\n{y} ", "?")]:
        context_part, question_part = fmt.split(context, question)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": f"{context}\nQuestion: {question}\nAnswer:"})
        assert context_part + question_part == full_render(tiny_tokenizer, messages)
        assert context_part.endswith(context) and question_part.startswith("\nQuestion: ")
    assert fmt.head == ("<s><|system|>\nHelp briefly.</s>\n<|user|>\n" if system else "<s><|user|>\n")
    assert fmt.tail == "\nAnswer:</s>\n<|assistant|>\n"


def test_chat_context_part_holds_its_special_tokens_as_text(tiny_tokenizer) -> None:  # noqa: ANN001
    bos = tiny_tokenizer.bos_token_id
    chat = PromptFormat.from_chat_template(tiny_tokenizer)
    ids = tiny_tokenizer(chat.context_part("the bridge"), add_special_tokens=chat.add_special_tokens).input_ids
    assert ids == [bos, tiny_tokenizer.convert_tokens_to_ids("<|user|>"), *ids[2:]] and ids.count(bos) == 1
    plain = PromptFormat.plain()
    assert (
        tiny_tokenizer(plain.context_part("the bridge"), add_special_tokens=plain.add_special_tokens).input_ids[0]
        == bos
    )


def test_chat_template_with_text_before_the_context(tiny_tokenizer) -> None:  # noqa: ANN001
    template = "Answer briefly.\n\n{context}\n\nQuestion: {question}"
    context_part, question_part = PromptFormat.from_chat_template(tiny_tokenizer, template).split("C", "Q?")
    assert context_part == "<s><|user|>\nAnswer briefly.\n\nC"
    assert context_part + question_part == full_render(
        tiny_tokenizer, [{"role": "user", "content": "Answer briefly.\n\nC\n\nQuestion: Q?"}]
    )


class FakeTokenizer:
    """Just enough of a tokenizer to try templates that misbehave."""

    name_or_path = "fake/model"

    def __init__(self, render) -> None:  # noqa: ANN001
        self.chat_template = "set" if render else None
        self._render = render

    def apply_chat_template(self, messages: list[dict], **kwargs: object) -> str:
        return self._render(messages)


def _refuse_system(messages: list[dict]) -> str:
    if messages[0]["role"] == "system":
        raise ValueError("System role not supported\nmore")
    return "<user>" + messages[0]["content"]


@pytest.mark.parametrize(
    ("render", "system", "match"),
    [
        (None, None, r"^tokenizer fake/model has no chat template; drop --chat to use plain prompts$"),
        (
            _refuse_system,
            "Be brief.",
            r"failed to render \(ValueError: System role not supported\); try without --system",
        ),
        (lambda messages: "<user>" + messages[-1]["content"].replace("<", "&lt;"), None, "rewrites message text"),
        (lambda messages: "<user>" + messages[-1]["content"].replace("\n", " "), None, "rewrites message text"),
        (lambda messages: "constant", None, "does not show the user message once"),
        (lambda messages: messages[-1]["content"] * 2, None, "does not show the user message once"),
        (lambda messages: ["not", "text"], None, "did not render to text"),
    ],
)
def test_unusable_chat_templates(render, system: str | None, match: str) -> None:  # noqa: ANN001
    with pytest.raises(ModelError, match=match) as info:
        PromptFormat.from_chat_template(FakeTokenizer(render), system=system)
    assert "\n" not in str(info.value)


def test_bad_template_is_reported_before_the_tokenizer(tiny_tokenizer) -> None:  # noqa: ANN001
    with pytest.raises(DatasetError):
        PromptFormat.from_chat_template(tiny_tokenizer, template="no placeholder")


def _demo_pairs(count: int) -> list[tuple[str, str]]:
    pairs: dict[str, str] = {}
    for line in DEMO.read_text("utf-8").splitlines():
        row = json.loads(line)
        pairs.setdefault(row["context"], row["question"])
    return list(pairs.items())[:count]


@pytest.mark.parametrize("system", [None, "You answer with a few words."])
def test_smollm2_chat_split(smollm2_tokenizer, system: str | None) -> None:  # noqa: ANN001
    tokenizer = smollm2_tokenizer
    fmt = PromptFormat.from_chat_template(tokenizer, system=system)
    if system is None:  # SmolLM2's template injects its own system prompt; it is part of what gets cached
        assert "You are a helpful AI assistant named SmolLM" in fmt.head
    else:
        assert system in fmt.head and "SmolLM" not in fmt.head
    assert fmt.tail.endswith("<|im_end|>\n<|im_start|>assistant\n")
    for context, question in _demo_pairs(3):
        context_part, question_part = fmt.split(context, question)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": f"{context}\nQuestion: {question}\nAnswer:"})
        full = full_render(tokenizer, messages)
        assert context_part + question_part == full
        # Tokenizing the parts separately gives the tokens of the whole prompt, and the context part
        # starts with the <|im_start|> special token rather than its spelling.
        context_ids = tokenizer(context_part, add_special_tokens=fmt.add_special_tokens).input_ids
        question_ids = tokenizer(question_part, add_special_tokens=False).input_ids
        assert context_ids + question_ids == tokenizer(full, add_special_tokens=False).input_ids
        assert context_ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_smollm2_plain_split_tokens(smollm2_tokenizer) -> None:  # noqa: ANN001
    fmt = PromptFormat.plain()
    for context, question in _demo_pairs(3):
        context_part, question_part = fmt.split(context, question)
        joined = (
            smollm2_tokenizer(context_part, add_special_tokens=True).input_ids
            + smollm2_tokenizer(question_part, add_special_tokens=False).input_ids
        )
        assert joined == smollm2_tokenizer(context_part + question_part).input_ids
