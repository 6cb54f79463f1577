"""Reference outputs from NVIDIA kvpress 0.5.5 (side environment; never imported by kvstore).

kvpress 0.5.5 pins ``transformers<5.3`` so it lives in its own virtual environment, and this
script must be run ONLY with that interpreter (it imports nothing from kvstore / this repo):

    cd /work/main && HF_HUB_OFFLINE=1 /work/kvpress-venv/bin/python experiments/kvpress_reference.py \\
        --rows ROWS.jsonl --presses knorm,streaming_llm,snapkv,keydiff,tova,random \\
        --ratios 0,0.25,0.5,0.75 --new-tokens 12 --out /tmp/kvpress_reference.json

(``--ids IDS.jsonl`` instead of ``--rows`` runs on exact token ids.)  The side venv is built with

    python3 -m venv /work/kvpress-venv
    /work/kvpress-venv/bin/pip install torch==2.13.0
    /work/kvpress-venv/bin/pip install -c <(echo torch==2.13.0) "transformers<5.3" kvpress==0.5.5

Inputs
    --rows FILE.jsonl  lines {"id": str, "context": str, "question": str}; tokenized with the
                       kvpress pipeline's own ``preprocess`` (chat template split at a separator,
                       answer_prefix="", no truncation unless --max-context-length is given).
    --ids FILE.jsonl   lines {"id": str, "context_ids": [int], "question_ids": [int]}; fed as is.

For every row: one dense answer (press=None) and, for every (press, ratio), one kvpress-style
run: ``KVPressTextGenerationPipeline.forward`` (prefill of the context under the press's forward
hooks, then the question forward with position_ids = c + j and greedy decoding).  The kept
context positions are captured by wrapping the press instance's ``score``/``compress`` and
re-running ``scores.topk(n_kept)`` on the very scores kvpress used; every layer is checked
(keys.gather(idx) == compressed keys and values, bitwise) and the final cache is checked against
an independent dense prefill gathered at the captured indices.

Output JSON (see ``--help``; written to --out):
    meta: versions, model shape, press classes and parameters, options
    rows[]: id, context_ids, question_ids, context_len, question_len, (context_text, question_text),
            dense {answer_ids, answer_text, stopped_at_eos, positions, seconds},
            runs[] {press, ratio, params, n_kept, cache_len, boundary_ties, kept[layer][kv_head] (sorted context
                    positions), kept_order (optional; cache order = topk order), answer_ids,
                    answer_text, stopped_at_eos, matches_dense, positions, verified, seconds}
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import kvpress  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from kvpress import (  # noqa: E402
    ExpectedAttentionPress,
    KeyDiffPress,
    KnormPress,
    KVPressTextGenerationPipeline,
    RandomPress,
    ScorerPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache  # noqa: E402

try:
    from importlib.metadata import version as _pkg_version
except ImportError:  # pragma: no cover
    _pkg_version = None


PRESS_NAMES = ("knorm", "streaming_llm", "snapkv", "keydiff", "tova", "random", "expected_attention")


def make_press(name: str, ratio: float, args) -> ScorerPress:
    if name == "knorm":
        return KnormPress(compression_ratio=ratio)
    if name == "streaming_llm":
        return StreamingLLMPress(compression_ratio=ratio, n_sink=args.n_sink)
    if name == "snapkv":
        return SnapKVPress(compression_ratio=ratio, window_size=args.snapkv_window, kernel_size=args.snapkv_kernel)
    if name == "keydiff":
        return KeyDiffPress(compression_ratio=ratio)
    if name == "tova":
        return TOVAPress(compression_ratio=ratio)
    if name == "random":
        return RandomPress(compression_ratio=ratio, seed=args.random_seed)
    if name == "expected_attention":
        return ExpectedAttentionPress(compression_ratio=ratio)
    raise SystemExit(f"unknown press {name!r}; choose from {PRESS_NAMES}")


def press_params(press) -> dict:
    return {f.name: getattr(press, f.name) for f in dataclasses.fields(press)}


# ----------------------------------------------------------------------------------------------
# capture helpers
# ----------------------------------------------------------------------------------------------


class Capture:
    """Wraps a ScorerPress instance's score/compress to record exactly what kvpress selected."""

    def __init__(self, press: ScorerPress):
        self.press = press
        self.scores: dict[int, torch.Tensor] = {}
        self.idx: dict[int, torch.Tensor] = {}  # layer -> (kv_heads, n_kept), cache (topk) order
        self.gather_ok: dict[int, bool] = {}
        self.boundary_ties: list[list[int]] = []  # [layer, kv_head] where score[n_kept-1] == score[n_kept]
        orig_score = press.score
        orig_compress = press.compress

        def score(module, hidden_states, keys, values, attentions, kwargs):
            s = orig_score(module, hidden_states, keys, values, attentions, kwargs)
            self.scores[module.layer_idx] = s
            return s

        def compress(module, hidden_states, keys, values, attentions, kwargs):
            layer = module.layer_idx
            k2, v2 = orig_compress(module, hidden_states, keys, values, attentions, kwargs)
            bsz, n_heads, k_len, head_dim = keys.shape
            assert bsz == 1
            n_kept = k2.shape[2]
            if layer in self.scores:
                s = self.scores.pop(layer)
                # identical call to ScorerPress.compress (scorer_press.py:96)
                idx = s.topk(n_kept, dim=-1).indices
                if n_kept < k_len:
                    top = s.topk(n_kept + 1, dim=-1).values
                    tied = (top[0, :, n_kept - 1] == top[0, :, n_kept]).nonzero().flatten().tolist()
                    self.boundary_ties += [[layer, h] for h in tied]
            else:  # compression_ratio == 0: ScorerPress.compress returns keys, values untouched
                assert n_kept == k_len
                idx = torch.arange(k_len, device=keys.device).expand(bsz, n_heads, k_len)
            gidx = idx.unsqueeze(-1).expand(-1, -1, -1, head_dim)
            ok = torch.equal(keys.gather(2, gidx), k2) and torch.equal(values.gather(2, gidx), v2)
            self.idx[layer] = idx[0].detach().cpu()
            self.gather_ok[layer] = bool(ok)
            return k2, v2

        press.score = score
        press.compress = compress


