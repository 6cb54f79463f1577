"""The tuning runs behind ``int4h``: 4-bit variants of the keys and values compared in memory by
next-token KL on the **tuning** text only (the demo articles joined, ``experiments/data/demo.jsonl``),
never on the held-out prose ``bench_quality.py`` reports on.

Each variant quantizes and dequantizes the lossless cache in float32 in memory (round to nearest,
asymmetric codes, scales and zeros unrounded: a model of the codecs, not the stored bytes), keeping
the first 4 tokens exact as every codec does: keys per channel over groups of GK tokens (``chan``)
or per token over groups of GK channels (``tok``), values per token over groups of GV channels;
optionally the keys un-rotated first (``pre``: pre-RoPE, as ``int4r``), keys and/or values rotated by
the normalized Hadamard matrix (``H``), and the largest ``o`` fraction of |x - channel median| kept
exactly (dense-and-sparse outliers, charged 48 bits each: a 32-bit index and a 16-bit value). Per
variant: nominal bits per element (codes + a 16-bit scale and zero per group + outliers, keys and
values averaged), KL(lossless || variant) and top-1 agreement of the next-token distributions over
``--scored`` teacher-forced tokens after each of ``--windows`` windows of ``--context`` tokens, with
keys and values quantized, only keys, only values.

Command (from the repository root; the suite ``int4h_variants`` writes
experiments/results/int4h_variants.json)::

    .venv/bin/python experiments/int4h_variants.py --threads 1

``--layers`` (writes experiments/results/int4h_layers.json), still on the tuning text only: the
sensitivity of each layer to ``int4h`` (KL with only layer L's keys quantized, the rest lossless;
then only its values), beside a data-only proxy of each layer (the int4h key rounding error's
squared norm, mean per token), then mixed precision: the ``k`` layers whose keys (or values) the
measured KL ranks most sensitive given 8-bit codes (same axes and groups, rotated), every other
layer ``int4h``, with the nominal bits per element of the whole cache. ``--layers --text prose``
(``int4h_layers_prose.json``): the same scan on the held-out prose (``bench_frontier.prose_text``),
whose mixed rows take their layers from the **tuning** run's ranking (``--ranking``, default
experiments/results/int4h_layers.json): whether a per-model choice made on one text transfers.
"""

from __future__ import annotations

import benchlib as bl

VARIANTS = {
    "int4 K chan32 / V 64": dict(kb=4, kg=32, kax="chan", vb=4, vg=64),
    "int4r K pre chan32 / V 32": dict(pre=1, kb=4, kg=32, kax="chan", vb=4, vg=32),
    "K H chan32 / V 64": dict(had=1, kb=4, kg=32, kax="chan", vb=4, vg=64),
    "K H tok32 / V 64": dict(had=1, kb=4, kg=32, kax="tok", vb=4, vg=64),
    "K pre H chan32 / V 64": dict(pre=1, had=1, kb=4, kg=32, kax="chan", vb=4, vg=64),
    "K H chan32 / V H 64 (int4h)": dict(had=1, vhad=1, kb=4, kg=32, kax="chan", vb=4, vg=64),
    "K pre H chan32 / V H 64": dict(pre=1, had=1, vhad=1, kb=4, kg=32, kax="chan", vb=4, vg=64),
    "K H chan64 / V H 32": dict(had=1, vhad=1, kb=4, kg=64, kax="chan", vb=4, vg=32),
    "K H chan128 / V H 32": dict(had=1, vhad=1, kb=4, kg=128, kax="chan", vb=4, vg=32),
    "K H chan64 o1% / V H 64": dict(had=1, vhad=1, kb=4, kg=64, kax="chan", ko=0.01, vb=4, vg=64),
    "K chan32 o1% / V 64": dict(kb=4, kg=32, kax="chan", ko=0.01, vb=4, vg=64),
    "K H chan32 o1% / V 64 o1%": dict(had=1, kb=4, kg=32, kax="chan", ko=0.01, vb=4, vg=64, vo=0.01),
    "K5 H chan32 / V3 32": dict(had=1, kb=5, kg=32, kax="chan", vb=3, vg=32),
    "K H chan32 / V H 32": dict(had=1, vhad=1, kb=4, kg=32, kax="chan", vb=4, vg=32),
    "K H chan16 / V 64": dict(had=1, kb=4, kg=16, kax="chan", vb=4, vg=64),
}


def qchan(x, bits, g):
    qmax = 2**bits - 1
    out = x.clone()
    for i in range(0, x.shape[1], g):
        t = x[:, i : i + g]
        lo, hi = t.amin(1, keepdim=True), t.amax(1, keepdim=True)
        s = ((hi - lo) / qmax).clamp(min=1e-8)
        out[:, i : i + g] = ((t - lo) / s).round().clamp(0, qmax) * s + lo
    return out


