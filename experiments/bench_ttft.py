"""Time to first token vs context length: recompute, kvstore, the ways people do it today, and the floor.

For each context length (random token ids, fixed seed) and one fixed 23-token question, every
method produces the first answer token, batch 1, fp32 SmolLM2-135M-Instruct (bundled), 2 threads:

* ``recompute``       - ``adapter.greedy_sample([ctx], [q], 1, use_cache=False)``: prefill + question.
* ``kvstore:<codec>`` - ``adapter.greedy_sample([ctx], [q], 1, use_cache=True, store=store)`` on a
  warm LMDB store holding the context: open + verify + decode the entry, copy it into the
  Adapter's padded buffers, question forward, first token.
* ``pickle``          - ``torch.load(f, weights_only=False)`` of a pickled ``DynamicCache``, forward.
* ``pt``              - one ``.pt`` per context holding a tuple of per-layer ``(k, v)``
  (``torch.load(weights_only=True)``, what the research Adapter did) -> ``DynamicCache`` -> forward.
* ``safetensors``     - one safetensors file per context (``load_file``) -> ``DynamicCache`` -> forward.
* ``kvstore:<codec> v1`` - the same through a format-1 entry (one whole-context entry, as phase 1
  wrote it; written with ``tests/helpers/entries.encode_v1``), which this kvstore still answers from.
* ``kvstore:<codec> chunk=<c>`` (``--chunk-sweep``, at the lengths in ``--sweep-lengths``): stores
  with ``c``-token chunks, to measure the per-chunk overhead of format 2's chains.
* ``floor``           - the question forward alone, on a cache already in memory in the same
  preallocated buffers kvstore decodes into, with kvstore's grouped-KV attention
  (``floor-dynamic``: on a ``DynamicCache`` already in memory, transformers' own path).

Every method also reports its pieces (``load``: everything before the model call, ``forward``: the
model call). Methods run round-robin within each repeat, so drift in the machine's load hits them
alike; one untimed run of each warms the page cache first. Files live under ``cache/bench/ttft``.

Command (from the repository root; the suite ``ttft``: ``python -m experiments run ttft [ARGS]``
writes experiments/results/; run by hand it writes to cache/bench/raw/)::

    .venv/bin/python experiments/bench_ttft.py                 # full: 256..4096 tokens, 5 repeats
    .venv/bin/python experiments/bench_ttft.py --chunk-sweep   # + chunk sizes 64..2048 at 2048 tokens
    .venv/bin/python experiments/bench_ttft.py --quick         # smoke test: 256/512, 2 repeats
    .venv/bin/python experiments/bench_ttft.py --dtype bfloat16   # ttft_bfloat16.* (the suite ttft_bf16)

The suite ``ttft_codecs`` runs it per lossless codec (``--codecs ... --no-v1 --out ttft_codecs``).
"""

from __future__ import annotations

import shutil
import time

import torch

import benchlib as bl

DEFAULT_LENGTHS = (256, 512, 1024, 2048, 4096)
DEFAULT_CODECS = ("raw", "zstd-shuffle:1")
SWEEP_CHUNKS = (64, 128, 256, 512, 1024, 2048)


class ForwardTimer:
    """Wraps ``model.forward`` to add up the seconds spent in it (the Adapter calls the model
    once per ``greedy_sample`` with one new token, plus nothing else once warm)."""

    def __init__(self, model):
        self.model, self.orig, self.seconds, self.calls = model, model.forward, 0.0, 0

        def timed(*args, **kwargs):
            t = bl.timed()
            try:
                return self.orig(*args, **kwargs)
            finally:
                self.seconds += t.elapsed()
                self.calls += 1

        model.forward = timed

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0

    def close(self) -> None:
        del self.model.forward  # back to the class's method


@torch.inference_mode()
def question_forward(model, cache, past: int, q_ids: list[int]) -> int:
    """The question step of the peers: explicit positions after ``past`` cached tokens."""
    ids = torch.tensor([q_ids])
    pos = torch.arange(past, past + len(q_ids))[None]
    out = model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return int(out.logits[0, -1].argmax())


