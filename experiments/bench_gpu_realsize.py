"""The GPU suite: an 8B model's stored contexts against recomputing them, on one CUDA GPU.

A Llama-3.1-8B-shaped model (32 layers, hidden 4096, 32 query / 8 KV heads, head_dim 128,
intermediate 14,336, vocabulary 128,256; ``bench_realsize.config_of``) with random weights built
on the device (nothing is downloaded; timings do not depend on the weights' values), bfloat16,
SDPA, batch 1, random context ids, a fixed 23-token question, first token; stores in LMDB on the
local disk (512-token chunks); the device synchronized around every clock read. Per context length
(``--contexts``, default 4k / 16k / 32k):

* what ``bench_realsize.run_config`` measures: ``recompute`` (prefill + question step), ``floor``
  (the question step on the KV already in GPU buffers), ``stored:CODEC`` (``greedy_sample`` from a
  warm store, TTFT), ``load:CODEC`` (the load alone into buffers allocated once, through the
  handle's staging ring: GB/s of KV), ``copy-layers-from-host``, ``memcpy-flat``, ``h2d-pinned``
  and ``h2d-pageable`` (one host-to-device copy of as many bytes: the copy engine's limit);
  ``x_floor`` and ``speedup_vs_recompute`` on every row. Codecs: ``raw``, the default
  ``zstd-split:1:16`` and ``int8`` (``--codecs``);
* ``cold:CODEC``: the stored TTFT with the page cache dropped before each run (``echo 3 >
  /proc/sys/vm/drop_caches``; recorded as not permitted where it is not; not with ``--tiny``
  unless ``--drop-caches``);
* ``build:CODEC``: ``Adapter.build`` of the context into an empty store, seconds and
  ``x_recompute`` (at the longest context only, ``--build-at``);
* ``build-press:PRESS``: ``build --press PRESS`` over the context stored with the default codec,
  and ``stored-press:PRESS``: the TTFT answering from those pressed entries (``--press-at``);
* ``decode-step:eager`` / ``decode-step:compiled``: ms per decode step from a stored context
  (the fastest of ``--repeats`` runs answering ``1 + --decode-steps`` tokens, less the fastest
  answering one, per step; ``compile=True``; not with ``--tiny`` unless ``--compile``).

``--tiny`` rehearses the whole protocol on any machine (CPU here): a tiny Llama shape (2 layers,
hidden 128, 4 / 2 heads, head_dim 32, vocabulary 1,024), short contexts, 2 repeats; it writes
``gpu_realsize_rehearsal`` with ``"rehearsal": true`` in its notes: its timings are a check that the
suite runs, not GPU figures.

Commands (from the repository root; the suites ``gpu_realsize`` (needs a CUDA GPU, <= 5 minutes on
one H100) and ``gpu_realsize_rehearsal``: ``python -m experiments run gpu_realsize`` writes
experiments/results/; run by hand it writes to cache/bench/raw/)::

    python -m experiments run gpu_realsize              # an H100 / H200
    python -m experiments run gpu_realsize_rehearsal    # anywhere, ~1 minute: --tiny
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import shutil

import bench_realsize as rs
import torch

import benchlib as bl

TINY = dict(contexts="1024,2048", repeats=2, recompute_repeats=2, decode_steps=16)


def tiny_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=1024, hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=8192,
                       rope_theta=500000.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)  # fmt: skip


def build_model(tiny: bool, device: torch.device):
    """The suite's model in bfloat16 on ``device``, random weights built there: ``(model, params)``."""
    from transformers import AutoModelForCausalLM

    if not tiny:
        return rs.build_model("llama-3.1-8b", torch.bfloat16, device)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.bfloat16, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    return model, sum(p.numel() for p in model.parameters())


