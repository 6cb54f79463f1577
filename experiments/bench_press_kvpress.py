"""kvstore's presses against NVIDIA kvpress 0.5.5 on the same token ids: kept tokens and answers.

kvpress pins ``transformers<5.3``, so it runs in its own virtual environment (``--kvpress-python``,
default /work/kvpress-venv/bin/python; see ``experiments/kvpress_reference.py`` for how it is built):
without that interpreter this script prints why and exits without a result (this suite never runs in
CI). Steps:

1. **kvpress**: ``experiments/kvpress_reference.py --rows`` with that interpreter on the long set's
   rows (``benchlib.question_sets()["long"]``, the first ``--per-context`` questions of each of its 5
   contexts of ~1.3k tokens), tokenized the kvpress pipeline's way (``preprocess``: the chat template
   around the context, the question followed by the template's suffix; the question is given as
   ``"\\nQuestion: Q\\nAnswer:"``, the text kvstore's benchmarks ask, so the ids are kvstore's own
   prompt format's: checked, ``ids_equal_kvstore_prompt``), for knorm, streaming_llm, snapkv, keydiff,
   tova and random (seed 0) at the ratios 0.25, 0.5 and 0.75, 12 new tokens, stopping at EOS
   (``--presses new``: kvzip, kvzip:layer, kvzip:plus, expected_attention, snapkv:adakv,
   expected_attention:adakv and snapkv:pyramid instead, kvstore specs ``kvzip:R:layer`` and so on). It
   reports, per row and press, the positions every (layer, KV head) kept (captured from the scores
   kvpress itself ranked, and verified against its cache; for AdaKV and KVzip, which mask keys rather
   than remove them, the complement of the pruned pairs kvpress recorded), the layers and heads whose
   cut fell on a tie (``boundary_ties``), its answer ids, and the error of a run that raised (kvpress
   0.5.5's PyramidKVPress, whenever its layers get different budgets).
2. **kept tokens**: kvstore's press on the same context ids: a dense in-memory prefill
   (``kvstore.model.stages.answer.prefill_contexts``, under kvstore's grouped-KV attention, as its
   sweeps run), each press's scores and kept positions (``kvstore.model.press.select.row_scores``
   and ``kept_positions``). Per press and ratio over every (context, layer, KV head) set:
   ``sets_identical``, ``jaccard_mean`` / ``_min``, whether the counts agree per head and per layer
   (``head_counts_agree``, ``layer_counts_agree``: heads keep different counts under AdaKV, KVzip
   and the pyramid), and the differing sets explained by ties (``differ_at_ties``: every position in
   the symmetric difference scores exactly kvstore's cut score, so the order of equal scores decided
   it) or by near-ties (``differ_near_ties``: within ``--near`` of the cut, relative to the spread
   of the scores; rounding of keys computed by another transformers version), with the largest
   relative gap seen. The cut of a per-head selection is the head's ``n``-th best score; of a
   selection across heads, the highest score kvstore dropped in the layer (in the row: KVzip's global
   cut). Where
   kvpress's scores were saved (the new presses), kvstore's are compared with them
   (``scores_max_rel_diff``, relative to the layer's spread, and ``scores_over_near``: how many
   differ by more than ``--near`` of it; KVzip's with its sinks raised to kvpress's ``sink_value``).
3. **answers**: the contexts built into a store, then one :meth:`Adapter.sweep` of ``dense`` and
   every press/ratio over the same context and question ids: rows whose tokens equal kvpress's
   (``answers_identical``), and the fraction of kvpress's answer tokens matched step by step. Every
   row whose answer differs (or where kvpress raised) is replayed with plain transformers once with
   kvpress's kept sets and once with kvstore's (``notes.differing_answers_replayed``): which choice of
   tokens gives which answer. The replay is a dense prefill, then the question at ``c + j`` and greedy
   decoding; a per-head press gathers each head's kept positions into the cache, the others keep the
   dense cache and mask each (layer, head)'s dropped keys with an additive -inf before the model's
   own SDPA (an attention function registered with transformers' ``AttentionInterface``). For the
   pyramid, ``notes.pyramid`` gives, per ratio, where kvpress raised (its layers' caches differ in
   length and the question's mask is sized from layer 0's) and both sides' per-layer budgets.

A reference given with ``--reference`` may hold more rows or presses than are compared (``--limit``,
``--quick``: the runs asked are picked out); an unfinished one (``meta.complete`` false, its run
stopped) is compared on the rows it has, and the result says so (``notes.reference_note``).

**RULER** (``--set ruler``, written as ``press_kvpress_ruler``): the rows are instead the first
``--ruler-samples`` requests of lm-eval's ``niah_single_1`` at 4096 tokens (the samples
``bench_press_ruler.py`` scores, generated the same way), as kvstore's lm-eval backend splits them
(captured from ``KVStoreLM``: the prompt but its last token is the context, the last token the
question), fed to kvpress as ids (``kvpress_reference.py --ids``), 32 new tokens (the niah tasks'
``max_gen_toks`` in that suite): whether kvpress's presses fail the needle where kvstore's do.

Command (from the repository root; the suite ``press_kvpress``: ``python -m experiments run
press_kvpress [ARGS]`` writes ``press_kvpress.json`` (``--set ruler``: ``press_kvpress_ruler.json``;
``--presses new``: ``press_kvpress_new.json``) into experiments/results/; run by hand it writes to
cache/bench/raw/)::

    .venv/bin/python experiments/bench_press_kvpress.py
    .venv/bin/python experiments/bench_press_kvpress.py --reference cache/bench/press_kvpress/kvpress.json  # reuse
    .venv/bin/python experiments/bench_press_kvpress.py --quick   # 1 row, knorm and snapkv at 0.5
    .venv/bin/python experiments/bench_press_kvpress.py --set ruler
    .venv/bin/python experiments/bench_press_kvpress.py --presses new --stem press_kvpress_new \\
        --reference cache/bench/press_kvpress/kvpress_new.json
    .venv/bin/python -m experiments run press_kvpress --presses new --stem press_kvpress_new \\
        --reference cache/bench/press_kvpress/kvpress_new.json   # the same, into experiments/results/
    .venv/bin/python experiments/bench_press_kvpress.py --presses new --quick \\
        --reference cache/bench/press_kvpress/kvpress_new.json   # 1 row, kvzip and snapkv:adakv at 0.5
    .venv/bin/python experiments/bench_press_kvpress.py --set ruler --presses kvzip,snapkv:adakv --ratios 0.5,0.75 \\
        --stem press_kvpress_ruler_new --reference cache/bench/press_kvpress/kvpress_ruler_new.json
    .venv/bin/python experiments/bench_press_kvpress.py --presses new --kvpress-only   # the reference alone
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import benchlib as bl

WORK = bl.SCRATCH / "press_kvpress"
KVPRESS_PYTHON = "/work/kvpress-venv/bin/python"
PRESSES = ("knorm", "streaming_llm", "snapkv", "keydiff", "tova", "random")
# ``--presses new``: kvpress_reference.py's names (kvstore spec: the method, the ratio, the flag)
NEW_PRESSES = ("kvzip", "kvzip:layer", "kvzip:plus", "expected_attention", "snapkv:adakv",
               "expected_attention:adakv", "snapkv:pyramid")  # fmt: skip
RATIOS = (0.25, 0.5, 0.75)
N_NEW = 12
RULER_NEW = 32
MASKED_ATTENTION = "bench_press_kvpress_masked"  # the replay's attention implementation
SPREAD_CAP = 1e30  # scores at or above this mark protected tokens (AdaKV's safeguard), not part of a spread


def ruler_ids(model_dir: str, n: int, path: Path) -> list[str]:
    """Write the first ``n`` niah_single_1 requests at 4096 tokens, as kvstore's lm-eval backend
    splits them, to ``path`` (``kvpress_reference.py --ids`` lines); returns their ids."""
    import bench_press_ruler as ruler  # points NLTK_DATA at its scratch folder
    import lm_eval

    from kvstore.lm_eval import KVStoreLM

    (ruler.NLTK_DATA / "tokenizers" / "punkt_tab").mkdir(parents=True, exist_ok=True)
    tasks = ruler.load_tasks(["niah_single_1"], model_dir, RULER_NEW)
    lm = KVStoreLM(pretrained=model_dir, dtype="float32", use_cache=False)  # no store: nothing is answered
    prompts: list[list[int]] = []

    def capture(batch: list[list[int]], until: list[str], new_tokens: int) -> list[str]:
        prompts.extend(batch)
        return [""] * len(batch)

    lm._generate = capture  # the prompts the backend would answer (it splits each as below)
    try:
        lm_eval.simple_evaluate(model=lm, tasks=list(tasks.values()), limit=n, verbosity="WARNING")
    finally:
        lm.close()
    ids = [f"niah_single_1-{i}" for i in range(len(prompts))]
    with path.open("w") as f:
        for name, p in zip(ids, prompts):
            f.write(json.dumps({"id": name, "context_ids": p[:-1], "question_ids": p[-1:]}) + "\n")
    return ids


def rows_file(questions: list[dict], path: Path) -> None:
    with path.open("w") as f:
        for q in questions:
            f.write(json.dumps({"id": q["id"], "context": q["context"],
                                "question": f"\nQuestion: {q['question']}\nAnswer:"}) + "\n")  # fmt: skip


def run_kvpress(args, rows_path: Path, out: Path, model_dir: str, new_tokens: int) -> float:
    given = "--ids" if args.set == "ruler" else "--rows"
    cmd = [args.kvpress_python, str(bl.HERE / "kvpress_reference.py"), "--model", model_dir, given, str(rows_path),
           "--presses", args.presses, "--ratios", args.ratios, "--new-tokens", str(new_tokens), "--out", str(out),
           "--threads", str(args.threads)]  # fmt: skip
    print("running", " ".join(cmd), flush=True)
    with bl.timed() as t:
        subprocess.run(cmd, check=True, env=os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    return t.seconds


def spec_of(name: str, ratio: float | str) -> str:
    """kvstore's spec of a ``kvpress_reference.py`` press name at ``ratio``: the method, the ratio,
    then the name's flags (``kvzip:layer`` at 0.5 is ``kvzip:0.5:layer``)."""
    method, *flags = name.split(":")
    return ":".join([method, f"{float(ratio):g}", *flags])


