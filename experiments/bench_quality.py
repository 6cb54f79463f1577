"""The lossy codecs' quality gate (``kvstore.quality.quality_gate``, the ``kvstore quality`` command)
side by side on one text, and the decode speed of the 4-bit codecs on CPU.

Text, the bundled SmolLM2-135M-Instruct in float32, no chat template:

* ``prose`` (held out): the standard library's docstrings (``bench_frontier.prose_text``, the text
  the frontier's KL is measured on; no codec was tuned on it), ``--rows`` windows spread evenly over
  it, each ``--context`` tokens of cache then its next token fed and ``--new-tokens`` greedy tokens;
* ``report`` (held out, the third text): the docstrings of other standard-library modules
  (:data:`REPORT_SOURCES`, none of them in ``prose``), cut the same way: added for ``kvh`` (issue
  49), whose points were chosen before any of it was measured;
* ``tuning``: the demo articles joined (``experiments/data/demo.jsonl``), windows cut the same way:
  the text ``int4h``'s design was chosen on.

Per codec (every row of the JSON): bytes vs float32, next-token KL and top-1 agreement against the
lossless cache with keys and values quantized, only keys, only values; rows whose greedy answer is
identical and the mean common prefix (``quality.json``, per row in its notes). ``--decode``
(``quality_decode.json``): per codec, the first ``--decode-tokens`` tokens of the text (30 layers x
3 heads x 64 channels of real keys and values, prefilled) decoded from their stored bytes into
float32 buffers on CPU (``copy_into``, the load path's call, one payload per layer): median, min
and max of ``--repeats`` runs, on ``--threads`` threads.

Command (from the repository root; the suite ``quality``: ``python -m experiments run quality``
writes experiments/results/quality.json; run by hand it writes to cache/bench/raw/)::

    .venv/bin/python experiments/bench_quality.py
    .venv/bin/python experiments/bench_quality.py --text tuning --rows 12 --no-decode --stem quality_tuning
    .venv/bin/python experiments/bench_quality.py --no-gate --codecs int4h,int4,int4r,ecq,int8   # decode times only
    .venv/bin/python experiments/bench_quality.py --quick    # 3 rows, 4 new tokens
    .venv/bin/python experiments/bench_quality.py --text report --no-decode --codecs int8,kvh:8/4,... \
        --stem quality_kvh     # the kvh points (suite quality_kvh; its params name the codecs run)
"""

from __future__ import annotations

import json

from bench_frontier import prose_text

import benchlib as bl

# the third text: standard-library modules that neither ``prose`` (bench_frontier.PROSE_SOURCES) nor
# the tuning text used
REPORT_SOURCES = (
    "abc", "ast", "base64", "bisect", "bz2", "calendar", "cmd", "codecs", "configparser", "copy", "csv",
    "datetime", "dis", "filecmp", "fnmatch", "ftplib", "getopt", "gettext", "glob", "graphlib", "gzip", "hashlib",
    "hmac", "html.parser", "http.client", "imaplib", "io", "locale", "lzma", "mailbox", "mimetypes", "numbers",
    "operator", "optparse", "os", "pdb", "platform", "pprint", "queue", "sched", "secrets", "selectors", "shelve",
    "shlex", "smtplib", "socket", "socketserver", "ssl", "struct", "symtable", "sysconfig", "tabnanny", "tokenize",
    "trace", "traceback", "types", "wave", "zipimport", "zoneinfo",
)  # fmt: skip
CODECS = ("int4h", "int4", "int4r", "ecq", "int4r:32/32+zstd:1", "int8")


def windows(ids: list[int], n: int, size: int) -> list[list[int]]:
    step = (len(ids) - size) // max(1, n - 1) if n > 1 else 0
    if len(ids) < size or step < 0:
        raise SystemExit(f"the text has {len(ids)} tokens, fewer than {size}")
    return [ids[i * step : i * step + size] for i in range(n)]


def tuning_text() -> str:
    rows = [json.loads(line) for line in (bl.HERE / "data" / "demo.jsonl").read_text().splitlines() if line.strip()]
    return "\n\n".join(dict.fromkeys(r["context"] for r in rows))


