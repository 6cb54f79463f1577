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
    ids = adapter.tokenizer.encode(tuning_text(), add_special_tokens=False)
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

    def run(kf, vf, which):
        kls, top = [], []
        with torch.inference_mode():
            for kv, ref, w in refs:
                cache = DynamicCache()
                for j, (k, v) in enumerate(kv):
                    k2, v2 = k.clone(), v.clone()
                    if "k" in which:
                        k2[:, 4:] = kf(k[:, 4:], 4)
                    if "v" in which:
                        v2[:, 4:] = vf(v[:, 4:], 4)
                    cache.update(k2[None], v2[None], j)
                got = model(input_ids=w[:, args.context :], past_key_values=cache).logits[0].float().log_softmax(-1)
                kls.append(float((ref.exp() * (ref - got)).sum(-1).mean()))
                top.append(float((ref.argmax(-1) == got.argmax(-1)).float().mean()))
        return sum(kls) / len(kls), sum(top) / len(top)

    h = hadamard(refs[0][0][0][0].shape[-1], torch.float32)
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


if __name__ == "__main__":
    main()