def run_spec(run: dict) -> str:
    """The spec of one kvpress run (references written before ``spec`` was recorded: press:ratio)."""
    return run.get("spec") or spec_of(run["press"], run["ratio"])


def kvstore_kept(adapter, ctx_ids: list[int], specs: list[str]) -> dict:
    """Per spec: ``(kept [layer][head] position sets, scores [layer] float32 [kv_heads, c])`` of
    kvstore's press over the dense in-memory prefill of ``ctx_ids``
    (``kvstore.model.press.select``: the scores every ratio and budget of a method share, then the
    budget's cut)."""
    from kvstore.model.compute.attention import grouped_kv
    from kvstore.model.press.select import PressMemo, kept_positions, row_scores
    from kvstore.model.press.spec import parse_press
    from kvstore.model.stages.answer import prefill_contexts

    out = {}
    with grouped_kv():
        cache = prefill_contexts(adapter.handle, [ctx_ids], 0, False)
        memo = PressMemo()
        for spec in specs:
            press = parse_press(spec)
            kept = kept_positions(adapter.handle, cache, press, 0, memo)
            scores = row_scores(adapter.handle, cache, press, 0, memo)
            out[spec] = ([[set(p.tolist()) for p in heads] for heads in kept], [s.float() for s in scores])
    return out


