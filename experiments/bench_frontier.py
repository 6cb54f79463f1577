"""The size/quality frontier of stored caches: bytes on disk per context token against quality, for
dense caches under every codec and for pressed caches, alone and stacked with int8 and 4-bit codecs.

The bundled SmolLM2-135M-Instruct (float32, CPU, sdpa). Points:

* **dense** under ``zstd-split:1:16`` (lossless, the default), ``int8``, ``int4``, ``int4r``, ``ecq`` and ``int4h``;
* **pressed**: ``kvzip``, ``expected_attention``, ``snapkv:adakv`` (AdaKV over SnapKV), ``snapkv``,
  ``knorm`` and ``streaming_llm`` at the ratios 0.25, 0.5, 0.75 and 0.875, each stored alone (lossless)
  and stacked with ``int8``, ``int4`` and ``int4h`` (``kvstore build --press SPEC --codec C``: the kept tokens
  stored with the codec).

For each codec a fresh store holds the dense caches of the contexts and every pressed cache
(``Adapter.build(..., presses=...)``, each context's scores computed once and shared by the ratios);
a point's bytes are its entries' stored bytes (the dense chains, or the pressed entries) over the
contexts' tokens. Quality, three ways:

(a) **the long QA set** (``benchlib.question_sets()["long"]``: 5 contexts of ~1.3k tokens, 71 questions,
    the chat template): every context compressed once, without the question, and every question
    answered from the stored entries (SCBench's multi-request protocol), 12 greedy tokens: ``contains``
    (an accepted answer in the output) and ``rows_identical`` to the lossless dense answers;
(c) **next-token distributions on text none of these was tuned on**: prose from the Python standard
    library's own documentation (the docstrings of a fixed list of modules, classes and functions,
    joined: ``prose_rows``), 3 windows of ``--prose-context`` tokens each followed by ``--prose-tokens``
    tokens scored teacher-forced (``Adapter.score_sweep`` with a generation context recording the
    logits): the mean KL divergence ``KL(dense || variant)`` and the top-1 agreement of each scored
    token's next-token distribution against the lossless dense one (as llama.cpp reports KV
    quantization damage);
(b) RULER ``niah_single_1`` and ``ruler_vt`` at 4k through lm-eval is ``bench_press_ruler.py``
    (``--stem press_ruler_frontier``), on a subset of these points (its invocations are ~1 min each).

Performance (timings, never tests): per codec the build's seconds (dense, and the scores and pressed
entries apart); for ``kvzip:0.75`` against dense (lossless, and kvzip:0.75 + int8) over the long
set's contexts: the bytes a load reads (the entries' stored bytes), the time to first token (batch 1,
one question, ``--repeats`` runs: min/median/max), and a decode step's time (32 tokens after the first, in
each of ``--repeats`` runs: min/median/max). The
break-even number of questions per context: what storing a pressed cache costs (its scoring forward
and encoding, per context) against what each question answered from it saves (a prefill of the
context).

Command (from the repository root; the suite ``frontier``: ``python -m experiments run frontier
[ARGS]`` writes ``frontier.json`` into experiments/results/ and ``frontier.png`` into docs/img/; run by
hand it writes to cache/bench/raw/)::

    .venv/bin/python experiments/bench_frontier.py
    .venv/bin/python experiments/bench_frontier.py --quick   # 1 context, kvzip and knorm at 0.5, lossless and int8
    .venv/bin/python experiments/bench_frontier.py --perf-only experiments/results/frontier.json  # timings again
"""

from __future__ import annotations

import contextlib
import math
import shutil
from pathlib import Path

import benchlib as bl

WORK = bl.SCRATCH / "frontier"
PRESSES = ("kvzip", "expected_attention", "snapkv:adakv", "snapkv", "knorm", "streaming_llm")
RATIOS = (0.25, 0.5, 0.75, 0.875)
STACKS = ("zstd-split:1:16", "int8", "int4", "int4h")  # codecs pressed caches are stored with
DENSE = ("zstd-split:1:16", "int8", "int4", "int4r", "ecq", "int4h")  # codecs of the dense points
N_NEW = 12
# documentation prose from the standard library: none of kvstore's codecs or presses was tuned on it
PROSE_SOURCES = (
    "argparse", "asyncio", "collections", "contextlib", "dataclasses", "decimal", "difflib", "email",
    "enum", "fractions", "functools", "heapq", "inspect", "ipaddress", "itertools", "json", "logging",
    "pathlib", "pickle", "random", "re", "shutil", "sqlite3", "statistics", "string", "subprocess",
    "tarfile", "tempfile", "textwrap", "threading", "timeit", "typing", "unittest", "urllib.parse",
    "uuid", "warnings", "weakref", "zipfile",
)  # fmt: skip


