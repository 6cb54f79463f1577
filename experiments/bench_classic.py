"""The classic KV-cache table, extended: tokens/s generating 200 new tokens from a short prompt.

SmolLM2-135M-Instruct (bundled), fp32, CPU, 2 threads, batch 1, greedy, EOS ignored (exactly 200
new tokens every time). A short chat prompt (``PROMPT`` in the chat template, ~30 tokens):

* ``generate, no cache``      - ``model.generate(..., use_cache=False)``: every step reruns the prefix.
* ``generate, dynamic cache`` - ``model.generate(...)`` with the default ``DynamicCache``.
* ``generate, static cache``  - ``cache_implementation="static"``.
* ``generate, static cache + torch.compile`` - the same with ``model.forward`` compiled (inductor on
  CPU), in a separate run (``--compile``, beside the dynamic and static rows it is compared with):
  compiling takes minutes here. The compile happens in an untimed warm-up, reported separately.
* ``kvstore Adapter, in memory`` - ``adapter.greedy_sample`` without a store: prefill of the
  prompt's context part, question step, decode into the Adapter's preallocated cache.
* ``kvstore Adapter, store <codec>`` - the same with the context part read from a warm store.

For the kvstore rows the prompt is split into a *context* (system + user turn, stored) and a
*question* (the assistant header ``<|im_start|>assistant\\n``), so they answer the same prompt.
tokens/s = 200 / wall seconds of the whole call (prefill included). Methods run round-robin per
repeat. The original table (Hugging Face's KV-cache docs) was measured on GPUs; this is a CPU.

Command (from the repository root; the suite ``classic``: ``python -m experiments run classic [ARGS]``
writes experiments/results/; run by hand it writes to cache/bench/raw/):

    .venv/bin/python experiments/bench_classic.py               # 200 tokens, 3 repeats
    .venv/bin/python experiments/bench_classic.py --compile     # dynamic vs static vs static + torch.compile
    .venv/bin/python experiments/bench_classic.py --quick       # smoke test: 20 tokens, 1 repeat
"""

from __future__ import annotations

import shutil
import traceback

import torch

import benchlib as bl

PROMPT = "Write a long story about a lighthouse keeper who finds a map in a bottle."
DEFAULT_CODECS = ("zstd-shuffle:1", "raw")


def main() -> None:
    p = bl.parser(__doc__)
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--codecs", default=",".join(DEFAULT_CODECS))
    p.add_argument(
        "--compile",
        action="store_true",
        help="only the torch.compile run: dynamic, static and static + torch.compile (results to classic_compile.json)",
    )
    args = bl.start(p, quick=dict(new_tokens=20, repeats=1))
    adapter = bl.load_adapter("float32")
    model, tok = adapter.model, adapter.tokenizer
    from kvstore.store.kvstore import KVStore

    messages = [{"role": "user", "content": PROMPT}]
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    if isinstance(prompt_ids, dict) or hasattr(prompt_ids, "keys"):
        prompt_ids = prompt_ids["input_ids"]
    prompt_ids = list(prompt_ids)
    head = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert prompt_ids[-len(head) :] == head, "the chat template should end with the assistant header"
    ctx_ids, q_ids = prompt_ids[: -len(head)], prompt_ids[-len(head) :]
    N = args.new_tokens
    input_ids = torch.tensor([prompt_ids])
    gen_kw = dict(
        max_new_tokens=N,
        min_new_tokens=N,
        do_sample=False,
        pad_token_id=adapter.pad_id,
        attention_mask=torch.ones_like(input_ids),
    )

    @torch.inference_mode()
    def gen(**kw):
        out = model.generate(input_ids, **gen_kw, **kw)
        return out[0, input_ids.shape[1] :].tolist()

    scratch = bl.SCRATCH / "classic"
    shutil.rmtree(scratch, ignore_errors=True)
    stores = {c: KVStore(str(scratch / c.replace(":", "")), codec=c, sync=False) for c in args.codecs.split(",")}
    for s in stores.values():
        adapter.generate_kv_cache([ctx_ids], s)

    def adapter_run(store=None):
        def fn():
            return adapter.greedy_sample(
                [ctx_ids], [q_ids], N, use_cache=True, store=store, batch_size=1, stop_at_eos=False
            )[0].tolist()

        return fn

    methods = {
        "generate, no cache": lambda: gen(use_cache=False),
        "generate, dynamic cache": lambda: gen(),
        "generate, static cache": lambda: gen(cache_implementation="static"),
        "kvstore Adapter, in memory": adapter_run(),
    }
    for c, s in stores.items():
        methods[f"kvstore Adapter, store {c}"] = adapter_run(s)
    notes = {}
    compiled = None
    if args.compile:
        methods = {m: methods[m] for m in ("generate, dynamic cache", "generate, static cache")}
        try:
            with bl.timed() as t:
                compiled = torch.compile(model.forward)
                model.forward = compiled
                gen(cache_implementation="static")  # compiles the prefill and the decode step
                gen(cache_implementation="static")
            notes["compile_seconds"] = round(t.seconds, 1)
            del model.forward
            print(f"torch.compile warm-up: {notes['compile_seconds']} s", flush=True)

            def compiled_static():
                model.forward = compiled
                try:
                    return gen(cache_implementation="static")
                finally:
                    del model.forward

            methods["generate, static cache + torch.compile"] = compiled_static
        except Exception as exc:  # noqa: BLE001 - recorded in the results, not fatal
            if "forward" in model.__dict__:
                del model.forward
            notes["compile_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            traceback.print_exc()
            print(f"torch.compile failed: {notes['compile_error']}", flush=True)
    outputs = {m: fn() for m, fn in methods.items()}  # warm-up, and the tokens for the comparison
    times: dict[str, list[float]] = {m: [] for m in methods}
    for r in range(args.repeats):
        for m, fn in methods.items():
            times[m] += bl.repeat(fn, 1, warmup=0)
        print(f"  repeat {r + 1}/{args.repeats} done (load {bl.loadavg()})", flush=True)
    for s in stores.values():
        s.close()
    shutil.rmtree(scratch, ignore_errors=True)
    ref = outputs["generate, dynamic cache"]
    rows = []
    dyn = bl.summarize(times["generate, dynamic cache"])["median"]
    for m, ts in times.items():
        s = bl.summarize(ts)
        same = sum(a == b for a, b in zip(outputs[m], ref))
        rows.append(
            {
                "method": m,
                "new_tokens": N,
                "prompt_tokens": len(prompt_ids),
                "median_s": s["median"],
                "min_s": s["min"],
                "max_s": s["max"],
                "tokens_per_s": N / s["median"],
                "tokens_per_s_min": N / s["max"],
                "tokens_per_s_max": N / s["min"],
                "n": s["n"],
                "same_tokens_as_dynamic": f"{same}/{N}",
                "x_dynamic": dyn / s["median"],
            }
        )
        print(f"  {m:<42} {N / s['median']:7.1f} tok/s  ({s['min']:.2f}-{s['max']:.2f} s)  same tokens {same}/{N}")
    prompt = {"prompt": PROMPT, "prompt_tokens": len(prompt_ids), "context_tokens": len(ctx_ids),
              "question_tokens": len(q_ids)}  # fmt: skip
    bl.write_result("classic_compile" if args.compile else "classic", params=vars(args) | prompt, rows=rows,
                    notes=notes | {"text_dynamic": tok.decode(ref)})  # fmt: skip


if __name__ == "__main__":
    main()
