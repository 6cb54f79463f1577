"""Cache families: what kvstore serves exactly, and a one-line refusal for everything else.

Models whose attention does not see positions the way kvstore lays them out (sliding or chunked
windows counted over cache slots, ALiBi over slots, RoPE that rescales with the longest position
of a forward pass) or that keep a recurrent state instead of (or beside) attention KV are refused
at ``build`` and ``sample`` with one line naming the family, never answered wrongly. Models whose
position handling survives the layout (ALiBi computed from the 2-D mask, learned absolute
positions) are served and checked against Hugging Face ``generate``, one row at a time.
"""

from __future__ import annotations

import re

import pytest
import torch

from helpers.cli import run_main, write_dataset
from kvstore.errors import ModelError
from kvstore.model.adapter import Adapter
from kvstore.store.kvstore import KVStore
from tiny import make_family_model, save_family_model

REFUSED = {
    "mistral": "sliding-window attention",
    "gemma3": "sliding-window attention",
    "qwen2-sliding": "sliding-window attention",
    "mamba2": "state-space",
    "bamba": "hybrid attention + state-space",
    "lfm2": "hybrid attention + state-space",
    "mpt": "ALiBi",
    "llama-dynamic-rope": "dynamic RoPE",
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_families_name_the_reason(name):
    model, tok = make_family_model(name, attn_implementation=None)
    adapter = Adapter(model, tok)
    with KVStore("memory://") as store:
        with pytest.raises(ModelError, match=re.escape(REFUSED[name])):
            adapter.generate_kv_cache([[5, 6, 7]], store)
        assert len(store) == 0
    for use_cache in (True, False):  # the no-cache path lays rows out the same way: refused too
        with pytest.raises(ModelError, match=re.escape(REFUSED[name])):
            adapter.greedy_sample([[5, 6, 7]], [[8]], 2, use_cache=use_cache)


@pytest.mark.parametrize("name", ["mamba2", "mistral"])
@pytest.mark.parametrize("command", ["build", "sample"])
def test_cli_refuses_with_one_line(name, command, tmp_path, capsys):
    """Through the CLI (whose loader must also accept a model that has no SDPA path, like Mamba2)."""
    model_dir = save_family_model(tmp_path / name, name)
    dataset = write_dataset(tmp_path / "data.jsonl", range(2))
    capsys.readouterr()  # saving the model prints a progress bar
    code, out, err = run_main(capsys, command, dataset, "--model", model_dir, "--store", tmp_path / "store", "--quiet")
    assert code == 1 and out == "", err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvstore: error: ") and REFUSED[name] in lines[0], err
    assert "Traceback" not in err and "internal error" not in err


def _per_row_generate(model, prompts, n):
    out = []
    for p in prompts:
        x = torch.tensor([p])
        g = model.generate(
            input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
        out.append(g[0, len(p) :].tolist())
    return out


@pytest.mark.parametrize("name", ["bloom", "gpt2"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_position_schemes_that_survive_the_layout_are_exact(name, dtype):
    """ALiBi from the 2-D mask (Bloom) and learned absolute positions (GPT-2): cached ==
    no-cache == per-row generate at batch sizes 1, 3 and 8, mixed lengths."""
    model, tok = make_family_model(name, dtype=dtype, seed=3, attn_implementation="eager")
    adapter = Adapter(model, tok)
    g = torch.Generator().manual_seed(0)
    vocab = [i for i in range(len(tok)) if i not in tok.all_special_ids]
    pick = lambda n: [vocab[int(i)] for i in torch.randint(len(vocab), (n,), generator=g)]  # noqa: E731
    contexts = [pick(n) for n in (1, 7, 31, 12, 3, 20, 9, 5)]
    contexts[-1] = list(contexts[0])
    questions = [pick(n) for n in (3, 1, 5, 2, 4, 6, 1, 2)]
    want = _per_row_generate(model, [c + q for c, q in zip(contexts, questions)], 6)
    with KVStore("memory://") as store:
        adapter.generate_kv_cache(contexts, store, batch_size=3)
        for bs in (1, 3, 8):
            got = adapter.greedy_sample(contexts, questions, 6, store=store, batch_size=bs, stop_at_eos=False)
            assert got.tolist() == want, f"cached, batch size {bs}"
            ref = adapter.greedy_sample(contexts, questions, 6, use_cache=False, batch_size=bs, stop_at_eos=False)
            assert ref.tolist() == want, f"no cache, batch size {bs}"
