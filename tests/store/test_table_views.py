"""The part table every zstd packing checks before it decompresses anything
(``records.table_views``): each way a table can disagree with its payload or its header is one
CorruptEntryError, never an exception of another kind, a short read or a large allocation."""

from __future__ import annotations

import pytest

from kvstore.errors import CorruptEntryError
from kvstore.store.codecs.records import table_views

PAYLOAD = bytes(range(10))


def test_a_table_that_fits_gives_each_parts_view():
    views, sizes = table_views(memoryview(PAYLOAD), [[4, 8], [6, 12]], 20, what="zstd", part="frame", min_stored=1)
    assert sizes == [(4, 8), (6, 12)]
    assert [bytes(v) for v in views] == [PAYLOAD[:4], PAYLOAD[4:]]
    _, sizes = table_views(PAYLOAD, [[0, 0], [10, 5]], 5, what="zstd-split", part="part")  # an empty part
    assert sizes == [(0, 0), (10, 5)]


@pytest.mark.parametrize(
    "table,raw,min_stored,message",
    [
        (None, 20, 0, "lists no frames"),
        ([], 20, 0, "lists no frames"),
        ([[4, 8], ["x", 12]], 20, 0, "table is malformed"),
        ([[4, 8, 1], [6, 12]], 20, 0, "table is malformed"),
        ([[4, 8], [5, 12]], 20, 0, "do not add up to the payload"),
        ([[4, 8], [7, 12]], 20, 0, "do not add up to the payload"),
        ([[-1, 8], [11, 12]], 20, 0, "do not add up to the payload"),
        ([[0, 8], [10, 12]], 20, 1, "do not add up to the payload"),
        ([[4, -8], [6, 28]], 20, 0, "do not add up to the payload"),
        ([[4, 8], [6, 12]], 21, 0, "declare a different size than the entry header"),
    ],
)
def test_each_disagreement_is_one_corrupt_entry_error(table, raw, min_stored, message):
    with pytest.raises(CorruptEntryError, match=message):
        table_views(PAYLOAD, table, raw, what="zstd", part="frame", min_stored=min_stored)
