"""Contexts composed of stored passages (``sample --compose``): quality, accuracy and time to first
token per policy against the full prefill, and the bytes of a passage store against a prefix-chain
store of the same rows.

Data: ``--rows`` rows spread evenly over ``experiments/data/multidoc.jsonl`` (each demo question with its
gold article among 3 distractor articles, shuffled), the bundled SmolLM2-135M-Instruct in float32
on CPU, the chat template and the default prompt (what ``kvstore sample`` uses), greedy answers.

Per policy (``--policies``; ``full`` is the full prefill, the exact reference):

* **quality** (:func:`kvstore.model.compose.quality.compose_quality`, the ``kvstore quality
  --compose`` machinery, on the same prompt): next-token KL and top-1 against ``full`` over
  ``--new-tokens`` teacher-forced answer tokens, rows whose greedy answer equals ``full``'s over all
  of them, mean common prefix, the share of passage tokens recomputed;
* **accuracy**: each policy's greedy answer (up to EOS, first line) scored with ``sample``'s
  lenient match against the dataset's answers (and its containment match);
* **time to first token**: ``Adapter.sample`` of one row, one new token, from the passage store
  (warm: every passage and the head stored, the files read once before): min, median and max over
  the rows; ``full`` is the full prefill of the row without a cache; ``prefix`` is a plain
  ``sample`` from the prefix-chain store (the exact stored path, for scale).

Bytes: the passage store (each distinct passage once, and the head) and the prefix-chain store
(``build`` of the rows' composed ids), stored payload bytes of their chunks; how many distinct
passages the rows use, how many times each appears (``k``), and their token lengths.

Command (from the repository root; the suite ``compose``: ``python -m experiments run compose``
writes experiments/results/compose.json; run by hand it writes to cache/bench/raw/)::

    nice -n 5 .venv/bin/python experiments/bench_compose.py --rows 16 --threads 1
    .venv/bin/python experiments/bench_compose.py --quick    # 2 rows, 4 new tokens
"""

from __future__ import annotations

import json
import shutil
import statistics

import benchlib as bl

POLICIES = ("full", "none", "last:64", "blend:0.15", "blend:0.3")


def spread(xs: list[float]) -> dict:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def stored_bytes(store) -> int:
    return sum(e.stored_bytes for e in store.scan().entries)


