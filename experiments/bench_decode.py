"""Decode throughput: static shapes and torch.compile, Hugging Face beside kvstore.

Every row answers the same ``--batch`` questions (real demo questions) about ``--batch`` distinct
contexts of ``--context-tokens`` tokens each (consecutive slices of the demo articles), with the
bundled SmolLM2-135M-Instruct (float32, sdpa) and exactly ``--new-tokens`` greedy tokens per row
(no stop at EOS, so every row decodes as long). Rows:

* ``hf-dynamic``: ``model.generate`` with its default ``DynamicCache`` (prefill included);
* ``hf-static``: ``generate(cache_implementation="static")``;
* ``hf-static+compile``: the same with the forward compiled by ``generate`` itself
  (``CompileConfig``; on CPU it must be asked for);
* ``no-cache``: ``Adapter.greedy_sample(use_cache=False)``: kvstore's reference path (prefill of
  context + question, then its decode loop);
* ``kvstore``: ``greedy_sample`` from a warm store holding the contexts (eager decode steps);
* ``kvstore+static``: the same with fixed-shape steps, eager (:mod:`kvstore.model.compute.static`);
* ``kvstore+compile``: ``greedy_sample(compile=True)`` (``sample --compile``).

Each repeat runs every row once, round-robin, after one untimed warm-up run per row (which pays
compilation; its wall time is reported as ``first_s``). ``tok_per_s`` counts generated tokens
(batch x new tokens) over the wall time of the whole call (prefill or load included). Each row also
runs once per repeat with one new token; ``step_ms`` = (wall - that) / (new tokens - 1) is the
decode step alone. ``identical``: rows of the batch whose tokens equal ``hf-dynamic``'s.

Command (from the repository root; the suite ``decode``: ``python -m experiments run decode [ARGS]``
writes experiments/results/; run by hand it writes to cache/bench/raw/):

    .venv/bin/python experiments/bench_decode.py                   # batch 1 and 8, 200 tokens, 3 repeats
    .venv/bin/python experiments/bench_decode.py --quick           # smoke test: 24 tokens, 1 repeat
"""

from __future__ import annotations

import json
import shutil

import torch

import benchlib as bl

ROWS = ("hf-dynamic", "hf-static", "hf-static+compile", "no-cache", "kvstore", "kvstore+static", "kvstore+compile")


