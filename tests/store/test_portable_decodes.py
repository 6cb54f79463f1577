"""Portable decodes: every golden entry decodes to the same bits, and every lossy golden entry is
encoded to the same bytes, whatever kernels torch and MKL dispatch to and however many threads run.

One subprocess per dispatch setting (``ATEN_CPU_CAPABILITY`` default / avx2 / avx512 as the CPU
allows, ``MKL_ENABLE_INSTRUCTIONS=AVX2``, 1 and 2 threads) runs this file as a script: it decodes
every golden ``.kvs`` file and encodes every lossy golden entry afresh, and prints the sha256 of
the bits. The runs must agree with one another and with the facts the golden files pin. A decode
that used a matrix product, a reduction, a fused multiply-add of an inexact product or a libm
``cos`` would give other bits under some setting (or on another machine: the golden comparison
catches what this CPU's settings alone may not). See docs/lossy-codecs.md, "Portable decodes".
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
THREADS_VAR = "KVSTORE_PROBE_THREADS"
# the lossy golden entries encoded afresh: (facts file, spec, maker in helpers.entries)
FRESH = [
    ("format_v2_lossy.json", "int8:64", "golden_quant_entry"),
    ("format_v2_lossy.json", "int4:32/64", "golden_quant_entry"),
    ("format_v2_lossy.json", "fp8", "golden_quant_entry"),
    ("format_v3_prerope.json", "int4r", "golden_rotary_entry"),
    ("format_v4_ecq.json", "ecq", "golden_rotary_entry"),
    ("format_v6_int4h.json", "int4h", "golden_rotary_entry"),
    ("format_v7_kvh.json", "kvh:6/3:16/8:s=2:t=8", "golden_quant_entry"),
]


def probe() -> dict:
    """What this process makes of the golden files: ``{"capability", "threads", "decoded/FILE":
    sha256 of every record's and layer's bits (entries of formats 1-4, 6, 7), "derived/FILE": the
    derived entries' decoded sha256, "fresh/SPEC": lossy facts of a fresh encoding}``."""
    import importlib

    import torch

    if os.environ.get(THREADS_VAR):
        torch.set_num_threads(int(os.environ[THREADS_VAR]))
    from helpers import entries
    from helpers.entries import bits, lossy_facts
    from helpers.paths import GOLDEN
    from kvstore.store.entry import decode_entry

    out: dict = {"capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads()}
    for path in sorted(GOLDEN.glob("entry_v[1-467]_*.kvs")):
        view, h = decode_entry(path.read_bytes()), hashlib.sha256()
        for rec in sorted(view.records):  # as test_every_older_golden_file_still_decodes_to_the_same_tensors
            h.update(rec.encode())
            h.update(bits(view.records[rec].materialize()).numpy().tobytes())
        for kv in view.layers:
            for t in kv or ():
                h.update(bits(t.materialize()).numpy().tobytes())
        out["decoded/" + path.name] = h.hexdigest()
        if path.name.startswith(("entry_v6_", "entry_v7_")):
            out["stored/" + path.name] = lossy_facts(path.read_bytes())["decoded_sha256"]
    derived = importlib.import_module("test_derived")
    for path in sorted(GOLDEN.glob("entry_v5_*.kvs")):
        out["derived/" + path.name] = derived._decoded_sha(path.read_bytes())
    for _, spec, maker in FRESH:
        out["fresh/" + spec] = lossy_facts(getattr(entries, maker)(spec))
    return out


def settings() -> dict[str, dict[str, str]]:
    """The dispatch settings to compare, by name: environment overrides for the subprocess."""
    import torch

    have = torch.backends.cpu.get_cpu_capability()  # DEFAULT, AVX2, AVX512 on x86-64
    out = {"as is": {}, "aten default": {"ATEN_CPU_CAPABILITY": "default"}}
    if have in ("AVX2", "AVX512"):
        out["aten avx2"] = {"ATEN_CPU_CAPABILITY": "avx2"}
        out["mkl avx2"] = {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    if have == "AVX512":
        out["aten avx512"] = {"ATEN_CPU_CAPABILITY": "avx512"}
    out["1 thread"] = {"OMP_NUM_THREADS": "1", THREADS_VAR: "1"}
    out["2 threads"] = {"OMP_NUM_THREADS": "2", THREADS_VAR: "2"}
    return out


def _run(overrides: dict[str, str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")}
    env.update(overrides)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parents[1]), str(HERE.parent), str(HERE), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    todo = settings()
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(todo, pool.map(_run, todo.values())))


def test_each_setting_took_effect(runs):
    for name, got in runs.items():
        want = settings()[name].get("ATEN_CPU_CAPABILITY")
        if want:
            assert got["capability"] == want.upper(), (name, got["capability"])
        if THREADS_VAR in settings()[name]:
            assert got["threads"] == int(settings()[name][THREADS_VAR]), name


def test_every_setting_decodes_and_encodes_the_same_bits(runs):
    first, *others = runs
    facts = {k: v for k, v in runs[first].items() if k not in ("capability", "threads")}
    for name in others:
        differ = sorted(k for k in facts if runs[name][k] != facts[k])
        assert not differ, f"{name} differs from {first} on {differ}"


def test_the_bits_are_the_ones_the_golden_files_pin(runs):
    from helpers.paths import GOLDEN

    got = runs["as is"]
    older = json.loads((GOLDEN / "decoded_v1_v4.json").read_text())
    for name, sha in older.items():
        assert got["decoded/" + name] == sha, name
    derived = json.loads((GOLDEN / "format_v5_derived.json").read_text())
    for key, facts in derived.items():
        assert got[f"derived/entry_v5_{key}.kvs"] == facts["decoded_sha256"], key
    for file, spec, _ in FRESH:
        want = json.loads((GOLDEN / file).read_text())[spec]
        assert got["fresh/" + spec] == want, f"{spec}: a fresh encoding or its decode differs from {file}"
    assert (
        got["stored/entry_v6_int4h.kvs"]
        == json.loads((GOLDEN / "format_v6_int4h.json").read_text())["int4h"]["decoded_sha256"]
    )
    kvh = json.loads((GOLDEN / "format_v7_kvh.json").read_text())["kvh:6/3:16/8:s=2:t=8"]
    assert got["stored/entry_v7_kvh.kvs"] == kvh["decoded_sha256"]


# -- the pieces, in this process ---------------------------------------------------------------------
def _angles():
    import torch

    pos = torch.arange(0, 100000, 13, dtype=torch.float64).float()
    inv = torch.tensor([1.0, 0.1, 0.01, 1e-4], dtype=torch.float32)
    return (pos[:, None] * inv[None]).double()  # as prerope._angles makes them


def test_cos_sin_is_within_about_an_ulp_and_its_bits_are_pinned():
    """cos_sin over 30k rotary angles (positions to 1e5): within 1.1 ulp of libm's, and the very bits
    pinned here (element-wise IEEE operations only: the same on every machine; torch's own cos, SLEEF's
    or libm's, differs from these in the last bit of about one value in six)."""
    import math

    import torch

    from kvstore.store.codecs.portable import cos_sin

    ang = _angles()
    cos, sin = cos_sin(ang)
    for got, ref in ((cos, math.cos), (sin, math.sin)):
        want = torch.tensor([ref(a) for a in ang.flatten().tolist()], dtype=torch.float64).view_as(ang)
        ulps = (got - want).abs() / (want.abs().clamp(min=2.0**-20) * torch.finfo(torch.float64).eps)
        assert float(ulps.max()) < 1.1, float(ulps.max())
    digest = hashlib.sha256(cos.numpy().tobytes() + sin.numpy().tobytes()).hexdigest()
    assert digest == "37fddac7712f5f6af8da91156f4e9ccb306a866758e28ef1f3f0582253b609f0"
    with pytest.raises(ValueError, match="float64"):
        cos_sin(ang.float())


def test_fixed_sum_is_the_pairwise_tree():
    import torch

    from kvstore.store.codecs.portable import fixed_mean, fixed_sum

    x = torch.randn(3, 37, 5, dtype=torch.float64) * torch.logspace(-8, 8, 5, dtype=torch.float64)

    def tree(vals: list[float]) -> float:
        while len(vals) & (len(vals) - 1):
            vals.append(0.0)
        while len(vals) > 1:
            half = len(vals) // 2
            vals = [a + b for a, b in zip(vals[:half], vals[half:])]
        return vals[0]

    got = fixed_sum(x, (1, 2))
    assert got.shape == (3, 1, 1)
    assert got.flatten().tolist() == [tree(x[h].flatten().tolist()) for h in range(3)]
    assert fixed_sum(x, (1,))[1, 0].tolist() == [tree(x[1, :, c].tolist()) for c in range(5)]
    assert torch.equal(fixed_mean(x, (1,)), fixed_sum(x, (1,)) / 37)


def test_no_decode_runs_a_matrix_product_or_a_library_cos(monkeypatch):
    """Decoding every golden entry (each codec, lossless and lossy, the derived ones too) calls no
    matmul/mm/bmm/einsum and no torch cos/sin/exp: the operations whose bits follow the BLAS kernel
    or the vector math library."""
    import torch

    from helpers.entries import golden_rotary_entry
    from helpers.paths import GOLDEN
    from kvstore.store.entry import decode_entry

    def boom(*args, **kwargs):
        raise AssertionError("a decode called a non-portable operation")

    from test_derived import _decoded_sha

    blobs = [p.read_bytes() for p in sorted(GOLDEN.glob("entry_v[1-467]_*.kvs"))]
    blobs.append(golden_rotary_entry("int4h:k8=0:v8=0"))  # int4h's 8-bit layers too
    derived = [p.read_bytes() for p in sorted(GOLDEN.glob("entry_v5_*.kvs"))]
    for name in ("matmul", "mm", "bmm", "einsum", "cos", "sin", "exp"):
        monkeypatch.setattr(torch, name, boom)
    for name in ("__matmul__", "matmul", "mm", "bmm", "cos", "sin", "exp"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    for blob in blobs:
        for kv in decode_entry(blob).layers:
            for t in kv or ():
                t.materialize()
    for blob in derived:
        _decoded_sha(blob)


if __name__ == "__main__":
    print(json.dumps(probe(), sort_keys=True))
