"""Cache families: every family kvstore serves is exact, and everything else is refused in one line.

Windowed attention (Mistral, Qwen2 and Gemma 2/3 with sliding layers, Llama 4 with attention
chunks), state-space models (Mamba, Mamba-2) and hybrids (Bamba, Jamba, FalconH1, LFM2, Qwen3-Next)
are stored per layer as the model needs them and decoded with position masks and restored states
(``kvstore.model.family.layout`` / ``slots`` / ``contexts``). Each is compared with Hugging Face
``generate`` run on one row at a time (which shares no code with kvstore's layouts), cached and
without a cache, at batch sizes 1, 3 and 8, with contexts shorter and longer than the window
(8 tokens), 8-token chunks (so contexts are chains), a repeated context and two partial hits (a
stored prefix extended by the rest). Tiny models use ``initializer_range`` 0.3 and untied
embeddings, or window and state bugs would not change tokens; the mutation tests below check that
they do. Models whose position handling survives kvstore's dense layout (ALiBi from the 2-D mask,
learned absolute positions) keep the dense path and are checked the same way.
"""

from __future__ import annotations

import re

import pytest
import torch

from helpers.cli import run_main, write_dataset
from helpers.rows import random_tokens
from helpers.tiny import make_family_model, save_family_model
from kvstore.errors import ModelError
from kvstore.model.adapter import Adapter
from kvstore.model.compute import masks
from kvstore.model.paths import slots
from kvstore.store.kvstore import KVStore

N_NEW = 6
CHUNK = 8
REFUSED = {
    "mpt": "ALiBi",
    "llama-dynamic-rope": "dynamic RoPE",
    "zamba2": "clamp dt",
}
# family -> the (dtype, attention) runs it gets: the whole matrix for one model of each kind, a
# smaller one for the rest (every family gets float64 and float32 and each attention it has)
F64, F32 = torch.float64, torch.float32
FULL = [(F64, "sdpa"), (F32, "sdpa"), (F64, "eager"), (F32, "eager")]
EXACT = {
    "mistral": FULL,
    "gemma3": FULL,
    "qwen2-sliding": [(F64, "eager"), (F32, "sdpa")],
    "gemma2": [(F64, "eager"), (F32, "eager")],  # eager only: transformers refuses SDPA for Gemma 2
    "gpt-oss": [(F64, "eager"), (F32, "eager")],  # learned sinks need eager attention
    "mixtral": [(F64, "sdpa"), (F32, "eager")],
    "qwen3-sliding": [(F64, "eager"), (F32, "sdpa")],
    "starcoder2": [(F64, "sdpa"), (F32, "eager")],
    "cohere2": [(F64, "eager"), (F32, "sdpa")],
    "llama4-chunked": [(F64, "sdpa"), (F32, "eager")],
    "mamba": [(F64, None), (F32, None)],
    "mamba2": [(F64, None), (F32, None)],
    "bamba": FULL,
    "jamba": [(F64, "eager"), (F32, "sdpa")],
    "falcon_h1": [(F64, "sdpa"), (F32, "eager")],
    "lfm2": [(F64, "sdpa"), (F32, "eager")],
    "qwen3_next": [(F64, "eager"), (F32, "sdpa")],
}


