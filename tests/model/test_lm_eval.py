"""The lm-evaluation-harness backend (kvstore.lm_eval) against lm-eval's own ``hf`` model.

Tiny local tasks (tests/fixtures/lm_eval_tasks: multiple choice with 4 options and a shared task
description, rolling log-likelihood, generation until stop strings) run through
``lm_eval.simple_evaluate`` with ``hf`` and with ``kvstore`` on the same saved tiny model: the
metrics, every request's log-likelihood (1e-4, float32) and ``is_greedy``, and every generation
must agree; a second run on the same store computes no context token.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

lm_eval = pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'kvstore[eval]')")

from helpers.cli import run_main  # noqa: E402
from helpers.paths import FIXTURES  # noqa: E402

TASKS_DIR = FIXTURES / "lm_eval_tasks"
TASKS = ["kv_tiny_mc", "kv_tiny_ppl", "kv_tiny_gen"]
TOL = 1e-4


@pytest.fixture(scope="module")
def task_manager():
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(TASKS_DIR))


@pytest.fixture(scope="module")
def hf_lm():
    """lm-eval's ``hf`` model, built per saved tiny model (memoized)."""
    from lm_eval.models.huggingface import HFLM

    made: dict[tuple[str, int | None], HFLM] = {}

    def make(directory: Path, max_length: int | None = None) -> HFLM:
        key = (str(directory), max_length)
        if key not in made:
            made[key] = HFLM(
                pretrained=str(directory), dtype="float32", device="cpu", batch_size=3, max_length=max_length
            )
        return made[key]

    return make


def _evaluate(lm, task_manager, tasks=TASKS, **kwargs) -> dict:
    return lm_eval.simple_evaluate(model=lm, tasks=tasks, task_manager=task_manager, log_samples=True, **kwargs)


def _kvstore(directory: Path, store: Path | None, **kwargs):
    from kvstore.lm_eval import KVStoreLM

    if store is None:
        return KVStoreLM(pretrained=str(directory), use_cache=False, batch_size=3, **kwargs)
    return KVStoreLM(pretrained=str(directory), store=str(store), batch_size=3, **kwargs)


def assert_same(ref: dict, got: dict, tasks=TASKS) -> None:
    """Metrics equal (accuracies exactly, perplexities to 1e-6 relative), each request's
    log-likelihood within 1e-4 with the same is_greedy, generations identical."""
    for task in tasks:
        for name, value in ref["results"][task].items():
            if "," not in name or "stderr" in name:
                continue
            other = got["results"][task][name]
            if name.startswith(("acc", "exact_match")):
                assert other == value, (task, name)
            else:
                assert math.isclose(other, value, rel_tol=1e-6), (task, name, value, other)
        a = sorted(ref["samples"][task], key=lambda s: s["doc_id"])
        b = sorted(got["samples"][task], key=lambda s: s["doc_id"])
        assert len(a) == len(b) > 0
        for sa, sb in zip(a, b):
            assert len(sa["resps"]) == len(sb["resps"])
            for ra, rb in zip(sa["resps"], sb["resps"]):
                x, y = ra[0], rb[0]
                if isinstance(x, str):  # generation
                    assert x == y, (task, sa["doc_id"])
                elif isinstance(x, tuple):  # (loglikelihood, is_greedy)
                    assert abs(x[0] - y[0]) <= TOL, (task, sa["doc_id"], x, y)
                    assert x[1] == y[1], (task, sa["doc_id"])
                else:  # rolling loglikelihood
                    assert abs(x - y) <= TOL * max(1.0, abs(x) / 100), (task, sa["doc_id"], x, y)