def qtok(x, bits, g):
    qmax = 2**bits - 1
    xg = x.unflatten(2, (x.shape[2] // g, g))
    lo, hi = xg.amin(3, keepdim=True), xg.amax(3, keepdim=True)
    s = ((hi - lo) / qmax).clamp(min=1e-8)
    return (((xg - lo) / s).round().clamp(0, qmax) * s + lo).flatten(2)


def outliers(x, frac, quant):
    if not frac:
        return quant(x)
    import torch

    centre = x.median(1, keepdim=True).values
    dev = (x - centre).abs()
    k = max(1, int(frac * dev.numel()))
    mask = dev > dev.flatten().kthvalue(dev.numel() - k).values
    return torch.where(mask, x, quant(torch.where(mask, centre.expand_as(x), x)))


def variant(spec, rotary, h):
    from kvstore.store.codecs.prerope import rotate

    def keys(x, start):
        y = rotate(x.double(), rotary, start, inverse=True).float() if spec.get("pre") else x
        y = y @ h if spec.get("had") else y
        kb, kg = spec["kb"], spec["kg"]
        quant = (lambda t: qchan(t, kb, kg)) if spec["kax"] == "chan" else (lambda t: qtok(t, kb, kg))
        y = outliers(y, spec.get("ko", 0), quant)
        y = y @ h if spec.get("had") else y
        return rotate(y.double(), rotary, start).float() if spec.get("pre") else y

    def values(x, start):
        y = x @ h if spec.get("vhad") else x
        y = outliers(y, spec.get("vo", 0), lambda t: qtok(t, spec["vb"], spec["vg"]))
        return y @ h if spec.get("vhad") else y

    return keys, values


def bits(spec) -> float:
    k = spec["kb"] + 32 / spec["kg"] + spec.get("ko", 0) * 48
    v = spec["vb"] + 32 / spec["vg"] + spec.get("vo", 0) * 48
    return (k + v) / 2


def main() -> None:
    ap = bl.parser(__doc__)
    ap.add_argument("--layers", action="store_true", help="per-layer sensitivity and mixed precision")
    ap.add_argument("--text", choices=("tuning", "prose"), default="tuning", help="with --layers")
    ap.add_argument("--ranking", default=str(bl.HERE / "results" / "int4h_layers.json"), help="with --text prose")
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--context", type=int, default=448)
    ap.add_argument("--scored", type=int, default=48)
    args = bl.start(ap, {"windows": 2})
    import torch
    from bench_quality import tuning_text
    from transformers import DynamicCache

    from kvstore.model.adapter import Adapter
    from kvstore.store.codecs.hadamard import hadamard

    adapter = Adapter.from_pretrained(None, dtype="float32", device="cpu")
    model = adapter.handle.model
    if args.text == "prose" and not args.layers:
        raise SystemExit("--text prose goes with --layers (the variants are compared on the tuning text)")
    if args.text == "prose":
        from bench_frontier import prose_text

        text = prose_text()
    else:
        text = tuning_text()
    ids = adapter.tokenizer.encode(text, add_special_tokens=False)
    size = args.context + args.scored
    step = (len(ids) - size) // args.windows
    refs = []
    with torch.inference_mode():
        for i in range(args.windows):
            w = torch.tensor([ids[i * step : i * step + size]])
            cache = DynamicCache()
            model(input_ids=w[:, : args.context], past_key_values=cache, use_cache=True)
            kv = [(layer.keys[0].clone(), layer.values[0].clone()) for layer in cache.layers]
            ref = model(input_ids=w[:, args.context :], past_key_values=cache).logits[0].float().log_softmax(-1)
            refs.append((kv, ref, w))

    def run(kf, vf, which, klayers=None, vlayers=None):
        kls, top = [], []
        with torch.inference_mode():
            for kv, ref, w in refs:
                cache = DynamicCache()
                for j, (k, v) in enumerate(kv):
                    k2, v2 = k.clone(), v.clone()
                    if "k" in which and (klayers is None or j in klayers):
                        k2[:, 4:] = kf(k[:, 4:], 4) if klayers is None else klayers[j](k[:, 4:], 4)
                    if "v" in which and (vlayers is None or j in vlayers):
                        v2[:, 4:] = vf(v[:, 4:], 4) if vlayers is None else vlayers[j](v[:, 4:], 4)
                    cache.update(k2[None], v2[None], j)
                got = model(input_ids=w[:, args.context :], past_key_values=cache).logits[0].float().log_softmax(-1)
                kls.append(float((ref.exp() * (ref - got)).sum(-1).mean()))
                top.append(float((ref.argmax(-1) == got.argmax(-1)).float().mean()))
        return sum(kls) / len(kls), sum(top) / len(top)

    h = hadamard(refs[0][0][0][0].shape[-1], torch.float32)
    if args.layers:
        per_layer(run, refs, h, adapter, args)
        return
    rows = []
    for name, spec in VARIANTS.items():
        kf, vf = variant(spec, adapter.rotary, h)
        kl, top1 = run(kf, vf, "kv")
        kl_k, top1_k = run(kf, vf, "k")
        kl_v, top1_v = run(kf, vf, "v")
        row = {"variant": name, "spec": spec, "bits": bits(spec), "kl": kl, "top1": top1, "kl_keys": kl_k,
               "top1_keys": top1_k, "kl_values": kl_v, "top1_values": top1_v}  # fmt: skip
        rows.append(row)
        print(f"  {name:<30} {row['bits']:.2f} bits  KL {kl:.5f}  top1 {top1:.4f}  K only {kl_k:.5f}  V only "
              f"{kl_v:.5f}", flush=True)  # fmt: skip
        bl.write_result("int4h_variants", params=vars(args), rows=rows, notes={"text": "tuning (demo articles)"})


def per_layer(run, refs, h, adapter, args) -> None:
    """``--layers`` (module docstring): per-layer KL of int4h's keys and values, then mixed precision."""
    int4h = dict(had=1, vhad=1, kb=4, kg=32, kax="chan", vb=4, vg=64)
    kf, vf = variant(int4h, adapter.rotary, h)
    kf8, vf8 = variant(dict(int4h, kb=8, vb=8), adapter.rotary, h)
    n = len(refs[0][0])
    layers = []
    for j in range(n):
        kl_k, _ = run(kf, vf, "k", klayers={j: kf})
        kl_v, _ = run(kf, vf, "v", vlayers={j: vf})
        err_k = sum(float((kf(kv[j][0][:, 4:], 4) - kv[j][0][:, 4:]).square().sum(-1).mean()) for kv, _, _ in refs)
        err_v = sum(float((vf(kv[j][1][:, 4:], 4) - kv[j][1][:, 4:]).square().sum(-1).mean()) for kv, _, _ in refs)
        layers.append({"layer": j, "kl_keys": kl_k, "kl_values": kl_v, "err_keys": err_k / len(refs),
                       "err_values": err_v / len(refs)})  # fmt: skip
        print(f"  layer {j:2d}  K only {kl_k:.5f}  V only {kl_v:.5f}  K err {err_k / len(refs):.4f}", flush=True)
    chosen_on = layers
    if args.text == "prose":  # the layers ranked on the tuning text, never on this one
        import json

        chosen_on = json.loads(open(args.ranking).read())["notes"]["layers"]
    by_k = [r["layer"] for r in sorted(chosen_on, key=lambda r: -r["kl_keys"])]
    by_v = [r["layer"] for r in sorted(chosen_on, key=lambda r: -r["kl_values"])]
    rows = []
    for name, ks, vs in [("int4h", [], [])] + [
        (f"int4h, 8-bit keys of top {k}", by_k[:k], []) for k in (1, 2, 3, 4, 6)
    ] + [(f"int4h, 8-bit values of top {k}", [], by_v[:k]) for k in (1, 2)] + [
        ("int4h, 8-bit keys and values of top 1", by_k[:1], by_v[:1]),
        ("int4h, 8-bit keys of top 2 and values of top 1", by_k[:2], by_v[:1]),
    ]:  # fmt: skip
        kmap = {j: (kf8 if j in ks else kf) for j in range(n)}
        vmap = {j: (vf8 if j in vs else vf) for j in range(n)}
        kl, top1 = run(kf, vf, "kv", klayers=kmap, vlayers=vmap)
        kl_k, _ = run(kf, vf, "k", klayers=kmap)
        kl_v, _ = run(kf, vf, "v", vlayers=vmap)
        nb = (bits(int4h) * 2 * n + 4 * (len(ks) + len(vs))) / (2 * n)
        rows.append({"variant": name, "keys8": ks, "values8": vs, "bits": nb, "kl": kl, "top1": top1,
                     "kl_keys": kl_k, "kl_values": kl_v})  # fmt: skip
        print(f"  {name:<46} {nb:.3f} bits  KL {kl:.5f}  top1 {top1:.4f}  K {kl_k:.5f}  V {kl_v:.5f}", flush=True)
        text = "tuning (demo articles)" if args.text == "tuning" else "prose (held out; layers ranked on tuning)"
        stem = "int4h_layers" if args.text == "tuning" else "int4h_layers_prose"
        bl.write_result(stem, params=vars(args), rows=rows, notes={"text": text, "layers": layers})


if __name__ == "__main__":
    main()