class PositionProbe:
    """Forward pre-hook on decoder layer 0 recording position_ids / cache_position of each call."""

    def __init__(self, model):
        self.calls: list[tuple[list[int], list[int]]] = []
        self.handle = model.model.layers[0].register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        pos = kwargs.get("position_ids")
        cp = kwargs.get("cache_position")
        self.calls.append((pos[0].tolist() if pos is not None else None, cp.tolist() if cp is not None else None))

    def reset(self):
        self.calls = []

    def summary(self) -> dict:
        """calls[0] = context prefill, calls[1] = question forward, calls[2:] = decode steps."""
        if len(self.calls) < 2:
            return {}

        def span(x):
            return [x[0], x[-1]] if x else x

        q_pos, q_cp = self.calls[1]
        return {
            "prefill_position_ids": span(self.calls[0][0]),
            "prefill_cache_position": span(self.calls[0][1]),
            "question_position_ids": span(q_pos),
            "question_cache_position": span(q_cp),
            "decode_position_ids": [c[0][0] for c in self.calls[2:]],
            "decode_cache_position": [c[1][0] for c in self.calls[2:]],
        }


class DecodeCapture:
    """generate_answer() ends with tokenizer.decode(torch.stack(generated_ids)); record those ids."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.orig = tokenizer.decode
        self.last_ids = None

        def decode(ids, *a, **kw):
            self.last_ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
            return self.orig(ids, *a, **kw)

        tokenizer.decode = decode


# ----------------------------------------------------------------------------------------------


def load_inputs(args, pipe) -> list[dict]:
    rows = []
    path = args.rows or args.ids
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            rows.append(json.loads(line))
    if args.limit:
        rows = rows[: args.limit]
    out = []
    for r in rows:
        if args.rows:
            max_len = args.max_context_length if args.max_context_length else int(1e10)
            t = pipe.preprocess(r["context"], questions=[r["question"]], answer_prefix="", max_context_length=max_len)
            ctx = t["context_ids"]
            q = t["questions_ids"][0]
            item = {"id": str(r["id"]), "context_ids": ctx, "question_ids": q}
        else:
            ctx = torch.tensor([r["context_ids"]], dtype=torch.long)
            q = torch.tensor([r["question_ids"]], dtype=torch.long)
            item = {"id": str(r["id"]), "context_ids": ctx, "question_ids": q}
        out.append(item)
    return out


def dense_prefill_keys(model, ctx_ids):
    cache = DynamicCache()
    with torch.inference_mode():
        model.model(input_ids=ctx_ids, past_key_values=cache)
    return [(cache.layers[i].keys.clone(), cache.layers[i].values.clone()) for i in range(len(cache))]


def run_pipeline(pipe, dec, probe, ctx, q, press, n_new):
    cache = DynamicCache()
    probe.reset()
    dec.last_ids = None
    t0 = time.perf_counter()
    answers = pipe.forward({"context_ids": ctx, "questions_ids": [q]}, press=press, max_new_tokens=n_new, cache=cache)
    dt = time.perf_counter() - t0
    ids = dec.last_ids
    eos = pipe.model.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    return {
        "answer_ids": ids,
        "answer_text": answers[0],
        "stopped_at_eos": bool(ids) and ids[-1] in eos,
        "positions": probe.summary(),
        "seconds": round(dt, 3),
    }, cache


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="/work/smollm2-dir")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--rows", help="jsonl with id, context, question")
    src.add_argument("--ids", help="jsonl with id, context_ids, question_ids")
    ap.add_argument("--presses", default="knorm,streaming_llm,snapkv,keydiff,tova,random")
    ap.add_argument("--ratios", default="0,0.25,0.5,0.75")
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-context-length", type=int, default=None, help="pipeline truncation (default: none)")
    ap.add_argument("--attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--limit", type=int, default=0, help="only the first N rows")
    ap.add_argument("--n-sink", type=int, default=4, help="StreamingLLMPress.n_sink (kvpress default 4)")
    ap.add_argument("--snapkv-window", type=int, default=64, help="SnapKVPress.window_size (default 64)")
    ap.add_argument("--snapkv-kernel", type=int, default=5, help="SnapKVPress.kernel_size (default 5)")
    ap.add_argument("--random-seed", type=int, default=0, help="RandomPress.seed (kvpress default None)")
    ap.add_argument("--store-order", action="store_true", help="also store kept indices in cache (topk) order")
    ap.add_argument("--no-verify", action="store_true", help="skip the dense-prefill cache comparison")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    presses = [p.strip() for p in args.presses.split(",") if p.strip()]
    for p in presses:
        if p not in PRESS_NAMES:
            raise SystemExit(f"unknown press {p!r}; choose from {PRESS_NAMES}")
    ratios = [float(x) for x in args.ratios.split(",") if x.strip()]

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation=args.attn)
    model.eval()
    pipe = KVPressTextGenerationPipeline(model=model, tokenizer=tok, device=torch.device("cpu"))
    dec = DecodeCapture(pipe.tokenizer)
    probe = PositionProbe(model)

    cfg = model.config
    n_layers = cfg.num_hidden_layers
    meta = {
        "kvpress_version": _pkg_version("kvpress") if _pkg_version else getattr(kvpress, "__version__", None),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "python": platform.python_version(),
        "model": os.path.abspath(args.model),
        "model_shape": {
            "num_hidden_layers": n_layers,
            "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads,
            "head_dim": getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads),
        },
        "attn_implementation": args.attn,
        "dtype": "float32",
        "threads": args.threads,
        "input_mode": "rows" if args.rows else "ids",
        "input_file": os.path.abspath(args.rows or args.ids),
        "pipeline": {
            "answer_prefix": "",
            "max_context_length": args.max_context_length,
            "eos_token_id": model.generation_config.eos_token_id,
            "question_position_ids": "context_len + j (pipeline.generate_answer)",
            "question_cache_position": "n_kept + j (LlamaModel default from cache.get_seq_length())",
        },
        "new_tokens": args.new_tokens,
        "presses": {
            p: {
                "class": type(make_press(p, 0.5, args)).__name__,
                "params": {k: v for k, v in press_params(make_press(p, 0.5, args)).items() if k != "compression_ratio"},
            }
            for p in presses
        },
        "ratios": ratios,
        "kept_layout": "kept[layer][kv_head] = sorted list of kept context positions (0-based)",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }

    items = load_inputs(args, pipe)
    out_rows = []
    for it in items:
        ctx, q = it["context_ids"], it["question_ids"]
        c = ctx.shape[1]
        row = {
            "id": it["id"],
            "context_ids": ctx[0].tolist(),
            "question_ids": q[0].tolist(),
            "context_len": c,
            "question_len": q.shape[1],
        }
        if args.rows:
            row["context_text"] = tok.decode(ctx[0])
            row["question_text"] = tok.decode(q[0])
        dense, _ = run_pipeline(pipe, dec, probe, ctx, q, None, args.new_tokens)
        row["dense"] = dense
        print(f"[{it['id']}] c={c} q={q.shape[1]} dense={dense['answer_text']!r} ({dense['seconds']}s)", flush=True)
        dense_kv = None if args.no_verify else dense_prefill_keys(model, ctx)
        runs = []
        for pname in presses:
            for ratio in ratios:
                press = make_press(pname, ratio, args)
                params = press_params(press)
                cap = Capture(press)
                res, cache = run_pipeline(pipe, dec, probe, ctx, q, press, args.new_tokens)
                assert sorted(cap.idx) == list(range(n_layers)), sorted(cap.idx)
                n_kept = int(cap.idx[0].shape[-1])
                cache_len = cache.get_seq_length()
                verified = {"gather_equal_all_layers": all(cap.gather_ok.values())}
                if dense_kv is not None:
                    ok = True
                    for layer in range(n_layers):
                        dk, dv = dense_kv[layer]
                        gidx = cap.idx[layer].unsqueeze(0).unsqueeze(-1).expand(-1, -1, -1, dk.shape[-1])
                        lk, lv = cache.layers[layer].keys, cache.layers[layer].values
                        ok = ok and torch.equal(dk.gather(2, gidx), lk) and torch.equal(dv.gather(2, gidx), lv)
                    verified["cache_equals_dense_gather"] = bool(ok)
                run = {
                    "press": pname,
                    "ratio": ratio,
                    "params": params,
                    "n_kept": n_kept,
                    "cache_len": cache_len,
                    "boundary_ties": cap.boundary_ties,
                    "kept": [[sorted(h) for h in cap.idx[layer].tolist()] for layer in range(n_layers)],
                }
                if args.store_order:
                    run["kept_order"] = [cap.idx[layer].tolist() for layer in range(n_layers)]
                run.update(res)
                run["matches_dense"] = res["answer_ids"] == dense["answer_ids"]
                run["verified"] = verified
                runs.append(run)
                print(
                    f"  {pname:>18} r={ratio:<5} kept={n_kept:>5} ans={res['answer_text']!r} "
                    f"dense_eq={run['matches_dense']} verified={verified} ({res['seconds']}s)",
                    flush=True,
                )
        row["runs"] = runs
        out_rows.append(row)

    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": out_rows}, f, separators=(",", ":"))
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