def _per_row_generate(model, prompts, n):
    out = []
    for p in prompts:
        x = torch.tensor([p])
        g = model.generate(
            input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
        out.append(g[0, len(p) :].tolist())
    return out


def _rows(tok, seed: int = 0):
    """Contexts of 1..31 tokens (window 8, chunks of 8), row 7 repeating row 0, rows 5 and 6
    extending row 3 (all of it: it ends mid-chunk) and the first two chunks of row 2 (partial hits
    once rows 0-4 are stored)."""
    g = torch.Generator().manual_seed(seed)
    pick = lambda n: random_tokens(tok, n, g)  # noqa: E731
    contexts = [pick(n) for n in (1, 7, 31, 12, 3)]
    contexts += [contexts[3] + pick(9), contexts[2][:16] + pick(5), list(contexts[0])]
    questions = [pick(n) for n in (3, 1, 5, 2, 4, 6, 1, 2)]
    return contexts, questions


def _check_exact(adapter, model, contexts, questions):
    want = _per_row_generate(model, [c + q for c, q in zip(contexts, questions)], N_NEW)
    with KVStore("memory://", chunk_tokens=CHUNK) as store:
        report = adapter.generate_kv_cache(contexts[:5], store, batch_size=3)
        assert report.built == 5 and report.chunks_written == 1 + 1 + 4 + 2 + 1
        _assert_finite(store)  # a fully masked pad row (NaN under eager float64) must never reach an entry
        for bs in (1, 3, 8):
            kw = dict(batch_size=bs, stop_at_eos=False, return_details=True)
            got = adapter.greedy_sample(contexts, questions, N_NEW, store=store, **kw)
            assert got.tokens.tolist() == want, f"cached, batch size {bs}"
            if bs == 1:  # row 5 extended row 3 (12 tokens: a chunk and its partial last one), row 6 two chunks
                assert got.cached_tokens == [1, 7, 31, 12, 3, 12, 16, 1]
            else:  # everything was stored by the batch-size-1 run
                assert got.cached_tokens == [len(c) for c in contexts]
            ref = adapter.greedy_sample(contexts, questions, N_NEW, use_cache=False, **kw)
            assert ref.tokens.tolist() == want, f"no cache, batch size {bs}"


def _assert_finite(store):
    for key in store.keys():
        entry = store.get(key)
        tensors = [t for kv in entry.layers if kv is not None for t in kv]
        tensors += [t for st in entry.states or () if st is not None for t in st.values()]
        assert all(bool(torch.isfinite(t).all()) for t in tensors), key


@pytest.mark.parametrize(
    "name,dtype,attn",
    [pytest.param(n, d, a, id=f"{n}-{str(d)[6:]}-{a or 'default'}") for n, runs in EXACT.items() for d, a in runs],
)
def test_cached_equals_no_cache_equals_generate(name, dtype, attn):
    model, tok = make_family_model(name, dtype=dtype, seed=3, attn_implementation=attn)
    adapter = Adapter(model, tok)
    contexts, questions = _rows(tok)
    _check_exact(adapter, model, contexts, questions)


@pytest.mark.parametrize("name", ["gemma3", "mamba", "bamba"])
def test_shared_prefixes_are_built_once_and_exact(name):
    """All eight contexts in one build: the chunks rows 2 and 6 (16 tokens) and rows 3 and 5
    (8 tokens) share are computed first, once, and the rest extends them; then every row is a hit
    and exact."""
    model, tok = make_family_model(name, dtype=torch.float32, seed=5, attn_implementation=None)
    adapter = Adapter(model, tok)
    contexts, questions = _rows(tok, seed=1)
    want = _per_row_generate(model, [c + q for c, q in zip(contexts, questions)], N_NEW)
    with KVStore("memory://", chunk_tokens=CHUNK) as store:
        report = adapter.generate_kv_cache(contexts, store, batch_size=4)
        assert (report.distinct, report.built) == (7, 7)
        # 1 + 1 + 4 + 2 + 1 chunks for rows 0-4, then 2 + 1 new ones for rows 5 and 6
        assert report.chunks_written == 12 and len(store) == 12
        got = adapter.greedy_sample(contexts, questions, N_NEW, store=store, stop_at_eos=False, return_details=True)
        assert got.tokens.tolist() == want and all(got.cache_hit) and got.prefill_tokens_computed == 0


def _entry_layers(adapter, contexts):
    with KVStore("memory://", chunk_tokens=CHUNK) as store:
        report = adapter.generate_kv_cache(contexts, store)
        record = store.context(report.keys[0])
        return [store.header(k) for k in record.chunks], [store.get(k) for k in record.chunks]


def test_entries_keep_only_what_later_tokens_see():
    """Gemma 3 (sliding window 8 on layers 0, 1, 3; layer 2 global), 20 tokens in chunks of 8, 8, 4:
    a sliding layer keeps min(chunk, 7) tokens of each chunk, the global layer all of them; the
    stored keys are the ones a one-row forward computes for those positions."""
    model, tok = make_family_model("gemma3", dtype=torch.float64, seed=1)
    adapter = Adapter(model, tok)
    ids = list(range(10, 30))
    headers, entries = _entry_layers(adapter, [ids])
    assert [(h.start, h.n_tokens) for h in headers] == [(0, 8), (8, 8), (16, 4)]
    for h in headers:
        assert [(s.kind, s.length, s.window) for s in h.layers] == [
            ("sliding", min(h.n_tokens, 7), 8), ("sliding", min(h.n_tokens, 7), 8), ("attn", h.n_tokens, None),
            ("sliding", min(h.n_tokens, 7), 8),
        ]  # fmt: skip
    full = model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values  # a DynamicCache of its own
    k_global = full.layers[2].keys[0]
    torch.testing.assert_close(torch.cat([e.layers[2][0] for e in entries], 1), k_global, atol=1e-12, rtol=0)
    # the sliding layer's cache holds the last 7 positions: the last chunk's 4 and the previous chunk's last 3
    k_slide = torch.cat([entries[1].layers[0][0][:, -3:], entries[2].layers[0][0]], 1)
    torch.testing.assert_close(k_slide, full.layers[0].keys[0, :, -7:], atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", ["mamba2", "bamba"])
def test_states_are_stored_at_every_chunk_end_in_their_own_dtype(name):
    """A float64 Mamba-2 mixer keeps its SSM state in float32; each chunk holds the state after its
    last token, which is the state of a one-row forward over the context up to there (to float32
    rounding: the scan runs in float32)."""
    model, tok = make_family_model(name, dtype=torch.float64, seed=1, attn_implementation=None)
    adapter = Adapter(model, tok)
    ids = list(range(10, 30))
    headers, entries = _entry_layers(adapter, [ids])
    first = next(i for i, s in enumerate(headers[0].layers) if s.kind == "state")
    assert {n: d for n, _, d in headers[0].layers[first].state} == {"conv": "float64", "recurrent": "float32"}
    for h, e in zip(headers, entries):
        cache = model(input_ids=torch.tensor([ids[: h.end]]), use_cache=True)
        cache = getattr(cache, "cache_params", None) or cache.past_key_values
        for i, spec in enumerate(h.layers):
            if spec.kind != "state":
                continue
            # chunk by chunk vs one pass: the Mamba-2 scan runs in float32 even in a float64 model
            for name, got in e.states[i].items():
                want = (cache.layers[i].conv_states if name == "conv" else cache.layers[i].recurrent_states)[0][0]
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
    assert len({h.state_bytes for h in headers}) == 1  # a state does not grow with the context


# -- the tests above can fail --------------------------------------------------------------------
def _broken(monkeypatch, name, bug):
    model, tok = make_family_model(name, dtype=torch.float64, seed=3, attn_implementation=None)
    adapter = Adapter(model, tok)
    contexts, questions = _rows(tok)
    _check_exact(adapter, model, contexts, questions)  # sound as shipped
    bug(monkeypatch)
    with pytest.raises(AssertionError):
        _check_exact(adapter, model, contexts, questions)


def test_a_window_over_slots_would_be_caught(monkeypatch):
    """Windows applied to slots instead of positions (what transformers' own masks do in a padded
    batch) change tokens."""

    def slot_windows(kv_pos, q_pos, q_slot, group, dtype, attn):
        slot = torch.arange(kv_pos.shape[1]).expand_as(kv_pos)
        q_slots = (q_slot + torch.arange(q_pos.shape[1])).expand_as(q_pos)
        kv_slots, q_slots = torch.where(kv_pos >= 0, slot, -1), torch.where(q_pos >= 0, q_slots, -1)
        return original(kv_slots, q_slots, q_slot, group, dtype, attn)

    original = masks.position_mask
    _broken(monkeypatch, "gemma3", lambda mp: mp.setattr(slots, "position_mask", slot_windows))


def test_no_window_would_be_caught(monkeypatch):
    original = masks.position_mask
    full = lambda kv_pos, q_pos, q_slot, group, dtype, attn: original(kv_pos, q_pos, q_slot, "attn", dtype, attn)  # noqa: E731
    _broken(monkeypatch, "mistral", lambda mp: mp.setattr(slots, "position_mask", full))


def test_a_fully_masked_pad_would_be_caught(monkeypatch):
    """A pad query that sees nothing (not even its own slot) is NaN under eager float64 and poisons
    the keys and values of real tokens in the next global layer: the finiteness check fails."""
    original = masks.position_mask

    def no_own_slot(kv_pos, q_pos, q_slot, group, dtype, attn):
        mask = original(kv_pos, q_pos, q_slot, group, dtype, attn)
        pad = (q_pos < 0)[:, None, :, None].expand_as(mask)
        return mask.masked_fill(pad, torch.finfo(dtype).min) if attn == "eager" else mask & ~pad

    model, tok = make_family_model("gemma3", dtype=torch.float64, seed=3, attn_implementation="eager")
    adapter = Adapter(model, tok)
    contexts, questions = _rows(tok)
    monkeypatch.setattr(slots, "position_mask", no_own_slot)
    with pytest.raises(AssertionError):
        _check_exact(adapter, model, contexts, questions)


def test_a_lost_state_would_be_caught(monkeypatch):
    """Restoring the stored convolution state but not the SSM state changes tokens."""
    original = slots._fill_state

    def conv_only(layer, state):
        original(layer, {k: (torch.zeros_like(v) if k == "recurrent" else v) for k, v in state.items()})

    _broken(monkeypatch, "bamba", lambda mp: mp.setattr(slots, "_fill_state", conv_only))


def test_pads_through_a_state_would_be_caught(monkeypatch):
    """Running rows of different question lengths together (pads in the recurrence, masked the
    way transformers masks them) changes tokens: that is why rows are grouped by length."""
    original = slots.Slots.run

    def padded(self, rows, tokens):
        if self.layout.has_state and len({len(t) for t in tokens}) > 1 and not any(self.fresh[r] for r in rows):
            S = max(len(t) for t in tokens)
            return original(self, rows, [[self.pad_id] * (S - len(t)) + list(t) for t in tokens])
        return original(self, rows, tokens)

    _broken(monkeypatch, "mamba2", lambda mp: mp.setattr(slots.Slots, "run", padded))


# -- refusals -----------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_families_name_the_reason(name):
    model, tok = make_family_model(name, attn_implementation=None)
    adapter = Adapter(model, tok)
    with KVStore("memory://") as store:
        with pytest.raises(ModelError, match=re.escape(REFUSED[name])):
            adapter.generate_kv_cache([[5, 6, 7]], store)
        assert len(store) == 0
    for use_cache in (True, False):  # the no-cache path lays rows out the same way: refused too
        with pytest.raises(ModelError, match=re.escape(REFUSED[name])):
            adapter.greedy_sample([[5, 6, 7]], [[8]], 2, use_cache=use_cache)


def test_encoder_decoder_models_are_refused():
    from transformers import BartConfig, T5Config

    from kvstore.model.family.families import refusal

    for config in (T5Config(), BartConfig()):
        assert "encoder-decoder" in refusal(config) and "bidirectionally" in refusal(config)


def test_position_masks_need_sdpa_or_eager():
    model, tok = make_family_model("mistral")
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ModelError, match="sdpa or eager"):
        Adapter(model, tok).greedy_sample([[5, 6, 7]], [[8]], 2, use_cache=False)


@pytest.mark.parametrize("name", ["mamba2", "mistral"])
def test_unverified_families_are_refused(name):
    model, tok = make_family_model(name, attn_implementation=None)
    model.config.model_type = "unmeasured_like"  # a mixer or a mask builder kvstore has not measured
    with pytest.raises(ModelError, match="not verified exact"):
        Adapter(model, tok).check_supported()


@pytest.mark.parametrize("name", ["zamba2", "mpt"])
@pytest.mark.parametrize("command", ["build", "sample"])
def test_cli_refuses_with_one_line(name, command, tmp_path, capsys):
    model_dir = save_family_model(tmp_path / name, name)
    dataset = write_dataset(tmp_path / "data.jsonl", range(2))
    capsys.readouterr()  # saving the model prints a progress bar
    code, out, err = run_main(capsys, command, dataset, "--model", model_dir, "--store", tmp_path / "store", "--quiet")
    assert code == 1 and out == "", err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvstore: error: ") and REFUSED[name] in lines[0], err
    assert "Traceback" not in err and "internal error" not in err


@pytest.mark.parametrize("name", ["mistral", "mamba2", "bamba"])
def test_cli_build_then_sample_equals_no_cache(name, tmp_path, capsys):
    """Through the CLI (whose loader falls back from SDPA for Mamba-2): a built store answers every
    row with the no-cache path's full output. The store uses 16-token chunks, so contexts of
    ~25-70 tokens are chains longer than the window."""
    import json

    model_dir = save_family_model(tmp_path / name, name, seed=2)
    dataset = write_dataset(tmp_path / "data.jsonl", range(4))
    KVStore(tmp_path / "store", chunk_tokens=16).close()
    capsys.readouterr()
    common = ["--model", model_dir, "--store", tmp_path / "store", "--quiet", "--format", "json"]
    code, out, err = run_main(capsys, "build", dataset, *common, "--batch-size", "3")
    assert code == 0, err
    assert json.loads(out)["built"] == 4
    rows = {}
    for mode in ("cache", "no-cache"):
        path = tmp_path / f"{mode}.jsonl"
        extra = ["--no-cache"] if mode == "no-cache" else []
        code, out, err = run_main(capsys, "sample", dataset, *common, "-n", "6", "-o", path, *extra)
        assert code == 0, err
        assert json.loads(out)["cache_hit_rate"] == (1.0 if mode == "cache" else 0.0)
        rows[mode] = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows["cache"]) == 8
    assert [r["raw_output"] for r in rows["cache"]] == [r["raw_output"] for r in rows["no-cache"]]