def run_length(
    adapter,
    n: int,
    q_ids: list[int],
    stores: dict,
    scratch,
    repeats: int,
    recompute_repeats: int,
    v1_stores: dict | None = None,
) -> list[dict]:
    from safetensors.torch import load_file, save_file
    from transformers import DynamicCache

    from helpers.entries import encode_v1
    from kvstore.model.io.chains import plan
    from kvstore.store.keys import cache_key
    from kvstore.store.kvstore import KVStore

    model = adapter.model
    ctx = bl.synthetic_ids(n, seed=1000 + n)
    layers = tuple((k.contiguous().clone(), v.contiguous().clone()) for k, v in adapter.prefill([ctx])[0])
    built: dict[int, KVStore] = {}  # chunk size -> the store prefilled for it
    for store in stores.values():
        source = built.get(store.chunk_tokens)
        if source is None:  # a chain of the store's chunk size
            adapter.generate_kv_cache([ctx], store, batch_size=1)
            built[store.chunk_tokens] = store
            continue
        # the same chain re-encoded with this store's codec (what `kvstore sync --codec` does): the
        # same entries as a prefill would write, without one more prefill per codec
        p = plan(adapter, ctx, chunk_tokens=store.chunk_tokens)
        for key in p.keys:
            entry = source.get(key)
            assert entry is not None
            store.put(entry)
        store.put_context(p.key, p.keys, len(ctx))
    v1_key = cache_key(adapter.fingerprint, adapter.dtype, ctx)
    for spec, store in (v1_stores or {}).items():
        blob = encode_v1(layers, spec, ctx, v1_key, time.time(), adapter.fingerprint, adapter.name)
        store.put_bytes(v1_key, blob)
    f_pickle = scratch / f"ctx{n}.pickle.pt"
    f_pt = scratch / f"ctx{n}.pt"
    f_st = scratch / f"ctx{n}.safetensors"
    torch.save(DynamicCache([(k[None], v[None]) for k, v in layers]), f_pickle)
    torch.save(tuple((k, v) for k, v in layers), f_pt)
    save_file({f"layers.{i}.{w}": t for i, kv in enumerate(layers) for w, t in zip(("keys", "values"), kv)}, f_st)
    ft = ForwardTimer(model)

    def via_adapter(**kw):
        def fn():
            ft.reset()
            with bl.timed() as t:
                res = adapter.greedy_sample([ctx], [q_ids], 1, batch_size=1, return_details=True, **kw)
            total = t.seconds
            if kw.get("use_cache") and not res.cache_hit[0]:
                raise SystemExit(f"{n} tokens: expected a cache hit ({kw})")
            return int(res.tokens[0, 0]), {"total": total, "load": total - ft.seconds, "forward": ft.seconds}

        return fn

    def via_dynamic(load):
        def fn():
            ft.reset()
            t = bl.timed()
            cache = load()
            loaded = t.lap()
            tok = question_forward(model, cache, n, q_ids)
            forward = t.lap()
            return tok, {"total": loaded + forward, "load": loaded, "forward": forward}

        return fn

    def load_pickle():
        return torch.load(f_pickle, weights_only=False)

    def load_pt():
        return DynamicCache([(k[None], v[None]) for k, v in torch.load(f_pt, weights_only=True)])

    def load_st():
        d = load_file(f_st)
        return DynamicCache([(d[f"layers.{i}.keys"][None], d[f"layers.{i}.values"][None]) for i in range(len(layers))])

    run_floor = bl.floor(adapter, layers, q_ids)

    def floor():
        tok, t = run_floor()
        return tok, {"total": t, "load": 0.0, "forward": t}

    def floor_dynamic():
        cache = DynamicCache([(k[None], v[None]) for k, v in layers])  # untimed
        with bl.timed() as t:
            tok = question_forward(model, cache, n, q_ids)
        return tok, {"total": t.seconds, "load": 0.0, "forward": t.seconds}

    methods = {"recompute": via_adapter(use_cache=False)}
    for name, store in stores.items():
        methods[f"kvstore:{name}"] = via_adapter(use_cache=True, store=store)
    for spec, store in (v1_stores or {}).items():
        methods[f"kvstore:{spec} v1"] = via_adapter(use_cache=True, store=store)
    methods |= {
        "pickle": via_dynamic(load_pickle),
        "pt": via_dynamic(load_pt),
        "safetensors": via_dynamic(load_st),
        "floor": floor,
        "floor-dynamic": floor_dynamic,
    }
    first = {name: fn()[0] for name, fn in methods.items()}  # warm-up (page cache, lazy init)
    tokens = {name: [tok] for name, tok in first.items()}
    times: dict[str, list[dict]] = {name: [] for name in methods}
    for r in range(repeats):
        for name, fn in methods.items():
            if name == "recompute" and r >= recompute_repeats:
                continue
            tok, t = fn()
            tokens[name].append(tok)
            first[name] = tok if first[name] == tok else -1
            times[name].append(t)
    ft.close()
    rows = []
    ref = first["recompute"]
    for name, ts in times.items():
        row = {
            "context_tokens": n,
            "method": name,
            "kv_mib": round(sum(2 * k.numel() * k.element_size() for k, _ in layers) / 2**20, 1),
        }
        for piece in ("total", "load", "forward"):
            s = bl.summarize([t[piece] for t in ts])
            row |= {f"{piece}_median_s": s["median"]}
            if piece == "total":
                row |= {
                    "total_min_s": s["min"],
                    "total_max_s": s["max"],
                    "total_q1_s": s["q1"],
                    "total_q3_s": s["q3"],
                    "n": s["n"],
                }
        row["first_token"] = first[name]
        row["tokens"] = tokens[name]  # every run's first token, the warm-up first
        row["same_token_as_recompute"] = first[name] == ref
        rows.append(row)
    by = {r["method"]: r for r in rows}
    for r in rows:
        r["speedup_vs_recompute"] = by["recompute"]["total_median_s"] / r["total_median_s"]
        r["x_floor"] = r["total_median_s"] / by["floor"]["total_median_s"]
    for f in (f_pickle, f_pt, f_st):
        f.unlink()
    return rows


