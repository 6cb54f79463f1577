"""gc against a build that reuses its orphans between gc's plan and its deletes (issue 31, item 1),
as a user meets it: a store whose chunks have no context record (what a killed build leaves),
``kvstore gc`` waiting at its confirmation prompt while ``kvstore build`` of the same dataset runs
(it finds the chunks whole: "built 0, skipped N", and records its contexts), then ``y``. Before,
gc removed the chunks under the new records and ``verify`` failed; now it removes none of them.
On LMDB and on S3 (a real SeaweedFS on 127.0.0.1). The ordering is forced by the prompt itself,
not by sleeps."""

from __future__ import annotations

import json
import struct
import time

import click
import pytest

import kvstore.cli.common
from helpers.cli import build_argv, run_main, write_dataset
from kvstore.store.kvstore import KVStore


def _orphans_of_a_killed_build(store: str, model_dir, data, capsys, *, age: float) -> int:
    """Build, then drop every context record and date every chunk's last use ``age`` s back: the
    state a build killed before its records leaves, orphaned longer ago than gc's grace."""
    code, out, err = run_main(capsys, *build_argv(data, model_dir, store))
    assert code == 0, err
    with KVStore(store) as s:
        s.delete_many([], contexts=s.context_keys())
        chunks = s.keys()
        s.backend.put_many([(b"a/" + k.encode(), struct.pack("<d", time.time() - age)) for k in chunks])
    return len(chunks)


@pytest.mark.parametrize("where", ["lmdb", "s3"])
def test_gc_at_its_prompt_while_a_build_reuses_its_orphans(where, tiny_llama_dir, tmp_path, capsys, monkeypatch,
                                                          request):  # fmt: skip
    store = str(tmp_path / "store") if where == "lmdb" else request.getfixturevalue("s3_url")
    data = write_dataset(tmp_path / "data.jsonl", range(5), questions=1)
    n_chunks = _orphans_of_a_killed_build(store, tiny_llama_dir, data, capsys, age=7200)
    builds, printed = [], []

    def answer_after_a_build(question, default=False, err=True):
        # while gc waits here with its plan, the same dataset is built again (same process: one
        # LMDB store may be opened twice now), then the user says yes
        printed.append(capsys.readouterr().out)  # gc's plan, so far
        builds.append(run_main(capsys, *build_argv(data, tiny_llama_dir, store)))
        return True

    monkeypatch.setattr(kvstore.cli.common, "stdin_is_tty", lambda: True)
    monkeypatch.setattr(click, "confirm", answer_after_a_build)
    code, out, err = run_main(capsys, "gc", "--store", store, "--quiet")
    assert code == 0, err
    out = printed[0] + out
    (build_code, build_out, build_err), = builds  # fmt: skip
    summary = json.loads(build_out)
    assert build_code == 0 and (summary["built"], summary["skipped"]) == (0, 5), build_err
    assert f"{n_chunks} entries to remove" in out  # the plan named every chunk...
    assert "Removed 0 contexts and 0 entries" in out and f"Kept {n_chunks} of the planned" in out  # ...none went
    code, out, err = run_main(capsys, "verify", "--store", store, "--quiet")
    assert code == 0 and "5 contexts verified, all intact" in out, (out, err)


def test_gc_warns_below_a_safe_grace(tmp_path, capsys):
    store = str(tmp_path / "store")
    KVStore(store).close()
    code, out, err = run_main(capsys, "gc", "--store", store, "--grace", "1s", "--dry-run")
    assert code == 0 and "Nothing to remove." in out
    assert err == (
        "kvstore: warning: --grace 1s is under 10 minutes: chunks a running build has written but not recorded yet "
        "may go (the build then computes them again)\n"
    )
    assert run_main(capsys, "gc", "--store", store, "--grace", "10m", "--dry-run")[2] == ""
