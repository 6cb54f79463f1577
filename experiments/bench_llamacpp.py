"""llama.cpp side by side: time to first token from a saved context, same GGUF, same threads.

The bundled SmolLM2-135M-Instruct GGUF (Q4_1 weights) runs in llama.cpp through llama-cpp-python
(an optional benchmark-only peer, never a kvstore dependency: ``pip install llama-cpp-python``
builds it from source). kvstore runs the same GGUF converted to float32 safetensors (the weights
dequantized once), so the two compute with different kernels and precisions: this compares what
each tool's user gets, not the same arithmetic. For each context length (random token ids, the
same fixed seeds as ``bench_ttft.py``) and one fixed 23-token question, batch 1, 2 threads each:

* ``llama.cpp recompute``: clear the KV cache, ``eval(context + question)``, argmax of the last logits.
* ``llama.cpp state file``: ``llama_state_seq_load_file`` of a sequence state saved to a file
  (warm in the page cache) after evaluating the context, then ``eval(question)``.
* ``llama.cpp seq in memory``: ``llama_state_seq_set_data`` from a copy of the sequence state
  held in memory, then ``eval(question)``.
* ``kvstore:zstd-shuffle:1`` (the default codec before ``zstd-split:1:16``) and ``kvstore:raw``:
  ``greedy_sample`` of one row, one new token, from a warm LMDB store (load, decode into the batch
  buffers, question step).
* ``kvstore floor``: kvstore's question step alone, on a cache already in its buffers.

The KV cache is cleared (untimed) before every timed llama.cpp run, so a restore really restores,
and every timed run starts after an untimed 0.3 s pause: llama.cpp's worker threads spin after a
call and would otherwise slow whatever runs next on the 2 cores (measured: a 0.2 MB torch copy
took 31 ms instead of 0.2 ms right after llama.cpp calls).
Methods run round-robin within each repeat after one untimed warm-up each. ``state_bytes`` is the
size of llama.cpp's state file; ``stored_bytes`` kvstore's stored chain.

Command (from the repository root; needs ``pip install llama-cpp-python``; the suite ``llamacpp``:
``python -m experiments run llamacpp [ARGS]`` writes experiments/results/; run by hand it writes to
cache/bench/raw/)::

    .venv/bin/python experiments/bench_llamacpp.py                 # 256..4096 tokens, 5 repeats
    .venv/bin/python experiments/bench_llamacpp.py --quick         # 256 and 512 tokens, 2 repeats
"""

from __future__ import annotations

import ctypes
import shutil
import time
from pathlib import Path

import numpy as np

import benchlib as bl

DEFAULT_LENGTHS = (256, 1024, 2048, 4096)
SETTLE_S = 0.3  # untimed pause before every timed run


def gguf_path() -> Path:
    from kvstore.model.load.loading import bundled_gguf_path

    return bundled_gguf_path()


class LlamaCpp:
    """A llama.cpp context over the GGUF, with the three ways of reaching the first token."""

    def __init__(self, path: Path, n_ctx: int, threads: int):
        import llama_cpp

        self.lc = llama_cpp
        self.llm = llama_cpp.Llama(
            model_path=str(path), n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=threads,
            n_threads_batch=threads, logits_all=False, verbose=False,
        )  # fmt: skip
        self.ctx = self.llm._ctx.ctx
        self.n_vocab = self.llm.n_vocab()

    def clear(self) -> None:
        self.llm._ctx.kv_cache_seq_rm(-1, 0, -1)
        self.llm.n_tokens = 0

    def last_token(self) -> int:
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.n_vocab,))
        return int(logits.argmax())

    def eval(self, ids: list[int]) -> int:
        self.llm.eval(ids)
        return self.last_token()

    def save_file(self, ids: list[int], path: Path) -> int:
        self.clear()
        self.llm.eval(ids)
        toks = (self.lc.llama_token * len(ids))(*ids)
        n = self.lc.llama_state_seq_save_file(self.ctx, str(path).encode(), 0, toks, len(ids))
        if not n:
            raise SystemExit("llama_state_seq_save_file failed")
        return path.stat().st_size

    def load_file(self, path: Path, n: int) -> None:
        toks = (self.lc.llama_token * (n + 8))()
        count = ctypes.c_size_t(0)
        got = self.lc.llama_state_seq_load_file(self.ctx, str(path).encode(), 0, toks, n + 8, ctypes.byref(count))
        if not got or count.value != n:
            raise SystemExit(f"llama_state_seq_load_file failed ({got}, {count.value} tokens)")
        self.llm.n_tokens = n

    def get_seq(self, ids: list[int]) -> ctypes.Array:
        self.clear()
        self.llm.eval(ids)
        size = self.lc.llama_state_seq_get_size(self.ctx, 0)
        buf = (ctypes.c_uint8 * size)()
        if self.lc.llama_state_seq_get_data(self.ctx, buf, size, 0) != size:
            raise SystemExit("llama_state_seq_get_data failed")
        return buf

    def set_seq(self, buf: ctypes.Array, n: int) -> None:
        if self.lc.llama_state_seq_set_data(self.ctx, buf, len(buf), 0) != len(buf):
            raise SystemExit("llama_state_seq_set_data failed")
        self.llm.n_tokens = n