def _style(m: str) -> dict:
    if m.startswith("floor"):
        return {"linestyle": "--"}
    if "+" in m:
        return {"linestyle": "-.", "marker": "x"}
    if m.startswith("kvstore") or m == "recompute":
        return {"linestyle": "-", "marker": "o"}
    return {"linestyle": ":", "marker": "s"}


def plot(rows: list[dict], path, threads: int, dtype: str = "float32") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = list(dict.fromkeys(r["method"] for r in rows))
    colors = {m: plt.get_cmap("tab20")(i % 20) for i, m in enumerate(methods)}
    fig, (a1, a2, a3) = plt.subplots(1, 3, figsize=(18, 5.5), gridspec_kw={"width_ratios": [1, 1, 1.1]})
    for m in methods:
        rs = [r for r in rows if r["method"] == m]
        xs = [r["context_tokens"] for r in rs]
        st = {"marker": "o"} | _style(m)
        a1.errorbar(
            xs,
            [r["total_median_s"] for r in rs],
            yerr=[
                [r["total_median_s"] - r["total_min_s"] for r in rs],
                [r["total_max_s"] - r["total_median_s"] for r in rs],
            ],
            capsize=3,
            label=m,
            color=colors[m],
            **st,
        )
        if m != "recompute":
            a2.plot(xs, [r["speedup_vs_recompute"] for r in rs], label=m, color=colors[m], **st)
    for a in (a1, a2):
        a.set_xscale("log", base=2)
        a.set_yscale("log")
        a.set_xlabel("context tokens")
        a.grid(True, which="both", alpha=0.3)
    a1.set_ylabel("time to first token (s): median, bars min-max")
    a1.set_title("TTFT, 23-token question, batch 1")
    a2.set_ylabel("speed-up vs recompute (x)")
    a2.set_title("Speed-up over recomputing the context")
    a2.scatter([2048, 4096], [20, 45], marker="*", s=150, color="k", zorder=5, label="target, default codec")
    a2.scatter([2048], [40], marker="*", s=150, facecolor="none", edgecolor="k", zorder=5, label="stretch")
    a1.legend(fontsize=7)
    a2.legend(fontsize=7)
    n = max(r["context_tokens"] for r in rows)
    rs = [r for r in rows if r["context_tokens"] == n and r["method"] != "recompute"]
    ys = range(len(rs))
    a3.barh(ys, [r["load_median_s"] * 1e3 for r in rs], color="tab:orange", label="load (before the model call)")
    a3.barh(
        ys,
        [r["forward_median_s"] * 1e3 for r in rs],
        left=[r["load_median_s"] * 1e3 for r in rs],
        color="tab:blue",
        label="question forward",
    )
    a3.set_yticks(list(ys), [r["method"] for r in rs], fontsize=8)
    a3.invert_yaxis()
    a3.set_xlabel("ms (medians of the pieces)")
    a3.set_title(f"Where the time goes at {n} tokens")
    a3.legend(fontsize=8)
    a3.grid(True, axis="x", alpha=0.3)
    fig.suptitle(f"SmolLM2-135M-Instruct {dtype} on CPU ({threads} threads)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = bl.parser(__doc__)
    p.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)))
    p.add_argument("--codecs", default=",".join(DEFAULT_CODECS), help="store codecs to compare (comma-separated)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--recompute-repeats", type=int, default=5, help="repeats for the (slow) recompute row")
    p.add_argument("--no-v1", action="store_true", help="skip the format-1 entry rows")
    p.add_argument("--chunk-sweep", action="store_true", help="add stores with other chunk sizes (SWEEP_CHUNKS)")
    p.add_argument("--sweep-lengths", default="2048", help="context lengths that get the chunk-size rows")
    p.add_argument("--dtype", default="float32", help="model and KV dtype (not float32: results to ttft_<dtype>.*)")
    p.add_argument("--out", default="", help="results file stem (default: ttft, or ttft_<dtype>)")
    args = bl.start(p, quick=dict(lengths="256,512", repeats=2, recompute_repeats=2, sweep_lengths="512"))
    args.recompute_repeats = min(args.recompute_repeats, args.repeats)
    bl.use_test_helpers()  # helpers.entries.encode_v1 writes the format-1 entries
    lengths = [int(x) for x in args.lengths.split(",")]
    adapter = bl.load_adapter(args.dtype)
    from kvstore.store.kvstore import KVStore

    scratch = bl.SCRATCH / "ttft"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    q_ids = bl.synthetic_ids(bl.QUESTION_TOKENS, seed=7)
    codecs = args.codecs.split(",")
    stores = {c: KVStore(str(scratch / f"store-{c.replace(':', '')}"), codec=c, sync=False) for c in codecs}
    v1_stores = {} if args.no_v1 else {c: KVStore(str(scratch / f"v1-{c.replace(':', '')}"), codec=c, sync=False)
                                       for c in codecs}  # fmt: skip
    sweep = {}
    if args.chunk_sweep:
        from kvstore.store.codecs import DEFAULT_CODEC as default

        for c in SWEEP_CHUNKS:
            sweep[f"{default} chunk={c}"] = KVStore(
                str(scratch / f"chunk{c}"), codec=default, chunk_tokens=c, sync=False
            )
    sweep_lengths = {int(x) for x in args.sweep_lengths.split(",")}
    rows = []
    try:
        for n in lengths:
            t = bl.timed()
            rs = run_length(
                adapter,
                n,
                q_ids,
                stores | (sweep if n in sweep_lengths else {}),
                scratch,
                args.repeats,
                args.recompute_repeats,
                v1_stores,
            )
            rows += rs
            print(f"{n} tokens ({t.elapsed():.0f} s, load {bl.loadavg()}):")
            for r in rs:
                print(
                    f"  {r['method']:<22} {bl.fmt_s(r['total_median_s']):>10}  (load "
                    f"{bl.fmt_s(r['load_median_s'])}, forward "
                    f"{bl.fmt_s(r['forward_median_s'])})  {r['speedup_vs_recompute']:6.1f}x  {r['x_floor']:5.2f}x floor"
                    f"{'' if r['same_token_as_recompute'] else '  DIFFERENT TOKEN'}",
                    flush=True,
                )
    finally:
        for s in (stores | v1_stores | sweep).values():
            s.close()
        shutil.rmtree(scratch, ignore_errors=True)
    stem = args.out or "ttft" + ("" if args.dtype == "float32" else f"_{args.dtype}")
    notes = {"chunk_sweep": sorted(sweep_lengths) if sweep else []}
    bl.write_result(stem, params=vars(args) | {"question_tokens": len(q_ids)}, rows=rows, notes=notes)
    plot(rows, bl.RESULTS / f"{stem}.png", torch.get_num_threads(), args.dtype)


if __name__ == "__main__":
    main()
