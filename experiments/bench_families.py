"""What the family path (position masks, per-layer records, grouped states) costs next to the dense one.

One MistralForCausalLM (hidden 256, 8 heads / 2 KV heads, 6 layers, random weights, fp32, SDPA,
1 thread) run twice on the same weights: with ``sliding_window=None`` kvstore takes its dense path
(2-D masks); with a window longer than any context (4096, so the math is the same) it takes the
family path (4-D position masks built per forward, per-layer sliding records). Both store the same
contexts (``--rows`` rows of ``--tokens`` tokens, 256-token chunks) and answer a 16-token question
with 16 new tokens from a warm memory store. A Mamba-2 of similar width (6 layers) shows the state
path, whose questions run grouped by length (here all questions have one length: one forward).

Medians and min-max of ``--repeats`` runs; build = ``generate_kv_cache`` into a fresh memory
store; sample = ``greedy_sample`` on all rows at once from the warm store.

Command (from the repository root; the suite ``families``: ``python -m experiments run families [ARGS]``
writes experiments/results/; run by hand it writes to cache/bench/raw/)::

    .venv/bin/python experiments/bench_families.py            # 8 rows x 1024 tokens, 5 repeats
    .venv/bin/python experiments/bench_families.py --quick    # 4 rows x 256 tokens, 2 repeats
"""

from __future__ import annotations

import statistics

import torch
from transformers import AutoModelForCausalLM, Mamba2Config, MistralConfig

import benchlib as bl
from kvstore.model.adapter import Adapter
from kvstore.store.kvstore import KVStore


class _Tok:  # just enough tokenizer for id inputs
    eos_token_id = None
    pad_token_id = 0


def _model(kind: str) -> torch.nn.Module:
    common = dict(vocab_size=512, hidden_size=256, num_hidden_layers=6, initializer_range=0.02, pad_token_id=0)
    if kind == "mamba2":
        config = Mamba2Config(**common, num_heads=8, head_dim=64, state_size=64, expand=2, n_groups=1, conv_kernel=4)
    else:
        window = None if kind == "dense" else 4096
        config = MistralConfig(
            **common, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2, sliding_window=window,
            max_position_embeddings=8192,
        )  # fmt: skip
        config._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.eval().requires_grad_(False)


def _time(fn) -> float:
    with bl.timed() as t:
        fn()
    return t.seconds


def main() -> None:
    ap = bl.parser(__doc__, threads=1)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    args = bl.start(ap, quick=dict(rows=4, tokens=256, repeats=2))
    g = torch.Generator().manual_seed(0)
    contexts = [torch.randint(1, 512, (args.tokens,), generator=g).tolist() for _ in range(args.rows)]
    questions = [torch.randint(1, 512, (16,), generator=g).tolist() for _ in range(args.rows)]
    results = {}
    for kind in ("dense", "windowed", "mamba2"):
        adapter = Adapter(_model(kind), _Tok(), name=kind)
        adapter.check_supported()
        path = "dense" if adapter.layout.dense else "family"
        build, sample, answers = [], [], None
        for _ in range(args.repeats):
            with KVStore("memory://") as store:
                build.append(_time(lambda: adapter.generate_kv_cache(contexts, store)))  # noqa: B023
                kw = dict(store=store, batch_size=args.rows, stop_at_eos=False)

                def run() -> None:
                    nonlocal answers
                    answers = adapter.greedy_sample(contexts, questions, 16, **kw).tolist()  # noqa: B023

                sample.append(_time(run))
        results[kind] = {
            "path": path,
            "build_s": {"median": statistics.median(build), "min": min(build), "max": max(build)},
            "sample_s": {"median": statistics.median(sample), "min": min(sample), "max": max(sample)},
        }
        if kind == "windowed":  # the same weights and math as dense: the same answers
            results[kind]["same_tokens_as_dense"] = answers == results["dense"].pop("_answers")
        else:
            results[kind]["_answers"] = answers
        print(kind, path, {k: round(v["median"], 3) for k, v in results[kind].items() if isinstance(v, dict)})
    results["mamba2"].pop("_answers", None)
    bl.write_result("families", params=vars(args), rows=[{"case": kind} | r for kind, r in results.items()])


if __name__ == "__main__":
    main()
