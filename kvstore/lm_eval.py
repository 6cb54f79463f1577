"""An lm-evaluation-harness backend: the model name ``kvstore``, answering from stored caches.

``import kvstore.lm_eval`` registers :class:`KVStoreLM` with lm-eval's model registry, so
``lm_eval.simple_evaluate(model="kvstore", model_args="pretrained=DIR,store=PATH")`` and
``kvstore lm-eval --model kvstore ...`` (lm-eval's own command line, with this module imported
first) evaluate any task through kvstore. Importing :mod:`kvstore` never imports this module
(lm-eval is the optional ``kvstore[eval]`` extra).

The three request types, each matching lm-eval's ``hf`` model (same tokenization, same windows,
same truncation, same text post-processing):

* ``loglikelihood``: lm-eval tokenizes each ``(context, continuation)`` pair itself (its
  ``_encode_pair``: trailing whitespace of the context moves to the continuation; the
  continuation's ids are those of the whole past the context's) and the ids go to
  :meth:`kvstore.Adapter.score` as they are. A pair longer than ``max_length + 1`` tokens loses
  the context's first tokens, as ``hf`` truncates it. Requests sharing a context (the options of
  one question) load or compute it once; contexts sharing a head (a few-shot block, an
  instruction) store it as its own chunk (see ``prefix`` of :meth:`kvstore.Adapter.chain`).
* ``loglikelihood_rolling``: the document's ids (encoded like ``hf`` does) are cut into lm-eval's
  own windows (``lm_eval.utils.get_rolling_token_windows`` + ``make_disjoint_window``) and each
  window is a scored row; the log-likelihoods of a document's windows are summed.
* ``generate_until``: the prompt is encoded like ``hf`` does (left-truncated to ``max_length -
  max_gen_toks``); everything but its last token is the stored context and the last token is
  fed as the question, so a prompt asked again is answered without computing any context token.
  Greedy only: a request asking for sampling (``do_sample``, ``temperature > 0``) or another
  decoding rule (beams, penalties) is refused with :class:`~kvstore.errors.RequestError`. The
  text is cut at the first stop string, as ``hf`` cuts it.

:attr:`KVStoreLM.context_tokens_computed` counts context tokens run through the model, summed
over calls, and :attr:`KVStoreLM.context_tokens_loaded` the context tokens each request found in
the store, summed over requests (:meth:`KVStoreLM.reset_counters` zeroes both): a second run over
the same task with the same store computes none.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, TypedDict

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
    from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"kvstore.lm_eval needs lm-evaluation-harness ({exc}); install it with: pip install 'kvstore[eval]'"
    ) from exc

from kvstore.errors import ModelError, PressError, RequestError
from kvstore.model.adapter import Adapter
from kvstore.model.keywords import documented, field_default, option, takes_options
from kvstore.model.options import ScoreOptions, press_of
from kvstore.model.pipelines.sample import SampleResult
from kvstore.model.press.spec import Press, is_press_spec
from kvstore.store.kvstore import KVStore

if TYPE_CHECKING:  # pragma: no cover
    from typing_extensions import Unpack

_log = logging.getLogger(__name__)
MODEL_NAME = "kvstore"
DEFAULT_BATCH_SIZE = field_default(ScoreOptions, "batch_size")  # what ``batch_size=auto`` means (no probing)
DEFAULT_MAX_LENGTH = 2048  # lm-eval's default when neither the config nor the tokenizer names one
DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's ``hf`` default
# A head shared by every context of a call is stored as its own chunk when at least this long.
MIN_SHARED_HEAD = 16
# generation options that leave greedy decoding greedy (top_k / top_p only act when sampling)
_GREEDY_NEUTRAL = {"do_sample", "temperature", "top_k", "top_p", "until", "max_gen_toks"}


def _bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ModelError(f"model arg {name}={value!r} is not a boolean; use true or false")


def _optional_int(value: Any, name: str) -> int | None:
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise ModelError(f"model arg {name}={value!r} is not an integer") from None
    if out < 1:
        raise ModelError(f"model arg {name}={value!r} must be at least 1")
    return out


def _press(spec: str | None) -> Press | None:
    """The ``press`` model arg, parsed (None: no press, ``none`` or ``dense``); ModelError (one
    line) for a bad or question-aware one."""
    text = "" if spec is None else str(spec).strip()
    if text.lower() in ("", "none") or (not is_press_spec(text) and _is_dense(text)):
        return None
    try:
        press = press_of(text)
    except PressError as exc:
        raise ModelError(f"model arg press={spec!r}: {exc}") from None
    assert press is not None
    if press.question:
        raise ModelError(
            f"model arg press={spec!r}: a question-aware press needs the question apart from its context; in lm-eval "
            "requests the question is part of the context: use the press without ':q'"
        )
    return press


def _is_dense(text: str) -> bool:
    """Whether ``text`` is the dense variant (read by the variant parser, the one that knows it)."""
    from kvstore.errors import KVStoreError
    from kvstore.model.variants.variant import parse_variant

    try:
        return parse_variant(text).dense
    except KVStoreError:
        return False


def _device(device: str | None) -> str:
    """The device to load on, as lm-eval's ``hf`` model picks it: none given, or a ``cuda:N`` this
    machine does not have (lm-eval's command line passes ``cuda:0`` by default), means CUDA when
    available, else CPU; anything else is used as given (and checked by the loader)."""
    if device is None or not str(device).strip():
        return "auto"
    text = str(device).strip().lower()
    if text.startswith("cuda:"):
        import torch

        index = text.split(":", 1)[1]
        if not index.isdigit() or int(index) >= torch.cuda.device_count():
            _log.warning("device %s is not available; using %s", device, "cuda" if torch.cuda.is_available() else "cpu")
            return "auto"
    return text


def shared_head(rows: Sequence[Sequence[int]]) -> list[int]:
    """The longest token prefix every row of ``rows`` starts with (``[]`` for fewer than two
    distinct rows)."""
    distinct = {tuple(r) for r in rows}
    if len(distinct) < 2:
        return []
    first, last = min(distinct), max(distinct)  # the lexicographic extremes bound every common prefix
    n = 0
    for a, b in zip(first, last):
        if a != b:
            break
        n += 1
    return list(first[:n])


@documented
@dataclass(frozen=True)
class ModelArgs:
    """The ``kvstore`` model's args (``--model_args k=v,...``: text, checked by :class:`KVStoreLM`;
    in Python, values). Most mirror lm-eval's ``hf`` model."""

    pretrained: str | None = option(
        None, "a local model directory, a hub id, a .gguf file, or None / default: the bundled SmolLM2-135M-Instruct"
    )
    store: str | None = option(None, "a store path or URL (None: $KVSTORE_STORE or <kvstore home>/store)")
    dtype: str | None = option(None, "float32 (None: kvstore's exact setting), ..., auto (the config's)")
    device: str | None = option(None, "None, or a cuda:N that does not exist: CUDA when available, else CPU, as hf")
    batch_size: int | str | None = option(None, f"an integer; auto or None: {DEFAULT_BATCH_SIZE}, or max_batch_size")
    max_batch_size: int | None = option(None, "caps an auto batch_size")
    max_length: int | str | None = option(None, "positions a request may use (None: the model's, as hf resolves it)")
    max_gen_toks: int | str | None = option(None, f"new tokens when a task does not say (None: {DEFAULT_MAX_GEN_TOKS})")
    use_cache: bool | str = option(True, "false: no store, everything computed (kvstore's reference path)")
    readonly: bool | str = option(False, "true: read the store, never write it")
    codec: str | None = option(None, "as for KVStore")
    chunk_tokens: int | str | None = option(None, "as for KVStore (applies when the store is created)")
    attn_implementation: str | None = option(None, "as for hf")
    add_bos_token: bool | str | None = option(None, "as for hf")
    prefix_token_id: int | str | None = option(None, "as for hf")
    press: str | None = option(
        None, "a press spec of the registry (snapkv:0.5, kvzip:0.75, expected_attention:0.5:adakv) applied to every "
        "request's stored context; not question-aware (a request's question is part of its context); the store keeps "
        "dense caches, so another press or ratio computes no context token"
    )  # fmt: skip