def prose_text(sources: tuple[str, ...] = PROSE_SOURCES) -> str:
    """The docstrings of the modules ``sources`` (default: the ones above) and of their public
    classes and functions, in a fixed order, joined by blank lines."""
    import importlib
    import inspect

    parts: list[str] = []
    for name in sources:
        mod = importlib.import_module(name)
        docs = [inspect.getdoc(mod)]
        for attr in sorted(dir(mod)):
            if attr.startswith("_"):
                continue
            obj = getattr(mod, attr, None)
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", "") == mod.__name__:
                docs.append(inspect.getdoc(obj))
        parts += [d.strip() for d in docs if d and len(d) > 200]
    return "\n\n".join(parts)


def prose_rows(adapter, n: int, context: int, scored: int) -> tuple[list[list[int]], list[list[int]]]:
    """``n`` windows of the prose's tokens: ``context`` tokens, then the ``scored`` tokens after them."""
    ids = adapter.tokenizer.encode(prose_text(), add_special_tokens=False)
    size = context + scored
    if len(ids) < n * size:
        raise SystemExit(f"the prose has {len(ids)} tokens, fewer than {n} x {size}")
    step = len(ids) // n
    return [ids[i * step : i * step + context] for i in range(n)], [
        ids[i * step + context : i * step + size] for i in range(n)
    ]


class Logits:
    """A generation context recording the logits of every scoring forward (the fed slots')."""

    def __init__(self):
        self.seen: list = []

    def __call__(self, model):
        @contextlib.contextmanager
        def recording():
            head = model.get_output_embeddings()
            hook = head.register_forward_hook(lambda m, a, out: self.seen.append(out.detach().float().cpu()))
            try:
                yield
            finally:
                hook.remove()

        return recording()


def distributions(adapter, store, contexts, conts, presses) -> dict[str, list]:
    """Per variant (``dense`` and each press), per row, the log-softmax ``[len(cont), vocab]`` of the
    scored tokens' next-token distributions (one row at a time: the recorded logits are that row's)."""
    import torch

    from kvstore.model.press.spec import parse_press
    from kvstore.model.variants.variant import make_variant

    out: dict[str, list] = {}
    for ctx, cont in zip(contexts, conts):
        recorders = {name: Logits() for name in ["dense", *presses]}
        variants = [
            make_variant(press=None if name == "dense" else parse_press(name), context=rec)
            for name, rec in recorders.items()
        ]
        adapter.score_sweep([ctx], [cont], variants=variants, store=store, batch_size=1)
        for name, rec in recorders.items():
            logits = torch.cat([x[0] for x in rec.seen], dim=0)[: len(cont)]
            out.setdefault(name, []).append(torch.log_softmax(logits.double(), dim=-1))
    return out


def damage(ref: list, got: list) -> dict:
    """Mean ``KL(ref || got)`` over every scored token and the fraction whose argmax agrees."""
    kl, agree, n = 0.0, 0, 0
    for a, b in zip(ref, got):
        kl += float((a.exp() * (a - b)).sum())
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        n += a.shape[0]
    return {"kl": kl / n, "top1_agree": agree / n, "scored_tokens": n}


def stored_bytes(store, chains, spec: str | None) -> int:
    """The stored bytes of the dense chains of ``chains`` (``spec`` None) or of their pressed entries
    under ``spec``."""
    from kvstore.model.press.spec import parse_press
    from kvstore.model.press.stored import pressed_key

    total = 0
    if spec is None:
        for c in chains:
            for key in c.keys:
                total += store.peek_header(key)[1]
        return total
    from kvstore.store.keyspace import derived_entry_key

    press = parse_press(spec)
    for c in chains:
        blob = store.backend.get(derived_entry_key(c.context_key, pressed_key(c, press, store.codec)))
        assert blob is not None, (spec, c.key)
        total += len(blob)
    return total


