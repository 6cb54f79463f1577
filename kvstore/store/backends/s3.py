"""S3 backend: a store in an S3-compatible object store (AWS S3, MinIO, SeaweedFS, R2...).

URL ``s3://BUCKET`` or ``s3://BUCKET/PREFIX`` (a trailing slash changes nothing). The endpoint,
credentials, region and profile come the standard AWS way: ``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, ``AWS_REGION``, ``AWS_PROFILE`` and
``~/.aws/config``; an ``http://`` endpoint works as it is. boto3 is imported only here, when an
``s3://`` store is opened (``pip install 'kvstore[s3]'``). kvstore never creates buckets.

Layout: one object per backend key (:mod:`kvstore.store.backends.s3_names`): keys of the form
``NAME/HEX`` fan out on their first two hex digits, any other key is one percent-encoded name.

Semantics:

* **Atomic writes.** A PUT is all or nothing; values above ``multipart_threshold`` go up as a
  multipart upload, completed (atomically) only after every part arrived, aborted on error.
  ``put_if_absent`` sends ``If-None-Match: *``: a 412 means the key is already stored.
* **Loads.** The first GET asks for the first ``first_part`` bytes (2 parts): its answer carries
  the total size and the ETag (no HEAD). One buffer of that size is taken (buffers are recycled
  once the ``view`` that lent one ends) and the other parts are fetched by ``threads`` threads
  straight into it, each pinned with ``If-Match: ETAG``. A 412 (the object was replaced
  meanwhile) restarts the load, at most ``version_retries`` times; a 404 (deleted meanwhile) is
  a miss. So a reader never sees a mix of two versions nor a part of one, and a delete racing a
  read costs the reader a miss, never a partial value.
* **Failures** become one line each (:mod:`kvstore.store.backends.s3_errors`): connect timeout ``connect_timeout``
  s, each socket read ``read_timeout`` s, at most ``max_attempts`` tries per request. The worst
  case (an endpoint that accepts connections and never answers) takes about
  ``max_attempts * read_timeout`` s. After a server has been unreachable, further requests fail
  at once for ``down_seconds`` s instead of waiting for their own timeouts.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields, replace
from typing import Any

from kvstore.errors import (
    ReadOnlyStoreError,
    StoreError,
    StoreNotFoundError,
    StoreUnavailableError,
)
from kvstore.store.backends.base import BackendBase
from kvstore.store.backends.s3_errors import first_line, request_error, status_of
from kvstore.store.backends.s3_names import backend_key, listing_prefixes, object_name, parse_url

MiB = 1 << 20
# Defaults, read when a backend opens. Worst case for an endpoint that accepts connections and
# never answers: MAX_ATTEMPTS * READ_TIMEOUT + backoff, about 45 s.
CONNECT_TIMEOUT = 5.0  # seconds to establish a connection
READ_TIMEOUT = 15.0  # seconds of silence on an open connection (per socket read, not per transfer)
MAX_ATTEMPTS = 3  # tries per request, the first included
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


class _Changed(Exception):
    """The object was replaced (412) or deleted (404) while its parts were being read."""

    def __init__(self, status: int):
        self.status = status


@dataclass(frozen=True)
class S3Options:
    """How an S3 store moves bytes (see the module docstring): ``part_size`` of a multipart load
    or upload, ``first_part`` (None: two parts), ``threads`` fetching parts, ``multipart_threshold``
    above which an upload goes in parts, ``connect_timeout`` / ``read_timeout`` / ``max_attempts``
    (None: the module's ``CONNECT_TIMEOUT``, ``READ_TIMEOUT``, ``MAX_ATTEMPTS``, read when a backend
    opens), ``page_size`` of a listing, ``version_retries`` of a load whose object was replaced,
    ``down_seconds`` a server found unreachable is not asked again, ``buffer_pool_bytes`` of load
    buffers kept for reuse, ``prefetch_limit`` values fetched ahead of their load."""

    part_size: int = 8 * MiB
    first_part: int | None = None
    threads: int = 8
    multipart_threshold: int = 64 * MiB
    connect_timeout: float | None = None
    read_timeout: float | None = None
    max_attempts: int | None = None
    page_size: int = 1000
    version_retries: int = 3
    down_seconds: float = 30.0
    buffer_pool_bytes: int = 1 << 30
    prefetch_limit: int = 256


class S3Backend(BackendBase):
    """A store under ``s3://BUCKET/PREFIX``; see the module docstring for layout and semantics.

    ``readonly`` refuses writes; ``readonly`` or ``create=False`` also require the prefix to
    hold a store already (else StoreNotFoundError). ``session``: a ``boto3.session.Session`` to
    use instead of a new one. ``options`` (an :class:`S3Options`) tunes parts, threads and
    timeouts; keywords named as its fields (``threads=4``) replace those of ``options`` (an
    unknown one is a TypeError). Raises StoreError subclasses (one line each) when the store
    cannot be used."""

    def __init__(
        self, url: str, *, readonly: bool = False, create: bool = True, options: S3Options | None = None,
        session: Any = None, **tuning: Any,
    ):  # fmt: skip
        try:
            o = replace(options or S3Options(), **tuning)
        except TypeError:
            known = ", ".join(f.name for f in fields(S3Options))
            raise TypeError(f"S3Backend: unknown option among {sorted(tuning)} (known: {known})") from None
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise StoreError(f"{url} needs boto3 for s3:// stores: pip install 'kvstore[s3]'") from None

        self.bucket, self.root = parse_url(url)
        self.url = f"s3://{self.bucket}/{self.root}".rstrip("/")
        self.readonly = readonly
        self.options = o
        self.part_size, self.threads, self.page_size = o.part_size, o.threads, o.page_size
        # the first request of a load is longer than the others: a value up to its size costs one
        # request, as a plain GET would (each request costs ~2 ms of client CPU), and the other
        # parts run while it streams
        self.first_part = 2 * o.part_size if o.first_part is None else o.first_part
        self.multipart_threshold, self.version_retries = o.multipart_threshold, o.version_retries
        self.connect_timeout = CONNECT_TIMEOUT if o.connect_timeout is None else o.connect_timeout
        self.read_timeout = READ_TIMEOUT if o.read_timeout is None else o.read_timeout
        self.max_attempts = MAX_ATTEMPTS if o.max_attempts is None else o.max_attempts
        self.down_seconds = o.down_seconds
        self.buffer_pool_bytes = o.buffer_pool_bytes  # load buffers kept for reuse, at most this many bytes
        self._free: list[bytearray] = []
        self._free_lock = threading.Lock()
        # values being fetched ahead of their load (prefetch): key -> future of _load's result
        self.prefetch_limit = o.prefetch_limit
        self._ahead: dict[bytes, futures.Future] = {}
        self._ahead_lock = threading.Lock()
        self._down: tuple[float, StoreError] | None = None
        self._closed = False
        config = Config(
            connect_timeout=self.connect_timeout,
            read_timeout=self.read_timeout,
            # total_max_attempts counts the first try ({"max_attempts": n} would mean n retries)
            retries={"total_max_attempts": self.max_attempts, "mode": "standard"},
            max_pool_connections=2 * o.threads + 2,
            s3={"addressing_style": "path"},  # an IP or localhost endpoint has no per-bucket host names
            # entries carry their own xxh3 checksum: skip botocore's CRC32 pass over every byte
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        try:
            session = session or boto3.session.Session()
            self.client = session.client("s3", config=config)
        except Exception as exc:  # noqa: BLE001 - profile or configuration problems, one line each
            raise StoreError(f"cannot set up the S3 client for {self.url}: {first_line(exc)}") from None
        self.endpoint = str(self.client.meta.endpoint_url)
        # parts of one value (loads, multipart uploads) run on _parts; batched calls on _batch,
        # whose tasks may wait on _parts (never the other way round, so neither can deadlock)
        self._parts = ThreadPoolExecutor(o.threads, thread_name_prefix="kvstore-s3-part")
        self._batch = ThreadPoolExecutor(o.threads, thread_name_prefix="kvstore-s3")
        self._prefetcher = ThreadPoolExecutor(2, thread_name_prefix="kvstore-s3-ahead")  # tasks wait on _parts
        try:
            self._probe(must_exist=readonly or not create)
        except BaseException:
            self.close()
            raise

    # -- requests and errors ----------------------------------------------------------------------
    def _call(self, method: str, **kwargs: Any) -> Any:
        """One client request (``Bucket`` filled in), failing at once while the server is down."""
        if self._down is not None:
            until, err = self._down
            if time.monotonic() < until:
                raise err
            self._down = None
        return getattr(self.client, method)(Bucket=self.bucket, **kwargs)

    def _error(self, exc: BaseException, op: str) -> StoreError:
        """The one-line StoreError for a failed request; after a connection failure, further
        requests fail at once for ``down_seconds`` (see :meth:`_call`)."""
        err = request_error(exc, op, self)
        if isinstance(err, StoreUnavailableError) and not isinstance(exc, StoreError):
            self._down = (time.monotonic() + self.down_seconds, err)
        return err

    def _probe(self, *, must_exist: bool) -> None:
        """One LIST: maps a missing bucket, bad credentials or a dead endpoint to their own
        message (a HEAD's error carries no code), and tells whether the prefix holds anything."""
        try:
            r = self._call("list_objects_v2", Prefix=self.root, MaxKeys=1)
        except Exception as exc:  # noqa: BLE001 - mapped to one line
            raise self._error(exc, "open") from None
        if must_exist and not r.get("KeyCount", len(r.get("Contents", []))):
            raise StoreNotFoundError(
                f"no store at {self.url} ({self.endpoint}); build one first with `kvstore build`, or check the prefix"
            )

    def _writable(self) -> None:
        if self.readonly:
            raise ReadOnlyStoreError(f"store {self.url} was opened read-only")

    def _name(self, key: bytes) -> str:
        return self.root + object_name(key)

    # -- reads --------------------------------------------------------------------------------------
    @staticmethod
    def _fill(body: Any, dest: memoryview) -> None:
        """Read exactly ``len(dest)`` bytes of a response body into ``dest``."""
        pos = 0
        while pos < len(dest):
            n = body.readinto(dest[pos:])
            if not n:
                raise OSError(f"short read: {pos} of {len(dest)} bytes")
            pos += n

    def _take(self, n: int) -> bytearray:
        """A buffer of at least ``n`` bytes: a recycled one when one fits (its pages are already
        mapped: a fresh bytearray costs a memset and a page fault per 4 KiB, ~30% of a load)."""
        with self._free_lock:
            fits = [i for i, b in enumerate(self._free) if len(b) >= n]
            if fits:
                return self._free.pop(min(fits, key=lambda i: len(self._free[i])))
        return bytearray(n)

    def _give(self, buf: bytearray) -> None:
        with self._free_lock:
            self._free.append(buf)
            while sum(map(len, self._free)) > self.buffer_pool_bytes:
                self._free.pop(0)

    def _load(self, key: bytes) -> tuple[bytearray, int] | None:
        """``(buffer, length)``: the whole value in the buffer's first ``length`` bytes, or None
        when missing (see the module docstring). The caller hands the buffer back with _give."""
        name = self._name(key)
        for _ in range(self.version_retries + 1):
            try:
                r = self._call("get_object", Key=name, Range=f"bytes=0-{self.first_part - 1}")
            except Exception as exc:  # noqa: BLE001
                status, code = status_of(exc)
                if status == 404 and code != "NoSuchBucket":
                    return None
                if status == 416:  # a range of an empty object cannot be satisfied
                    return bytearray(), 0
                raise self._error(exc, "get") from None
            m = _CONTENT_RANGE.match(r.get("ContentRange") or "")
            total = int(m.group(3)) if m else int(r["ContentLength"])  # a 200 carries the whole object
            buf = self._take(total)
            view = memoryview(buf)
            first = int(r["ContentLength"])
            # the other parts start now, while this thread reads the first part's body
            parts = [
                self._parts.submit(self._part, name, r["ETag"], view, s, min(s + self.part_size, total))
                for s in range(first, total, self.part_size)
            ]
            try:
                try:
                    self._fill(r["Body"], view[:first])
                finally:
                    futures.wait(parts)  # all of them, so that no straggler writes into a recycled buffer
                for part in parts:
                    part.result()
            except _Changed as changed:
                self._give(buf)
                if changed.status == 404:
                    return None  # deleted while we read it: a miss
                continue  # replaced while we read it: load the new version
            except Exception as exc:  # noqa: BLE001
                self._give(buf)
                raise self._error(exc, "get") from None
            return buf, total
        return None  # it kept changing under us: a miss now, the next load will try again

    def _part(self, name: str, etag: str, buf: memoryview, start: int, end: int) -> None:
        """Bytes ``start:end`` of version ``etag`` of ``name`` into ``buf[start:end]``."""
        try:
            r = self._call("get_object", Key=name, Range=f"bytes={start}-{end - 1}", IfMatch=etag)
        except Exception as exc:  # noqa: BLE001
            status, code = status_of(exc)
            if status == 412 or (status == 404 and code != "NoSuchBucket"):
                raise _Changed(status) from None
            raise
        if int(r["ContentLength"]) != end - start:
            raise OSError(f"asked for {end - start} bytes at {start}, got {r['ContentLength']}")
        self._fill(r["Body"], buf[start:end])

    def prefetch(self, keys: Iterable[bytes]) -> None:
        """Start loading ``keys`` in the background (e.g. the next batch's entries while this one
        decodes): a later :meth:`view` or :meth:`get` of one of them takes the loaded value (or
        the error its load met) instead of asking again. At most ``prefetch_limit`` values wait
        at a time; a put or delete of a key forgets its prefetched value."""
        with self._ahead_lock:
            for key in keys:
                if self._closed or len(self._ahead) >= self.prefetch_limit:
                    return
                if key not in self._ahead:
                    self._ahead[key] = self._prefetcher.submit(self._load, key)

    def _forget(self, key: bytes) -> None:
        with self._ahead_lock:
            fut = self._ahead.pop(key, None)
        if fut is not None:
            self._discard(fut)

    def _discard(self, fut: futures.Future) -> None:
        if fut.cancel():
            return
        with contextlib.suppress(Exception):
            got = fut.result()
            if got is not None:
                self._give(got[0])

    def _load_or_ahead(self, key: bytes) -> tuple[bytearray, int] | None:
        with self._ahead_lock:
            fut = self._ahead.pop(key, None)
        return self._load(key) if fut is None else fut.result()

    def get(self, key: bytes) -> bytes | None:
        got = self._load_or_ahead(key)
        if got is None:
            return None
        try:
            return bytes(memoryview(got[0])[: got[1]])  # a copy; the load path uses view()
        finally:
            self._give(got[0])

    @contextlib.contextmanager
    def view(self, key: bytes) -> Iterator[memoryview | None]:
        """The value in a buffer of this backend's, valid inside the ``with`` block only (the
        buffer is reused by later loads, as LMDB reuses its pages)."""
        got = self._load_or_ahead(key)
        if got is None:
            yield None
            return
        try:
            yield memoryview(got[0])[: got[1]]
        finally:
            self._give(got[0])

    def peek(self, key: bytes, n: int) -> tuple[bytes, int] | None:
        try:
            r = self._call("get_object", Key=self._name(key), Range=f"bytes=0-{max(n, 1) - 1}")
            data = r["Body"].read()
        except Exception as exc:  # noqa: BLE001
            status, code = status_of(exc)
            if status == 404 and code != "NoSuchBucket":
                return None
            if status == 416:
                return b"", 0
            raise self._error(exc, "get") from None
        m = _CONTENT_RANGE.match(r.get("ContentRange") or "")
        return data[:n], int(m.group(3)) if m else len(data)

    def contains(self, key: bytes) -> bool:
        try:
            self._call("head_object", Key=self._name(key))
            return True
        except Exception as exc:  # noqa: BLE001
            if status_of(exc)[0] == 404:
                return False
            raise self._error(exc, "head") from None

    def keys(self, prefix: bytes = b"") -> Iterator[bytes]:
        found: set[bytes] = set()
        for listing in listing_prefixes(prefix):
            token: dict[str, str] = {}
            while True:
                try:
                    r = self._call("list_objects_v2", Prefix=self.root + listing, MaxKeys=self.page_size, **token)
                except Exception as exc:  # noqa: BLE001
                    raise self._error(exc, "list") from None
                for obj in r.get("Contents", []):
                    key = backend_key(obj["Key"][len(self.root) :])
                    if key is not None and key.startswith(prefix):
                        found.add(key)
                if not r.get("IsTruncated"):
                    break
                token = {"ContinuationToken": r["NextContinuationToken"]}
        return iter(sorted(found))

    # -- writes -------------------------------------------------------------------------------------
    def _put(self, key: bytes, value: bytes | bytearray | memoryview, conditional: bool) -> bool:
        self._writable()
        self._forget(key)
        name = self._name(key)
        cond = {"IfNoneMatch": "*"} if conditional else {}
        try:
            if len(value) <= self.multipart_threshold:
                data = value if isinstance(value, (bytes, bytearray)) else bytes(value)  # botocore wants bytes
                self._call("put_object", Key=name, Body=data, **cond)
            else:
                self._multipart(name, memoryview(value), cond)  # copies one part at a time
        except Exception as exc:  # noqa: BLE001
            # 412: the key exists; 409: another conditional write of it is in progress
            if conditional and status_of(exc)[0] in (409, 412):
                return False
            raise self._error(exc, "put") from None
        return True

    def _multipart(self, name: str, view: memoryview, cond: dict[str, str]) -> None:
        upload = self._call("create_multipart_upload", Key=name)["UploadId"]
        part = max(self.part_size, 5 * MiB, -(-len(view) // 10_000))  # S3: parts >= 5 MiB, <= 10,000 of them

        def one(i: int) -> dict[str, Any]:
            body = bytes(view[i * part : (i + 1) * part])
            r = self._call("upload_part", Key=name, UploadId=upload, PartNumber=i + 1, Body=body)
            return {"PartNumber": i + 1, "ETag": r["ETag"]}

        try:
            parts = list(self._parts.map(one, range(-(-len(view) // part))))
            self._call("complete_multipart_upload", Key=name, UploadId=upload, MultipartUpload={"Parts": parts}, **cond)
        except BaseException:
            with contextlib.suppress(Exception):  # the server may be gone; `kvstore gc` cannot see these
                self._call("abort_multipart_upload", Key=name, UploadId=upload)
            raise

    def put(self, key: bytes, value: bytes | memoryview) -> None:
        self._put(key, value, conditional=False)

    def put_if_absent(self, key: bytes, value: bytes | memoryview) -> bool:
        return self._put(key, value, conditional=True)

    def delete(self, key: bytes) -> bool:
        self._writable()
        self._forget(key)
        existed = self.contains(key)  # a DELETE answers 204 whether or not the key existed
        if existed:
            try:
                self._call("delete_object", Key=self._name(key))
            except Exception as exc:  # noqa: BLE001
                raise self._error(exc, "delete") from None
        return existed

    # -- batched ------------------------------------------------------------------------------------
    def _each(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        return list(self._batch.map(fn, list(items)))

    def get_many(self, keys: Iterable[bytes]) -> list[bytes | None]:
        return self._each(self.get, keys)

    def put_many(self, items: Iterable[tuple[bytes, bytes]]) -> None:
        self._writable()
        self._each(lambda kv: self.put(kv[0], kv[1]), items)

    def put_many_if_absent(self, items: Iterable[tuple[bytes, bytes | memoryview]]) -> list[bool]:
        self._writable()
        return self._each(lambda kv: self.put_if_absent(kv[0], kv[1]), items)

    def delete_many(self, keys: Iterable[bytes]) -> int:
        self._writable()
        keys = list(keys)
        for k in keys:
            self._forget(k)
        present = [k for k, there in zip(keys, self._each(self.contains, keys)) if there]
        for start in range(0, len(present), 1000):  # DeleteObjects takes up to 1000 names
            chunk = present[start : start + 1000]
            try:
                r = self._call("delete_objects", Delete={"Objects": [{"Key": self._name(k)} for k in chunk]})
            except Exception as exc:  # noqa: BLE001
                raise self._error(exc, "delete") from None
            if r.get("Errors"):
                e = r["Errors"][0]
                raise StoreError(f"S3 delete failed on {self.url} for {e.get('Key')}: {e.get('Code')}")
        return len(present)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._ahead_lock:
            pending, self._ahead = list(self._ahead.values()), {}
        for fut in pending:
            self._discard(fut)
        for pool in (getattr(self, "_prefetcher", None), getattr(self, "_batch", None), getattr(self, "_parts", None)):
            if pool is not None:
                pool.shutdown(wait=True)
        with contextlib.suppress(Exception):
            self.client.close()


__all__ = ["CONNECT_TIMEOUT", "MAX_ATTEMPTS", "READ_TIMEOUT", "S3Backend"]
