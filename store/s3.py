"""Writing a dataset on S3: S3's conditional writes make the commit protocol hold without a rename.

Reads go through pyarrow's S3 filesystem; writes that must not race go through boto3, since pyarrow
cannot send ``If-None-Match`` / ``If-Match`` nor abort an upload. Credentials, region and endpoint come
from the standard chain (``AWS_*`` variables, ``AWS_ENDPOINT_URL``, profiles), which both libraries read.

What each write guarantees:

* **A shard is created once.** Its bytes go up as a multipart upload (one ``PutObject`` when small)
  completed with ``If-None-Match: *`` at commit. Before completion nothing is visible; an aborted shard
  is an aborted upload (never completed, so never adopted); a key that exists already (another process
  writing under this writer id) is refused rather than overwritten.
* **A manifest is fenced.** Its owner rewrites it with ``If-Match`` on the ETag it last wrote, so a
  writer whose manifest was changed behind its back stops instead of overwriting the other's entries.
* **A writer id is leased.** ``_manifests/<writer_id>.lease`` names the process holding it and is renewed
  every third of its term; a second process refuses to open while the lease is live. The term is judged
  by the server's clock (the object's ``Last-Modified`` against the response's ``Date``), so hosts whose
  clocks disagree still agree on expiry. A lease left by a dead process on this host is taken over at
  once; one from another host after its term. The lease spares a second writer hours of work it could
  not commit; correctness rests on the two points above.

An endpoint that ignores conditional headers would silently void all three: :func:`check_conditional_writes`
probes for it once per bucket and refuses to write there.
"""

from __future__ import annotations

import email.utils
import json
import os
import re
import socket
import threading
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import pyarrow.fs as pafs

PART_BYTES = 8 << 20  # S3 parts are >= 5 MiB except the last; 8 MiB keeps a 512 MiB shard at 64 parts
PARTS_IN_FLIGHT = 4  # parts uploading at once (32 MiB held), as pyarrow's and boto3's uploaders do
LEASE_SECONDS = 60.0


class S3Error(RuntimeError):
    """A write S3 refused; the message says why and what to do."""


class PreconditionFailed(S3Error):
    """An ``If-None-Match`` / ``If-Match`` write lost: someone else wrote the key first."""


def _client(fs: pafs.S3FileSystem):
    try:
        import boto3
        import botocore.config
    except ImportError as e:
        raise S3Error("writing a dataset on S3 needs boto3: pip install 'rollshard[s3]'") from e
    # Retries are botocore's standard mode (throttling, 5xx, connection resets), as for any S3 client.
    config = botocore.config.Config(retries={"mode": "standard", "max_attempts": 5})
    return boto3.session.Session().client("s3", region_name=fs.region or None, config=config)


def _network_errors() -> tuple[type[Exception], ...]:
    import botocore.exceptions

    return botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError


def _code(e: Exception) -> str:
    return str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))