# -- the dense path: position schemes that survive its layout --------------------------------------
@pytest.mark.parametrize("name", ["bloom", "gpt2"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_position_schemes_that_survive_the_layout_are_exact(name, dtype):
    """ALiBi from the 2-D mask (Bloom) and learned absolute positions (GPT-2) keep the dense path
    (2-D masks): cached == no-cache == per-row generate at batch sizes 1, 3 and 8, mixed lengths."""
    model, tok = make_family_model(name, dtype=dtype, seed=3, attn_implementation="eager")
    adapter = Adapter(model, tok)
    assert adapter.layout.dense
    contexts, questions = _rows(tok)
    _check_exact(adapter, model, contexts, questions)


# -- size: a state does not grow with the context ----------------------------------------------------
@pytest.mark.parametrize("name", ["mamba", "mamba2", "bamba", "jamba", "falcon_h1", "lfm2", "qwen3_next"])
def test_size_counts_the_state_per_example(name, tmp_path, capsys):
    """``kvstore size`` on a saved config: the state per example (from the config alone) is what the
    model's own cache holds, in bfloat16 and float64 (Mamba-2 style states stay float32), and the
    per-example bytes grow only with the attention layers' keys and values."""
    from kvstore.size.estimate import kv_bytes_per_example
    from kvstore.size.shapes import resolve_shape

    shape = resolve_shape(str(save_family_model(tmp_path / name, name)))
    for dtype in (torch.bfloat16, torch.float64):
        model, tok = make_family_model(name, dtype=dtype, attn_implementation=None if "mamba" in name else "eager")
        layout = Adapter(model, tok).layout
        probed = sum(
            torch.Size(s).numel() * torch.empty(0, dtype=getattr(torch, d)).element_size()
            for layer in layout.layers for _, s, d in layer.state
        )  # fmt: skip
        dname = str(dtype).removeprefix("torch.")
        assert shape.state_bytes(dname) == probed > 0
        per_token = kv_bytes_per_example(shape, 2001, dname) - kv_bytes_per_example(shape, 2000, dname)
        assert per_token == sum(2 * lay.kv_heads * lay.head_dim for lay in layout.layers) * dtype.itemsize
    capsys.readouterr()
    code, out, err = run_main(capsys, "size", tmp_path / name, "--seq-len", "100")
    assert code == 0, err
    assert "state/example" in out and f"{shape.state_bytes('float32'):,}" in out


@pytest.mark.parametrize("name", ["gemma3", "mamba"])
def test_the_layout_probe_runs_without_autograd(name):
    """A model the user hands over as is (parameters requiring grad) is probed in inference mode:
    the one-token forward that reads a non-dense cache's shapes builds no autograd graph."""
    model, _ = make_family_model(name, attn_implementation=None)
    model.requires_grad_(True)
    seen: list[bool] = []
    handle = model.register_forward_pre_hook(lambda *_: seen.append(torch.is_inference_mode_enabled()))
    try:
        from kvstore.model.family.layout import cache_layout

        cache_layout(model)
    finally:
        handle.remove()
    assert seen == [True]