def main() -> None:
    ap = bl.parser(__doc__, threads=1)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--stem", default="compose")
    args = bl.start(ap, {"rows": 2, "new_tokens": 4})
    from kvstore.data.metrics import clean_prediction, contains_match, lenient_match
    from kvstore.data.prompts import DEFAULT_TEMPLATE, PromptFormat
    from kvstore.model.compose.quality import compose_quality
    from kvstore.model.compose.rows import compose_inputs
    from kvstore.model.compose.spec import SEPARATOR
    from kvstore.model.io.chains import Keying
    from kvstore.store.kvstore import KVStore

    data = [json.loads(line) for line in (bl.HERE / "data" / "multidoc.jsonl").read_text().splitlines()]
    data = [data[i * len(data) // args.rows] for i in range(min(args.rows, len(data)))]  # spread over the articles
    contexts, questions = [r["context"] for r in data], [r["question"] for r in data]
    policies = args.policies.split(",")
    adapter = bl.load_adapter("float32")
    handle = adapter.handle
    prompt = PromptFormat.from_chat_template(adapter.tokenizer, DEFAULT_TEMPLATE, None)
    composed = compose_inputs(handle, prompt, contexts, questions, Keying())
    assert composed is not None and composed.questions is not None
    q_ids = [handle.encode_question(q) for q in composed.questions]
    distinct = list(dict.fromkeys(t for c in contexts for t in c))
    lengths = [len(handle.encode_context(t + SEPARATOR, special_tokens=False)) for t in distinct]
    uses = [sum(t in c for c in contexts) for t in distinct]
    notes: dict = {
        "passages_distinct": len(distinct), "passage_slots": sum(len(c) for c in contexts),
        "passage_tokens": spread(lengths), "appearances_k": spread(uses) | {"mean": statistics.mean(uses)},
        "head_tokens": len(composed.rows[0].head), "composed_tokens": spread([len(r.ids) for r in composed.rows]),
        "question_tokens": spread([len(q) for q in q_ids]),
    }  # fmt: skip
    print(f"{len(data)} rows, {len(distinct)} distinct passages ({notes['passage_tokens']} tokens), "
          f"load {bl.loadavg()}", flush=True)  # fmt: skip

    # the stores: each passage once (a composed sample stores what it lacks) and the prefix chains
    root = bl.SCRATCH / "compose"
    shutil.rmtree(root, ignore_errors=True)
    passages, prefix = KVStore(root / "passages"), KVStore(root / "prefix")
    kw = dict(prompt=prompt, num_new_tokens=1)
    with bl.timed() as t:
        adapter.sample(contexts, questions, store=passages, compose="none", **kw)
        notes["passage_store_build_s"] = t.lap()
        adapter.build(contexts, prefix, prompt=prompt)
        notes["prefix_store_build_s"] = t.lap()
    records = [passages.context(k) for k in passages.context_keys()]
    notes["passage_records"] = sum(1 for r in records if r is not None and r.passage)
    notes["passage_store_bytes"], notes["prefix_store_bytes"] = stored_bytes(passages), stored_bytes(prefix)
    notes["bytes_ratio"] = notes["passage_store_bytes"] / notes["prefix_store_bytes"]
    print(f"  bytes: passages {notes['passage_store_bytes']:,} prefix {notes['prefix_store_bytes']:,} "
          f"({notes['bytes_ratio']:.3f}; 1/k {1 / notes['appearances_k']['mean']:.3f})", flush=True)  # fmt: skip

    # time to first token, row by row, the stores warm (read once above and once here first)
    ttft: dict[str, list[float]] = {p: [] for p in [*policies, "prefix"]}
    for name in ttft:
        store = prefix if name == "prefix" else passages
        opts = {} if name == "prefix" else {"compose": name}
        adapter.sample(contexts[:1], questions[:1], store=store, **opts, **kw)  # warm-up
        for c, q in zip(contexts, questions):
            with bl.timed() as t:
                got = adapter.sample([c], [q], store=store, **opts, **kw)
            ttft[name].append(t.seconds)
            assert name in ("full", "prefix") or all(got.cache_hit)
        print(f"  ttft {name:<11} median {statistics.median(ttft[name]):.3f} s", flush=True)
    notes["ttft_per_row"] = ttft

    # quality and accuracy against full, on the same prompt
    with bl.timed() as t:
        gate = compose_quality(adapter, composed.rows, q_ids, policies, new_tokens=args.new_tokens)
        notes["quality_s"] = t.lap()
    full_ttft = statistics.median(ttft["full"])
    rows = []
    for q in gate:
        preds = [clean_prediction(adapter.decode(a)) for a in q.answers]
        correct = [lenient_match(p, r["answers"]) for p, r in zip(preds, data)]
        contains = [contains_match(p, r["answers"]) for p, r in zip(preds, data)]
        rec = {k: v for k, v in q.record().items()}
        rec |= {"accuracy": statistics.mean(correct), "contains": statistics.mean(contains),
                "ttft_s": spread(ttft[q.compose]), "ttft_vs_full": statistics.median(ttft[q.compose]) / full_ttft,
                "predictions": preds}  # fmt: skip
        rows.append(rec)
        print(f"  {q.compose:<11} KL {q.kl:.4f} top1 {q.top1:.3f} identical {q.identical}/{q.rows} acc "
              f"{rec['accuracy']:.3f} contains {rec['contains']:.3f} ttft x{rec['ttft_vs_full']:.2f}",
              flush=True)  # fmt: skip
    rows.append({"compose": "prefix", "ttft_s": spread(ttft["prefix"]),
                 "ttft_vs_full": statistics.median(ttft["prefix"]) / full_ttft})  # fmt: skip
    passages.close()
    prefix.close()
    bl.write_result(args.stem, params=vars(args), rows=rows, notes=notes)


if __name__ == "__main__":
    main()
