"""Time to first token on a GPU: recompute vs kvstore (``raw``, ``zstd-shuffle:1``) vs the floor.

For machines with CUDA. The model is SmolLM2-135M-shaped (its config: 30 layers, hidden 576, 9
query / 3 KV heads, vocabulary 49,152) with random weights, built from the config so that nothing
needs downloading; timings do not depend on the weights' values. Same protocol as
``bench_ttft.py``: random context ids, a fixed 23-token question, batch 1, first token; stores on
the local disk (LMDB), warm; ``torch.cuda.synchronize()`` before every clock read. The stored KV
is decoded on the CPU and copied into the GPU batch buffers (no pinned staging yet).

Command (from the repository root on a CUDA machine; the suite ``gpu_ttft``: ``python -m experiments run
gpu_ttft [ARGS]`` writes experiments/results/; run by hand it writes to cache/bench/raw/)::

    python experiments/bench_gpu_ttft.py
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
from pathlib import Path

import torch

import benchlib as bl


def smollm2_shaped(dtype: torch.dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(dtype=dtype, device="cuda").eval()


def main() -> None:
    p = bl.parser(__doc__, threads=os.cpu_count() or 1, quick=False)  # a GPU machine: torch's own thread count
    p.add_argument("--lengths", default="1024,2048,4096")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeats", type=int, default=7)
    args = bl.start(p)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from kvstore.model.adapter import Adapter
    from kvstore.model.compute.attention import grouped_kv
    from kvstore.model.compute.cache import PreallocatedCache, new_buffers
    from kvstore.store.kvstore import KVStore

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")))
    tok.add_special_tokens({"eos_token": "<unk>", "pad_token": "<unk>"})
    g = torch.Generator().manual_seed(7)
    q_ids = torch.randint(100, 49152, (23,), generator=g).tolist()
    rows = []
    scratch = Path(tempfile.mkdtemp(prefix="kvstore-gpu-ttft-"))

    def synchronized(fn, n):
        """Seconds of ``n`` calls of ``fn`` after one untimed, each up to the GPU's last kernel."""
        fn()
        torch.cuda.synchronize()
        out = []
        for _ in range(n):
            torch.cuda.synchronize()
            with bl.timed() as t:
                fn()
                torch.cuda.synchronize()
            out.append(t.seconds)
        return out

    try:
        for dname in args.dtypes.split(","):
            dtype = getattr(torch, dname)
            model = smollm2_shaped(dtype)
            adapter = Adapter(model, tok, name="smollm2-shaped-random")
            stores = {c: KVStore(str(scratch / f"{dname}-{c.replace(':', '')}"), codec=c, sync=False)
                      for c in ("raw", "zstd-shuffle:1")}  # fmt: skip
            for n in [int(x) for x in args.lengths.split(",")]:
                ctx = torch.randint(100, 49152, (n,), generator=torch.Generator().manual_seed(1000 + n)).tolist()
                for s in stores.values():
                    adapter.generate_kv_cache([ctx], s, batch_size=1)
                layers = adapter.prefill([ctx])[0]
                bufs = new_buffers(adapter.kv_shapes(), 1, n + 24, adapter.dtype, adapter.device)
                for (kb, vb), (k, v) in zip(bufs, layers):
                    kb[0, :, :n].copy_(k)
                    vb[0, :, :n].copy_(v)
                mask = torch.ones((1, n + 23), dtype=torch.long, device="cuda")
                pos = torch.arange(n, n + 23, device="cuda")[None]
                ids = torch.tensor([q_ids], device="cuda")

                @torch.inference_mode()
                def floor():
                    with grouped_kv():
                        model(input_ids=ids, attention_mask=mask, position_ids=pos,
                              past_key_values=PreallocatedCache(bufs, n), use_cache=True, logits_to_keep=1)  # fmt: skip

                methods = {
                    "recompute": lambda: adapter.greedy_sample([ctx], [q_ids], 1, use_cache=False, batch_size=1),
                    "floor": floor,
                }
                for c, s in stores.items():
                    methods[f"kvstore:{c}"] = lambda s=s: adapter.greedy_sample(
                        [ctx], [q_ids], 1, store=s, batch_size=1
                    )
                for name, fn in methods.items():
                    ts = synchronized(fn, args.repeats)
                    rows.append({"dtype": dname, "context_tokens": n, "method": name, "runs_s": ts,
                                 "median_s": statistics.median(ts), "min_s": min(ts), "max_s": max(ts)})  # fmt: skip
                by = {r["method"]: r for r in rows if r["dtype"] == dname and r["context_tokens"] == n}
                for r in by.values():
                    r["x_floor"] = r["median_s"] / by["floor"]["median_s"]
                    r["speedup_vs_recompute"] = by["recompute"]["median_s"] / r["median_s"]
                    print(f"{dname} {n:>5} {r['method']:<22} {r['median_s'] * 1e3:8.2f} ms  {r['x_floor']:5.2f}x floor"
                          f"  {r['speedup_vs_recompute']:6.1f}x", flush=True)  # fmt: skip
            for s in stores.values():
                s.close()
            torch.cuda.empty_cache()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    bl.write_result("gpu_ttft", params=vars(args), rows=rows)  # the machine's GPU recorded by benchlib


if __name__ == "__main__":
    main()
