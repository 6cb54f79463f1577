"""How much undoing RoPE narrows the per-channel key ranges int4/int4r quantize, on real SmolLM2 KV.

For one ~1.3k-token context (the first of ``bench_quant.py``'s ``long`` set, chat template), every
layer's keys are cut into groups of G tokens (after the 4 sink tokens), and for each head and
channel the range (max - min) over a group is taken after RoPE (what ``int4``/``int8`` quantize) and
before it (what ``int4r``/``int8r`` quantize, un-rotated by ``kvstore.store.codecs.prerope``). A
4-bit step is range / 15, so the ratio of the summed ranges is the ratio of the mean steps.
Reported per G: the summed pre/post range ratio over all layers, heads, channels and groups, the
same for the rotated channel pairs split by how far they turn over G tokens (``inv_freq * G``
below or above pi/2), and those pairs' share of the post-RoPE range.

Command (from the repository root; the suite ``prerope_ranges``: ``python -m experiments run
prerope_ranges`` writes experiments/results/; run by hand it writes to cache/bench/raw/)::

    .venv/bin/python experiments/prerope_ranges.py
"""

from __future__ import annotations

import math

import torch

import benchlib as bl
from benchlib import question_sets

SINK = 4


def main() -> None:
    bl.start(bl.parser(__doc__, threads=1, quick=False))
    from kvstore.data.prompts import PromptFormat
    from kvstore.model.pipelines.build import prefill
    from kvstore.store.codecs.prerope import rotate

    adapter = bl.load_adapter("float32")
    fmt = PromptFormat.from_chat_template(adapter.tokenizer)
    rotary = adapter.rotary
    assert rotary is not None
    context = question_sets()["long"][0]["context"]
    ids = adapter.encode_context(fmt.context_part(context), special_tokens=fmt.add_special_tokens)
    layers = prefill(adapter, [ids])[0]
    freqs = torch.tensor(rotary.inv_freq, dtype=torch.float64)
    h = rotary.dim // 2
    rows = []
    for g in (32, 128):
        fast = torch.cat([freqs * g > math.pi / 2] * 2)  # per rotated channel: turns more than pi/2 per group
        post_sum = pre_sum = 0.0
        part = {"slow": [0.0, 0.0], "fast": [0.0, 0.0]}
        for k, _ in layers:
            post = k.double()[:, SINK:]
            pre = rotate(k.double(), rotary, 0, inverse=True)[:, SINK:]
            n = (post.shape[1] // g) * g
            r_post = post[:, :n].unflatten(1, (n // g, g))
            r_pre = pre[:, :n].unflatten(1, (n // g, g))
            r_post = (r_post.amax(2) - r_post.amin(2)).sum(dim=(0, 1))  # per channel
            r_pre = (r_pre.amax(2) - r_pre.amin(2)).sum(dim=(0, 1))
            post_sum += float(r_post.sum())
            pre_sum += float(r_pre.sum())
            for name, sel in (("slow", ~fast), ("fast", fast)):
                part[name][0] += float(r_post[: 2 * h][sel].sum())
                part[name][1] += float(r_pre[: 2 * h][sel].sum())
        rows.append({
            "group_tokens": g,
            "context_tokens": len(ids),
            "pre_over_post_range": pre_sum / post_sum,
            "fast_pairs": int(fast.sum()) // 2,
            "slow_pairs": int((~fast).sum()) // 2,
            "fast_share_of_post_range": part["fast"][0] / post_sum,
            "fast_pre_over_post": part["fast"][1] / part["fast"][0] if part["fast"][0] else None,
            "slow_pre_over_post": part["slow"][1] / part["slow"][0] if part["slow"][0] else None,
        })  # fmt: skip
        print(rows[-1], flush=True)
    bl.write_result("prerope_ranges", params={"sink_tokens": SINK}, rows=rows)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    main()
