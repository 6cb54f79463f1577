"""S3 failures as one line each (:mod:`kvstore.errors`), with codes as S3 and SeaweedFS send them:
a missing bucket, bad credentials, no permission to write, an endpoint that refuses, times out or
breaks the connection. Every message says what to check next."""

from __future__ import annotations

from typing import Any

from kvstore.errors import (
    ReadOnlyStoreError,
    StoreAccessError,
    StoreError,
    StoreNotFoundError,
    StoreUnavailableError,
)


def status_of(exc: BaseException) -> tuple[int | None, str]:
    """(HTTP status, error code) of a botocore ClientError; (None, "") for anything else."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict):
        return None, ""
    return response.get("ResponseMetadata", {}).get("HTTPStatusCode"), response.get("Error", {}).get("Code", "")


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type when empty)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def request_error(exc: BaseException, op: str, backend: Any) -> StoreError:
    """The one-line StoreError for a request ``op`` (``open``, ``get``, ``put``...) that failed
    with ``exc`` on ``backend`` (an S3Backend: its url, endpoint, bucket and timeouts go into the
    message). A StoreError is returned as it is."""
    from botocore import exceptions as bx

    if isinstance(exc, StoreError):
        return exc
    what = f"{backend.url} at {backend.endpoint}"
    status, code = status_of(exc)
    err: StoreError
    if status is not None:
        message = str(getattr(exc, "response", {}).get("Error", {}).get("Message", "")).strip()
        if code == "NoSuchBucket" or (op == "open" and status == 404):
            err = StoreNotFoundError(
                f"bucket {backend.bucket!r} does not exist at {backend.endpoint}; create it first (kvstore never "
                "creates buckets) or check the name"
            )
        elif code == "InvalidAccessKeyId":
            err = StoreAccessError(
                f"{backend.endpoint} does not know this access key; check AWS_ACCESS_KEY_ID or AWS_PROFILE"
            )
        elif code == "SignatureDoesNotMatch":
            err = StoreAccessError(
                f"{backend.endpoint} rejected the request signature; check AWS_SECRET_ACCESS_KEY for this access key"
            )
        elif status == 403 and op in ("put", "delete"):
            err = ReadOnlyStoreError(
                f"no permission to write to {what}; use credentials with write access, or read without "
                "storing (kvstore sample --readonly-store)"
            )
        elif status == 403:
            err = StoreAccessError(f"access denied to {what} ({op}); use credentials allowed to read it")
        elif code == "InvalidBucketName":
            err = StoreError(f"{backend.bucket!r} is not a valid bucket name (S3: 3-63 lowercase letters, digits, -)")
        else:
            detail = f"{status} {code}: {message}" if message else f"{status} {code}".strip()
            err = StoreError(f"S3 {op} failed on {what}: {detail}")
        return err
    if isinstance(exc, bx.NoCredentialsError):
        return StoreAccessError(
            f"no AWS credentials found for {backend.url}; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or "
            "AWS_PROFILE"
        )
    if isinstance(exc, bx.ConnectTimeoutError):
        err = StoreUnavailableError(
            f"cannot connect to {backend.endpoint}: no answer within {backend.connect_timeout:g} s "
            f"({backend.max_attempts} tries); check AWS_ENDPOINT_URL and the network"
        )
    elif isinstance(exc, bx.EndpointConnectionError):
        err = StoreUnavailableError(
            f"cannot connect to {backend.endpoint} (connection refused or host unreachable); is the object "
            "store running? check AWS_ENDPOINT_URL"
        )
    elif isinstance(exc, bx.ReadTimeoutError):
        err = StoreUnavailableError(
            f"{backend.endpoint} accepted the connection but did not answer within {backend.read_timeout:g} s "
            f"({backend.max_attempts} tries); is it an S3 server? check AWS_ENDPOINT_URL"
        )
    elif isinstance(exc, (bx.ConnectionError, bx.ResponseStreamingError, bx.IncompleteReadError, OSError)):
        err = StoreUnavailableError(
            f"the connection to {backend.endpoint} broke during {op}; the object store may have stopped "
            "(what was stored before is intact: re-run to complete the rest)"
        )
    else:
        return StoreError(f"S3 {op} failed on {what}: {type(exc).__name__}: {first_line(exc)}")
    if op != "open" and "re-run" not in str(err):
        err = StoreUnavailableError(f"{err} (what was stored before is intact: re-run once it is back)")
    return err


__all__ = ["first_line", "request_error", "status_of"]