def decode_speed(adapter, ids: list[int], codecs, repeats: int) -> list[dict]:
    import torch

    from kvstore.store.codecs import get_codec
    from kvstore.store.codecs.prerope import with_rotary

    (layers,) = adapter.prefill([ids])
    out = []
    for spec in codecs:
        codec = with_rotary(get_codec(spec), adapter.rotary)
        readers, dests = [], []
        for k, v in layers:
            payload, params, raw = codec.encode([("k", k, "keys"), ("v", v, "values")], {}, start=0)
            recs = codec.packing.unpack(payload, params, raw, threads=1).tensors
            for role, name, t in (("keys", "k", k), ("values", "v", v)):
                readers.append(codec.quantizer.reader(role, name, recs, tuple(t.shape), t.dtype, start=0))
                dests.append(torch.empty_like(t))

        def run(readers=readers, dests=dests):
            for r, d in zip(readers, dests):
                r.copy_into(d)

        s = bl.summarize(bl.repeat(run, repeats, warmup=1))
        mb = sum(d.numel() * d.element_size() for d in dests) / 1e6
        row = {"codec": codec.spec, "tokens": len(ids), "kv_mb": round(mb, 2), "decode_ms": s["median"] * 1e3,
               "decode_ms_min": s["min"] * 1e3, "decode_ms_max": s["max"] * 1e3}  # fmt: skip
        print(f"  decode {codec.spec:<22} {row['decode_ms']:7.1f} ms ({row['decode_ms_min']:.1f}-"
              f"{row['decode_ms_max']:.1f})  {mb / s['median']:.0f} MB/s", flush=True)  # fmt: skip
        out.append(row)
    return out


def summary(per_row: list[list[dict]], text: str) -> list[dict]:
    """Per codec, the rows' gates together: sums of rows and identical answers, means of the rest
    (every row has the same number of new tokens and of context tokens)."""
    import statistics

    out = []
    for j, first in enumerate(per_row[0]):
        recs = [r[j] for r in per_row]
        mean = statistics.mean
        out.append({
            "codec": first["codec"], "text": text, "rows": sum(r["rows"] for r in recs),
            "new_tokens": first["new_tokens"], "identical": sum(r["identical"] for r in recs),
            "common_prefix": mean(r["common_prefix"] for r in recs),
            "kl": {m: mean(r["kl"][m] for r in recs) for m in first["kl"]},
            "top1": {m: mean(r["top1"][m] for r in recs) for m in first["top1"]},
            "size_vs_f32": mean(r["size_vs_f32"] for r in recs),
            "size_vs_dtype": mean(r["size_vs_dtype"] for r in recs),
        })  # fmt: skip
    return out


def main() -> None:
    ap = bl.parser(__doc__)
    ap.add_argument("--text", choices=("prose", "report", "tuning"), default="prose")
    ap.add_argument("--codecs", default=",".join(CODECS))
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--gate", action=bl.argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--decode", action=bl.argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--decode-stem", default="quality_decode")
    ap.add_argument("--decode-tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--stem", default="quality")
    args = bl.start(ap, {"rows": 3, "new_tokens": 4, "decode_tokens": 256, "repeats": 3})
    from kvstore.model.adapter import Adapter
    from kvstore.quality import QualityRow

    adapter = Adapter.from_pretrained(None, dtype="float32", device="cpu")
    texts = {"prose": prose_text, "report": lambda: prose_text(REPORT_SOURCES), "tuning": tuning_text}
    text = texts[args.text]()
    ids = adapter.tokenizer.encode(text, add_special_tokens=False)
    rows = [QualityRow(tuple(w[:-1]), tuple(w[-1:])) for w in windows(ids, args.rows, args.context + 1)]
    codecs = args.codecs.split(",")
    if args.gate:
        gate(adapter, rows, codecs, args)
    if args.decode:
        speed = decode_speed(adapter, ids[: args.decode_tokens], codecs, args.repeats)
        bl.write_result(args.decode_stem, params=vars(args), rows=speed)


def gate(adapter, rows, codecs, args) -> None:
    from kvstore.quality import quality_gate

    per_row: list[list[dict]] = []  # per row, per codec: one row's gate (written after every row)
    with bl.timed() as t:  # every codec on the same lossless answers, computed once per row
        for i, row in enumerate(rows):
            per_row.append([q.record() for q in quality_gate(adapter, [row], codecs, new_tokens=args.new_tokens)])
            results = summary(per_row, args.text)
            print(f"  row {i + 1}/{len(rows)}: {t.elapsed():.0f} s (load {bl.loadavg()[0]})", flush=True)
            bl.write_result(args.stem, params=vars(args), rows=results, notes={"per_row": per_row})
    for r in results:
        print(f"  {r['codec']:<22} {r['size_vs_f32']:.3f}x f32  identical {r['identical']}/{r['rows']}  prefix "
              f"{r['common_prefix']:.3f}  KL {r['kl']['kv']:.5f} (K {r['kl']['keys']:.5f} V {r['kl']['values']:.5f})"
              f"  top1 {r['top1']['kv']:.4f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
