"""Prefix reuse (format 2) against whole-context entries (format 1), through the CLI as a user runs it.

Three workloads, each built by ``kvstore build --format json`` in a subprocess with the bundled
SmolLM2-135M-Instruct in float32, 2 threads:

``fewshot``
    One shared few-shot block of about 500 tokens (question/answer pairs cut from the demo articles)
    in the prompt template's head, then ``--docs`` documents of ~250 words each. Built twice into
    fresh stores: by this checkout (format 2: the head is its own chain of chunks, stored once) and
    by the format-1 code of commit ``V1_COMMIT`` (one whole-context entry per document, the head
    inside each). Reports the bytes on disk, tokens computed and build time of both.
``longer``
    ``--long-docs`` documents of ~800 words; first the first half of each (its first 400 words) is
    built, then the whole documents on top of that store (the halves are prefixes of the wholes),
    against the whole documents built into a fresh store (recompute). Reports tokens computed and
    reused and the build time of both, and the extension's time as a fraction of recompute.
``chat``
    The demo set with the chat template (the default for SmolLM2): every context starts with the
    same system turn. Built by both formats, with the template's own system prompt and with a longer
    ``--system`` prompt; reports the bytes saved by storing the system turn once.

Bytes are counted from the LMDB files directly, the same way for both formats: the values under
``e/`` (entries or chunks) and ``r/`` (format 2's context records), and the pages LMDB uses.

Command (from the repository root; the suite ``prefix``: ``python -m experiments run prefix [ARGS]``
writes experiments/results/; run by hand it writes to cache/bench/raw/)::

    .venv/bin/python experiments/bench_prefix.py
    .venv/bin/python experiments/bench_prefix.py --quick    # smoke test: few documents, short texts
    .venv/bin/python -m experiments run prefix --parts longer    # one part again: the other parts' committed rows stay

The format-1 code is exported from git history into ``cache/bench/prefix/v1-code`` (needs the
repository's history; a shallow clone cannot run the ``v1`` rows).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import benchlib as bl

WORK = bl.SCRATCH / "prefix"
V1_COMMIT = "8730376"  # the last commit whose store wrote format-1 entries
V1_CODE = WORK / "v1-code"
QUESTION = "What is the first place named in the text?"
LONG_SYSTEM = (
    "You are a careful research assistant. Answer every question from the document given in the "
    "user's message and from nothing else. Give the shortest answer that is complete: a name, a "
    "number, a date or a short phrase, with no explanation and no full sentence. If the document does "
    "not hold the answer, say that it does not. Keep names exactly as the document spells them, "
    "including titles and initials, and give numbers with their units."
)


def fewshot_block(tokenizer, target: int) -> tuple[str, int]:
    """Question/answer examples (a passage's first sentences, a question, its answer) from the demo
    set, added until the block holds at least ``target`` tokens."""
    parts, seen = [], set()
    for row in bl.demo_rows():
        if row["context"] in seen:
            continue
        seen.add(row["context"])
        passage = ". ".join(row["context"].split(". ")[:2]).rstrip(".") + "."
        parts.append(f"Passage: {passage}\nQuestion: {row['question']}\nAnswer: {row['answers'][0]}\n\n")
        text = "Answer each question from its passage in a few words.\n\n" + "".join(parts)
        n = len(tokenizer(text, add_special_tokens=False).input_ids)
        if n >= target:
            return text, n
    raise ValueError(f"the demo set holds fewer than {target} tokens of examples")


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return path


def store_bytes(path: Path) -> dict:
    """Bytes under each key prefix of an LMDB store, and the pages it uses."""
    import lmdb

    env = lmdb.open(str(path), readonly=True, lock=False, subdir=True, max_dbs=0)
    try:
        out = {"entries": 0, "entry_bytes": 0, "record_bytes": 0, "other_bytes": 0}
        with env.begin() as txn:
            for k, v in txn.cursor():
                if k.startswith(b"e/"):
                    out["entries"] += 1
                    out["entry_bytes"] += len(v)
                elif k.startswith(b"r/"):
                    out["record_bytes"] += len(v)
                else:
                    out["other_bytes"] += len(v)
        info, stat = env.info(), env.stat()
        out["used_bytes"] = (info["last_pgno"] + 1) * stat["psize"]
        out["stored_bytes"] = out["entry_bytes"] + out["record_bytes"]
        return out
    finally:
        env.close()


def v1_code() -> Path:
    """The format-1 kvstore and CLI, exported from git history once."""
    if not (V1_CODE / "cli" / "main.py").exists():
        V1_CODE.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "archive", V1_COMMIT, "kvstore", "cli"], cwd=bl.ROOT, check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(V1_CODE)], input=archive, check=True)
    return V1_CODE


def kvstore_cmd(fmt: int) -> list[str]:
    if fmt == 2:
        return [sys.executable, "-m", "kvstore"]
    code = v1_code()
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(code)!r}); from cli.main import main; main()"]


def build(fmt: int, dataset: Path, store: Path, *extra: str, threads: int, fresh: bool = True) -> dict:
    if fresh and store.exists():
        shutil.rmtree(store)
    cmd = [*kvstore_cmd(fmt), "build", str(dataset), "--store", str(store), "-q", "--format", "json", *extra]
    env = {"OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    import os

    with bl.timed() as t:
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env})
    wall = t.seconds
    if proc.returncode != 0:
        raise SystemExit(f"format-{fmt} build failed:\n{proc.stderr[-2000:]}")
    summary = json.loads(proc.stdout)
    summary["wall_seconds"] = wall
    return summary


def row(part: str, variant: str, fmt: int, summary: dict, nbytes: dict, **extra) -> dict:
    return {
        "part": part,
        "variant": variant,
        "format": fmt,
        "contexts": summary.get("built", 0) + summary.get("skipped", 0),
        "tokens_computed": summary.get("tokens_computed", summary.get("tokens")),
        "tokens_reused": summary.get("tokens_reused", 0),
        "build_seconds": summary.get("seconds"),
        "wall_seconds": summary["wall_seconds"],
        "entries": nbytes["entries"],
        "stored_bytes": nbytes["stored_bytes"],
        "used_bytes": nbytes["used_bytes"],
        **extra,
    }


def part_fewshot(args, tokenizer) -> list[dict]:
    block, block_tokens = fewshot_block(tokenizer, args.prefix_tokens)
    docs = [bl.synthetic_text(args.doc_words, seed=1000 + i) for i in range(args.docs)]
    data = write_jsonl(
        WORK / "fewshot.jsonl", [{"id": f"d{i}", "context": d, "question": QUESTION} for i, d in enumerate(docs)]
    )
    template = block + "Passage: {context}\nQuestion: {question}\nAnswer:"
    opts = ["--no-chat", "--template", template]
    rows = []
    for fmt in (1, 2):
        store = WORK / f"fewshot-v{fmt}"
        summary = build(fmt, data, store, *opts, threads=args.threads)
        rows.append(
            row("fewshot", "few-shot head + documents", fmt, summary, store_bytes(store), prefix_tokens=block_tokens)
        )
        print(f"  fewshot v{fmt}: {rows[-1]}", flush=True)
    return rows


def part_longer(args) -> list[dict]:
    words = [bl.synthetic_text(args.long_words, seed=2000 + i).split(" ") for i in range(args.long_docs)]
    half = write_jsonl(
        WORK / "half.jsonl",
        [{"id": f"h{i}", "context": " ".join(w[: len(w) // 2]), "question": QUESTION} for i, w in enumerate(words)],
    )
    whole = write_jsonl(
        WORK / "whole.jsonl",
        [{"id": f"w{i}", "context": " ".join(w), "question": QUESTION} for i, w in enumerate(words)],
    )
    rows = []
    store = WORK / "longer"
    s = build(2, half, store, threads=args.threads)
    rows.append(row("longer", "halves (stored first)", 2, s, store_bytes(store)))
    s = build(2, whole, store, threads=args.threads, fresh=False)
    rows.append(row("longer", "wholes on stored halves", 2, s, store_bytes(store)))
    s = build(2, whole, WORK / "longer-fresh", threads=args.threads)
    rows.append(row("longer", "wholes recomputed (fresh store)", 2, s, store_bytes(WORK / "longer-fresh")))
    ext, fresh = rows[1], rows[2]
    ext["time_vs_recompute"] = ext["build_seconds"] / fresh["build_seconds"]
    ext["tokens_vs_recompute"] = ext["tokens_computed"] / fresh["tokens_computed"]
    for r in rows:
        print(f"  longer: {r}", flush=True)
    return rows


def part_chat(args) -> list[dict]:
    data = bl.HERE / "data" / "demo.jsonl"
    rows = []
    for variant, opts in (("template's system turn", []), ("long --system prompt", ["--system", LONG_SYSTEM])):
        for fmt in (1, 2):
            store = WORK / f"chat-v{fmt}"
            summary = build(fmt, data, store, "--chat", *opts, threads=args.threads)
            rows.append(row("chat", variant, fmt, summary, store_bytes(store)))
            print(f"  chat v{fmt} {variant}: {rows[-1]}", flush=True)
    return rows


def main() -> None:
    ap = bl.parser(__doc__)
    ap.add_argument("--parts", default="fewshot,longer,chat")
    ap.add_argument("--docs", type=int, default=50)
    ap.add_argument("--doc-words", type=int, default=250)
    ap.add_argument("--prefix-tokens", type=int, default=500)
    ap.add_argument("--long-docs", type=int, default=20)
    ap.add_argument("--long-words", type=int, default=800)
    quick = dict(docs=4, doc_words=60, prefix_tokens=120, long_docs=3, long_words=200)
    args = bl.start(ap, quick=quick, wait=False)  # waits for a quiet machine once the tokenizer is loaded
    from kvstore.model.load.loading import load_model

    tokenizer = load_model(None, dtype="float32", device="cpu").tokenizer
    bl.wait_for_quiet(max_wait_s=args.wait)
    rows: list[dict] = []
    parts = args.parts.split(",")
    if "fewshot" in parts:
        rows += part_fewshot(args, tokenizer)
    if "longer" in parts:
        rows += part_longer(args)
    if "chat" in parts:
        rows += part_chat(args)
    bl.write_result("prefix", params=vars(args), rows=rows, notes={"v1_commit": V1_COMMIT})


if __name__ == "__main__":
    main()