def run_length(n, q_ids, lcpp: LlamaCpp, adapter, stores, scratch: Path, repeats: int) -> list[dict]:
    ctx = bl.synthetic_ids(n, seed=1000 + n)
    state_file = scratch / f"state{n}.bin"
    state_bytes = lcpp.save_file(ctx, state_file)
    seq = lcpp.get_seq(ctx)
    stored = {}
    for name, store in stores.items():
        rep = adapter.generate_kv_cache([ctx], store, batch_size=1)
        stored[name] = rep.stored_bytes
    run_floor = bl.floor(adapter, adapter.prefill([ctx])[0], q_ids)

    def timed(prepare, fn):
        def run():
            prepare()
            # llama.cpp's worker threads spin for a while after a call: let them go to sleep, so
            # that no method pays for the one before it (torch's own threads included)
            time.sleep(SETTLE_S)
            with bl.timed() as t:
                tok = fn()
            return tok, t.seconds

        return run

    def recompute():
        return lcpp.eval(ctx + q_ids)

    def from_file():
        lcpp.load_file(state_file, n)
        return lcpp.eval(q_ids)

    def from_memory():
        lcpp.set_seq(seq, n)
        return lcpp.eval(q_ids)

    def via_store(store):
        def fn():
            res = adapter.greedy_sample([ctx], [q_ids], 1, batch_size=1, store=store, return_details=True)
            assert res.cache_hit[0]
            return int(res.tokens[0, 0])

        return fn

    def floor():
        return run_floor()[0]

    nothing = lambda: None  # noqa: E731
    methods = {
        "llama.cpp recompute": timed(lcpp.clear, recompute),
        "llama.cpp state file": timed(lcpp.clear, from_file),
        "llama.cpp seq in memory": timed(lcpp.clear, from_memory),
    }
    for name, store in stores.items():
        methods[f"kvstore:{name}"] = timed(nothing, via_store(store))
    methods["kvstore floor"] = timed(nothing, floor)
    first = {name: fn()[0] for name, fn in methods.items()}  # warm-up
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            tok, t = fn()
            if tok != first[name]:
                first[name] = -1
            times[name].append(t)
    rows = []
    for name, ts in times.items():
        s = bl.summarize(ts)
        row = {"context_tokens": n, "method": name, "median_s": s["median"], "min_s": s["min"], "max_s": s["max"],
               "n": s["n"], "runs_s": ts, "first_token": first[name]}  # fmt: skip
        if name.startswith("llama.cpp"):
            row["state_bytes"] = state_bytes
        elif name in (f"kvstore:{k}" for k in stores):
            row["stored_bytes"] = stored[name.removeprefix("kvstore:")]
        rows.append(row)
    by = {r["method"]: r for r in rows}
    for r in rows:
        r["vs_llamacpp_state_file"] = r["median_s"] / by["llama.cpp state file"]["median_s"]
        r["vs_llamacpp_seq_memory"] = r["median_s"] / by["llama.cpp seq in memory"]["median_s"]
        r["speedup_vs_llamacpp_recompute"] = by["llama.cpp recompute"]["median_s"] / r["median_s"]
    state_file.unlink()
    return rows


def main() -> None:
    p = bl.parser(__doc__)
    p.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)))
    p.add_argument("--repeats", type=int, default=5)
    args = bl.start(p, quick=dict(lengths="256,512", repeats=2))
    try:
        import llama_cpp
    except ImportError as exc:
        raise SystemExit("llama-cpp-python is missing: pip install llama-cpp-python (builds from source)") from exc
    lengths = [int(x) for x in args.lengths.split(",")]
    adapter = bl.load_adapter("float32")
    from kvstore.store.kvstore import KVStore

    scratch = bl.SCRATCH / "llamacpp"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    lcpp = LlamaCpp(gguf_path(), max(lengths) + 64, args.threads)
    q_ids = bl.synthetic_ids(bl.QUESTION_TOKENS, seed=7)
    stores = {c: KVStore(str(scratch / c.replace(":", "")), codec=c, sync=False) for c in ("zstd-shuffle:1", "raw")}
    rows = []
    try:
        for n in lengths:
            rs = run_length(n, q_ids, lcpp, adapter, stores, scratch, args.repeats)
            rows += rs
            print(f"{n} tokens (load {bl.loadavg()}):")
            for r in rs:
                spread = f"{bl.fmt_s(r['min_s'])}..{bl.fmt_s(r['max_s'])}"
                print(f"  {r['method']:<26} {bl.fmt_s(r['median_s']):>10} ({spread})"
                      f"  {r['vs_llamacpp_state_file']:5.2f}x state file  {r['vs_llamacpp_seq_memory']:5.2f}x seq"
                      f"  token {r['first_token']}", flush=True)  # fmt: skip
    finally:
        for s in stores.values():
            s.close()
        shutil.rmtree(scratch, ignore_errors=True)
    peer = {"llama_cpp_python": llama_cpp.__version__, "gguf": gguf_path().name}
    bl.write_result("llamacpp", params=vars(args), rows=rows, machine=peer)


if __name__ == "__main__":
    main()
