"""Exploration of 4-bit key/value quantization schemes on real SmolLM2 KV, in memory (no store).

A faster, rougher companion of ``bench_quant.py`` used to choose what to build: each scheme
fake-quantizes (quantize, then dequantize) the keys and values of a few long contexts (the
``long`` question set of ``bench_quant.py``); every question's 12 greedy reference tokens come from
the exact cache, then each scheme's cache is checked by teacher forcing (question and reference in
one forward: the first position whose argmax differs is where greedy decoding would diverge).
Reported per scheme: rows identical, mean tokens before divergence, max |logit difference| at the
first step, and the scheme's stored bits per element (codes, scales, zeros, outliers; the 4 sink
tokens and entropy coding aside).

Schemes (``--schemes``, comma-separated; ``k``/``v`` parts joined by ``/``):

* keys: ``post:G`` (int4 per channel over groups of G tokens, after RoPE: today's ``int4``),
  ``pre:G`` (the same before RoPE: ``int4r``), ``preo:G:P`` (pre-RoPE, the P per mille largest
  magnitudes of each layer kept exact), ``prenf:G`` (pre-RoPE, NF4-like levels), ``exact``;
* values: ``tok:G`` (int4 per token over groups of G channels: today's), ``toko:G:P``, ``exact``.

Command::

    .venv/bin/python experiments/explore_int4.py --contexts 2 --stem explore_int4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_quant import N_NEW, question_sets

import benchlib as bl

SINK = 4


def _rot(x: torch.Tensor, inv_freq: torch.Tensor, inverse: bool) -> torch.Tensor:
    """x [H, n, D] float64, positions 0..n-1, rotate_half layout over the first 2*len(inv_freq) dims."""
    n = x.shape[1]
    h = inv_freq.numel()
    ang = (torch.arange(n, dtype=torch.float32)[:, None] * inv_freq.float()[None]).double()
    c, s = ang.cos(), ang.sin()
    if inverse:
        s = -s
    a, b = x[..., :h], x[..., h : 2 * h]
    out = x.clone()
    out[..., :h] = a * c - b * s
    out[..., h : 2 * h] = b * c + a * s
    return out


def _uniform(x: torch.Tensor, dim: int, bits: int = 4) -> torch.Tensor:
    """Asymmetric min-max quantization along ``dim`` (x already grouped so ``dim`` is the group)."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    qmax = (1 << bits) - 1
    s = ((hi - lo) / qmax).clamp(min=1e-8)
    return ((x - lo) / s).round().clamp(0, qmax) * s + lo


# NF4 levels (quantiles of a normal, normalized to [-1, 1]; the QLoRA construction)
def _nf_levels(bits: int = 4) -> torch.Tensor:
    from statistics import NormalDist

    nd = NormalDist()
    n = 1 << bits
    p = torch.linspace(0.5 / n, 1 - 0.5 / n, n).tolist()
    q = torch.tensor([nd.inv_cdf(v) for v in p], dtype=torch.float64)
    return q / q.abs().max()


def _nonuniform(x: torch.Tensor, dim: int, levels: torch.Tensor) -> torch.Tensor:
    mid = (x.amax(dim, keepdim=True) + x.amin(dim, keepdim=True)) / 2
    half = ((x.amax(dim, keepdim=True) - x.amin(dim, keepdim=True)) / 2).clamp(min=1e-8)
    u = (x - mid) / half
    idx = (u.unsqueeze(-1) - levels.to(x.dtype)).abs().argmin(-1)
    return levels.to(x.dtype)[idx] * half + mid


def _keys_groups(x: torch.Tensor, g: int, fn) -> torch.Tensor:
    """Apply ``fn(group, dim=1)`` over groups of g tokens of x [H, m, D]."""
    out = torch.empty_like(x)
    for i in range(0, x.shape[1], g):
        out[:, i : i + g] = fn(x[:, i : i + g], 1)
    return out


