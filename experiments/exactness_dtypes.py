"""Agreement of cached vs no-cache greedy decoding per dtype, on the bundled model and demo set.

In float32 the two paths agree token for token (the tests prove it). In 16-bit dtypes, prefill
followed by a decode step and one long prefill round differently, and greedy decoding can flip
where two logits are nearly tied. This measures how often, on real questions.

Command (about 10 minutes on a 2-core CPU):

    .venv/bin/python experiments/exactness_dtypes.py --questions 40 --new-tokens 16

Prints a table; the suite ``exactness_dtypes`` (``python -m experiments run exactness_dtypes [ARGS]``)
writes experiments/results/exactness_dtypes.json (run by hand, the script writes to cache/bench/raw/).
"""

from __future__ import annotations

import torch

import benchlib as bl
from kvstore.data.datasets import load_dataset
from kvstore.data.prompts import PromptFormat
from kvstore.model.adapter import Adapter
from kvstore.model.load.loading import load_model
from kvstore.store.kvstore import KVStore


def measure(dtype: str, n_questions: int, new_tokens: int, batch_size: int) -> dict:
    loaded = load_model(None, dtype=dtype)
    adapter = Adapter(loaded.model, loaded.tokenizer, name=loaded.name, weight_files=loaded.weight_files)
    fmt = PromptFormat.from_chat_template(adapter.tokenizer)
    rows = load_dataset(bl.HERE / "data" / "demo.jsonl").examples[:n_questions]
    contexts = [fmt.context_part(r.context) for r in rows]
    questions = [fmt.question_part(r.question) for r in rows]
    kw = dict(
        special_tokens=fmt.add_special_tokens,
        batch_size=batch_size,
        stop_at_eos=False,
        return_details=True,
        return_scores=True,
    )
    with bl.timed() as t:
        with KVStore("memory://") as store:
            adapter.generate_kv_cache(contexts, store, special_tokens=fmt.add_special_tokens, batch_size=batch_size)
            cached = adapter.greedy_sample(contexts, questions, new_tokens, store=store, **kw)
        ref = adapter.greedy_sample(contexts, questions, new_tokens, use_cache=False, **kw)
    seconds = t.seconds
    same_rows = sum(bool(torch.equal(a, b)) for a, b in zip(cached.tokens, ref.tokens))
    first = sum(int(a[0] == b[0]) for a, b in zip(cached.tokens, ref.tokens))
    # tokens that agree before the first divergence, as a share of all generated tokens
    prefix = 0
    for a, b in zip(cached.tokens.tolist(), ref.tokens.tolist()):
        for x, y in zip(a, b):
            if x != y:
                break
            prefix += 1
    first_logit_diff = max(float((a[0] - b[0]).abs().max()) for a, b in zip(cached.scores, ref.scores))
    return {
        "dtype": dtype,
        "questions": len(rows),
        "new_tokens": new_tokens,
        "rows_identical": same_rows,
        "rows_identical_rate": same_rows / len(rows),
        "first_token_agreement": first / len(rows),
        "token_agreement_before_divergence": prefix / (len(rows) * new_tokens),
        "max_abs_first_step_logit_diff": first_logit_diff,
        "seconds": round(seconds, 1),
    }


def main() -> None:
    ap = bl.parser(__doc__, batch_size=8, quick=False)
    ap.add_argument("--questions", type=int, default=40)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--dtypes", default="float32,bfloat16,float16")
    args = bl.start(ap)
    torch.manual_seed(0)
    results = [measure(d, args.questions, args.new_tokens, args.batch_size) for d in args.dtypes.split(",")]
    bl.write_result("exactness_dtypes", params=vars(args), rows=results)
    print(
        f"{'dtype':<10}{'rows identical':>16}{'first token':>13}"
        f"{'tokens before divergence':>26}{'max |dlogit| step 1':>22}"
    )
    for r in results:
        print(
            f"{r['dtype']:<10}{r['rows_identical']:>9}/{r['questions']:<6}{r['first_token_agreement']:>12.1%}"
            f"{r['token_agreement_before_divergence']:>26.1%}{r['max_abs_first_step_logit_diff']:>22.2e}"
        )


if __name__ == "__main__":
    main()
