"""Print the markdown tables the README's benchmark section quotes, from the committed result files.

Command (from the repository root)::

    .venv/bin/python experiments/report.py
"""

from __future__ import annotations

import json

import benchlib as bl


def load(name: str) -> dict | None:
    path = bl.RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def machine_line(m: dict) -> str:
    return (
        f"{m['cpu']}, {m['cores']} cores, {m.get('mem_gib')} GiB, no GPU; torch {m['torch']}, transformers "
        f"{m['transformers']}, {m['torch_threads']} threads; load average before {m['load_before']}, after "
        f"{m.get('load_after')}; {m['date']}"
    )


def classic() -> None:
    for name in ("classic", "classic_compile"):
        d = load(name)
        if not d:
            continue
        print(
            f"### {name}\n\n{machine_line(d['machine'])}; prompt {d['prompt_tokens']} tokens, {d['repeats']} "
            f"repeats; {d['notes']}\n"
        )
        rows = [
            (
                r["method"],
                f"{r['tokens_per_s']:.1f}",
                f"{r['tokens_per_s_min']:.1f}-{r['tokens_per_s_max']:.1f}",
                f"{r['x_dynamic']:.2f}x",
                r["same_tokens_as_dynamic"],
            )
            for r in d["rows"]
        ]
        print(
            bl.md_table(rows, ["method", "tokens/s (median)", "min-max", "vs dynamic", "same tokens as dynamic"]) + "\n"
        )


def ttft() -> None:
    d = load("ttft")
    if not d:
        return
    print(
        f"### ttft\n\n{machine_line(d['machine'])}; {d['repeats']} repeats ({d['recompute_repeats']} for recompute)\n"
    )
    lengths = sorted({r["context_tokens"] for r in d["rows"]})
    methods = list(dict.fromkeys(r["method"] for r in d["rows"]))
    by = {(r["method"], r["context_tokens"]): r for r in d["rows"]}
    rows = []
    for m in methods:
        cells = []
        for n in lengths:
            r = by.get((m, n))
            cells.append(
                ""
                if r is None
                else f"{r['total_median_s'] * 1e3:.0f} ms ({r['speedup_vs_recompute']:.1f}x, {r['x_floor']:.2f}F)"
            )
        rows.append((m, *cells))
    print(bl.md_table(rows, ["method \\ context tokens", *map(str, lengths)]))
    print("\nms: median TTFT; (Nx) speed-up over recompute; F: multiple of the floor.\n")
    rows = []
    for m in methods:
        rows.append(
            (
                m,
                *(
                    f"{by[(m, n)]['load_median_s'] * 1e3:.0f} + {by[(m, n)]['forward_median_s'] * 1e3:.0f}"
                    if (m, n) in by
                    else ""
                    for n in lengths
                ),
            )
        )
    print(bl.md_table(rows, ["load + forward (ms)", *map(str, lengths)]) + "\n")


def throughput() -> None:
    d = load("throughput")
    if not d:
        return
    print(f"### throughput\n\n{machine_line(d['machine'])}; {d['repeats']} repeats\n")
    rows = [
        (
            r["dtype"],
            r["codec"],
            r["path"],
            f"{r['median_ms']:.1f}",
            f"{r['mb_per_s']:.0f}",
            f"{r['mb_per_s_min']:.0f}-{r['mb_per_s_max']:.0f}",
            f"{r['pct_memcpy_fresh']:.0f}%",
            f"{r['pct_memcpy_prealloc']:.0f}%",
        )
        for r in d["rows"]
    ]
    print(
        bl.md_table(
            rows, ["KV dtype", "codec", "path", "ms", "MB/s", "MB/s min-max", "% fresh memcpy", "% prealloc memcpy"]
        )
        + "\n"
    )