def _with_outliers(x: torch.Tensor, per_mille: float, quant) -> tuple[torch.Tensor, int]:
    """Keep the largest ``per_mille``/1000 of |x - channel median| exact, quantize the rest (the
    outliers replaced by the channel median before the ranges are taken)."""
    k = max(1, int(x.numel() * per_mille / 1000))
    med = x.median(dim=1, keepdim=True).values
    dev = (x - med).abs().reshape(-1)
    thr = dev.topk(k).values.min()
    mask = (x - med).abs() >= thr
    filled = torch.where(mask, med.expand_as(x), x)
    y = quant(filled)
    return torch.where(mask, x, y), int(mask.sum())


def fake_keys(spec: str, k: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, float]:
    """k [H, n, D] float32 -> (dequantized, stored bits per element)."""
    if spec == "exact":
        return k, 32.0
    parts = spec.split(":")
    kind, g = parts[0], int(parts[1])
    sink, x = k[:, :SINK], k[:, SINK:].double()
    n = x.shape[1]
    pre = kind.startswith("pre")
    if pre:  # un-rotate with the positions SINK..
        full = _rot(k.double(), inv_freq, inverse=True)
        x = full[:, SINK:]
    bits = 4 + 32 / g
    if kind in ("post", "pre"):
        y = _keys_groups(x, g, lambda t, d: _uniform(t, d))
    elif kind == "prenf":
        lv = _nf_levels()
        y = _keys_groups(x, g, lambda t, d: _nonuniform(t, d, lv))
    elif kind == "preo":
        pm = float(parts[2])
        y, cnt = _with_outliers(x, pm, lambda t: _keys_groups(t, g, lambda u, d: _uniform(u, d)))
        bits += cnt * (16 + 32) / x.numel()  # a 16-bit index within the row block and the exact value
    else:
        raise ValueError(spec)
    if pre:
        full = torch.cat([torch.zeros_like(full[:, :SINK]), y], 1)
        y = _rot(full, inv_freq, inverse=False)[:, SINK:]
    del n
    return torch.cat([sink, y.float()], 1), bits