def spread(scores) -> float:
    """max - min of the scores below :data:`SPREAD_CAP` (1.0 when that is 0)."""
    real = scores[scores.abs() < SPREAD_CAP]
    width = float(real.max() - real.min()) if real.numel() else 0.0
    return width or 1.0


def head_gap(a: set, b: set, scores) -> float:
    """How far from kvstore's cut the positions that differ between kvstore's set ``a`` and kvpress's
    ``b`` of one head score, under kvstore's ``scores`` ``[c]`` (a per-head selection: the cut is
    the ``|a|``-th best score): the largest |score - cut|, relative to the spread of the head's scores
    (0: every one of them ties with the cut, so only the order of equal scores decided it)."""
    import torch

    cut = torch.sort(scores, descending=True).values[len(a) - 1]
    gap = float((scores[torch.tensor(sorted(a ^ b))] - cut).abs().max())
    return gap / spread(scores)


def layer_gap(kept_mask, differ_mask, scores) -> float:
    """:func:`head_gap` for a selection across a layer's heads (AdaKV, KVzip's ``layer``): ``kept_mask``
    / ``differ_mask`` / ``scores`` ``[kv_heads, c]``; the cut is the highest score kvstore dropped in
    the layer (the lowest it kept when it dropped none), the spread the layer's. KVzip's ``global``
    selection passes every layer (``[layers, kv_heads, c]``): its cut and spread are the row's."""
    dropped = scores[~kept_mask]
    cut = dropped.max() if dropped.numel() else scores[kept_mask].min()
    gap = float((scores[differ_mask] - cut).abs().max())
    return gap / spread(scores)


def layer_masks(sets: list[set], c: int):
    import torch

    mask = torch.zeros((len(sets), c), dtype=torch.bool)
    for h, positions in enumerate(sets):
        mask[h, sorted(positions)] = True
    return mask


def reference_scores(ref_path: Path, reference: dict) -> dict:
    """kvpress's saved scores (``kvpress_reference.py``'s side file), ``{}`` when it saved none."""
    name = reference["meta"].get("scores_file")
    path = ref_path.parent / name if name else None
    if path is None or not path.exists():
        return {}
    from safetensors.torch import load_file

    return load_file(str(path))