def drop_page_cache() -> str | None:
    """Drop the page cache; the reason it could not be, or None."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError as exc:
        return f"not permitted ({exc.strerror or exc})"
    return None


def extra_rows(adapter, n: int, args, scratch, base: dict, recompute_s: float) -> tuple[list[dict], dict]:
    """Cold reads, builds, the pressed store and decode steps at context length ``n``."""
    from kvstore.model.io import chains
    from kvstore.model.options import BuildOptions
    from kvstore.store.codecs import DEFAULT_CODEC
    from kvstore.store.kvstore import KVStore

    dev = adapter.device
    vocab = adapter.model.config.vocab_size
    ctx = bl.synthetic_ids(n, seed=1000 + n, vocab=vocab)  # run_config's context and question
    q_ids = bl.synthetic_ids(bl.QUESTION_TOKENS, seed=7, vocab=vocab)
    rows: list[dict] = []
    notes: dict = {}

    def add(method: str, runs: list[float], **extra) -> None:
        r = rs.row(base, method, runs, **extra)
        r["speedup_vs_recompute"] = recompute_s / r["median_s"]
        rows.append(r)
        print(f"   {method:<28} {bl.fmt_s(r['median_s']):>10} (min {bl.fmt_s(r['min_s'])}, max {bl.fmt_s(r['max_s'])})"
              f"  {r['speedup_vs_recompute']:6.2f}x vs recompute", flush=True)  # fmt: skip

    def answer(store, tokens: int = 1, **kw):
        return lambda: adapter.greedy_sample([ctx], [q_ids], tokens, store=store, batch_size=1, stop_at_eos=False, **kw)

    build_here = n in _ints(args.build_at) if args.build_at else n == max(_ints(args.contexts))
    press_here = n in _ints(args.press_at) if args.press_at else n == max(_ints(args.contexts))
    stores = {}
    layers = None if build_here else adapter.prefill([ctx])[0]
    for codec in args.codecs.split(","):
        store = KVStore(str(scratch / f"extra-{n}-{codec.replace(':', '')}"), codec=codec, sync=False)
        stores[codec] = store
        if layers is not None:  # filled from one prefill, as run_config fills its stores (no build timed here)
            plan = adapter.chain(ctx, store)
            for entry in chains.chunk_entries(adapter.handle, plan, layers):
                store.put(entry)
            store.put_context(plan.key, plan.keys, n)
            continue
        with bl.timed() as t:
            adapter.build([ctx], store, BuildOptions(batch_size=1))
            rs.sync(dev)
        add(f"build:{codec}", [t.seconds], x_recompute=t.seconds / recompute_s)
    del layers
    for codec, store in stores.items():
        cold: list[float] = []
        for _ in range(min(args.repeats, 3) if args.drop_caches else 0):
            why = drop_page_cache()
            if why is not None:
                notes["cold"] = why
                break
            cold += rs.timed(answer(store), 1, dev, warmup=0)
        if cold:
            add(f"cold:{codec}", cold)
    if press_here and args.press:
        store = stores.get(DEFAULT_CODEC) or next(iter(stores.values()))
        with bl.timed() as t:
            adapter.build([ctx], store, BuildOptions(batch_size=1, presses=(args.press,)))
            rs.sync(dev)
        add(f"build-press:{args.press}", [t.seconds], x_recompute=t.seconds / recompute_s, codec=store.codec.spec)
        add(f"stored-press:{args.press}", rs.timed(answer(store, press=args.press), args.repeats, dev),
            codec=store.codec.spec)  # fmt: skip
    store = stores.get("raw") or next(iter(stores.values()))
    steps = args.decode_steps
    for mode, compiled in (("eager", False), ("compiled", True))[: 2 if args.compile else 1]:
        try:
            one = rs.timed(answer(store, compile=compiled), args.repeats, dev)
            more = rs.timed(answer(store, 1 + steps, compile=compiled), args.repeats, dev)
        except Exception as exc:  # noqa: BLE001 - a compiler missing on the machine: recorded, not fatal
            notes[f"decode_{mode}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            continue
        per_step = (min(more) - min(one)) / steps  # the least disturbed runs: a difference of two timings
        rows.append({**base, "method": f"decode-step:{mode}", "median_s": per_step, "steps": steps,
                     "one_token_runs_s": one, "more_tokens_runs_s": more})  # fmt: skip
        print(f"   decode-step:{mode:<16} {per_step * 1e3:8.2f} ms per step", flush=True)
    for s in stores.values():
        s.close()
    return rows, notes


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    cuda = torch.cuda.is_available()
    p = bl.parser(__doc__, threads=(os.cpu_count() or 1) if cuda else bl.THREADS, quick=False)
    p.add_argument("--tiny", action="store_true", help="rehearse on any device: a tiny shape, short contexts")
    p.add_argument("--contexts", default="4096,16384,32768")
    p.add_argument("--codecs", default="raw,zstd-split:1:16,int8")
    p.add_argument("--press", default="kvzip:0.75")
    p.add_argument("--build-at", default="", help="context lengths whose builds are timed (default: the longest)")
    p.add_argument("--press-at", default="16384", help="context lengths whose pressed store is built and timed")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--recompute-repeats", type=int, default=3)
    p.add_argument("--recompute-budget-s", type=float, default=30.0)
    p.add_argument("--decode-steps", type=int, default=16)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="time compiled decode steps too (default: yes, but not with --tiny)")  # fmt: skip
    p.add_argument("--drop-caches", action=argparse.BooleanOptionalAction, default=None,
                   help="time cold reads, dropping the page cache (default: yes, but not with --tiny)")  # fmt: skip
    args = bl.start(p)
    if args.compile is None:
        args.compile = not args.tiny  # torch.compile of a CPU model takes minutes of a rehearsal's two
    if args.drop_caches is None:
        args.drop_caches = not args.tiny  # a rehearsal on a shared machine leaves its page cache alone
    if args.tiny:
        for k, v in TINY.items():
            setattr(args, k, v)
        args.press_at = ""
    elif not cuda:
        raise SystemExit("gpu_realsize needs a CUDA GPU; rehearse it anywhere with --tiny (gpu_realsize_rehearsal)")
    dev = torch.device("cuda" if cuda else "cpu")
    from kvstore.model.adapter import Adapter

    stem = "gpu_realsize_rehearsal" if args.tiny else "gpu_realsize"
    shape = "tiny-llama" if args.tiny else "llama-3.1-8b"
    notes: dict = {"rehearsal": bool(args.tiny), "device": torch.cuda.get_device_name(dev) if cuda else "cpu"}
    if args.tiny:
        notes["what"] = "a rehearsal of the protocol at a tiny shape: not GPU figures"
    scratch = bl.SCRATCH / stem
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    rows: list[dict] = []
    model, params = build_model(args.tiny, dev)
    adapter = Adapter(model, rs.word_tokenizer(), name=f"{shape}-random", fingerprint=f"gpu-realsize-{shape}")
    adapter.prefill([list(range(100, 164))])  # warm up
    try:
        for n in _ints(args.contexts):
            ns = argparse.Namespace(**vars(args))
            got = rs.run_config(adapter, shape, params, "bfloat16", n, ns, scratch)
            rows += got
            base = {k: got[0][k] for k in ("shape", "params", "dtype", "context_tokens", "device", "kv_bytes")}
            recompute_s = next(r["median_s"] for r in got if r["method"] == "recompute")
            more, found = extra_rows(adapter, n, args, scratch, base, recompute_s)
            rows += more
            notes |= {f"{k}_{n}": v for k, v in found.items()}
            bl.write_result(stem, params=vars(args), rows=rows, notes=notes)  # rewritten after every length
            shutil.rmtree(scratch, ignore_errors=True)
            scratch.mkdir(parents=True)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