class ModelArgKeywords(TypedDict, total=False):
    """:class:`ModelArgs`' fields as :class:`KVStoreLM`'s keywords (for the type checker)."""

    pretrained: str | None
    store: str | None
    dtype: str | None
    device: str | None
    batch_size: int | str | None
    max_batch_size: int | None
    max_length: int | str | None
    max_gen_toks: int | str | None
    use_cache: bool | str
    readonly: bool | str
    codec: str | None
    chunk_tokens: int | str | None
    attn_implementation: str | None
    add_bos_token: bool | str | None
    prefix_token_id: int | str | None
    press: str | None


def _unknown_args(names: Iterable[str]) -> None:
    known = ", ".join(f.name for f in fields(ModelArgs) if f.name != "max_batch_size")
    raise ModelError(f"unknown model arg(s) for model {MODEL_NAME!r}: {', '.join(names)}; known: {known}")


@register_model(MODEL_NAME)
class KVStoreLM(TemplateLM):
    """lm-eval's ``LM`` on a :class:`kvstore.Adapter` and a :class:`kvstore.KVStore`, built from
    :class:`ModelArgs` (each a keyword). Raises :class:`~kvstore.errors.ModelError` for an unknown
    model arg or a bad value, before the model loads."""

    @takes_options(ModelArgs, unknown=_unknown_args)
    def __init__(self, options: ModelArgs | None = None, **fields: Unpack[ModelArgKeywords]) -> None:
        """The model and store of ``options`` (see :class:`ModelArgs`)."""
        assert options is not None  # completed by takes_options (from the field keywords)
        super().__init__()
        # every argument is checked before the (slow) model load
        self.use_cache = _bool(options.use_cache, "use_cache")
        ro = _bool(options.readonly, "readonly")
        ct = _optional_int(options.chunk_tokens, "chunk_tokens")
        if options.batch_size is None or str(options.batch_size).strip().lower().startswith("auto"):
            # no probing: a fixed size, capped by max_batch_size as lm-eval caps its probe
            cap = options.max_batch_size
            self._batch_size = min(DEFAULT_BATCH_SIZE, int(cap)) if cap else DEFAULT_BATCH_SIZE
        else:
            self._batch_size = _optional_int(options.batch_size, "batch_size") or DEFAULT_BATCH_SIZE
        self._max_length = _optional_int(options.max_length, "max_length")
        self._max_gen_toks = _optional_int(options.max_gen_toks, "max_gen_toks") or DEFAULT_MAX_GEN_TOKS
        self.add_bos_token = None if options.add_bos_token is None else _bool(options.add_bos_token, "add_bos_token")
        self.custom_prefix_token_id = None if options.prefix_token_id is None else int(options.prefix_token_id)
        self.press = _press(options.press)
        name = None if options.pretrained in (None, "", "default") else str(options.pretrained)
        self.adapter = Adapter.from_pretrained(
            name, dtype=options.dtype, device=_device(options.device), attn_implementation=options.attn_implementation
        )
        self.tokenizer = self.adapter.tokenizer
        self.store: KVStore | None = None
        if self.use_cache:
            self.store = KVStore(options.store, readonly=True, codec=options.codec) if ro else KVStore(
                options.store, codec=options.codec, chunk_tokens=ct
            )  # fmt: skip
            try:
                self.adapter.check_supported(self.store)
            except BaseException:
                self.store.close()
                raise
        self._device = self.adapter.device
        self.context_tokens_computed = 0
        self.context_tokens_loaded = 0

    # -- lm-eval's view of the model ------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def prefix_token_id(self) -> int:
        """The token an empty context is scored from: ``prefix_token_id``, else BOS, else EOS
        (lm-eval's ``hf`` rule)."""
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        bos = self.tokenizer.bos_token_id
        return int(bos) if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        if self._max_length:
            return self._max_length
        from lm_eval.models.utils import resolve_max_length

        return int(resolve_max_length(self.adapter.model.config, self.tokenizer, default=DEFAULT_MAX_LENGTH))

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "") or self.adapter.name).replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat rendered as text by the tokenizer's template, as ``hf`` renders it (a template
        that rejects a system turn is retried without it)."""
        import jinja2

        def render(history: list[dict[str, str]]) -> str:
            return self.tokenizer.apply_chat_template(
                history, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=not add_generation_prompt,
            )  # fmt: skip

        try:
            return render(chat_history)
        except jinja2.exceptions.TemplateError:
            _log.warning("the chat template failed; retrying without the system turn")
            return render([m for m in chat_history if m["role"] != "system"])

    def get_model_info(self) -> dict[str, Any]:
        return {
            "model_name": self.adapter.name,
            "model_dtype": self.adapter.dtype_name,
            "kvstore_store": self.store.url if self.store is not None else None,
            "kvstore_press": self.press.name if self.press is not None else None,
        }

    def reset_counters(self) -> None:
        """Zero :attr:`context_tokens_computed` and :attr:`context_tokens_loaded`."""
        self.context_tokens_computed = 0
        self.context_tokens_loaded = 0

    def close(self) -> None:
        """Close the store (the object is unusable afterwards)."""
        if self.store is not None:
            self.store.close()
            self.store = None

    # -- tokenization (lm-eval's ``hf`` rules) ---------------------------------------------------
    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """Token ids of ``string`` as lm-eval's ``hf`` model encodes it: ``add_special_tokens``
        if given, else ``add_bos_token`` if set, else the tokenizer's default, except that a string
        already starting with the prefix token's text gets no special tokens."""
        options: dict[str, bool] = {}
        if add_special_tokens is not None:
            options["add_special_tokens"] = add_special_tokens
        elif self.add_bos_token is not None:
            options["add_special_tokens"] = self.add_bos_token
        if add_special_tokens is None:
            head = self.tokenizer.decode(self.prefix_token_id)
            if head and string.startswith(head):
                options["add_special_tokens"] = False
        ids = list(self.tokenizer.encode(string, **options))
        left = kwargs.get("left_truncate_len")
        return ids[-left:] if left else ids

    def _prompt_ids(self, prompt: str, max_ctx_len: int) -> list[int]:
        """A generation prompt's ids as ``hf`` batches them (``tok_batch_encode``): special tokens
        unless the prompt starts with the BOS text or ``add_bos_token`` says otherwise, then the
        last ``max_ctx_len`` tokens."""
        bos = getattr(self.tokenizer, "bos_token", None)
        options: dict[str, bool] = {}
        if bos and prompt.startswith(bos):
            options["add_special_tokens"] = False
        elif self.add_bos_token is not None:
            options["add_special_tokens"] = self.add_bos_token
        ids = list(self.tokenizer(prompt, **options)["input_ids"])
        return ids[-max_ctx_len:]

    # -- scoring ---------------------------------------------------------------------------------
    def _score(self, contexts: list[list[int]], continuations: list[list[int]]) -> list[tuple[float, bool]]:
        """Score token rows through :meth:`kvstore.Adapter.score`, after ``hf``'s truncation."""
        limit = self.max_length
        ctx: list[list[int]] = []
        for i, (c, y) in enumerate(zip(contexts, continuations)):
            if not y:
                raise RequestError(f"request {i}: the continuation is empty after tokenization; nothing to score")
            if len(y) > limit:
                raise RequestError(f"request {i}: the continuation has {len(y)} tokens, more than max_length {limit}")
            over = len(c) + len(y) - (limit + 1)
            ctx.append(list(c[over:]) if over > 0 else list(c))
        head = shared_head(ctx)
        result = self.adapter.score(
            ctx, continuations, store=self.store, use_cache=self.use_cache, batch_size=self.batch_size,
            prefix=head if len(head) >= MIN_SHARED_HEAD else None, press=self.press,
        )  # fmt: skip
        self.context_tokens_computed += result.prefill_tokens_computed
        self.context_tokens_loaded += sum(r.cached_tokens for r in result.rows)
        return [(r.logprob, r.is_greedy) for r in result.rows]

    def _loglikelihood_tokens(
        self, requests: list[tuple[tuple[str, str], list[int], list[int]]], disable_tqdm: bool = False, **kwargs: Any
    ) -> list[tuple[float, bool]]:
        if not requests:
            return []
        answers = self._score([list(r[1]) for r in requests], [list(r[2]) for r in requests])
        for (request_str, _, _), answer in zip(requests, answers):
            if request_str is not None:
                self.cache_hook.add_partial("loglikelihood", request_str, answer)
        return answers

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        ctx: list[list[int]] = []
        cont: list[list[int]] = []
        owner: list[int] = []
        for d, (string,) in enumerate(req.args for req in requests):
            windows = get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1,
            )  # fmt: skip
            for c, y in map(make_disjoint_window, windows):
                ctx.append(list(c))
                cont.append(list(y))
                owner.append(d)
        scored = self._score(ctx, cont) if ctx else []
        totals = [0.0] * len(requests)
        for d, (logprob, _) in zip(owner, scored):
            totals[d] += logprob  # summed in window order, as ``hf`` sums them
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", (req.args[0],), total)
        return totals

    # -- generation ------------------------------------------------------------------------------
    def _generation_settings(self, gen_kwargs: dict[str, Any]) -> tuple[list[str], int]:
        """``(stop strings, max new tokens)`` of a request; RequestError unless it is greedy."""
        if not isinstance(gen_kwargs, dict):
            raise RequestError(f"generation arguments must be a dict, not {type(gen_kwargs).__name__}")
        if "max_length" in gen_kwargs:
            raise RequestError("generation argument max_length is not supported by model 'kvstore'; use max_gen_toks")
        kwargs = dict(normalize_gen_kwargs(gen_kwargs, self.max_gen_toks))
        if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0.0:
            raise RequestError(
                f"model {MODEL_NAME!r} decodes greedily; this request asks for sampling "
                f"(do_sample={kwargs.get('do_sample')}, temperature={kwargs.get('temperature')}): "
                "set do_sample=false and temperature=0, or use another model"
            )
        other = sorted(k for k in kwargs if k not in _GREEDY_NEUTRAL)
        if other:
            raise RequestError(
                f"model {MODEL_NAME!r} decodes greedily and does not support the generation argument(s) "
                f"{', '.join(other)}"
            )
        eos = self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False)
        until = handle_stop_sequences(kwargs.get("until"), eos=eos)
        return until, int(kwargs["max_gen_toks"])

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        args = [req.args for req in requests]
        settings = [self._generation_settings(a[1]) for a in args]  # every request checked before any work
        groups: dict[tuple[tuple[str, ...], int], list[int]] = {}
        for i, (until, n) in enumerate(settings):
            groups.setdefault((tuple(until), n), []).append(i)
        out: list[str | None] = [None] * len(requests)
        for (stops, n), rows in groups.items():
            max_ctx_len = self.max_length - n
            if max_ctx_len < 1:
                raise RequestError(f"max_gen_toks {n} leaves no room for a prompt in max_length {self.max_length}")
            prompts = [self._prompt_ids(args[i][0], max_ctx_len) for i in rows]
            for i, ids in zip(rows, prompts):
                if not ids:
                    raise RequestError(f"request {i}: the prompt is empty after tokenization")
            texts = self._generate(prompts, list(stops), n)
            for i, text in zip(rows, texts):
                out[i] = text
                self.cache_hook.add_partial("generate_until", args[i][:2], text)
        return [t if t is not None else "" for t in out]

    def _generate(self, prompts: list[list[int]], until: list[str], n: int) -> list[str]:
        """Greedy continuations of tokenized prompts, cut at the first stop string."""
        texts: list[str] = [""] * len(prompts)
        # a prompt's last token is fed as the question, the rest is the context (stored, or pressed in
        # memory without the cache); a one-token prompt has no context: it runs whole, without the cache
        split = [i for i, p in enumerate(prompts) if len(p) > 1 and (self.use_cache or self.press is not None)]
        plain = [i for i, p in enumerate(prompts) if i not in set(split)]
        for rows, is_split in ((split, True), (plain, False)):
            if not rows:
                continue
            if is_split:
                contexts = [prompts[i][:-1] for i in rows]
                questions = [prompts[i][-1:] for i in rows]
            else:
                contexts = [prompts[i] for i in rows]
                questions = [[] for _ in rows]
            use_cache = is_split and self.use_cache
            head = shared_head(contexts) if use_cache else []
            result = self.adapter.greedy_sample(
                contexts, questions, n, use_cache=use_cache, store=self.store if use_cache else None,
                batch_size=self.batch_size, max_context_tokens=max(len(c) for c in contexts), return_details=True,
                stop_strings=until, prefix=head if len(head) >= MIN_SHARED_HEAD else None,
                press=self.press if is_split else None,
            )  # fmt: skip
            assert isinstance(result, SampleResult)
            self.context_tokens_computed += result.prefill_tokens_computed
            self.context_tokens_loaded += sum(result.cached_tokens)
            for j, i in enumerate(rows):
                ids = result.tokens[j, : result.lengths[j]].tolist()
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                texts[i] = postprocess_generated_text(text, until, None)
        return texts


__all__ = ["KVStoreLM", "MODEL_NAME", "shared_head"]