def _is_precondition(e: Exception) -> bool:
    status = getattr(e, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode")
    return _code(e) in ("PreconditionFailed", "ConditionalRequestConflict") or status in (409, 412)


class Bucket:
    """The boto3 side of one S3 filesystem: conditional puts, gets with ETags, multipart uploads."""

    _probed: set[str] = set()  # buckets whose endpoint honours conditional writes (probed once per process)
    _probe_lock = threading.Lock()

    def __init__(self, fs: pafs.S3FileSystem):
        self.fs = fs
        self.client = _client(fs)

    @staticmethod
    def split(path: str) -> tuple[str, str]:
        bucket, _, key = path.partition("/")
        return bucket, key

    def call(self, op: str, path: str, *, ok: tuple[str, ...] = (), **kwargs) -> Any:
        """``client.<op>(Bucket=, Key=, **kwargs)`` for ``path``: None for an error code in ``ok``,
        :class:`PreconditionFailed` for a lost condition, :class:`S3Error` (one line) for any other refusal."""
        bucket, key = self.split(path)
        try:
            return getattr(self.client, op)(Bucket=bucket, **({"Key": key} if op != "list_multipart_uploads" else {}),
                                            **kwargs)
        except _network_errors() as e:
            if _code(e) in ok:
                return None
            if _is_precondition(e):
                raise PreconditionFailed(f"s3://{path} was written by someone else") from e
            raise S3Error(f"s3://{path}: {op} failed: {' '.join(str(e).split())}; check the bucket, the credentials "
                          "(AWS_* variables or profile) and AWS_ENDPOINT_URL") from e

    def put(self, path: str, data: bytes, *, create: bool = False, match: str | None = None) -> str:
        """Write ``data`` at ``path``; ``create``: only if absent; ``match``: only if its ETag is still this.
        Returns the new ETag; raises :class:`PreconditionFailed` when the condition does not hold."""
        extra: dict[str, str] = {}
        if create:
            extra["IfNoneMatch"] = "*"
        if match is not None:
            extra["IfMatch"] = match
        return self.call("put_object", path, Body=data, **extra)["ETag"]

    def get(self, path: str) -> tuple[bytes, str, float, float] | None:
        """(data, ETag, server time of its last write, server time now) of ``path``; None when absent."""
        r = self.call("get_object", path, ok=("NoSuchKey", "404"))
        if r is None:
            return None
        date = r["ResponseMetadata"]["HTTPHeaders"].get("date")
        now = email.utils.parsedate_to_datetime(date).timestamp() if date else time.time()
        return r["Body"].read(), r["ETag"], r["LastModified"].timestamp(), now

    def delete(self, path: str, *, match: str | None = None) -> None:
        """Delete ``path`` (if its ETag is still ``match``); absent or changed is not an error."""
        try:
            self.call("delete_object", path, ok=("NoSuchKey", "404"), **({"IfMatch": match} if match else {}))
        except PreconditionFailed:
            pass  # someone else's now: not ours to delete

    def uploads(self, prefix_path: str) -> list[tuple[str, str]]:
        """(key, upload id) of the multipart uploads in progress under ``prefix_path``."""
        bucket, prefix = self.split(prefix_path)
        out, marker = [], {}
        while True:
            page = self.call("list_multipart_uploads", prefix_path, Prefix=prefix, **marker)
            out += [(u["Key"], u["UploadId"]) for u in page.get("Uploads", [])]
            if not page.get("IsTruncated"):
                return out
            marker = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    def abort_upload(self, path: str, upload_id: str) -> None:
        self.call("abort_multipart_upload", path, ok=("NoSuchUpload",), UploadId=upload_id)

    def check_conditional_writes(self, root: str) -> None:
        """Refuse an endpoint that ignores ``If-None-Match`` (old S3-compatible servers do): every guarantee
        in the module docstring rests on it."""
        bucket, _ = self.split(root)
        with self._probe_lock:
            if bucket in self._probed:
                return
            probe = f"{root}/_manifests/.probe-{uuid.uuid4().hex}"
            self.put(probe, b"", create=True)
            try:
                self.put(probe, b"", create=True)
            except PreconditionFailed:
                self._probed.add(bucket)
                return
            finally:
                self.delete(probe)
        raise S3Error(f"the S3 endpoint of s3://{bucket} ignores conditional writes (If-None-Match), which "
                      "rollshard needs to commit shards safely there; use an endpoint that supports them "
                      "(AWS S3, or a recent MinIO or Ceph)")


class Upload:
    """A file-like sink that uploads a shard in parts and makes it visible only on :meth:`complete`.

    :class:`~rollshard.store.storage.HashingFile` calls :meth:`write` from its I/O thread, so the parts go up
    while the next row groups are encoded; up to :data:`PARTS_IN_FLIGHT` at once (one request at a time
    leaves most of a link idle: S3's throughput is per connection).
    """

    def __init__(self, bucket: Bucket, path: str):
        self.bucket, self.path = bucket, path
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._parts: list[Future] = []  # of each part's {"PartNumber", "ETag"}, in order
        self._pool: ThreadPoolExecutor | None = None

    def write(self, data: bytes) -> int:
        self._buf += data
        if len(self._buf) >= PART_BYTES:
            self._send_part()
        return len(data)

    def flush(self) -> None:
        pass

    def _send_part(self) -> None:
        if self._upload_id is None:
            self._upload_id = self.bucket.call("create_multipart_upload", self.path)["UploadId"]
            self._pool = ThreadPoolExecutor(PARTS_IN_FLIGHT, thread_name_prefix="rollshard-s3-part")
        while sum(not f.done() for f in self._parts) >= PARTS_IN_FLIGHT:  # bounds the memory held in parts
            wait([f for f in self._parts if not f.done()], return_when=FIRST_COMPLETED)
        self._parts.append(self._pool.submit(self._upload_part, len(self._parts) + 1, bytes(self._buf)))
        self._buf.clear()

    def _upload_part(self, n: int, body: bytes) -> dict[str, Any]:
        r = self.bucket.call("upload_part", self.path, UploadId=self._upload_id, PartNumber=n, Body=body)
        return {"PartNumber": n, "ETag": r["ETag"]}

    def complete(self) -> None:
        """Make the object visible, unless its key exists (:class:`PreconditionFailed`; the upload is aborted)."""
        try:
            if self._upload_id is None:
                self.bucket.put(self.path, bytes(self._buf), create=True)
                return
            if self._buf:
                self._send_part()
            parts = [f.result() for f in self._parts]  # a part's error is raised here
            self.bucket.call("complete_multipart_upload", self.path, UploadId=self._upload_id,
                             MultipartUpload={"Parts": parts}, IfNoneMatch="*")
            self._upload_id = None
            self._shutdown()
        except BaseException:
            self.abort()
            raise

    def abort(self) -> None:
        """Drop what was uploaded; nothing becomes visible."""
        self._buf.clear()
        self._shutdown()  # parts still going up finish first: an abort before them would leave them behind
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            self.bucket.abort_upload(self.path, upload_id)

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def close(self) -> None:
        pass


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Lease:
    """``_manifests/<writer_id>.lease``, held while a writer writes as that id (module docstring)."""

    def __init__(self, bucket: Bucket, path: str, *, uri: str, writer_id: str, seconds: float = LEASE_SECONDS):
        self.bucket, self.path, self.uri, self.writer_id, self.seconds = bucket, path, uri, writer_id, seconds
        self.token = f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:12]}"  # this claim's; in every write
        self.took_over = False  # the lease was another process's: its manifest may have moved since
        self.lost: str | None = None  # why the lease is gone (renewal lost to another process)
        self._etag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        # The token makes this holder's body differ from any other's: S3's ETag is a hash of the content, and
        # If-Match fences only writes whose content differs.
        return json.dumps({"writer_id": self.writer_id, "host": socket.gethostname(), "pid": os.getpid(),
                           "seconds": self.seconds, "token": self.token}).encode()

    def acquire(self) -> None:
        try:
            self._etag = self.bucket.put(self.path, self._body(), create=True)
        except PreconditionFailed:
            self._take_over()
        self._thread = threading.Thread(target=self._renew_loop, name="rollshard-s3-lease", daemon=True)
        self._thread.start()

    def _take_over(self) -> None:
        held = self.bucket.get(self.path)
        if held is not None:
            data, etag, written, now = held
            try:
                holder = json.loads(data)
            except ValueError:
                holder = {}
            left = float(holder.get("seconds", self.seconds)) - (now - written)
            dead_here = holder.get("host") == socket.gethostname() and not _pid_alive(int(holder.get("pid", -1)))
            if left > 0 and not dead_here:
                raise S3Error(
                    f"another process is writing into {self.uri} as writer {self.writer_id!r} (pid "
                    f"{holder.get('pid')} on {holder.get('host')}, its lease runs {left:.0f} s more); give each "
                    "process its own writer id, or wait for the lease to expire if that process is gone")
        try:
            self._etag = (self.bucket.put(self.path, self._body(), match=held[1]) if held is not None
                          else self.bucket.put(self.path, self._body(), create=True))
        except PreconditionFailed as e:
            raise S3Error(f"another process took writer {self.writer_id!r} of {self.uri} at the same moment; "
                          "give each process its own writer id") from e
        self.took_over = True

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.seconds / 3) and self.renew():
            pass

    def renew(self) -> bool:
        """Extend the term; False once the lease is lost to another process (then :meth:`check` raises)."""
        try:
            self._etag = self.bucket.put(self.path, self._body(), match=self._etag)
        except PreconditionFailed:
            self.lost = f"the lease of writer {self.writer_id!r} on {self.uri} was taken by another process"
            return False
        except S3Error:  # a network blip: the next renewal retries; the term covers two misses
            pass
        return True

    def check(self) -> None:
        if self.lost:
            raise S3Error(f"{self.lost}; this writer stopped (what it committed stays)")

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lost is None and self._etag is not None:
            self.bucket.delete(self.path, match=self._etag)