def compare_kept(reference: dict, mine: dict, near: float, saved: dict) -> list[dict]:
    """One row per press and ratio: the kept sets of every distinct context compared."""
    import torch

    from kvstore.model.press.spec import parse_press

    by_spec: dict[str, dict] = {}
    seen: set = set()
    for row in reference["rows"]:
        key = tuple(row["context_ids"])
        if key in seen:  # kept sets depend on the context alone (no press here reads the question)
            continue
        seen.add(key)
        c = len(key)
        for run in row["runs"]:
            spec = parse_press(run_spec(run)).name
            sets, scores = mine[key][spec]
            selection = run.get("selection", "head")
            acc = by_spec.setdefault(spec, {"selection": selection, "sets": 0, "identical": 0, "jaccard": [],
                                            "tie": 0, "near": 0, "far": 0, "max_gap": 0.0, "head_counts": 0,
                                            "layers": 0, "layer_counts": 0, "totals": 0, "kvpress_boundary_ties": 0,
                                            "verified": True, "score_gap": None, "scores_over_near": 0,
                                            "scores_compared": 0})  # fmt: skip
            acc["kvpress_boundary_ties"] += len(run["boundary_ties"])
            acc["verified"] &= all(run["verified"].values())
            acc["totals"] += sum(map(len, (h for layer in sets for h in layer))) == sum(
                len(h) for layer in run["kept"] for h in layer
            )
            every = None  # a global selection's kept masks and scores [layers, kv_heads, c]
            for layer, heads in enumerate(run["kept"]):
                acc["layers"] += 1
                acc["layer_counts"] += sum(map(len, sets[layer])) == sum(map(len, heads))
                masks = None
                for h, theirs in enumerate(heads):
                    a, b = sets[layer][h], set(theirs)
                    acc["sets"] += 1
                    acc["head_counts"] += len(a) == len(b)
                    acc["jaccard"].append(len(a & b) / len(a | b) if a | b else 1.0)
                    if a == b:
                        acc["identical"] += 1
                        continue
                    if selection in ("head", "pyramid"):
                        gap = head_gap(a, b, scores[layer][h])
                    elif selection == "global":  # one cut over every layer and head
                        every = every or (torch.stack([layer_masks(x, c) for x in sets]), torch.stack(scores))
                        differ = torch.zeros_like(every[0])
                        differ[layer, h] = every[0][layer, h] ^ layer_masks([b], c)[0]
                        gap = layer_gap(every[0], differ, every[1])
                    else:
                        masks = masks or (layer_masks(sets[layer], c), layer_masks(heads, c))
                        differ = torch.zeros_like(masks[0])
                        differ[h] = masks[0][h] ^ masks[1][h]
                        gap = layer_gap(masks[0], differ, scores[layer])
                    acc["tie" if gap == 0 else "near" if gap <= near else "far"] += 1
                    acc["max_gap"] = max(acc["max_gap"], gap)
            if "scores" in run and run["scores"]["key"] in saved:
                theirs = saved[run["scores"]["key"]]
                sink = (run.get("kvzip") or {}).get("sink_value")
                if sink is not None:  # KVzip's are saved before its sinks are raised to amax + 1
                    theirs = theirs.clone()
                    theirs[..., : run["params"]["n_sink"]] = sink
                ours = torch.stack(scores)
                if ours.shape == theirs.shape:
                    rel = max(float((o - t).abs().max()) / spread(t) for o, t in zip(ours, theirs))
                    acc["score_gap"] = max(acc["score_gap"] or 0.0, rel)
                    over = [(o - t).abs() > near * spread(t) for o, t in zip(ours, theirs)]
                    acc["scores_over_near"] += int(sum(int(x.sum()) for x in over))
                    acc["scores_compared"] += ours.numel()
    out = []
    for spec, acc in by_spec.items():
        press = parse_press(spec)
        out.append({
            "spec": spec, "press": press.method, "ratio": press.ratio, "selection": acc["selection"],
            "contexts": len(seen), "sets": acc["sets"],
            "sets_identical": acc["identical"], "sets_identical_frac": acc["identical"] / acc["sets"],
            "jaccard_mean": statistics.mean(acc["jaccard"]), "jaccard_min": min(acc["jaccard"]),
            "head_counts_agree": acc["head_counts"], "layer_counts_agree": acc["layer_counts"],
            "layers": acc["layers"], "total_kept_agree": acc["totals"],
            "differ_at_ties": acc["tie"], "differ_near_ties": acc["near"], "differ_otherwise": acc["far"],
            "max_relative_gap": acc["max_gap"], "kvpress_boundary_ties": acc["kvpress_boundary_ties"],
            "kvpress_verified": acc["verified"], "scores_max_rel_diff": acc["score_gap"],
            "scores_over_near": acc["scores_over_near"], "scores_compared": acc["scores_compared"],
        })  # fmt: skip
    return out


def compare_answers(reference: dict, results: dict) -> dict[str, dict]:
    """Per variant (``dense`` and every press spec): kvstore's answers against kvpress's (a run where
    kvpress raised counts in ``kvpress_errors``, not in the answers)."""
    from kvstore.model.press.spec import parse_press

    out: dict[str, dict] = {}
    for i, row in enumerate(reference["rows"]):
        runs = [("dense", row["dense"])] + [(parse_press(run_spec(r)).name, r) for r in row["runs"]]
        for spec, run in runs:
            res = results[spec]
            mine = res.tokens[i, : res.lengths[i]].tolist()
            theirs = run["answer_ids"]
            acc = out.setdefault(spec, {"rows": 0, "answers_identical": 0, "tokens": 0, "tokens_agree": 0,
                                        "kvpress_matches_its_dense": 0, "kvpress_errors": 0,
                                        "differing_rows": []})  # fmt: skip
            acc["rows"] += 1
            if theirs is None:
                acc["kvpress_errors"] += 1
                continue
            acc["answers_identical"] += mine == theirs
            acc["tokens"] += len(theirs)
            acc["tokens_agree"] += sum(x == y for x, y in zip(mine, theirs))
            acc["kvpress_matches_its_dense"] += run.get("matches_dense", True)
            if mine != theirs:
                acc["differing_rows"].append(row["id"])
    return out


