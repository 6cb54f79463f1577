"""What the decoder fuzz tests share (``tests/store/test_fuzz.py`` for entries,
``tests/store/test_fuzz_derived.py`` for derived entries): the example counts, CI's settings and the
strategies of hostile JSON values."""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

CI_EXAMPLES = int(os.environ.get("KVSTORE_FUZZ_EXAMPLES", "150"))
SOAK_EXAMPLES = int(os.environ.get("KVSTORE_FUZZ_SOAK_EXAMPLES", "10000"))

ci_settings = settings(
    max_examples=CI_EXAMPLES,
    deadline=None,
    database=None,  # no example database in the shared tree
    derandomize=True,  # CI runs the same cases every time
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
big_ints = st.one_of(
    st.integers(-3, 64),
    st.sampled_from([2**31 - 1, 2**31, 2**32, 2**40, 2**62, 2**63 - 1, 2**63, 2**64, 10**30, -(2**63)]),
    st.integers(),
)
json_scalars = st.one_of(
    st.none(), st.booleans(), big_ints,
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)  # fmt: skip
json_values = st.recursive(
    json_scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12,
)
