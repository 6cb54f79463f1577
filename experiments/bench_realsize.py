"""Time to first token at real model sizes: stored load vs recompute vs the in-memory floor.

Models are built from configs with random weights (nothing is downloaded; timings do not depend
on the weights' values), shaped like

* ``pythia-1b``: GPT-NeoX, 16 layers, hidden 2048, 8 heads (head_dim 256), rotary_pct 0.25,
  intermediate 8192, vocabulary 50,304;
* ``llama-3.2-1b``: Llama, 16 layers, hidden 2048, 32 query / 8 KV heads, head_dim 64,
  intermediate 8192, vocabulary 128,256, tied embeddings, rope_theta 500,000;
* ``llama-3.1-8b``: Llama, 32 layers, hidden 4096, 32 query / 8 KV heads, intermediate 14,336,
  vocabulary 128,256, rope_theta 500,000 (run only where CUDA is available).

Tokenizer-free: contexts are random token ids (fixed seeds) and the question is 23 fixed ids; a
one-token word-level tokenizer only supplies the pad/eos ids the adapter asks for. Per model,
dtype (float32, bfloat16) and context length, batch 1, one first token:

* ``recompute``: what a miss costs: ``adapter.prefill`` of the context, then the question step on
  its KV (the floor's call) and the first token. Its first run also fills the stores and the
  floor; more runs while ``--recompute-repeats`` and ``--recompute-budget-s`` allow;
* ``floor``: the question step on the context's KV already in preallocated buffers (no load);
* ``stored:CODEC``: ``greedy_sample(store=...)`` on a warm LMDB store holding the context's chain
  (512-token chunks) in that codec: plan, load into the batch buffers, question, first token;
* ``load:CODEC``: ``kvstore.model.stages.load.load_prefix`` alone into batch buffers allocated once (what the stored
  path moves), next to ``memcpy``: the same KV copied from memory into the same buffers
  (one copy per layer and role) and ``memcpy-flat`` (one contiguous copy of as many bytes);
* CUDA only: ``h2d-pinned`` / ``h2d-pageable``: one host-to-device copy of as many bytes from
  pinned / ordinary host memory, measured in the same run (the physical limit of a load).

The stores are filled from the first recompute run's KV (the same chunk entries
``generate_kv_cache`` writes), so a configuration costs its recompute runs and little else. Every timing is a
median with min and max over its repeats; the load average is recorded before and after each
configuration (the CPU machine is shared with other jobs). ``realsize.json`` is rewritten after every
configuration, so an interrupted run keeps what it measured.

Commands (from the repository root; the suite ``realsize``: ``python -m experiments run realsize
[ARGS]`` writes experiments/results/; run by hand it writes to cache/bench/raw/)::

    nohup .venv/bin/python experiments/bench_realsize.py > cache/realsize.log 2>&1 &   # CPU: 1B, 2k+4k
    python experiments/bench_realsize.py --contexts 2048,4096,8192,16384,32768 --shapes all  # CUDA
    .venv/bin/python experiments/bench_realsize.py --quick   # smoke test: tiny contexts, 1 repeat
"""

from __future__ import annotations

import gc
import os
import shutil
import statistics
from pathlib import Path

import torch

import benchlib as bl

CPU_SHAPES = ("pythia-1b", "llama-3.2-1b")
CODECS = ("zstd-shuffle:1", "raw")


