"""The benchmark runner behind ``python -m experiments``: the result schema (:mod:`.schema`), the
suites (:mod:`.suites`) and the generated results page (:mod:`.render`).

A subpackage, so that its modules never shadow an installed module when a script in
``experiments/`` runs with that folder first on ``sys.path``.
"""