def codecs() -> None:
    d = load("codecs")
    if not d:
        return
    print(f"### codecs\n\n{machine_line(d['machine'])}; {d['repeats']} repeats, decode threads {d['decode_threads']}\n")
    rows = [
        (
            r["dtype"],
            r["codec"],
            f"{r['ratio']:.3f}",
            f"{r['compress_mb_s']:.0f}",
            f"{r['decompress_mb_s']:.0f}",
            f"{r['decompress_1thread_mb_s']:.0f}",
            f"{r['decode_copy_mb_s']:.0f}",
        )
        for r in d["rows"]
    ]
    print(
        bl.md_table(
            rows,
            [
                "KV dtype",
                "codec",
                "stored/raw",
                "compress MB/s",
                "decompress MB/s (2 thr)",
                "decompress MB/s (1 thr)",
                "decode+copy MB/s",
            ],
        )
        + "\n"
    )


def e2e() -> None:
    d = load("e2e")
    if not d:
        return
    if "main" in d:
        m = d["main"]
        b = m["build"]
        print(f"### e2e main\n\n{machine_line(m['machine'])}\n")
        print(
            f"dataset: {m['dataset']}; build {b['seconds']:.1f} s ({b.get('tokens_computed', b.get('tokens'))} tokens, "
            f"{b['tokens_per_second']:.0f} tok/s, "
            f"store_seconds {b['store_seconds']:.1f} s = {m['build_store_share']:.1%} of build, ratio {b['ratio']}), "
            f"peak RSS {b['peak_rss_mib']:.0f} MiB\n"
        )
        rows = [
            (
                "sample (warm store)",
                f"{r['seconds']:.1f}",
                f"{r['questions_per_second']:.2f}",
                f"{r['wall_seconds']:.1f}",
                f"{r['peak_rss_mib']:.0f}",
            )
            for r in m["sample_cached"]
        ]
        rows += [
            (
                "sample --no-cache",
                f"{r['seconds']:.1f}",
                f"{r['questions_per_second']:.2f}",
                f"{r['wall_seconds']:.1f}",
                f"{r['peak_rss_mib']:.0f}",
            )
            for r in m["sample_nocache"]
        ]
        print(bl.md_table(rows, ["command", "answering s", "questions/s", "CLI wall s", "peak RSS MiB"]))
        print(
            f"\nspeed-up {m['speedup']:.1f}x (CLI wall {m['speedup_wall']:.1f}x); identical predictions "
            f"{m['identical_predictions']}\n"
        )
    if "sweep" in d:
        s = d["sweep"]
        print(f"### e2e sweep\n\n{machine_line(s['machine'])}\n")
        rows = [
            (
                r["max_new_tokens"],
                r["mean_answer_tokens"],
                f"{r['cached_s']:.1f} ({', '.join(f'{x:.1f}' for x in r.get('cached_s_all', []))})",
                f"{r['nocache_s']:.1f}",
                f"{r['speedup']:.1f}x",
                r.get("identical_predictions", ""),
            )
            for r in s["rows"]
        ]
        print(
            bl.md_table(rows, ["-n", "mean answer tokens", "cached s (runs)", "no-cache s", "speed-up", "identical"])
            + "\n"
        )
    if "cold" in d:
        c = d["cold"]
        print(f"### e2e cold\n\n{machine_line(c['machine'])}\n")
        rows = [
            (state, r["questions"], f"{r['seconds']:.1f}", r["load"]) for state in ("cold", "warm") for r in c[state]
        ]
        print(bl.md_table(rows, ["store", "questions", "answering s", "load"]) + "\n")
    if "overhead" in d:
        o = d["overhead"]
        print(f"### e2e overhead\n\n{machine_line(o['machine'])}\n")
        print(
            f"{o['contexts']} contexts, {o['tokens']} tokens: prefill only {o['prefill_only_s']} s (batch 1: "
            f"{o.get('prefill_only_batch1_s')} s), build {o['build_s']} s; "
            f"overhead {o['overhead_share']:.1%} of build wall; writer busy {o['writer_busy_share']:.1%}; compute "
            "waited "
            f"{o['waited_share']:.1%}\n"
        )