def config_of(shape: str):
    """The transformers config of a named shape (random weights come from its init)."""
    from transformers import GPTNeoXConfig, LlamaConfig

    if shape == "pythia-1b":
        return GPTNeoXConfig(
            vocab_size=50304, hidden_size=2048, num_hidden_layers=16, num_attention_heads=8, intermediate_size=8192,
            rotary_pct=0.25, max_position_embeddings=32768, use_parallel_residual=True, tie_word_embeddings=False,
        )  # fmt: skip
    common = dict(
        vocab_size=128256, num_attention_heads=32, num_key_value_heads=8, head_dim=None, rms_norm_eps=1e-5,
        max_position_embeddings=131072, rope_theta=500000.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
    )  # fmt: skip
    if shape == "llama-3.2-1b":
        return LlamaConfig(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192, tie_word_embeddings=True,
                           **{**common, "head_dim": 64})  # fmt: skip
    if shape == "llama-3.1-8b":
        return LlamaConfig(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, tie_word_embeddings=False,
                           **{**common, "head_dim": 128})  # fmt: skip
    raise SystemExit(f"unknown shape {shape!r}")


def build_model(shape: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    config = config_of(shape)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    t = bl.timed()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    model.eval().requires_grad_(False)
    params = sum(p.numel() for p in model.parameters())
    print(f"{shape} {dtype}: {params / 1e9:.2f}B parameters built in {t.elapsed():.1f} s", flush=True)
    return model, params


def word_tokenizer():
    """A one-token tokenizer: the benchmark passes token ids, the adapter only needs pad/eos."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))
    tok.add_special_tokens({"eos_token": "<unk>", "pad_token": "<unk>"})
    return tok


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, n: int, device: torch.device, warmup: int = 1) -> list[float]:
    """Seconds of ``n`` calls after ``warmup`` untimed ones; the device is synchronized around
    every clock read; GC off while timing."""
    for _ in range(warmup):
        fn()
    sync(device)
    out = []
    for _ in range(n):
        gc.collect()
        gc.disable()
        try:
            sync(device)
            with bl.timed() as t:
                fn()
                sync(device)
            out.append(t.seconds)
        finally:
            gc.enable()
    return out


def row(base: dict, method: str, runs: list[float], **extra) -> dict:
    s = bl.summarize(runs)
    return {**base, "method": method, "runs_s": runs, "median_s": s["median"], "min_s": s["min"], "max_s": s["max"],
            **extra}  # fmt: skip


def h2d(nbytes: int, device: torch.device, n: int) -> dict[str, list[float]]:
    """Host-to-device copies of ``nbytes`` from pinned and from pageable memory (seconds each)."""
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, pinned in (("h2d-pinned", True), ("h2d-pageable", False)):
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
        src.fill_(3)
        out[name] = timed(lambda: dst.copy_(src, non_blocking=pinned), n, device, warmup=2)
    return out


def run_config(adapter, shape: str, params: int, dname: str, n: int, args, scratch: Path) -> list[dict]:
    from kvstore.model.compute.cache import new_buffers
    from kvstore.model.io import chains
    from kvstore.model.stages.load import load_prefix
    from kvstore.store.kvstore import KVStore

    dev = adapter.device
    vocab = adapter.model.config.vocab_size
    ctx = bl.synthetic_ids(n, seed=1000 + n, vocab=vocab)
    q_ids = bl.synthetic_ids(bl.QUESTION_TOKENS, seed=7, vocab=vocab)
    kv_bytes = adapter.kv_bytes_per_token() * n
    base = {"shape": shape, "params": params, "dtype": dname, "context_tokens": n, "device": dev.type,
            "kv_bytes": kv_bytes, "load_before": bl.loadavg()}  # fmt: skip
    rows: list[dict] = []
    print(f"-- {shape} {dname} {n} tokens: KV {kv_bytes / 1e6:.0f} MB; load {base['load_before']}", flush=True)

    first: dict[str, int] = {}
    floor_bufs = new_buffers(adapter.kv_shapes(), 1, n + len(q_ids) + 1, adapter.dtype, dev)
    floor_fn = _floor(adapter, floor_bufs, n, q_ids, first)

    def recompute_fn():
        """What a miss costs: prefill the context, then the question step on its KV."""
        kv = adapter.prefill([ctx])[0]
        for (kb, vb), (k, v) in zip(floor_bufs, kv):
            kb[0, :, :n].copy_(k)
            vb[0, :, :n].copy_(v)
        floor_fn()
        first["recompute"] = first["floor"]
        return kv

    # the first recompute run also gives the KV the floor and the stores start from
    sync(dev)
    with bl.timed() as t:
        layers = recompute_fn()
        sync(dev)
    recompute_runs = [t.seconds]
    while len(recompute_runs) < args.recompute_repeats and sum(recompute_runs) < args.recompute_budget_s:
        recompute_runs += timed(recompute_fn, 1, dev, warmup=0)
    rows.append(row(base, "recompute", recompute_runs))
    recompute_first = first["recompute"]
    rows.append(row(base, "floor", timed(floor_fn, args.repeats, dev)))  # floor_bufs hold the context's KV

    stores = {}
    for codec in args.codecs.split(","):
        store = KVStore(str(scratch / f"{shape}-{dname}-{n}-{codec.replace(':', '')}"), codec=codec, sync=False)
        plan = adapter.chain(ctx, store)
        for entry in chains.chunk_entries(adapter.handle, plan, layers):
            store.put(entry)
        store.put_context(plan.key, plan.keys, n)
        stores[codec] = (store, plan)
        stored = sum(h[1] for h in (store.peek_header(k) for k in plan.keys) if h is not None)

        def stored_fn(store=store, codec=codec):
            out = adapter.greedy_sample([ctx], [q_ids], 1, store=store, batch_size=1, stop_at_eos=False)
            first[f"stored:{codec}"] = int(out[0, 0])

        rows.append(row(base, f"stored:{codec}", timed(stored_fn, args.repeats, dev), stored_bytes=stored))

    # load throughput: the stored path's copies vs memcpy of the same bytes into the same buffers
    bufs = new_buffers(adapter.kv_shapes(), 1, n + len(q_ids) + 1, adapter.dtype, dev)
    for codec, (store, plan) in stores.items():

        def load_fn(store=store, plan=plan):
            from kvstore.model.io.ring import Ring
            from kvstore.model.io.staging import Staging

            staging = Staging(dev, ring=Ring.of(adapter.handle, dev))  # the slots every load of the model reuses
            got = load_prefix(adapter.handle, store, plan, bufs, 0, 0, staging=staging)
            staging.finish()
            assert got == n, f"loaded {got} of {n} tokens"

        runs = timed(load_fn, args.repeats, dev)
        rows.append(row(base, f"load:{codec}", runs, gb_per_s=kv_bytes / statistics.median(runs) / 1e9))
    host_layers = [(k.to("cpu"), v.to("cpu")) for k, v in layers] if dev.type == "cuda" else layers

    def memcpy_fn():
        for (kb, vb), (k, v) in zip(bufs, host_layers):
            kb[0, :, :n].copy_(k)
            vb[0, :, :n].copy_(v)

    runs = timed(memcpy_fn, args.repeats, dev)
    rows.append(row(base, "memcpy" if dev.type == "cpu" else "copy-layers-from-host", runs,
                    gb_per_s=kv_bytes / statistics.median(runs) / 1e9))  # fmt: skip
    src = torch.empty(kv_bytes, dtype=torch.uint8)
    src.fill_(7)
    dst = torch.empty_like(src)
    dst.fill_(0)
    runs = timed(lambda: dst.copy_(src), args.repeats, torch.device("cpu"), warmup=2)
    rows.append(row(base, "memcpy-flat", runs, gb_per_s=kv_bytes / statistics.median(runs) / 1e9))
    if dev.type == "cuda":
        for name, runs in h2d(kv_bytes, dev, max(args.repeats, 5)).items():
            rows.append(row(base, name, runs, gb_per_s=kv_bytes / statistics.median(runs) / 1e9))

    first["recompute"] = recompute_first

    for store, _ in stores.values():
        store.close()
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    by = {r["method"]: r for r in rows}
    after = bl.loadavg()
    for r in rows:
        r["load_after"] = after
        r["x_floor"] = r["median_s"] / by["floor"]["median_s"]
        r["speedup_vs_recompute"] = by["recompute"]["median_s"] / r["median_s"]
    for r in rows:
        r["first_tokens"] = dict(first)
        extra = f"  {r['gb_per_s']:.2f} GB/s" if "gb_per_s" in r else ""
        print(f"   {r['method']:<22} {bl.fmt_s(r['median_s']):>10} (min {bl.fmt_s(r['min_s'])}, max "
              f"{bl.fmt_s(r['max_s'])})  {r['x_floor']:6.2f}x floor  {r['speedup_vs_recompute']:6.2f}x vs recompute"
              f"{extra}", flush=True)  # fmt: skip
    return rows


def _floor(adapter, bufs, n: int, q_ids: list[int], first: dict):
    from kvstore.model.compute.attention import grouped_kv
    from kvstore.model.compute.cache import PreallocatedCache

    dev = adapter.device
    Q = len(q_ids)
    mask = torch.ones((1, n + Q), dtype=torch.long, device=dev)
    pos = torch.arange(n, n + Q, device=dev)[None]
    ids = torch.tensor([q_ids], device=dev)

    @torch.inference_mode()
    def run() -> None:
        with grouped_kv():
            cache = PreallocatedCache(bufs, n)
            out = adapter.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                                use_cache=True, logits_to_keep=1)  # fmt: skip
        first["floor"] = int(out.logits[0, -1].argmax())

    return run


def main() -> None:
    cuda = torch.cuda.is_available()
    p = bl.parser(__doc__, threads=(os.cpu_count() or 1) if cuda else bl.THREADS)  # CUDA: torch's own CPU threads
    p.add_argument("--shapes", default=",".join(CPU_SHAPES), help="comma list, or 'all' (8B only with CUDA)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--contexts", default="2048,4096")
    p.add_argument("--codecs", default=",".join(CODECS))
    p.add_argument("--repeats", type=int, default=5, help="repeats of floor, stored and load timings")
    p.add_argument("--recompute-repeats", type=int, default=3)
    p.add_argument(
        "--recompute-budget-s",
        type=float,
        default=400.0,
        help="stop repeating recompute after 2 runs once they took this long together",
    )
    args = bl.start(p, quick=dict(contexts="256,512", repeats=1, recompute_repeats=1))
    dev = torch.device("cuda" if cuda else "cpu")
    shapes = list(CPU_SHAPES) + ["llama-3.1-8b"] if args.shapes == "all" else args.shapes.split(",")
    skipped = []
    if "llama-3.1-8b" in shapes and not cuda:
        shapes.remove("llama-3.1-8b")
        skipped.append("llama-3.1-8b: defined, run only where CUDA is available")
    from kvstore.model.adapter import Adapter

    notes = {"shared_machine_note": "CPU runs share the machine with other jobs: see load_*", "skipped": skipped}
    rows: list[dict] = []
    scratch = bl.SCRATCH / "realsize"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    tok = word_tokenizer()
    try:
        for n in [int(x) for x in args.contexts.split(",")]:
            for shape in shapes:
                model, params = build_model(shape, torch.float32, dev)
                for dname in args.dtypes.split(","):
                    model.to(getattr(torch, dname))  # in place: the same random weights, rounded
                    adapter = Adapter(model, tok, name=f"{shape}-random", fingerprint=f"realsize-{shape}-{dname}")
                    adapter.prefill([list(range(100, 164))])  # warm up: the first recompute run is not the first call
                    rows += run_config(adapter, shape, params, dname, n, args, scratch)
                    bl.write_result("realsize", params=vars(args), rows=rows, notes=notes)  # the GPU named by benchlib
                    shutil.rmtree(scratch, ignore_errors=True)
                    scratch.mkdir(parents=True)
                    del adapter
                del model
                gc.collect()
                if cuda:
                    torch.cuda.empty_cache()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