def masked_attention(dropped: list):
    """An attention function (transformers' ``AttentionInterface``) that attends like the model's own
    SDPA with, at each layer, the context keys ``dropped[layer]`` ``[kv_heads, c]`` (True: pruned)
    masked out by an additive -inf for every query head of their KV head."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attend(module, query, key, value, attention_mask, **kwargs):
        drop = dropped[module.layer_idx]
        _, heads, s, _ = query.shape
        k_len = key.shape[2]
        bias = torch.zeros((1, heads, s, k_len), dtype=query.dtype, device=query.device)
        if attention_mask is None:
            if s > 1:  # causal: the queries are the last s positions
                seen = torch.arange(k_len) <= torch.arange(s)[:, None] + (k_len - s)
                bias.masked_fill_(~seen.to(query.device), float("-inf"))
        elif attention_mask.dtype == torch.bool:
            bias.masked_fill_(~attention_mask, float("-inf"))
        else:
            bias = bias + attention_mask
        per_query_head = drop.repeat_interleave(heads // drop.shape[0], dim=0).to(query.device)
        bias[..., : drop.shape[1]].masked_fill_(per_query_head[None, :, None, :], float("-inf"))
        return sdpa_attention_forward(module, query, key, value, bias, **kwargs)

    return attend


def replay(adapter, ctx: list[int], question: list[int], kept_sets: list[list[list[int]]], new_tokens: int,
           masked: bool) -> list:  # fmt: skip
    """The answer over ``ctx``'s dense prefill (the model's own forward into a ``DynamicCache``) with
    every (layer, head) keeping the positions ``kept_sets[layer][head]``, then the question at
    ``c + j`` and greedy decoding (``bench_press_sweep.answer``): whose choice of kept tokens gives
    which answer, with nothing else of either implementation involved. Each head's kept positions are
    gathered into the cache (position order), or, ``masked``, the cache stays dense and the others are
    masked (:func:`masked_attention`: heads and layers may keep different counts)."""
    import torch
    from bench_press_sweep import answer
    from transformers import AttentionInterface, DynamicCache
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    model, cache_arg, c = adapter.model, adapter.handle.layout.cache_arg, len(ctx)
    cache = DynamicCache()
    with torch.inference_mode():
        model.model(input_ids=torch.tensor([ctx]), use_cache=True, **{cache_arg: cache})
    if not masked:
        for layer, heads in zip(cache.layers, kept_sets):
            idx = torch.tensor([sorted(h) for h in heads])  # [kv_heads, n]
            keys, values = layer.keys[0], layer.values[0]
            layer.keys = keys.gather(1, idx[..., None].expand(-1, -1, keys.shape[-1]))[None].contiguous()
            layer.values = values.gather(1, idx[..., None].expand(-1, -1, values.shape[-1]))[None].contiguous()
        return answer(model, cache, c, question, new_tokens, set(adapter.eos_ids), cache_arg)
    dropped = [~layer_masks([set(h) for h in heads], c) for heads in kept_sets]
    AttentionInterface.register(MASKED_ATTENTION, masked_attention(dropped))
    AttentionMaskInterface.register(MASKED_ATTENTION, sdpa_mask)
    before = model.config._attn_implementation
    model.config._attn_implementation = MASKED_ATTENTION
    try:
        with torch.inference_mode():
            return answer(model, cache, c, question, new_tokens, set(adapter.eos_ids), cache_arg)
    finally:
        model.config._attn_implementation = before


def replay_differences(adapter, reference: dict, results: dict, mine: dict, new_tokens: int) -> list[dict]:
    """For every row whose answer differs from kvpress's, or where kvpress raised: the answers
    :func:`replay` gives with kvpress's kept sets and with kvstore's, and which answer each equals."""
    from kvstore.model.press.spec import parse_press

    out = []
    for i, row in enumerate(reference["rows"]):
        for run in row["runs"]:
            spec = parse_press(run_spec(run)).name
            res = results[spec]
            kvstore_answer = res.tokens[i, : res.lengths[i]].tolist()
            if kvstore_answer == run["answer_ids"]:
                continue
            sets = mine[tuple(row["context_ids"])][spec][0]
            ctx, question = row["context_ids"], row["question_ids"]
            masked = run.get("selection", "head") != "head"
            with_theirs = replay(adapter, ctx, question, run["kept"], new_tokens, masked)
            with_mine = replay(adapter, ctx, question, [[sorted(h) for h in layer] for layer in sets], new_tokens,
                               masked)  # fmt: skip
            differ = [[layer, h] for layer, heads in enumerate(run["kept"]) for h, theirs in enumerate(heads)
                      if set(theirs) != sets[layer][h]]  # fmt: skip
            entry = {"id": row["id"], "variant": spec, "sets_differing": differ, "replay": "masked" if masked else
                     "gathered", "kvpress_answer": run["answer_text"], "kvstore_answer": adapter.decode(kvstore_answer),
                     "replay_with_kvpress_sets_equals_kvpress": None if run["answer_ids"] is None
                     else with_theirs == run["answer_ids"],
                     "replay_with_kvstore_sets_equals_kvstore": with_mine == kvstore_answer}  # fmt: skip
            if run["answer_ids"] is None:  # kvpress raised: what its kept sets answer, replayed
                entry |= {"kvpress_error": run["error"]["message"],
                          "replay_with_kvpress_sets": adapter.decode(with_theirs),
                          "replay_with_kvpress_sets_equals_kvstore": with_theirs == kvstore_answer}  # fmt: skip
            out.append(entry)
    return out


def pyramid_notes(reference: dict, mine: dict, answers: dict, replayed: list[dict]) -> dict:
    """Per ``pyramid`` spec: where kvpress's PyramidKVPress raised and what kvstore does instead. Its
    prefill keeps ``n_l`` tokens per head of layer ``l`` (the caches' lengths then differ by layer),
    the question forward sizes its attention mask from layer 0's length and SDPA raises at the first
    shorter layer; kvstore answers from per-layer buffers under per-head masks. Per distinct context:
    both per-layer budgets, equal or not; the rows where kvpress raised, and whether kvpress's own
    kept sets, replayed with masks, answer as kvstore did."""
    from kvstore.model.press.spec import parse_press

    out: dict[str, dict] = {}
    for row in reference["rows"]:
        for run in row["runs"]:
            spec = parse_press(run_spec(run)).name
            if run.get("selection") != "pyramid":
                continue
            acc = out.setdefault(spec, {"kvpress_raised": 0, "rows": 0, "errors": [], "budgets": [],
                                        "answers_identical": answers[spec]["answers_identical"],
                                        "replay_with_kvpress_sets_equals_kvstore": []})  # fmt: skip
            acc["rows"] += 1
            if run.get("error"):
                acc["kvpress_raised"] += 1
                if run["error"]["message"] not in acc["errors"]:
                    acc["errors"].append(run["error"]["message"])
            theirs = [layer[0] for layer in run["kept_counts"]]
            ours = [len(heads[0]) for heads in mine[tuple(row["context_ids"])][spec][0]]
            if not any(b["context_len"] == row["context_len"] for b in acc["budgets"]):
                acc["budgets"].append({"context_len": row["context_len"], "kvpress_per_layer": theirs,
                                       "kvstore_per_layer": ours, "equal": theirs == ours})  # fmt: skip
    for entry in replayed:
        if entry["variant"] in out and "replay_with_kvpress_sets_equals_kvstore" in entry:
            out[entry["variant"]]["replay_with_kvpress_sets_equals_kvstore"].append(
                entry["replay_with_kvpress_sets_equals_kvstore"]
            )
    return out


def quick_settings(args) -> None:
    """``--quick``: one row, two presses at 0.5 (a reference given with ``--reference`` may hold more)."""
    args.per_context, args.ruler_samples, args.limit = 1, 1, 1
    args.presses, args.ratios = ("kvzip,snapkv:adakv" if args.presses == "new" else "knorm,snapkv"), "0.5"


def restrict(reference: dict, ids: list[str], specs: list[str]) -> dict:
    """The reference's rows of ``ids`` (in that order) with their runs of ``specs`` only: a
    reference may hold more rows or presses than this run compares (``--limit``, ``--quick``); a
    row it lacks (an unfinished reference, ``meta.complete`` false) is left out by the caller."""
    from kvstore.model.press.spec import parse_press

    by_id = {r["id"]: r for r in reference["rows"]}
    rows = []
    for name in ids:
        row = by_id[name]
        runs = {parse_press(run_spec(x)).name: x for x in row["runs"]}
        missing = [spec for spec in specs if spec not in runs]
        if missing:
            raise SystemExit(f"the reference has no run of {', '.join(missing)} on {name}; run kvpress for them")
        rows.append(row | {"runs": [runs[spec] for spec in specs]})
    return {"meta": reference["meta"], "rows": rows}


def main() -> None:
    ap = bl.parser(__doc__.split("\n")[0], batch_size=8)
    ap.add_argument("--kvpress-python", default=KVPRESS_PYTHON)
    ap.add_argument("--per-context", type=int, default=2, help="questions per long-set context")
    ap.add_argument("--presses", default=",".join(PRESSES),
                    help=f"kvpress_reference.py press names; 'new': {','.join(NEW_PRESSES)}")  # fmt: skip
    ap.add_argument("--ratios", default=",".join(map(str, RATIOS)))
    ap.add_argument("--near", type=float, default=1e-4, help="a relative score gap below this is a near-tie")
    ap.add_argument("--reference", help="an earlier kvpress_reference.py output on the same rows (not run again)")
    ap.add_argument("--kvpress-only", action="store_true", help="write kvpress's reference, compare nothing")
    ap.add_argument("--set", choices=("long", "ruler"), default="long", help="the long QA set or RULER's niah_single_1")
    ap.add_argument("--ruler-samples", type=int, default=4, help="niah_single_1 requests (--set ruler)")
    ap.add_argument("--limit", type=int, default=0, help="compare only the first N rows (0: all)")
    ap.add_argument("--stem", default=None, help="the result's name (default: press_kvpress[_ruler][_new])")
    # the machine is waited for once kvpress's reference is there, before kvstore's side runs
    args = bl.start(ap, quick=quick_settings, wait=False)
    if args.presses == "new":
        args.presses = ",".join(NEW_PRESSES)
    names = [p for p in args.presses.split(",") if p]
    new = not set(names) <= set(PRESSES)  # the result of the presses added after the first six: *_new
    new_tokens = RULER_NEW if args.set == "ruler" else N_NEW
    args.stem = args.stem or "press_kvpress" + ("_ruler" if args.set == "ruler" else "") + ("_new" if new else "")
    if not args.reference and not Path(args.kvpress_python).exists():
        print(
            f"skipped: no kvpress interpreter at {args.kvpress_python} (build the side venv as "
            "experiments/kvpress_reference.py says, or pass --kvpress-python); nothing written",
            flush=True,
        )
        sys.exit(0)
    from kvstore.data.prompts import PromptFormat
    from kvstore.errors import PressError
    from kvstore.model.load.gguf import convert_gguf
    from kvstore.model.load.loading import bundled_gguf_path
    from kvstore.model.press.spec import parse_press
    from kvstore.store.kvstore import KVStore

    WORK.mkdir(parents=True, exist_ok=True)
    model_dir = str(convert_gguf(bundled_gguf_path()))
    quick = "_quick" if args.quick else ""
    rows_path = WORK / f"rows{'_ruler' if args.set == 'ruler' else ''}{quick}.jsonl"
    if args.set == "ruler":
        questions = [{"id": i} for i in ruler_ids(model_dir, args.ruler_samples, rows_path)]
    else:
        long = bl.question_sets()["long"]
        questions = [q for c in dict.fromkeys(q["context"] for q in long)
                     for q in [q for q in long if q["context"] == c][: args.per_context]]  # fmt: skip
    questions = questions[: args.limit] if args.limit else questions
    if args.set != "ruler":
        rows_file(questions, rows_path)
    named = args.stem.removeprefix("press_kvpress") if args.stem.startswith("press_kvpress") else f"_{args.stem}"
    ref_path = Path(args.reference) if args.reference else WORK / f"kvpress{named}{quick}.json"
    kvpress_s = None if args.reference else run_kvpress(args, rows_path, ref_path, model_dir, new_tokens)
    if args.kvpress_only:
        print(f"kvpress's reference: {ref_path} (--kvpress-only: nothing compared)", flush=True)
        return
    try:
        specs = [parse_press(spec_of(p, r)).name for p in names for r in args.ratios.split(",")]
    except PressError as e:
        raise SystemExit(f"kvstore cannot run these presses: {e}; kvpress's reference is in {ref_path}") from None
    full = json.loads(ref_path.read_text())
    have = {r["id"] for r in full["rows"]}
    unfinished = [q["id"] for q in questions if q["id"] not in have]
    if unfinished and full["meta"].get("complete", True):
        raise SystemExit(f"{ref_path} is of other rows: it lacks {', '.join(unfinished)}")
    questions = [q for q in questions if q["id"] in have]  # an unfinished reference: the rows it has
    reference = restrict(full, [q["id"] for q in questions], specs)
    adapter = bl.load_adapter("float32")
    fmt = PromptFormat.from_chat_template(adapter.tokenizer)
    same_ids = args.set == "ruler" or all(  # RULER's ids are the backend's own, captured
        r["context_ids"] == adapter.encode_context(fmt.context_part(q["context"]), special_tokens=False)
        and r["question_ids"] == adapter.encode_question(fmt.question_part(q["question"]))
        for r, q in zip(reference["rows"], questions)
    )  # the chat format: its text holds the special tokens
    contexts = [r["context_ids"] for r in reference["rows"]]
    asked = [r["question_ids"] for r in reference["rows"]]
    distinct = list(dict.fromkeys(map(tuple, contexts)))
    bl.wait_for_quiet(max_wait_s=args.wait)
    with bl.timed() as t:
        mine = {key: kvstore_kept(adapter, list(key), specs) for key in distinct}
    kept_s = t.seconds
    kept_rows = compare_kept(reference, mine, args.near, reference_scores(ref_path, reference))

    shutil.rmtree(WORK / "store", ignore_errors=True)
    with KVStore(str(WORK / "store")) as store:
        adapter.build([list(c) for c in distinct], store)
        results = adapter.sweep(contexts, asked, variants=["dense", *specs], store=store, num_new_tokens=new_tokens,
                                stop_at_eos=True, batch_size=args.batch_size)  # fmt: skip
    answers = compare_answers(reference, results)
    replayed = replay_differences(adapter, reference, results, mine, new_tokens)
    rows = []
    for r in kept_rows:
        a = answers[r["spec"]]
        rows.append(r | {"rows": a["rows"], "answers_identical": a["answers_identical"],
                         "answer_tokens_agree": a["tokens_agree"] / a["tokens"] if a["tokens"] else None,
                         "kvpress_answers_equal_its_dense": a["kvpress_matches_its_dense"],
                         "kvpress_errors": a["kvpress_errors"], "differing_rows": a["differing_rows"]})  # fmt: skip
        print(f"  {r['spec']:>24}: sets {r['sets_identical']}/{r['sets']} (ties {r['differ_at_ties']}, near "
              f"{r['differ_near_ties']}, other {r['differ_otherwise']}; head counts {r['head_counts_agree']}/"
              f"{r['sets']}), jaccard {r['jaccard_mean']:.5f}, answers {a['answers_identical']}/"
              f"{a['rows'] - a['kvpress_errors']}" + (f" (kvpress raised on {a['kvpress_errors']})"
                                                      if a["kvpress_errors"] else ""), flush=True)  # fmt: skip
    d = answers["dense"]
    print(f"  dense answers identical {d['answers_identical']}/{d['rows']}", flush=True)
    meta = reference["meta"]
    errors = [{"id": r["id"], "spec": run_spec(x), "context_len": r["context_len"], **x["error"]}
              for r in reference["rows"] for x in r["runs"] if x.get("error")]  # fmt: skip
    notes = {
        "model": "SmolLM2-135M-Instruct (bundled GGUF converted to a Hugging Face directory), float32, CPU, sdpa",
        "kvpress_meta": {k: meta[k] for k in ("kvpress_version", "transformers_version", "torch_version",
                                              "attn_implementation", "presses", "pipeline") if k in meta},  # fmt: skip
        "reference_file": str(ref_path),
        "kvpress_s": kvpress_s,  # this run's kvpress_reference.py (None: --reference given)
        "kvpress_pipeline_s": sum(x["seconds"] for r in reference["rows"] for x in [r["dense"], *r["runs"]]),
        "kvstore_kept_s": kept_s,
        "kvstore_kept_from": "kvstore.model.press.select (row_scores, kept_positions)",
        "reference_complete": bool(full["meta"].get("complete", True)),
        "reference_rows": f"{len(reference['rows'])} of {len(reference['rows']) + len(unfinished)}",
        "rows_not_in_reference": unfinished,  # kvpress's run was stopped before them: not compared
        "reference_note": None if not unfinished else (
            f"kvpress's reference is unfinished (meta.complete false): its {len(reference['rows'])} rows are "
            f"compared, {len(unfinished)} asked rows are not ({', '.join(unfinished)}); kvpress was not run again"),
        "ids_equal_kvstore_prompt": same_ids,
        "context_tokens": [len(c) for c in distinct],
        "question_ids": [q["id"] for q in questions],
        "kvpress_errors": errors,
        "pyramid_ragged_lengths": meta.get("pyramid_ragged_lengths"),
        "pyramid": pyramid_notes(reference, mine, answers, replayed),
        "differing_answers_replayed": replayed,
        "dense": {"rows": d["rows"], "answers_identical": d["answers_identical"],
                  "answer_tokens_agree": d["tokens_agree"] / d["tokens"], "differing_rows": d["differing_rows"]},
        "answers": {"kvpress": {"dense": [r["dense"]["answer_text"] for r in reference["rows"]]},
                    "kvstore": {"dense": [adapter.decode(results["dense"].tokens[i]) for i in range(len(contexts))]}},
    }  # fmt: skip
    for spec in specs:
        press = parse_press(spec)
        theirs = [next(x for x in r["runs"] if parse_press(run_spec(x)) == press)["answer_text"]
                  for r in reference["rows"]]  # fmt: skip
        notes["answers"]["kvpress"][spec] = theirs
        notes["answers"]["kvstore"][spec] = [adapter.decode(results[spec].tokens[i]) for i in range(len(contexts))]
    params = vars(args) | {"new_tokens": new_tokens, "stop_at_eos": True}
    bl.write_result(
        args.stem,
        params=params,
        rows=rows,
        notes=notes,
        machine={"kvpress": meta["kvpress_version"], "kvpress_transformers": meta["transformers_version"]},
    )


if __name__ == "__main__":
    main()