def fake_values(spec: str, v: torch.Tensor) -> tuple[torch.Tensor, float]:
    if spec == "exact":
        return v, 32.0
    parts = spec.split(":")
    kind, g = parts[0], int(parts[1])
    sink, x = v[:, :SINK], v[:, SINK:].double()
    H, m, D = x.shape
    bits = 4 + 32 / g

    def q(t):
        return _uniform(t.unflatten(2, (D // g, g)), 3).flatten(2)

    if kind == "tok":
        y = q(x)
    elif kind == "toko":
        y, cnt = _with_outliers(x, float(parts[2]), q)
        bits += cnt * 48 / x.numel()
    else:
        raise ValueError(spec)
    return torch.cat([sink, y.float()], 1), bits


@torch.inference_mode()
def reference(adapter, fmt, contexts: list[str], questions: list[str]) -> list[list[int]]:
    """12 greedy tokens per row from an exact (lossless) stored cache, batched (the reference)."""
    import tempfile

    from kvstore.store.kvstore import KVStore

    with tempfile.TemporaryDirectory() as d, KVStore(d) as store:
        got = adapter.greedy_sample(
            contexts, questions, N_NEW, store=store, stop_at_eos=False, return_details=True, batch_size=8,
            prefix=fmt.head, special_tokens=fmt.add_special_tokens,
        )  # fmt: skip
    return got.tokens.tolist()


@torch.inference_mode()
def forced(model, layers, q_ids: list[int], ref: list[int], n_ctx: int) -> tuple[int, torch.Tensor]:
    """Teacher forcing: the question and the reference answer in one forward on the cache; the
    first answer position whose argmax differs from the reference is where greedy decoding from
    this cache would diverge. Returns (tokens before divergence, first-step logits)."""
    from transformers import DynamicCache

    cache = DynamicCache([(k.unsqueeze(0), v.unsqueeze(0)) for k, v in layers], config=model.config)
    ids = torch.tensor([q_ids + ref[:-1]])
    pos = torch.arange(n_ctx, n_ctx + ids.shape[1])[None]
    logits = model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True).logits[0]
    picks = logits[len(q_ids) - 1 :].argmax(-1).tolist()
    j = next((i for i, (a, b) in enumerate(zip(picks, ref)) if a != b), N_NEW)
    return j, logits[len(q_ids) - 1].float()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--schemes", default="post:32/tok:64,pre:128/tok:64,pre:128/exact,exact/tok:64")
    ap.add_argument("--stem", default="explore_int4")
    args = ap.parse_args()
    bl.setup()
    from kvstore.data.prompts import PromptFormat
    from kvstore.model.build import prefill

    adapter = bl.load_adapter(args.dtype)
    model = adapter.model
    fmt = PromptFormat.from_chat_template(adapter.tokenizer)
    inv_freq = model.model.rotary_emb.inv_freq.detach().cpu()
    rows = question_sets()["long"]
    contexts = list(dict.fromkeys(r["context"] for r in rows))[: args.contexts]
    meta = {"machine": bl.machine(), "args": vars(args), "new_tokens": N_NEW}
    work = []
    for c in contexts:
        rows_c = [r for r in rows if r["context"] == c]
        ctx_text = fmt.context_part(c)
        q_texts = [fmt.question_part(r["question"]) for r in rows_c]
        refs = reference(adapter, fmt, [ctx_text] * len(q_texts), q_texts)
        ids = adapter.encode_context(ctx_text, special_tokens=fmt.add_special_tokens)
        layers = [(k.clone(), v.clone()) for k, v in prefill(adapter, [ids])[0]]
        qs = [adapter.encode_question(q) for q in q_texts]
        exact = [forced(model, layers, q, ref, len(ids)) for q, ref in zip(qs, refs)]
        agree = sum(j == N_NEW for j, _ in exact)  # teacher forcing on the exact cache reproduces greedy
        work.append((ids, layers, qs, [(ref, first) for ref, (_, first) in zip(refs, exact)]))
        print(f"context of {len(ids)} tokens, {len(qs)} questions, forced == greedy on {agree}", flush=True)
    results = []
    for scheme in args.schemes.split(","):
        t0 = time.perf_counter()
        ks, vs = scheme.split("/")
        same = before = dl = 0.0
        before_all, bits_k, bits_v = [], [], []
        n_rows = 0
        for ids, layers, qs, refs in work:
            fake = []
            for k, v in layers:
                kq, bk = fake_keys(ks, k.float(), inv_freq)
                vq, bv = fake_values(vs, v.float())
                fake.append((kq.to(k.dtype), vq.to(v.dtype)))
                bits_k.append(bk)
                bits_v.append(bv)
            for q, (ref, ref_first) in zip(qs, refs):
                j, first = forced(model, fake, q, ref, len(ids))
                before_all.append(j)
                same += j == N_NEW
                dl = max(dl, float((first - ref_first).abs().max()))
                n_rows += 1
        before = statistics.mean(before_all)
        row = {
            "scheme": scheme, "rows": n_rows, "rows_identical": int(same), "rows_identical_frac": same / n_rows,
            "tokens_before_divergence": before, "tokens_frac": before / N_NEW, "max_dlogit": dl,
            "bits_keys": statistics.mean(bits_k), "bits_values": statistics.mean(bits_v),
            "bits": (statistics.mean(bits_k) + statistics.mean(bits_v)) / 2, "seconds": time.perf_counter() - t0,
        }  # fmt: skip
        results.append(row)
        print(
            f"{scheme:28s} rows {int(same)}/{n_rows} tokens {before:.2f} dlogit {dl:.3f} bits {row['bits']:.2f}",
            flush=True,
        )
    meta["machine"]["load_after"] = bl.loadavg()
    bl.write_json(bl.RESULTS / f"{args.stem}.json", {"meta": meta, "rows": results})


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