def ratio_of(spec: str) -> float:
    from kvstore.model.press.spec import parse_press

    return parse_press(spec).ratio


def time_first_token(adapter, store, fmt, context: str, question: str, press: str | None, repeats: int) -> dict:
    """Seconds to the first answer token (batch 1, from the store: load, question forward, one
    token), ``repeats`` runs, and a decode step's (33 tokens against 1, from the answer's own time)."""
    times, steps, first, longer = [], [], None, None
    for _ in range(repeats):
        with bl.timed() as t:
            first = adapter.sample([context], [question], store=store, prompt=fmt, press=press, num_new_tokens=1,
                                   load_ahead=False)  # fmt: skip
        times.append(t.seconds)
        longer = adapter.sample([context], [question], store=store, prompt=fmt, press=press, num_new_tokens=33,
                                stop_at_eos=False)  # fmt: skip
        steps.append((longer.decode_seconds - first.decode_seconds) / 32)  # this run's 32 steps after the first
    assert first is not None and longer is not None
    assert first.prefill_tokens_computed == 0 and first.scoring_tokens_computed == 0, "the store should answer"
    return {
        "ttft_s": bl.summarize(times),
        "ttft_runs_s": times,
        "decode_step_s": bl.summarize(steps),
        "decode_step_runs_s": steps,
        "cache_bytes": longer.cache_bytes,
    }