def main() -> None:
    p = bl.parser(__doc__)
    p.add_argument("--batches", default="1,8")
    p.add_argument("--context-tokens", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--out", default="decode", help="results file stem")
    args = bl.start(p, quick=dict(new_tokens=24, repeats=1, context_tokens=128))
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import CompileConfig

    from kvstore.store.kvstore import KVStore

    adapter = bl.load_adapter()
    model, tok = adapter.model, adapter.tokenizer
    model.generation_config.eos_token_id = None  # generate fills an unset eos from here; rows never stop
    batches = [int(b) for b in args.batches.split(",")]
    rows = args.rows.split(",")
    B_max, C, N = max(batches), args.context_tokens, args.new_tokens
    text_ids = bl.real_context_ids(tok, B_max * C)
    contexts = [text_ids[i * C : (i + 1) * C] for i in range(B_max)]
    questions = [json.loads(line)["question"] for line in (bl.HERE / "data" / "demo.jsonl").open()][:B_max]
    q_ids = [adapter.encode_question(q) for q in questions]
    root = bl.SCRATCH / "decode"
    shutil.rmtree(root, ignore_errors=True)
    store = KVStore(root / "store")
    adapter.generate_kv_cache(contexts, store=store)

    def hf(batch: int, n: int, cache: str | None, compiled: bool):
        prompts = [c + q for c, q in zip(contexts[:batch], q_ids[:batch])]
        L = max(len(x) for x in prompts)
        ids = torch.full((batch, L), adapter.pad_id, dtype=torch.long)
        mask = torch.zeros((batch, L), dtype=torch.long)
        for r, x in enumerate(prompts):
            ids[r, L - len(x) :] = torch.tensor(x)
            mask[r, L - len(x) :] = 1
        cfg = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=adapter.pad_id)
        kw = {}
        if cache:
            kw["cache_implementation"] = cache
        if compiled:
            cc = CompileConfig()
            cc._compile_all_devices = True  # generate compiles on accelerators only unless told
            kw["compile_config"] = cc
        else:
            cfg.disable_compile = True
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg, **kw)
        return out[:, L:]

    def ours(batch: int, n: int, use_cache: bool, steps: str):
        r = adapter.sample(
            contexts[:batch], q_ids[:batch], num_new_tokens=n, use_cache=use_cache, store=store if use_cache else None,
            batch_size=batch, stop_at_eos=False, steps=steps,
        )  # fmt: skip
        return r.tokens

    runners = {
        "hf-dynamic": lambda b, n: hf(b, n, None, False),
        "hf-static": lambda b, n: hf(b, n, "static", False),
        "hf-static+compile": lambda b, n: hf(b, n, "static", True),
        "no-cache": lambda b, n: ours(b, n, False, "dynamic"),
        "kvstore": lambda b, n: ours(b, n, True, "dynamic"),
        "kvstore+static": lambda b, n: ours(b, n, True, "static"),
        "kvstore+compile": lambda b, n: ours(b, n, True, "compiled"),
    }
    results = []
    for batch in batches:
        first: dict[str, float] = {}
        ref = None
        tokens: dict[str, torch.Tensor] = {}
        for name in rows:  # warm-up (compiles what compiles), untimed
            with bl.timed() as t:
                tokens[name] = runners[name](batch, N)
            first[name] = t.seconds
            runners[name](batch, 1)
            print(f"batch {batch} {name}: first run {first[name]:.1f} s", flush=True)
        ref = tokens.get("hf-dynamic")
        walls: dict[str, list[float]] = {k: [] for k in rows}
        ones: dict[str, list[float]] = {k: [] for k in rows}
        for rep in range(args.repeats):
            for name in rows:
                with bl.timed() as t:
                    got = runners[name](batch, N)
                walls[name].append(t.seconds)
                with bl.timed() as t:
                    runners[name](batch, 1)
                ones[name].append(t.seconds)
                if not torch.equal(got, tokens[name]):
                    print(f"  note: {name} gave other tokens in repeat {rep}")
            print(f"batch {batch} repeat {rep + 1}: " + ", ".join(f"{k} {walls[k][-1]:.2f}s" for k in rows), flush=True)
        for name in rows:
            w, o = bl.summarize(walls[name]), bl.summarize(ones[name])
            steps_ms = [(a - b) / (N - 1) * 1e3 for a, b in zip(walls[name], ones[name])]
            same = None if ref is None else sum(torch.equal(ref[r], tokens[name][r]) for r in range(batch))
            results.append({
                "batch": batch, "row": name, "context_tokens": C, "new_tokens": N,
                "tok_per_s": batch * N / w["median"], "tok_per_s_min": batch * N / w["max"],
                "tok_per_s_max": batch * N / w["min"],
                "wall_s": w["median"], "wall_s_min": w["min"], "wall_s_max": w["max"],
                "one_token_s": o["median"], "step_ms": sorted(steps_ms)[len(steps_ms) // 2],
                "step_ms_min": min(steps_ms), "step_ms_max": max(steps_ms),
                "first_s": first[name], "compile_s": max(0.0, first[name] - w["median"]),
                "identical": same, "n": w["n"], "walls": walls[name],
            })  # fmt: skip
    bl.write_result(args.out, params=vars(args), rows=results, notes={"rss_mib": bl.rss_mib()})
    print(bl.md_table(
        [[r["batch"], r["row"], f"{r['tok_per_s']:.1f} ({r['tok_per_s_min']:.1f}-{r['tok_per_s_max']:.1f})",
          f"{r['step_ms']:.1f}", f"{r['compile_s']:.1f}", f"{r['identical']}/{r['batch']}"] for r in results],
        ["batch", "row", "tokens/s median (min-max)", "step ms", "compile s", "identical"],
    ))  # fmt: skip
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