class Claim:
    """What a writer holds on S3 while it writes as one writer id: the lease, and its fenced manifest."""

    def __init__(self, bucket: Bucket, root: str, *, uri: str, writer_id: str, manifest_rel: str,
                 lease_seconds: float = LEASE_SECONDS):
        bucket.check_conditional_writes(root)
        self.bucket, self.root, self.writer_id = bucket, root, writer_id
        self._manifest = f"{root}/{manifest_rel}"
        self._etag: str | None = None
        self.lease = Lease(bucket, f"{root}/_manifests/{writer_id}.lease", uri=uri, writer_id=writer_id,
                           seconds=lease_seconds)
        self.lease.acquire()
        self.uri = uri

    @property
    def took_over(self) -> bool:
        return self.lease.took_over

    @property
    def token(self) -> str:
        return self.lease.token

    def load_manifest(self) -> bytes | None:
        got = self.bucket.get(self._manifest)
        if got is None:
            return None
        data, self._etag, _, _ = got
        return data

    def save_manifest(self, data: bytes) -> None:
        self.lease.check()
        try:
            self._etag = (self.bucket.put(self._manifest, data, match=self._etag) if self._etag is not None
                          else self.bucket.put(self._manifest, data, create=True))
        except PreconditionFailed as e:
            raise S3Error(f"the manifest of writer {self.writer_id!r} in {self.uri} was changed by another process "
                          "since this one opened it; this writer stopped (what it committed stays); give each "
                          "process its own writer id") from e

    def check(self) -> None:
        self.lease.check()

    def clean_uploads(self) -> int:
        """Abort the multipart uploads of this writer's shards that a crash left unfinished; returns how many."""
        bucket, prefix = Bucket.split(f"{self.root}/shards/{self.writer_id}-")
        n = 0
        for key, upload_id in self.bucket.uploads(f"{bucket}/{prefix}"):
            if re.fullmatch(r"\d+\.parquet", key[len(prefix):]):
                self.bucket.abort_upload(f"{bucket}/{key}", upload_id)
                n += 1
        return n

    def release(self) -> None:
        self.lease.release()
