"""Reference outputs from NVIDIA kvpress 0.5.5 (side environment; never imported by kvstore).

kvpress 0.5.5 pins ``transformers<5.3`` so it lives in its own virtual environment, and this
script must be run ONLY with that interpreter (it imports nothing from kvstore / this repo):

    cd /work/main && HF_HUB_OFFLINE=1 /work/kvpress-venv/bin/python experiments/kvpress_reference.py \\
        --model cache/models/SmolLM2-135M-Instruct.Q4_1-6ae44dae8536 \\
        --rows cache/bench/press_kvpress/rows.jsonl \\
        --presses knorm,streaming_llm,snapkv,keydiff,tova,random --ratios 0.25,0.5,0.75 \\
        --new-tokens 12 --out cache/bench/press_kvpress/kvpress.json

    # the presses with per-head budgets, the expected-attention scorer and the pyramid:
    cd /work/main && HF_HUB_OFFLINE=1 nice /work/kvpress-venv/bin/python experiments/kvpress_reference.py \\
        --model cache/models/SmolLM2-135M-Instruct.Q4_1-6ae44dae8536 \\
        --rows cache/bench/press_kvpress/rows.jsonl \\
        --presses kvzip,kvzip:layer,kvzip:plus,expected_attention,snapkv:adakv,expected_attention:adakv,\\
snapkv:pyramid --ratios 0.25,0.5,0.75 --new-tokens 12 --out cache/bench/press_kvpress/kvpress_new.json

(``--ids IDS.jsonl`` instead of ``--rows`` runs on exact token ids; ``bench_press_kvpress.py`` writes
both kinds of file and runs this script itself.)  The side venv is built with

    python3 -m venv /work/kvpress-venv
    /work/kvpress-venv/bin/pip install torch==2.13.0
    /work/kvpress-venv/bin/pip install -c <(echo torch==2.13.0) "transformers<5.3" kvpress==0.5.5

Pass ``--model`` as a directory: ``KVzipPress`` loads the tokenizer again from
``model.config.name_or_path``, which is the path the model was loaded from.

Inputs
    --rows FILE.jsonl  lines {"id": str, "context": str, "question": str}; tokenized with the
                       kvpress pipeline's own ``preprocess`` (chat template split at a separator,
                       answer_prefix="", no truncation unless --max-context-length is given).
    --ids FILE.jsonl   lines {"id": str, "context_ids": [int], "question_ids": [int]}; fed as is.

Presses (``--presses``, kvpress 0.5.5's defaults unless an option says otherwise):

    knorm, streaming_llm, snapkv, keydiff, tova, random (seed 0), expected_attention
                             a ScorerPress: every KV head keeps its ``max(1, int(c (1 - ratio)))``
                             best tokens (``selection: head``)
    snapkv:pyramid           PyramidKVPress (beta 20): per-layer budgets (``selection: pyramid``)
    snapkv:adakv, expected_attention:adakv
                             AdaKVPress(inner, alpha_safeguard=0.2): per layer, the
                             ``kv_heads (c - n_kept)`` lowest scores across its heads are masked,
                             after each head's ``int(0.2 n_kept)`` best (at least 1) are protected
                             (``selection: layer``)
    kvzip, kvzip:plus        KVzipPress(layerwise=False[, kvzip_plus_normalization=True]): scores from
                             replaying the context; ``int(layers kv_heads c ratio)`` pairs masked across
                             every layer and head (``selection: global``)
    kvzip:layer              KVzipPress(layerwise=True): ``int(kv_heads c ratio)`` per layer, across its
                             heads (``selection: layer``)

For every row: one dense answer (press=None) and, for every (press, ratio), one kvpress run:
``KVPressTextGenerationPipeline.forward`` (the context prefilled under the press's forward hooks,
then the question forward at position_ids = c + j and greedy decoding). What was kept is captured
from the very scores kvpress ranked:

* ScorerPress / PyramidKVPress (they shrink the cache): the press instance's ``score``/``compress``
  are wrapped and ``scores.topk(n_kept)`` is re-run on the scores it used; every layer is checked
  (keys.gather(idx) == compressed keys and values, bitwise) and the final cache against an
  independent dense prefill gathered at the captured indices.
* AdaKVPress / KVzipPress (head-wise: nothing is removed; each attention module gets
  ``masked_key_indices`` = (batch, head, position) of the *pruned* pairs and kvpress overwrites those
  keys with a fake key during decoding, ``kvpress/attention_patch.py``): the kept set of a
  (layer, head) is the complement of its pruned positions. The inner scores (AdaKV) or
  ``score_val`` (KVzip) are captured, kvpress's own selection calls are re-run on them and must give
  the same ``masked_key_indices`` (``verified.masked_indices_recomputed``); the cache must hold the
  dense prefill's values everywhere and its keys at every kept position. Each run also records how
  far the fake key's logit trails the best real logit of the same query (``fake_key_margin``: an
  upper bound over every masked head, query and decode step; below about -104 its float32 softmax
  weight is exactly 0, so masking with -inf gives the same attention).

Ties at the cut (``boundary_ties``: [layer, kv_head] pairs holding a score equal to the cut value
where the cut falls inside a run of equal values) are recorded for every selection; for the
selections across heads and layers, ``boundary_tie_groups`` says where each tie is
(``scope``: head / safeguard / layer / global), its value, how many scores share it and how many
of those were dropped.

Output JSON (written to --out after every row; ``meta.complete`` is true once every row is done):
    meta: versions, model shape, press classes and parameters, selections, options, the pyramid's
          ragged lengths (``pyramid_ragged_lengths``), the KVzip replay facts, seconds per press
    rows[]: id, context_ids, question_ids, context_len, question_len, (context_text, question_text),
            kvzip_replay {prefix_length, context_length, suffix_ids, chunks[] {start, end, prompt_ids,
                          repeat_ids, position_ids}} (the first KVzip run's; every other KVzip run of
                          the row is checked equal: ``replay_equal_row``),
            dense {answer_ids, answer_text, stopped_at_eos, positions, seconds},
            runs[] {press, ratio, spec, selection, params, n_kept (per head; null when heads differ),
                    kept_counts[layer][kv_head], cache_len, boundary_ties, boundary_tie_groups,
                    kept[layer][kv_head] (sorted context positions), kept_order (optional, selection
                    head only), scores {file, key, equal_to_saved} (not for the six original presses),
                    answer_ids, answer_text, stopped_at_eos, matches_dense, positions, verified,
                    error (when kvpress raised; the kept sets are the ones its prefill chose),
                    fake_key_margin (head-wise), kvzip {sink_value, layer_counts} (KVzip), seconds}
Scores file (``--out`` with ``.scores.safetensors`` for ``.json``): float32 ``[layers, kv_heads, c]``
per ``"<row index>/<scorer>"`` (scorer: expected_attention, snapkv, kvzip, kvzip:plus): what kvpress
ranked for ScorerPress and AdaKV (SnapKV's window and ExpectedAttention's sinks already padded with
``max + 1``), and KVzip's ``score_val`` before its sinks are raised to ``amax + 1`` (``sink_value``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
import traceback
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import kvpress  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from kvpress import (  # noqa: E402
    AdaKVPress,
    ExpectedAttentionPress,
    KeyDiffPress,
    KnormPress,
    KVPressTextGenerationPipeline,
    KVzipPress,
    PyramidKVPress,
    RandomPress,
    ScorerPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
)
from kvpress.utils import compute_n_kept  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

try:
    from importlib.metadata import version as _pkg_version
except ImportError:  # pragma: no cover
    _pkg_version = None


ORIGINAL = ("knorm", "streaming_llm", "snapkv", "keydiff", "tova", "random")  # no scores file for these
# press name -> over what its kept set is chosen (see the module docstring)
SELECTION = {
    **{name: "head" for name in (*ORIGINAL, "expected_attention")},
    "snapkv:pyramid": "pyramid",
    "snapkv:adakv": "layer",
    "expected_attention:adakv": "layer",
    "kvzip": "global",
    "kvzip:layer": "layer",
    "kvzip:plus": "global",
}
PRESS_NAMES = tuple(SELECTION)


def make_press(name: str, ratio: float, args):
    method, _, flag = name.partition(":")
    if method == "kvzip":
        return KVzipPress(compression_ratio=ratio, layerwise=flag == "layer", kvzip_plus_normalization=flag == "plus")
    if flag == "adakv":
        return AdaKVPress(make_press(method, ratio, args))
    if flag == "pyramid":
        return PyramidKVPress(compression_ratio=ratio, window_size=args.snapkv_window, kernel_size=args.snapkv_kernel)
    if name == "knorm":
        return KnormPress(compression_ratio=ratio)
    if name == "streaming_llm":
        return StreamingLLMPress(compression_ratio=ratio, n_sink=args.n_sink)
    if name == "snapkv":
        return SnapKVPress(compression_ratio=ratio, window_size=args.snapkv_window, kernel_size=args.snapkv_kernel)
    if name == "keydiff":
        return KeyDiffPress(compression_ratio=ratio)
    if name == "tova":
        return TOVAPress(compression_ratio=ratio)
    if name == "random":
        return RandomPress(compression_ratio=ratio, seed=args.random_seed)
    if name == "expected_attention":
        return ExpectedAttentionPress(compression_ratio=ratio)
    raise SystemExit(f"unknown press {name!r}; choose from {', '.join(PRESS_NAMES)}")


def spec_of(name: str, ratio: float) -> str:
    """The kvstore spec of a press name and ratio: ``kvzip:layer`` at 0.5 is ``kvzip:0.5:layer``."""
    method, *flags = name.split(":")
    return ":".join([method, f"{ratio:g}", *flags])


def scorer_of(name: str) -> str:
    """The key its scores are saved under: what they depend on (every ratio, AdaKV, the pyramid and
    KVzip's layerwise selection score alike; KVzip+ normalizes differently)."""
    return name if name == "kvzip:plus" else name.split(":")[0]


def press_params(press) -> dict:
    """The press's dataclass fields; a wrapped press (AdaKV's) as its class and its own fields."""
    out = {}
    for f in dataclasses.fields(press):
        v = getattr(press, f.name)
        out[f.name] = {"class": type(v).__name__, **press_params(v)} if dataclasses.is_dataclass(v) else v
    return out


# ----------------------------------------------------------------------------------------------
# ties at a cut
# ----------------------------------------------------------------------------------------------


def cut_tie(values: torch.Tensor, n_dropped: int):
    """The value at the cut when the ``n_dropped`` lowest of ``values`` (any shape) are dropped and the
    cut falls inside a run of equal values (the lowest kept equals the highest dropped); else None."""
    flat = values.reshape(-1)
    if not 0 < n_dropped < flat.numel():
        return None
    asc = flat.sort().values
    return float(asc[n_dropped - 1]) if asc[n_dropped - 1] == asc[n_dropped] else None


def tie_group(scope: str, values: torch.Tensor, n_dropped: int, value: float, layer=None) -> dict:
    flat = values.reshape(-1)
    tied = int((flat == value).sum())
    below = int((flat < value).sum())
    return {"scope": scope, "layer": layer, "value": value, "tied": tied, "dropped_of_tied": n_dropped - below}


def heads_holding(scores: torch.Tensor, value: float) -> list[int]:
    """Heads of ``scores`` ``[kv_heads, c]`` with a score equal to ``value``."""
    return (scores == value).any(dim=-1).nonzero().flatten().tolist()


# ----------------------------------------------------------------------------------------------
# captures: what kvpress kept, from the scores it ranked
# ----------------------------------------------------------------------------------------------


class ScorerCapture:
    """Wraps a ScorerPress (or PyramidKVPress) instance's score/compress to record what it kept."""

    selection = "head"

    def __init__(self, press: ScorerPress, keep_scores: bool):
        self.press = press
        self.scores: dict[int, torch.Tensor] = {}
        self.saved: dict[int, torch.Tensor] = {}  # layer -> [kv_heads, c] scores it ranked (keep_scores)
        self.idx: dict[int, torch.Tensor] = {}  # layer -> (kv_heads, n_kept), cache (topk) order
        self.gather_ok: dict[int, bool] = {}
        self.boundary_ties: list[list[int]] = []  # [layer, kv_head] where score[n_kept-1] == score[n_kept]
        self.n_replay = 0
        orig_score = press.score
        orig_compress = press.compress

        def score(module, hidden_states, keys, values, attentions, kwargs):
            s = orig_score(module, hidden_states, keys, values, attentions, kwargs)
            self.scores[module.layer_idx] = s
            if keep_scores:
                self.saved[module.layer_idx] = s[0].detach().float().clone()
            return s

        def compress(module, hidden_states, keys, values, attentions, kwargs):
            layer = module.layer_idx
            k2, v2 = orig_compress(module, hidden_states, keys, values, attentions, kwargs)
            bsz, n_heads, k_len, head_dim = keys.shape
            assert bsz == 1
            n_kept = k2.shape[2]
            if layer in self.scores:
                s = self.scores.pop(layer)
                # the call ScorerPress.compress / PyramidKVPress.compress make
                idx = s.topk(n_kept, dim=-1).indices
                if n_kept < k_len:
                    top = s.topk(n_kept + 1, dim=-1).values
                    tied = (top[0, :, n_kept - 1] == top[0, :, n_kept]).nonzero().flatten().tolist()
                    self.boundary_ties += [[layer, h] for h in tied]
            else:  # compression_ratio == 0: compress returns keys, values untouched
                assert n_kept == k_len
                idx = torch.arange(k_len, device=keys.device).expand(bsz, n_heads, k_len)
            gidx = idx.unsqueeze(-1).expand(-1, -1, -1, head_dim)
            ok = torch.equal(keys.gather(2, gidx), k2) and torch.equal(values.gather(2, gidx), v2)
            self.idx[layer] = idx[0].detach().cpu()
            self.gather_ok[layer] = bool(ok)
            return k2, v2

        press.score = score
        press.compress = compress

    def report(self, model, cache, dense_kv, c: int, store_order: bool) -> dict:
        n_layers = model.config.num_hidden_layers
        assert sorted(self.idx) == list(range(n_layers)), sorted(self.idx)
        counts = [[int(self.idx[layer].shape[-1])] * self.idx[layer].shape[0] for layer in range(n_layers)]
        flat = {n for layer in counts for n in layer}
        verified = {"gather_equal_all_layers": all(self.gather_ok.values())}
        if dense_kv is not None:
            ok = True
            for layer in range(n_layers):
                dk, dv = dense_kv[layer]
                n = counts[layer][0]
                gidx = self.idx[layer].unsqueeze(0).unsqueeze(-1).expand(-1, -1, -1, dk.shape[-1])
                lk, lv = cache.layers[layer].keys[:, :, :n], cache.layers[layer].values[:, :, :n]
                ok = ok and torch.equal(dk.gather(2, gidx), lk) and torch.equal(dv.gather(2, gidx), lv)
            verified["cache_equals_dense_gather"] = bool(ok)
        out = {
            "n_kept": flat.pop() if len(flat) == 1 else None,
            "kept_counts": counts,
            "boundary_ties": self.boundary_ties,
            "kept": [[sorted(h) for h in self.idx[layer].tolist()] for layer in range(n_layers)],
            "verified": verified,
        }
        if store_order:
            out["kept_order"] = [self.idx[layer].tolist() for layer in range(n_layers)]
        return out

    def saved_scores(self):
        if not self.saved:
            return None
        return torch.stack([self.saved[layer] for layer in sorted(self.saved)])


class MaskCapture:
    """Base of the head-wise captures: kvpress leaves ``masked_key_indices`` (batch, head, position of
    every pruned pair) on each attention module; ``self.pruned[layer]`` holds the flat indices
    (head * c + position) that re-running kvpress's own selection on the captured scores gives."""

    selection = "layer"

    def __init__(self):
        self.pruned: dict[int, torch.Tensor] = {}
        self.boundary_ties: list[list[int]] = []
        self.tie_groups: list[dict] = []
        self.n_replay = 0

    def _tie_heads(self, layer: int, scores: torch.Tensor, value: float) -> None:
        self.boundary_ties += [[layer, h] for h in heads_holding(scores, value) if [layer, h] not in self.boundary_ties]

    def report(self, model, cache, dense_kv, c: int, store_order: bool) -> dict:
        kept, counts = [], []
        recomputed, values_ok, keys_ok, replaced = True, True, True, False
        for layer, block in enumerate(model.model.layers):
            module = block.self_attn
            heads = model.config.num_key_value_heads
            pruned = torch.zeros(heads, c, dtype=torch.bool)
            mki = getattr(module, "masked_key_indices", None)
            if mki is not None:
                _, h_idx, s_idx = mki
                pruned[h_idx.cpu(), s_idx.cpu()] = True
                flat = (h_idx.cpu() * c + s_idx.cpu()).to(torch.int64)
            else:
                flat = torch.zeros(0, dtype=torch.int64)
            mine = self.pruned.get(layer, torch.zeros(0, dtype=torch.int64)).cpu().to(torch.int64)
            recomputed &= torch.equal(flat, mine)
            keep = ~pruned
            kept.append([keep[h].nonzero().flatten().tolist() for h in range(heads)])
            counts.append(keep.sum(dim=-1).tolist())
            if dense_kv is not None:
                dk, dv = dense_kv[layer]
                lk, lv = cache.layers[layer].keys[0, :, :c], cache.layers[layer].values[0, :, :c]
                values_ok &= lv.shape == dv[0].shape and torch.equal(lv, dv[0])
                keys_ok &= lk.shape == dk[0].shape and torch.equal(lk[keep], dk[0][keep])
                replaced |= bool(pruned.any()) and not torch.equal(lk[pruned], dk[0][pruned])
        flat_counts = {n for layer in counts for n in layer}
        verified = {"masked_indices_recomputed": bool(recomputed)}
        if dense_kv is not None:
            verified |= {"cache_values_equal_dense": bool(values_ok), "kept_keys_equal_dense": bool(keys_ok)}
        return {
            "n_kept": flat_counts.pop() if len(flat_counts) == 1 else None,
            "kept_counts": counts,
            "boundary_ties": self.boundary_ties,
            "boundary_tie_groups": self.tie_groups,
            "kept": kept,
            "verified": verified,
            "pruned_keys_overwritten": replaced,  # kvpress wrote its fake key over them while decoding
        }


class AdaKVCapture(MaskCapture):
    """AdaKVPress(inner): the inner scores (before the safeguard), and the selection re-run on them."""

    def __init__(self, press: AdaKVPress, keep_scores: bool):
        super().__init__()
        self.raw: dict[int, torch.Tensor] = {}  # layer -> [1, kv_heads, c] inner scores, as returned
        inner = press.press
        orig_score = inner.score
        orig_compress = press.compress

        def score(module, hidden_states, keys, values, attentions, kwargs):
            s = orig_score(module, hidden_states, keys, values, attentions, kwargs)
            self.raw[module.layer_idx] = s.detach().clone()  # AdaKV writes its safeguard into s
            return s

        def compress(module, hidden_states, keys, values, attentions, kwargs):
            out = orig_compress(module, hidden_states, keys, values, attentions, kwargs)
            if module.layer_idx in self.raw:
                self._select(module.layer_idx, press)
            return out

        inner.score = score
        press.compress = compress
        self.keep_scores = keep_scores

    def _select(self, layer: int, press: AdaKVPress) -> None:
        """AdaKVPress.compress's selection, call for call, on a copy of the scores it used."""
        raw = self.raw[layer]
        scores = raw.clone()
        bsz, heads, k_len = scores.shape
        n_kept = compute_n_kept(k_len, press.compression_ratio)
        n_safe = int(n_kept * press.alpha_safeguard)
        if press.alpha_safeguard > 0:
            n_safe = max(1, n_safe) if n_kept > 0 else 0
        top = torch.topk(scores, n_safe, dim=-1).indices
        scores.scatter_(-1, top, torch.finfo(scores.dtype).max)
        n_pruned = heads * (k_len - n_kept)
        self.pruned[layer] = torch.topk(-scores.reshape(bsz, -1), n_pruned, dim=1).indices.flatten()
        dropped = torch.zeros(heads * k_len, dtype=torch.bool)
        dropped[self.pruned[layer]] = True
        for h in range(heads):  # a tie at a head's safeguard cut matters only if a tied score was then dropped
            v = cut_tie(raw[0, h], k_len - n_safe)
            if v is not None and dropped.view(heads, k_len)[h][raw[0, h] == v].any():
                self.tie_groups.append(tie_group("safeguard", raw[0, h], k_len - n_safe, v, layer) | {"head": h})
                if [layer, h] not in self.boundary_ties:
                    self.boundary_ties.append([layer, h])
        v = cut_tie(scores, n_pruned)
        if v is not None:
            self.tie_groups.append(tie_group("layer", scores, n_pruned, v, layer))
            self._tie_heads(layer, scores[0], v)

    def saved_scores(self):
        if not self.keep_scores or not self.raw:
            return None
        return torch.stack([self.raw[layer][0].float() for layer in sorted(self.raw)])


class KVzipCapture(MaskCapture):
    """KVzipPress: the replay inputs it built (``prepare``), ``score_val`` before the sinks are raised,
    and the selection of ``compress_post`` re-run on a copy of the scores it ranked."""

    def __init__(self, press: KVzipPress):
        super().__init__()
        self.selection = "layer" if press.layerwise else "global"
        self.replay: dict | None = None
        self.raw: torch.Tensor | None = None  # [layers, kv_heads, c]
        self.sink_value: float | None = None
        self.layer_counts: list[int] | None = None
        orig_prepare = press.prepare
        orig_compress_post = press.compress_post

        def prepare(model, tokenizer, *a, **kw):
            pairs = orig_prepare(model, tokenizer, *a, **kw)
            suffix = press._suffix_ids[0].tolist()
            start, chunks = press.prefix_length, []
            for a_ids, repeat in pairs:
                end = start + a_ids.shape[1]
                n_prompt = repeat.shape[1] - len(suffix) - a_ids.shape[1]
                chunks.append({"start": start, "end": end, "prompt_ids": repeat[0, :n_prompt].tolist(),
                               "repeat_ids": repeat[0].tolist()})  # fmt: skip
                start = end
            self.replay = {"prefix_length": press.prefix_length, "context_length": press.context_length,
                           "suffix_ids": suffix, "chunks": chunks}  # fmt: skip
            self.n_replay = len(chunks)
            return pairs

        def compress_post(model):
            self.raw = press.score_val[:, 0].detach().clone()
            orig_compress_post(model)
            self._select(press.score_val.detach().clone(), press)

        press.prepare = prepare
        press.compress_post = compress_post

    def _select(self, score_val: torch.Tensor, press: KVzipPress) -> None:
        """KVzipPress.compress_post's selection, call for call, on a copy of the (sink-raised) scores."""
        n_layer, bsz, heads, ctx_len = score_val.shape
        if press.n_sink:
            self.sink_value = float(score_val[0, 0, 0, 0])
        if press.layerwise:
            nl = int(bsz * heads * ctx_len * press.compression_ratio)
            counts = nl * torch.ones(n_layer, dtype=torch.int)
        else:
            n = int(score_val.numel() * press.compression_ratio)
            pruned = torch.topk(-score_val.reshape(-1), n).indices
            counts = torch.bincount(pruned // (bsz * heads * ctx_len), minlength=n_layer).int()
            v = cut_tie(score_val, n)
            if v is not None:
                self.tie_groups.append(tie_group("global", score_val, n, v))
                for layer in range(n_layer):
                    self._tie_heads(layer, score_val[layer, 0], v)
        self.layer_counts = counts.tolist()
        for layer in range(n_layer):
            scores = score_val[layer]
            n_pruned = counts[layer]
            self.pruned[layer] = torch.topk(-scores.reshape(bsz, -1), n_pruned, dim=1).indices.flatten().cpu()
            v = cut_tie(scores, int(n_pruned))
            if v is not None:
                self.tie_groups.append(tie_group("layer", scores, int(n_pruned), v, layer))
                self._tie_heads(layer, scores[0], v)

    def saved_scores(self):
        return None if self.raw is None else self.raw.float()


def capture_for(name: str, press, keep_scores: bool):
    if isinstance(press, KVzipPress):
        return KVzipCapture(press)
    if isinstance(press, AdaKVPress):
        return AdaKVCapture(press, keep_scores)
    cap = ScorerCapture(press, keep_scores)
    cap.selection = SELECTION[name]
    return cap


# ----------------------------------------------------------------------------------------------
# probes
# ----------------------------------------------------------------------------------------------


class FakeKeyProbe:
    """How far kvpress's fake keys stay below the real ones. Head-wise presses keep every pair and,
    at each decoding forward, write over the pruned keys a key ``k`` with ``q . k < 0`` for the
    forward's queries (``attention_patch.search_hyperplane``), relying on its softmax weight
    underflowing. Wrapping the (already patched) sdpa function, this records per run the largest
    ``(q . k_fake - max over unmasked past keys of q . k) * scaling`` over masked heads, queries and
    forwards: an upper bound on the fake key's log-weight relative to the row's maximum."""

    def __init__(self):
        self.margin: float | None = None
        self.forwards = 0
        inner = ALL_ATTENTION_FUNCTIONS["sdpa"]

        def observed(module, query, key, value, attention_mask, *args, **kwargs):
            out = inner(module, query, key, value, attention_mask, *args, **kwargs)
            mki = getattr(module, "masked_key_indices", None)
            if mki is not None and query.shape[2] != key.shape[2] and len(mki[1]):
                self._measure(query, key, mki, kwargs.get("scaling") or module.scaling)
            return out

        ALL_ATTENTION_FUNCTIONS["sdpa"] = observed

    def reset(self) -> None:
        self.margin, self.forwards = None, 0

    @torch.no_grad()
    def _measure(self, query, key, mki, scaling: float) -> None:
        _, hq, s, d = query.shape
        hkv = key.shape[1]
        past = key.shape[2] - s  # keys every query of this forward sees
        logits = torch.einsum("hgsd,hkd->hgsk", query[0].reshape(hkv, hq // hkv, s, d).float(),
                              key[0, :, :past].float()) * scaling  # fmt: skip
        masked = torch.zeros(hkv, past, dtype=torch.bool)
        masked[mki[1].cpu(), mki[2].cpu()] = True
        real = logits.masked_fill(masked[:, None, None, :], -float("inf")).amax(dim=-1)  # [hkv, g, s]
        for h in masked.any(dim=-1).nonzero().flatten().tolist():
            first = int(masked[h].nonzero()[0])  # every masked slot of head h holds the same fake key
            m = float((logits[h, :, :, first] - real[h]).max())
            self.margin = m if self.margin is None else max(self.margin, m)
        self.forwards += 1


class PositionProbe:
    """Forward pre-hook on decoder layer 0 recording position_ids / cache_position of each call."""

    def __init__(self, model):
        self.calls: list[tuple[list[int], list[int]]] = []
        self.handle = model.model.layers[0].register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        pos = kwargs.get("position_ids")
        cp = kwargs.get("cache_position")
        self.calls.append((pos[0].tolist() if pos is not None else None, cp.tolist() if cp is not None else None))

    def reset(self):
        self.calls = []

    def summary(self, n_replay: int = 0) -> dict:
        """calls[0] = context prefill, then ``n_replay`` KVzip replay forwards, then the question
        forward and the decode steps."""
        if len(self.calls) < 2 + n_replay:
            return {}

        def span(x):
            return [x[0], x[-1]] if x else x

        q_pos, q_cp = self.calls[1 + n_replay]
        out = {
            "prefill_position_ids": span(self.calls[0][0]),
            "prefill_cache_position": span(self.calls[0][1]),
            "question_position_ids": span(q_pos),
            "question_cache_position": span(q_cp),
            "decode_position_ids": [c[0][0] for c in self.calls[2 + n_replay :]],
            "decode_cache_position": [c[1][0] for c in self.calls[2 + n_replay :]],
        }
        if n_replay:
            out["replay_position_ids"] = [span(c[0]) for c in self.calls[1 : 1 + n_replay]]
        return out


class DecodeCapture:
    """generate_answer() ends with tokenizer.decode(torch.stack(generated_ids)); record those ids."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.orig = tokenizer.decode
        self.last_ids = None

        def decode(ids, *a, **kw):
            self.last_ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
            return self.orig(ids, *a, **kw)

        tokenizer.decode = decode


# ----------------------------------------------------------------------------------------------


def pyramid_ragged_lengths(config, ratios, window: int, kernel: int, longest: int) -> dict:
    """Per ratio, the context lengths (``window + 1 .. longest``) at which PyramidKVPress's own
    ``get_layer_budget`` gives the layers different budgets, as ``[first, last]`` runs: after such a
    prefill the layers' caches differ in length, while the question forward sizes its attention mask
    from layer 0's (``DynamicCache.get_seq_length()``), so SDPA raises at the first shorter layer.
    Elsewhere it falls back to one SnapKV budget for every layer (``round``, not ``int``)."""
    out = {}
    modules = [SimpleNamespace(layer_idx=i, config=config) for i in range(config.num_hidden_layers)]
    for ratio in ratios:
        press = PyramidKVPress(compression_ratio=ratio, window_size=window, kernel_size=kernel)
        runs: list[list[int]] = []
        for c in range(window + 1, longest + 1):
            if len({press.get_layer_budget(m, c) for m in modules}) > 1:
                if runs and runs[-1][1] == c - 1:
                    runs[-1][1] = c
                else:
                    runs.append([c, c])
        out[f"{ratio:g}"] = runs
    return out


def load_inputs(args, pipe) -> list[dict]:
    rows = []
    path = args.rows or args.ids
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rows.append(json.loads(line))
    if args.limit:
        rows = rows[: args.limit]
    out = []
    for r in rows:
        if args.rows:
            max_len = args.max_context_length if args.max_context_length else int(1e10)
            t = pipe.preprocess(r["context"], questions=[r["question"]], answer_prefix="", max_context_length=max_len)
            ctx = t["context_ids"]
            q = t["questions_ids"][0]
            item = {"id": str(r["id"]), "context_ids": ctx, "question_ids": q}
        else:
            ctx = torch.tensor([r["context_ids"]], dtype=torch.long)
            q = torch.tensor([r["question_ids"]], dtype=torch.long)
            item = {"id": str(r["id"]), "context_ids": ctx, "question_ids": q}
        out.append(item)
    return out


def dense_prefill_keys(model, ctx_ids):
    cache = DynamicCache()
    with torch.inference_mode():
        model.model(input_ids=ctx_ids, past_key_values=cache)
    return [(cache.layers[i].keys.clone(), cache.layers[i].values.clone()) for i in range(len(cache))]


def run_pipeline(pipe, dec, probe, ctx, q, press, n_new):
    """One kvpress pipeline run: (result, cache, error). A run that raises (PyramidKVPress on most
    lengths) gives ``answer_ids`` None and the error's last line; its prefill's choice stands."""
    cache = DynamicCache()
    probe.reset()
    dec.last_ids = None
    t0 = time.perf_counter()
    error = None
    try:
        answers = pipe.forward({"context_ids": ctx, "questions_ids": [q]}, press=press, max_new_tokens=n_new,
                               cache=cache)  # fmt: skip
    except Exception as e:  # noqa: BLE001 - recorded verbatim, the run goes on
        answers = [None]
        frame = traceback.extract_tb(e.__traceback__)[-1]
        error = {"type": type(e).__name__, "message": str(e),
                 "where": f"{frame.filename}:{frame.lineno} in {frame.name}"}  # fmt: skip
        dec.last_ids = None
    dt = time.perf_counter() - t0
    ids = dec.last_ids
    eos = pipe.model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    res = {
        "answer_ids": ids,
        "answer_text": answers[0],
        "stopped_at_eos": bool(ids) and ids[-1] in eos,
        "seconds": round(dt, 3),
    }
    return res, cache, error


def write_out(path: str, scores_path: str, meta: dict, rows: list[dict], saved: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, separators=(",", ":"))
    os.replace(tmp, path)
    if saved:
        save_file({k: v.contiguous() for k, v in saved.items()}, scores_path + ".tmp")
        os.replace(scores_path + ".tmp", scores_path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="cache/models/SmolLM2-135M-Instruct.Q4_1-6ae44dae8536",
                    help="a model directory (KVzip reloads its tokenizer from this path)")  # fmt: skip
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--rows", help="jsonl with id, context, question")
    src.add_argument("--ids", help="jsonl with id, context_ids, question_ids")
    ap.add_argument("--presses", default=",".join(ORIGINAL), help=f"comma-separated: {', '.join(PRESS_NAMES)}")
    ap.add_argument("--ratios", default="0,0.25,0.5,0.75")
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-context-length", type=int, default=None, help="pipeline truncation (default: none)")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit", type=int, default=0, help="only the first N rows")
    ap.add_argument("--n-sink", type=int, default=4, help="StreamingLLMPress.n_sink (kvpress default 4)")
    ap.add_argument("--snapkv-window", type=int, default=64, help="SnapKVPress.window_size (default 64)")
    ap.add_argument("--snapkv-kernel", type=int, default=5, help="SnapKVPress.kernel_size (default 5)")
    ap.add_argument("--random-seed", type=int, default=0, help="RandomPress.seed (kvpress default None)")
    ap.add_argument("--store-order", action="store_true", help="also store kept indices in cache (topk) order")
    ap.add_argument("--no-verify", action="store_true", help="skip the dense-prefill cache comparison")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    presses = [p.strip() for p in args.presses.split(",") if p.strip()]
    for p in presses:
        if p not in PRESS_NAMES:
            raise SystemExit(f"unknown press {p!r}; choose from {', '.join(PRESS_NAMES)}")
    ratios = [float(x) for x in args.ratios.split(",") if x.strip()]
    model_dir = os.path.abspath(args.model)
    scores_path = (args.out[:-5] if args.out.endswith(".json") else args.out) + ".scores.safetensors"

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation=args.attn)
    model.eval()
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tok, device=torch.device("cpu"))
    dec = DecodeCapture(pipe.tokenizer)
    probe = PositionProbe(model)
    fake = FakeKeyProbe()

    cfg = model.config
    n_layers = cfg.num_hidden_layers
    meta = {
        "kvpress_version": _pkg_version("kvpress") if _pkg_version else getattr(kvpress, "__version__", None),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "model": model_dir,
        "model_name_or_path": cfg.name_or_path,
        "model_shape": {
            "num_hidden_layers": n_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads),
        },
        "attn_implementation": args.attn,
        "dtype": "float32",
        "threads": args.threads,
        "input_mode": "rows" if args.rows else "ids",
        "input_file": os.path.abspath(args.rows or args.ids),
        "pipeline": {
            "answer_prefix": "",
            "max_context_length": args.max_context_length,
            "eos_token_id": model.generation_config.eos_token_id,
            "question_position_ids": "context_len + j (pipeline.generate_answer)",
            "question_cache_position": "n_kept + j (LlamaModel default from cache.get_seq_length())",
        },
        "new_tokens": args.new_tokens,
        "presses": {
            p: {
                "class": type(make_press(p, 0.5, args)).__name__,
                "params": {k: v for k, v in press_params(make_press(p, 0.5, args)).items() if k != "compression_ratio"},
                "selection": SELECTION[p],
            }
            for p in presses
        },
        "ratios": ratios,
        "kept_layout": "kept[layer][kv_head] = sorted list of kept context positions (0-based)",
        "scores_file": os.path.basename(scores_path),
        "scores_layout": "'<row index>/<scorer>' -> float32 [layers, kv_heads, c]; KVzip's before its sinks are raised",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "complete": False,
    }
    if any(p.endswith(":pyramid") for p in presses):
        meta["pyramid_ragged_lengths"] = pyramid_ragged_lengths(
            cfg, ratios, args.snapkv_window, args.snapkv_kernel, cfg.max_position_embeddings
        )

    items = load_inputs(args, pipe)
    out_rows: list[dict] = []
    saved: dict[str, torch.Tensor] = {}
    for index, it in enumerate(items):
        ctx, q = it["context_ids"], it["question_ids"]
        c = ctx.shape[1]
        row = {
            "id": it["id"],
            "context_ids": ctx[0].tolist(),
            "question_ids": q[0].tolist(),
            "context_len": c,
            "question_len": q.shape[1],
        }
        if args.rows:
            row["context_text"] = tok.decode(ctx[0])
            row["question_text"] = tok.decode(q[0])
        dense, _, error = run_pipeline(pipe, dec, probe, ctx, q, None, args.new_tokens)
        assert error is None, error
        dense["positions"] = probe.summary()
        row["dense"] = dense
        print(f"[{it['id']}] c={c} q={q.shape[1]} dense={dense['answer_text']!r} ({dense['seconds']}s)", flush=True)
        dense_kv = None if args.no_verify else dense_prefill_keys(model, ctx)
        runs = []
        for pname in presses:
            for ratio in ratios:
                press = make_press(pname, ratio, args)
                params = press_params(press)
                keep_scores = pname not in ORIGINAL
                cap = capture_for(pname, press, keep_scores)
                fake.reset()
                res, cache, error = run_pipeline(pipe, dec, probe, ctx, q, press, args.new_tokens)
                run = {"press": pname, "ratio": ratio, "spec": spec_of(pname, ratio), "selection": cap.selection,
                       "params": params, "cache_len": None if error else cache.get_seq_length()}  # fmt: skip
                run |= cap.report(model, cache, dense_kv, c, args.store_order)
                run |= res
                run["positions"] = probe.summary(cap.n_replay)
                run["matches_dense"] = res["answer_ids"] == dense["answer_ids"]
                if error is not None:
                    run["error"] = error
                if isinstance(cap, MaskCapture):
                    run["fake_key_margin"] = fake.margin
                    run["fake_key_forwards"] = fake.forwards
                if isinstance(cap, KVzipCapture):
                    run["kvzip"] = {"sink_value": cap.sink_value, "layer_counts": cap.layer_counts}
                    if cap.replay is not None:
                        row.setdefault("kvzip_replay", cap.replay | {"position_ids": run["positions"].get(
                            "replay_position_ids")})  # fmt: skip
                        run["replay_equal_row"] = all(row["kvzip_replay"][k] == v for k, v in cap.replay.items())
                scores = cap.saved_scores() if keep_scores else None
                if scores is not None:
                    key = f"{index}/{scorer_of(pname)}"
                    if key in saved:
                        run["scores"] = {"file": meta["scores_file"], "key": key,
                                         "equal_to_saved": torch.equal(saved[key], scores)}  # fmt: skip
                    else:
                        saved[key] = scores
                        run["scores"] = {"file": meta["scores_file"], "key": key, "equal_to_saved": True}
                runs.append(run)
                counts = [n for layer in run["kept_counts"] for n in layer]
                shown = run["n_kept"] if run["n_kept"] is not None else f"{min(counts)}..{max(counts)}"
                print(
                    f"  {pname:>24} r={ratio:<5} kept={shown:>9} ans={res['answer_text']!r} "
                    f"dense_eq={run['matches_dense']} verified={run['verified']} ({res['seconds']}s)"
                    + (f" ERROR {error['type']}: {error['message']}" if error else ""),
                    flush=True,
                )
        row["runs"] = runs
        out_rows.append(row)
        write_out(args.out, scores_path, meta, out_rows, saved)

    by_press: dict[str, list[float]] = {}
    for row in out_rows:
        for run in row["runs"]:
            by_press.setdefault(run["spec"], []).append(run["seconds"])
    meta["seconds"] = {
        "dense": {"runs": len(out_rows), "median": statistics.median(r["dense"]["seconds"] for r in out_rows),
                  "total": round(sum(r["dense"]["seconds"] for r in out_rows), 3)},
        **{spec: {"runs": len(xs), "median": statistics.median(xs), "total": round(sum(xs), 3)}
           for spec, xs in by_press.items()},
    }  # fmt: skip
    meta["complete"] = True
    meta["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
    write_out(args.out, scores_path, meta, out_rows, saved)
    print(f"wrote {args.out}" + (f" and {scores_path}" if saved else ""), file=sys.stderr)


if __name__ == "__main__":
    main()