def prefix() -> None:
    d = load("prefix")
    if not d:
        return
    print(f"### prefix\n\n{machine_line(d['meta']['machine'])}\n")
    rows = [
        (
            r["part"],
            r["variant"],
            r["format"],
            r["contexts"],
            f"{r['tokens_computed']:,}",
            f"{r['tokens_reused']:,}",
            f"{r['build_seconds']:.1f}",
            r["entries"],
            f"{r['stored_bytes'] / 1e6:,.0f}",
        )
        for r in d["rows"]
    ]
    heads = ["part", "variant", "format", "contexts", "tokens computed", "tokens reused", "build s", "entries", "MB"]
    print(bl.md_table(rows, heads) + "\n")


def quant() -> None:
    for stem in (
        "quant",
        "quant_bf16",
        "quant_prerope",
        "quant_prerope_bf16",
        "quant_prerope_groups",
        "quant_prerope_groups2",
    ):
        d = load(stem)
        if d:
            quant_table(stem, d)


def _spread(r: dict, what: str) -> str:
    """``median (min-max)`` in ms of a quant row's timing, or ``""``."""
    t = r.get("timing", {}).get(what)
    return f"{t['median'] * 1e3:.0f} ({t['min'] * 1e3:.0f}-{t['max'] * 1e3:.0f})" if t else ""


def quant_table(stem: str, d: dict) -> None:
    print(f"### {stem}\n\n{machine_line(d['meta']['machine'])}\n")
    rows = [
        (
            r["dtype"],
            r["set"],
            r["codec"],
            f"{r['size_vs_f32']:.3f}" if "size_vs_f32" in r else "",
            f"{r['rows_identical']}/{r['rows']}",
            f"{r['tokens_before_divergence']:.2f}/12",
            f"{r['max_dlogit']:.3f}",
            f"{r['contains']}",
            _spread(r, "load"),
            _spread(r, "ttft"),
        )
        for r in d["rows"]
    ]
    heads = ["dtype", "set", "codec", "size vs fp32", "rows identical", "tokens before divergence", "max dlogit",
             "contains", "load ms median (min-max)", "TTFT ms median (min-max)"]  # fmt: skip
    print(bl.md_table(rows, heads) + "\n")


def llamacpp() -> None:
    d = load("llamacpp")
    if not d:
        return
    print(f"### llamacpp\n\n{machine_line(d['machine'])}; {d['repeats']} repeats\n")
    rows = [
        (
            r["context_tokens"],
            r["method"],
            f"{r['median_s'] * 1e3:.0f} ({r['min_s'] * 1e3:.0f}-{r['max_s'] * 1e3:.0f})",
            f"{r['vs_llamacpp_state_file']:.2f}",
            f"{r['vs_llamacpp_seq_memory']:.2f}",
            r.get("state_bytes", r.get("stored_bytes", "")),
        )
        for r in d["rows"]
    ]
    heads = ["tokens", "method", "ms median (min-max)", "x state file", "x seq in memory", "bytes"]
    print(bl.md_table(rows, heads) + "\n")


def demo_prompt() -> None:
    d = load("demo_prompt")
    if not d:
        return
    print(f"### demo prompt\n\n{machine_line(d['machine'])}\n")
    rows = [
        (
            r["variant"],
            f"{r['accuracy']:.1%}",
            f"{r['contains']:.1%}",
            f"{r['exact_match']:.1%}",
            f"{r['f1']:.1%}",
            f"{r['mean_words']:.1f}",
        )  # fmt: skip
        for r in d["rows"]
    ]
    print(bl.md_table(rows, ["prompt", "accuracy", "contains", "EM", "F1", "words"]) + "\n")


if __name__ == "__main__":
    classic()
    ttft()
    throughput()
    codecs()
    e2e()
    prefix()
    quant()
    llamacpp()
    demo_prompt()