def test_import_kvstore_does_not_import_lm_eval():
    code = "import sys, kvstore; kvstore.Adapter; kvstore.KVStore; print('lm_eval' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_help_lists_lm_eval_without_importing_it():
    code = (
        "import sys, kvstore.cli.main as m; m.app.main(['--help'], standalone_mode=False); "
        "print('IMPORTED' if 'lm_eval' in sys.modules else 'CLEAN')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "  lm-eval " in out and out.strip().endswith("CLEAN")


def test_registers_the_model_name():
    from lm_eval.api.registry import get_model

    from kvstore.lm_eval import KVStoreLM

    assert get_model("kvstore") is KVStoreLM


def test_shared_head():
    from kvstore.lm_eval import shared_head

    assert shared_head([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == [1, 2]
    assert shared_head([[1, 2, 3], [1, 2, 3]]) == []  # one distinct row: nothing to share
    assert shared_head([[7, 1], [8, 1]]) == []


@pytest.mark.parametrize("kind", ["neox", "llama"])
def test_matches_hf_and_second_run_computes_no_context(kind, request, tmp_path, task_manager, hf_lm):
    """kvstore (cold store, warm store, no cache) == hf on all three request types."""
    directory = request.getfixturevalue(f"tiny_{kind}_dir")
    ref = _evaluate(hf_lm(directory), task_manager)
    store = tmp_path / "store"
    cold = _kvstore(directory, store)
    got = _evaluate(cold, task_manager)
    assert_same(ref, got)
    assert cold.context_tokens_computed > 0
    cold.close()

    warm = _kvstore(directory, store)
    again = _evaluate(warm, task_manager)
    assert_same(ref, again)
    assert warm.context_tokens_computed == 0  # every context (options, windows, prompts) read back
    assert warm.context_tokens_loaded > 0
    warm.close()

    plain = _kvstore(directory, None)  # kvstore's own no-cache reference
    assert_same(ref, _evaluate(plain, task_manager))


def test_two_model_objects_on_one_store_in_one_process(tiny_neox_dir, tmp_path, task_manager):
    """lm-eval builds a model object for every ``simple_evaluate`` and never closes it: a second
    one on the same store, while the first is alive, opens it again (it failed before:
    "environment already open")."""
    from lm_eval.api.registry import get_model

    import kvstore.lm_eval  # noqa: F401 - registers the model name

    args = f"pretrained={tiny_neox_dir},store={tmp_path / 'store'},batch_size=3"
    first = get_model("kvstore").create_from_arg_string(args)  # what simple_evaluate(model="kvstore") does
    second = get_model("kvstore").create_from_arg_string(args)
    runs = [_evaluate(lm, task_manager, tasks=["kv_tiny_mc"], limit=2) for lm in (first, second)]
    assert runs[0]["results"]["kv_tiny_mc"] == runs[1]["results"]["kv_tiny_mc"]
    assert second.context_tokens_computed == 0  # the second read what the first stored


def test_truncation_and_rolling_windows_match_hf(tiny_llama_dir, tmp_path, task_manager, hf_lm):
    """max_length=32: documents roll over several windows, multiple-choice contexts are
    left-truncated and generation prompts cut to max_length - max_gen_toks, all as hf does."""
    ref = _evaluate(hf_lm(tiny_llama_dir, 32), task_manager)
    lm = _kvstore(tiny_llama_dir, tmp_path / "store", max_length=32)
    assert_same(ref, _evaluate(lm, task_manager))
    lm.close()


def test_sampling_request_is_refused(tiny_neox_dir, tmp_path, task_manager):
    from kvstore.errors import RequestError

    lm = _kvstore(tiny_neox_dir, tmp_path / "store")
    with pytest.raises(RequestError, match="greedily") as exc:
        _evaluate(lm, task_manager, tasks=["kv_tiny_gen"], gen_kwargs="do_sample=True,temperature=0.7")
    assert "\n" not in str(exc.value)
    assert lm.context_tokens_computed == 0  # refused before any work
    with pytest.raises(RequestError, match="num_beams"):
        _evaluate(lm, task_manager, tasks=["kv_tiny_gen"], gen_kwargs="num_beams=2")
    lm.close()


def test_unknown_model_arg_is_one_line(tiny_neox_dir, tmp_path):
    from kvstore.errors import ModelError

    with pytest.raises(ModelError, match="unknown model arg.*trust_remote_cod") as exc:
        _kvstore(tiny_neox_dir, tmp_path / "store", trust_remote_cod=True)
    assert "\n" not in str(exc.value)


def test_cli_runs_lm_eval_with_the_model_registered(capsys, tiny_llama_dir, tmp_path):
    store = tmp_path / "store"
    args = [
        "lm-eval", "--model", "kvstore", "--model_args", f"pretrained={tiny_llama_dir},store={store}",
        "--tasks", "kv_tiny_mc", "--include_path", str(TASKS_DIR), "--batch_size", "4",
    ]  # fmt: skip
    code, out, err = run_main(capsys, *args)
    assert code == 0, err
    assert "kv_tiny_mc" in out and "acc" in out
    assert store.is_dir()


def test_cli_refuses_sampling_in_one_line(capsys, tiny_neox_dir, tmp_path):
    args = [
        "lm-eval", "--model", "kvstore", "--model_args", f"pretrained={tiny_neox_dir},store={tmp_path / 'store'}",
        "--tasks", "kv_tiny_gen", "--include_path", str(TASKS_DIR), "--gen_kwargs", "do_sample=true,temperature=0.5",
    ]  # fmt: skip
    code, _, err = run_main(capsys, *args)
    assert code == 1
    errors = [line for line in err.splitlines() if line.startswith("kvstore: error:")]
    assert len(errors) == 1 and "sampling" in errors[0]


def test_cli_without_lm_eval_says_how_to_install(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval now raises ImportError
    monkeypatch.setitem(sys.modules, "lm_eval.__main__", None)
    code, _, err = run_main(capsys, "lm-eval", "--tasks", "x")
    assert code == 1
    assert err.strip().splitlines()[-1].startswith("kvstore: error: lm-eval is not installed")
    assert "pip install 'kvstore[eval]'" in err


def test_cli_help_is_lm_evals(capsys):
    code, out, _ = run_main(capsys, "lm-eval", "--help")
    assert code == 0
    assert "lm-eval" in out and "run" in out


def test_chat_template_prompts_match_hf(tiny_llama_dir, tmp_path, task_manager, hf_lm):
    """With lm-eval's --apply_chat_template the rendered prompts start with the BOS text (tiny
    llama's template), which both backends then encode without a second BOS."""
    tasks = ["kv_tiny_mc", "kv_tiny_gen"]
    ref = _evaluate(hf_lm(tiny_llama_dir), task_manager, tasks=tasks, apply_chat_template=True)
    lm = _kvstore(tiny_llama_dir, tmp_path / "store")
    got = _evaluate(lm, task_manager, tasks=tasks, apply_chat_template=True)
    assert_same(ref, got, tasks)
    assert ref["samples"]["kv_tiny_gen"][0]["arguments"][0][0].startswith("<s>")
    lm.close()


def test_generation_second_run_computes_no_context(tiny_neox_dir, tmp_path, task_manager):
    """Generation alone: the cold run computes (and stores) every prompt's context once (a batch
    loads what an earlier batch stored, such as the prompts' shared head, even while the writer
    still holds it), the warm run reads all of them back and computes none."""
    store = tmp_path / "store"
    cold = _kvstore(tiny_neox_dir, store)
    first = _evaluate(cold, task_manager, tasks=["kv_tiny_gen"])
    assert cold.context_tokens_computed > 0
    cold.close()
    warm = _kvstore(tiny_neox_dir, store)
    second = _evaluate(warm, task_manager, tasks=["kv_tiny_gen"])
    assert warm.context_tokens_computed == 0
    assert warm.context_tokens_loaded == cold.context_tokens_computed + cold.context_tokens_loaded
    assert_same(first, second, ["kv_tiny_gen"])
    warm.close()


def test_bad_model_arg_is_refused_before_loading(tmp_path):
    from kvstore.errors import ModelError
    from kvstore.lm_eval import KVStoreLM

    # the model path does not exist: the argument error comes first, without loading anything
    with pytest.raises(ModelError, match="batch_size='zero' is not an integer"):
        KVStoreLM(pretrained=str(tmp_path / "no-model"), store=str(tmp_path / "store"), batch_size="zero")
    with pytest.raises(ModelError, match="use_cache='maybe' is not a boolean"):
        KVStoreLM(pretrained=str(tmp_path / "no-model"), use_cache="maybe")
    assert not (tmp_path / "store").exists()


def test_a_press_from_the_store_equals_the_press_without_it_and_reuses_the_dense_store(
    tiny_llama_dir, tmp_path, task_manager
):
    """``press=SPEC``: scores and generations under the press from stored dense caches equal the
    press applied without a store; a run under another press over the same store computes no
    context token (the store keeps dense caches only)."""
    store = tmp_path / "store"
    tasks = ["kv_tiny_mc", "kv_tiny_gen"]
    cold = _kvstore(tiny_llama_dir, store, press="snapkv:0.5")
    first = _evaluate(cold, task_manager, tasks=tasks)
    assert cold.context_tokens_computed > 0
    cold.close()
    ref = _kvstore(tiny_llama_dir, None, press="snapkv:0.5")
    assert_same(_evaluate(ref, task_manager, tasks=tasks), first, tasks)
    other = _kvstore(tiny_llama_dir, store, press="knorm:0.75")
    _evaluate(other, task_manager, tasks=tasks)
    assert other.context_tokens_computed == 0 and other.context_tokens_loaded > 0
    assert other.get_model_info()["kvstore_press"] == "knorm:0.75"
    other.close()


@pytest.mark.parametrize("spec", ["kvzip:0.5", "expected_attention:0.5:adakv", "snapkv:0.5:pyramid"])
def test_a_leaderboard_press_from_the_store_equals_the_press_without_it(tiny_llama_dir, tmp_path, task_manager, spec):
    """The leaderboard's presses and budgets, registered in the press registry, are lm-eval model
    args like any other: scores and generations from the store equal the press without a store
    (KVzip's replay and ExpectedAttention's statistics read the stored dense cache)."""
    tasks = ["kv_tiny_mc", "kv_tiny_gen"]
    stored = _kvstore(tiny_llama_dir, tmp_path / "store", press=spec)
    got = _evaluate(stored, task_manager, tasks=tasks)
    assert stored.get_model_info()["kvstore_press"] == spec
    stored.close()
    ref = _kvstore(tiny_llama_dir, None, press=spec)
    assert_same(_evaluate(ref, task_manager, tasks=tasks), got, tasks)
    # the press is applied on both sides, not ignored on both: the dense log-likelihoods differ
    dense = _evaluate(_kvstore(tiny_llama_dir, None), task_manager, tasks=["kv_tiny_mc"])
    assert [s["resps"] for s in dense["samples"]["kv_tiny_mc"]] != [s["resps"] for s in got["samples"]["kv_tiny_mc"]]


def test_a_question_aware_or_bad_press_is_refused_before_loading(tmp_path):
    from kvstore.errors import ModelError
    from kvstore.lm_eval import KVStoreLM

    for spec, message in (("snapkv:0.5:q", "question-aware"), ("snapkv:2", "not in")):
        with pytest.raises(ModelError, match=message):
            KVStoreLM(pretrained=str(tmp_path / "no-model"), store=str(tmp_path / "store"), press=spec)
    assert not (tmp_path / "store").exists()
