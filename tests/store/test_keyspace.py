"""The backend key scheme has one home (kvstore.store.keyspace): a store lays its records out as
that module says, and no other library module spells a prefix or the key pattern itself."""

from __future__ import annotations

import ast
import struct

from helpers.entries import make_entry
from helpers.paths import REPO
from kvstore.store import keyspace
from kvstore.store.kvstore import KVStore


def test_a_store_writes_what_keyspace_names(tmp_path):
    entry = make_entry(0)
    with KVStore(str(tmp_path / "s")) as store:
        store.put(entry)
        store.put_context(entry.key, [entry.key], entry.n_tokens)
        store.touch([entry.key])
        backend = store.backend
        assert keyspace.is_key(entry.key)
        assert backend.contains(keyspace.entry_key(entry.key))
        assert backend.contains(keyspace.record_key(entry.key))
        assert struct.unpack("<d", backend.get(keyspace.access_key(entry.key)))[0] > 0
        assert backend.contains(keyspace.META)
        assert store.keys() == [entry.key] and store.context_keys() == [entry.key]
        listed = set(backend.keys())
        assert listed == {
            keyspace.META,
            keyspace.ENTRY + entry.key.encode(),
            keyspace.RECORD + entry.key.encode(),
            keyspace.ACCESS + entry.key.encode(),
        }
    assert not keyspace.is_key("A" * 64) and not keyspace.is_key("a" * 63) and not keyspace.is_key(None)


def test_derived_entries_live_under_their_context():
    context, key = "0123456789abcdef" * 4, "fedcba9876543210" * 4
    assert keyspace.DERIVED == b"x/"
    assert keyspace.derived_prefix(context) == b"x/" + context.encode() + b"/"
    assert keyspace.derived_entry_key(context, key) == b"x/" + context.encode() + b"/" + key.encode()
    assert keyspace.derived_of(keyspace.derived_entry_key(context, key)) == (context, key)
    for bad in (b"x/" + context.encode(), b"x/abc/" + key.encode(), b"x/" + context.encode() + b"/zz",
                b"e/" + context.encode()):  # fmt: skip
        assert keyspace.derived_of(bad) is None
    assert keyspace.derived_entry_key(context, key).startswith(keyspace.derived_prefix(context))


def test_a_stored_name_says_its_kind_owner_and_key():
    from kvstore.store.kinds import stored_at

    context, key = "0123456789abcdef" * 4, "fedcba9876543210" * 4
    assert keyspace.entry_name(keyspace.entry_key(key)) == (keyspace.ENTRY, "", key)
    assert keyspace.entry_name(keyspace.owned_key(context, key)) == (keyspace.OWNED, context, key)
    for other in (keyspace.record_key(key), keyspace.access_key(key), keyspace.META, b"x/" + context.encode()):
        assert keyspace.entry_name(other) is None and stored_at(other) is None
    chunk, owner, got = stored_at(keyspace.entry_key(key))
    assert (chunk.name, chunk.owned, owner, got) == ("chunk", False, "", key)
    owned, owner, got = stored_at(keyspace.owned_key(context, key))
    assert owned.owned and (owner, got) == (context, key)
    assert owned.address(key, context) == keyspace.owned_key(context, key)


def test_the_scheme_is_what_earlier_releases_wrote():
    """Stores already written keep opening: these bytes are part of the on-disk format."""
    key = "0123456789abcdef" * 4
    assert (keyspace.META, keyspace.ENTRY, keyspace.RECORD, keyspace.ACCESS) == (b"meta", b"e/", b"r/", b"a/")
    assert keyspace.entry_key(key) == b"e/" + key.encode()
    assert keyspace.record_key(key) == b"r/" + key.encode() and keyspace.access_key(key) == b"a/" + key.encode()
    assert keyspace.key_of(b"e/" + key.encode(), keyspace.ENTRY) == key


def test_no_other_library_module_spells_the_scheme():
    spelled = {b"e/", b"r/", b"a/", b"x/", b"meta", "e/", "r/", "a/", "x/", r"^[0-9a-f]{64}$"}
    found = []
    for path in sorted((REPO / "kvstore").rglob("*.py")) + sorted((REPO / "cli").rglob("*.py")):
        if path.name == "keyspace.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in spelled:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}")
    assert not found, "the key scheme belongs in kvstore/store/keyspace.py:\n" + "\n".join(found)
