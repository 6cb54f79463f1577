"""Benchmarks as suites, and the demo (``experiments/demo.py``, ``experiments/data/``; ``make demo``).

Each benchmark script (``bench_*.py``, ``codec_planes.py``, ``exactness_dtypes.py``, ``profile_*.py``,
``size/measure_smollm2.py``...) is a suite in :mod:`experiments.runner.suites`; ``python -m experiments``
lists, runs and reports them (see ``experiments/__main__.py``), and every committed result in
``experiments/results/`` has the shape of :mod:`experiments.runner.schema`. Not part of the library.
"""