def main() -> None:
    ap = bl.parser(__doc__, batch_size=8)
    ap.add_argument("--presses", default=",".join(PRESSES))
    ap.add_argument("--ratios", default=",".join(map(str, RATIOS)))
    ap.add_argument("--stacks", default=",".join(STACKS))
    ap.add_argument("--dense-codecs", default=",".join(DENSE))
    ap.add_argument("--limit", type=int, default=None, help="the first N questions of the long set")
    ap.add_argument("--prose-rows", type=int, default=3)
    ap.add_argument("--prose-context", type=int, default=1200)
    ap.add_argument("--prose-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=5, help="time-to-first-token runs")
    ap.add_argument("--stem", default="frontier", help="the result's name (a subset of the points: another stem)")
    quick = dict(presses="kvzip,knorm", ratios="0.5", stacks="zstd-split:1:16,int8", dense_codecs="zstd-split:1:16",
                 limit=4, prose_rows=1, prose_context=300, prose_tokens=16, repeats=2)  # fmt: skip
    ap.add_argument(
        "--perf-only",
        metavar="RESULT",
        default=None,
        help="measure the performance part again into a copy of the result RESULT (its points kept)",
    )
    args = bl.start(ap, quick=quick)
    from kvstore.data.prompts import PromptFormat
    from kvstore.store.kvstore import KVStore

    questions = bl.question_sets()["long"][: args.limit]
    adapter = bl.load_adapter("float32")
    fmt = PromptFormat.from_chat_template(adapter.tokenizer)
    contexts = [q["context"] for q in questions]
    asked = [q["question"] for q in questions]
    distinct = sorted(set(contexts))
    if args.perf_only:
        perf_only(adapter, fmt, distinct, asked, args)
        return
    ctx_ids = [adapter.encode_context(fmt.context_part(c), special_tokens=fmt.add_special_tokens) for c in distinct]
    tokens = sum(len(x) for x in ctx_ids)
    prose_ctx, prose_cont = prose_rows(adapter, args.prose_rows, args.prose_context, args.prose_tokens)
    presses = [bl.press_spec(p, float(r)) for p in args.presses.split(",") for r in args.ratios.split(",")]
    stacks, dense_codecs = args.stacks.split(","), args.dense_codecs.split(",")
    shutil.rmtree(WORK, ignore_errors=True)
    rows: list[dict] = []
    notes: dict = {"model": "SmolLM2-135M-Instruct (bundled GGUF), float32, CPU, sdpa; chat template",
                   "contexts": len(distinct), "context_tokens": tokens, "questions": len(questions),
                   "prose": {"sources": PROSE_SOURCES, "rows": args.prose_rows, "context": args.prose_context,
                             "scored": args.prose_tokens},
                   "builds": {}, "timing": {}}  # fmt: skip
    reference = None  # lossless dense: answers and distributions every point is compared with
    answers: dict[str, list[str]] = {}
    for codec in dict.fromkeys(["zstd-split:1:16", *stacks, *dense_codecs]):
        pressed = presses if codec in stacks else []
        url = str(WORK / codec.replace(":", "_"))
        with KVStore(url, codec=codec) as store:
            with bl.timed() as t_dense:
                adapter.build(distinct, store, prompt=fmt)
                adapter.build(prose_ctx, store)
            with bl.timed() as t_press:
                built = adapter.build(distinct, store, prompt=fmt, presses=pressed) if pressed else None
                if pressed:  # scoring reads a context but its last token: the entries of those
                    adapter.build([c[:-1] for c in prose_ctx], store, presses=pressed)
            chains = [adapter.chain(x, store, prefix=fmt.head or None, special_tokens=fmt.add_special_tokens)
                      for x in ctx_ids]  # fmt: skip
            notes["builds"][codec] = {"dense_s": t_dense.seconds, "press_s": t_press.seconds,
                                      "scoring_tokens": built.scoring_tokens if built else 0}  # fmt: skip
            with bl.timed() as t:
                results = adapter.sweep(contexts, asked, variants=["dense", *pressed], store=store, prompt=fmt,
                                        num_new_tokens=N_NEW, batch_size=args.batch_size)  # fmt: skip
            sweep_s = t.seconds
            dists = distributions(adapter, store, prose_ctx, prose_cont, pressed)
            if reference is None:
                reference = (results["dense"], dists["dense"])
            for name, res in results.items():
                spec = None if name == "dense" else name
                nbytes = stored_bytes(store, chains, spec)
                label = "dense" if spec is None else bl.press_label(spec)
                texts = [adapter.decode(res.tokens[i][: res.lengths[i]]) for i in range(len(questions))]
                answers[f"{name}@{codec}"] = texts
                rows.append({
                    "point": f"{name}@{codec}", "press": label, "ratio": 0.0 if spec is None else ratio_of(spec),
                    "codec": codec, "lossy_codec": codec != "zstd-split:1:16",
                    "bytes": nbytes, "bytes_per_token": nbytes / tokens,
                    "vs_lossless_dense": None,  # filled below
                    **qa(adapter, questions, res, reference[0]),
                    **damage(reference[1], dists[name]),
                    "scoring_tokens": res.scoring_tokens_computed, "prefill_tokens": res.prefill_tokens_computed,
                    "decode_s": res.decode_seconds, "sweep_s": sweep_s,
                })  # fmt: skip
            print(f"{codec}: {len(results)} points in {sweep_s:.0f} s", flush=True)
            bl.write_result(args.stem, params=vars(args) | {"presses_": presses}, rows=rows, notes=notes)
    base = next(r["bytes"] for r in rows if r["point"] == "dense@zstd-split:1:16")
    for r in rows:
        r["vs_lossless_dense"] = r["bytes"] / base
    notes["timing"] = performance(adapter, fmt, distinct, asked, args, stacks)
    notes["break_even"] = break_even(notes)
    notes["answers"] = answers
    bl.write_result(args.stem, params=vars(args) | {"presses_": presses}, rows=rows, notes=notes)
    plot(rows, bl.RESULTS / f"{args.stem}.png")


def perf_only(adapter, fmt, distinct, asked, args) -> None:
    """The performance part alone, written into the points of an earlier full run (``--perf-only
    RESULT``): its rows kept, ``notes.timing`` and ``notes.break_even`` measured again, and where the
    points came from in ``notes.points_from``."""
    import json

    earlier = json.loads(Path(args.perf_only).read_text())
    notes = earlier["notes"] | {"points_from": {k: earlier[k] for k in ("command", "git_sha")}
                                | {"date": earlier["machine"]["date"]}}  # fmt: skip
    stacks = earlier["params"]["stacks"].split(",")
    notes["timing"] = performance(adapter, fmt, distinct, asked, args, stacks)
    notes["break_even"] = break_even(notes)
    params = earlier["params"] | {"repeats": args.repeats, "perf_only": args.perf_only}
    bl.write_result("frontier", params=params, rows=earlier["rows"], notes=notes)
    plot(earlier["rows"], bl.RESULTS / "frontier.png")


def qa(adapter, questions, res, dense) -> dict:
    from kvstore.data.metrics import answer_metrics, clean_prediction

    preds = [clean_prediction(adapter.decode(res.tokens[i][: res.lengths[i]])) for i in range(len(questions))]
    m = answer_metrics(preds, [q["answers"] for q in questions])
    same = sum(res.tokens[i, : res.lengths[i]].tolist() == dense.tokens[i, : dense.lengths[i]].tolist()
               for i in range(len(questions)))  # fmt: skip
    return {"contains": m["contains"], "accuracy": m["accuracy"], "f1": m["f1"], "rows_identical": same,
            "rows_identical_frac": same / len(questions)}  # fmt: skip


def performance(adapter, fmt, distinct, asked, args, stacks) -> dict:
    """kvzip:0.75 against dense from stores that hold only what each needs: bytes, TTFT, decode step."""
    from kvstore.store.kvstore import KVStore

    out: dict = {}
    context, question = distinct[0], asked[0]
    for label, codec, press, keep_dense in [("dense", "zstd-split:1:16", None, True),
                                            ("kvzip:0.75", "zstd-split:1:16", "kvzip:0.75", False),
                                            ("kvzip:0.75+int8", "int8", "kvzip:0.75", False)]:  # fmt: skip
        if press is not None and not any(s == codec for s in stacks):
            continue
        url = str(WORK / f"perf-{label.replace(':', '_')}")
        shutil.rmtree(url, ignore_errors=True)
        with KVStore(url, codec=codec) as store:
            with bl.timed() as t:
                built = adapter.build(distinct, store, prompt=fmt, presses=[press] if press else (), dense=keep_dense)
            out[label] = {"build_s": t.seconds, "build_tokens": built.tokens, "scoring_tokens": built.scoring_tokens,
                          "store_bytes": store.backend.disk_bytes(), "entry_bytes": built.stored_bytes +
                          built.derived_bytes}  # fmt: skip
            out[label] |= time_first_token(adapter, store, fmt, context, question, press, args.repeats)
        print(f"  {label}: {out[label]}", flush=True)
    return out


def break_even(notes: dict) -> dict:
    """Questions per context from which a stored kvzip:0.75 cache has paid for itself: its build
    (prefill, replay, encoding) against the prefill each question answered from it saves."""
    t = notes["timing"]
    if "dense" not in t or "kvzip:0.75" not in t:
        return {}
    contexts = notes["contexts"]
    prefill = t["dense"]["build_s"] / contexts  # a dense build is a prefill and a write per context
    pressed = t["kvzip:0.75"]["build_s"] / contexts
    saved = prefill - t["kvzip:0.75"]["ttft_s"]["median"]  # what a question no longer pays
    return {"prefill_s_per_context": prefill, "pressed_build_s_per_context": pressed,
            "saved_s_per_question": saved, "questions": math.ceil(pressed / saved) if saved > 0 else None}  # fmt: skip


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, metric, title in ((axes[0], "contains", "long QA: an accepted answer in the output"),
                              (axes[1], "top1_agree", "prose: next-token top-1 agreement with dense")):  # fmt: skip
        groups: dict[tuple[str, str], list] = {}
        for r in rows:
            groups.setdefault((r["press"], "" if r["press"] == "dense" else r["codec"]), []).append(r)
        presses = list(dict.fromkeys(press for press, _ in groups))
        codecs = list(dict.fromkeys(codec for _, codec in groups if codec))
        lines = ("-", "--", ":", "-.")
        for (press, codec), rs in groups.items():
            rs = sorted(rs, key=lambda r: r["bytes_per_token"])
            # a colour per press, a line style per codec: dense's points (one per codec) joined in black
            color = "black" if press == "dense" else f"C{presses.index(press) % 10}"
            style = "-" if not codec else lines[codecs.index(codec) % len(lines)]
            label = "dense, each codec" if press == "dense" else f"{press} + {codec}"
            ax.plot([r["bytes_per_token"] for r in rs], [r[metric] for r in rs], style, color=color, marker="o",
                    label=label, markersize=3)  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel("bytes on disk per context token")
        ax.set_title(title, fontsize=10)
    axes[1].legend(fontsize=6, ncol=2)
    fig.suptitle("Stored caches: size against quality (SmolLM2-135M-Instruct fp32)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
