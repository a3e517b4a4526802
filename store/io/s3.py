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
import hashlib
import json
import logging
import os
import re
import socket
import threading
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import pyarrow.fs as pafs

from rollshard.store.common import backoff_delay

PART_BYTES = 8 << 20  # S3 parts are >= 5 MiB except the last; 8 MiB keeps a 512 MiB shard at 64 parts
PARTS_IN_FLIGHT = 4  # parts uploading at once (32 MiB held), as pyarrow's and boto3's uploaders do
LEASE_SECONDS = 60.0

log = logging.getLogger(__name__)


class S3Error(OSError):
    """A write S3 refused; the message says why and what to do (an ``OSError``: commands report it in one line)."""

    code = ""  # S3's error code, when S3 answered


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


def _status(e: Exception) -> int | None:
    return getattr(e, "response", {}).get("ResponseMetadata", {}).get("HTTPStatusCode")


CONFLICT_RETRIES = 4  # S3 answers 409 ConditionalRequestConflict to one of two racing conditional writes: retry it
# The conflict retries' backoff (store/common.py backoff_delay): 0.05-0.1 s, then doubling, at most 1 s.
CONFLICT_BACKOFF_S, CONFLICT_BACKOFF_CAP_S = 0.1, 1.0


def _md5_etag(data: bytes) -> str:
    return f'"{hashlib.md5(data, usedforsecurity=False).hexdigest()}"'


class Bucket:
    """The boto3 side of one S3 filesystem: conditional puts, gets with ETags, multipart uploads."""

    probed: set[str] = set()  # buckets whose endpoint honours conditional writes (probed once per process)
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
        for attempt in range(CONFLICT_RETRIES + 1):
            try:
                return getattr(self.client, op)(Bucket=bucket, **({"Key": key} if op != "list_multipart_uploads"
                                                                  else {}), **kwargs)
            except _network_errors() as e:
                if _code(e) in ok:
                    return None
                if _status(e) == 409 and attempt < CONFLICT_RETRIES:
                    time.sleep(backoff_delay(attempt, CONFLICT_BACKOFF_S, CONFLICT_BACKOFF_CAP_S))
                    continue
                if _status(e) in (409, 412):
                    raise PreconditionFailed(f"s3://{path} was written by someone else") from e
                err = S3Error(f"s3://{path}: {op} failed: {' '.join(str(e).split())}; check the bucket, the "
                              "credentials (AWS_* variables or profile) and AWS_ENDPOINT_URL")
                err.code = _code(e)
                raise err from e
        raise AssertionError("unreachable")

    def etag(self, path: str) -> str | None:
        """The ETag of ``path``; None when absent."""
        r = self.call("head_object", path, ok=("NoSuchKey", "404", "NotFound"))
        return None if r is None else r["ETag"]

    def put(self, path: str, data: bytes, *, create: bool = False, match: str | None = None) -> str:
        """Write ``data`` at ``path``; ``create``: only if absent; ``match``: only if its ETag is still this.
        Returns the new ETag; raises :class:`PreconditionFailed` when the condition does not hold."""
        extra: dict[str, str] = {}
        if create:
            extra["IfNoneMatch"] = "*"
        if match is not None:
            extra["IfMatch"] = match
        try:
            return self.call("put_object", path, Body=data, **extra)["ETag"]
        except PreconditionFailed:
            # A retry of a write that landed (its answer was lost) fails its own condition: it is ours if the
            # object holds exactly these bytes (every fenced write carries its owner's token, so no other holds them).
            if self.etag(path) == _md5_etag(data):
                return _md5_etag(data)
            raise

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
            if bucket in self.probed:
                return
            probe = f"{root}/_manifests/.probe-{uuid.uuid4().hex}"
            self.put(probe, b"a", create=True)
            try:
                if self._refused(lambda: self.put(probe, b"b", create=True)) and self._refused(
                        lambda: self.put(probe, b"c", match=_md5_etag(b"x"))) and self._refused(
                        lambda: self._complete_once(probe)):
                    self.probed.add(bucket)
                    return
            finally:
                self.delete(probe)
        raise S3Error(f"the S3 endpoint of s3://{bucket} ignores conditional writes (If-None-Match on PutObject "
                      "and CompleteMultipartUpload, If-Match on PutObject), which rollshard needs to commit shards "
                      "safely there; use an endpoint that supports them (AWS S3, or a recent MinIO or Ceph)")

    @staticmethod
    def _refused(write) -> bool:
        try:
            write()
        except PreconditionFailed:
            return True
        return False

    def _complete_once(self, path: str) -> None:
        """A one-part multipart upload onto ``path`` (which exists), completed with If-None-Match."""
        upload = Upload(self, path)
        upload.write(b"d")
        upload.multipart = True
        upload.complete()


class Upload:
    """A file-like sink that uploads a shard in parts and makes it visible only on :meth:`complete`.

    :class:`~rollshard.store.io.storage.HashingFile` calls :meth:`write` from its I/O thread, so the parts go up
    while the next row groups are encoded; up to :data:`PARTS_IN_FLIGHT` at once (one request at a time
    leaves most of a link idle: S3's throughput is per connection).
    """

    def __init__(self, bucket: Bucket, path: str):
        self.bucket, self.path = bucket, path
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._parts: list[Future] = []  # of each part's {"PartNumber", "ETag"}, in order
        self._pool: ThreadPoolExecutor | None = None
        self.multipart = False  # True: a multipart upload even when the bytes fit one PUT (the endpoint probe)

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
        for f in self._parts:  # a part that failed stops the shard now, not after the rest went up
            if f.done() and f.exception() is not None:
                raise f.exception()
        self._parts.append(self._pool.submit(self._upload_part, len(self._parts) + 1, bytes(self._buf)))
        self._buf.clear()

    def _upload_part(self, n: int, body: bytes) -> dict[str, Any]:
        r = self.bucket.call("upload_part", self.path, UploadId=self._upload_id, PartNumber=n, Body=body)
        return {"PartNumber": n, "ETag": r["ETag"]}

    def complete(self) -> None:
        """Make the object visible, unless its key exists (:class:`PreconditionFailed`; the upload is aborted)."""
        try:
            if self._upload_id is None and not self.multipart:
                self.bucket.put(self.path, bytes(self._buf), create=True)
                return
            if self._buf or not self._parts:
                self._send_part()
            parts = [f.result() for f in self._parts]  # a part's error is raised here
            try:
                self.bucket.call("complete_multipart_upload", self.path, UploadId=self._upload_id,
                                 MultipartUpload={"Parts": parts}, IfNoneMatch="*")
            except PreconditionFailed:
                # A retried completion that had landed: the object's ETag is the one these parts make.
                digest = hashlib.md5(b"".join(bytes.fromhex(p["ETag"].strip('"')) for p in parts),
                                     usedforsecurity=False).hexdigest()
                if self.bucket.etag(self.path) != f'"{digest}-{len(parts)}"':
                    raise
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


def process_identity(pid: int) -> dict[str, Any]:
    """What tells this process apart from any other, here or elsewhere: the host, the kernel's boot, the pid
    namespace (containers on one host share the boot), the pid and the process's start time (pids are reused)."""
    ident: dict[str, Any] = {"host": socket.gethostname(), "pid": pid}
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            ident["boot"] = f.read().strip()
        ident["pidns"] = os.stat("/proc/self/ns/pid").st_ino
        with open(f"/proc/{pid}/stat") as f:
            ident["start"] = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: start time in clock ticks
    except (OSError, ValueError, IndexError):
        pass  # not Linux, or the process is gone: "start" missing
    return ident


def _dead_here(holder: dict[str, Any]) -> bool:
    """The lease's holder is a process of this host and pid namespace that no longer runs (its pid is free, or
    now another process's)."""
    me = process_identity(os.getpid())
    if any(holder.get(k) != me.get(k) for k in ("host", "boot", "pidns")) or "boot" not in me:
        return False
    try:
        os.kill(int(holder.get("pid", -1)), 0)
    except ProcessLookupError:
        return True
    except (PermissionError, ValueError, OverflowError):
        return False
    return process_identity(int(holder["pid"])).get("start") != holder.get("start")


MIN_LEASE_SECONDS = 10.0  # Last-Modified and Date have 1 s resolution: a shorter term could lapse mid-renewal


class Lease:
    """``_manifests/<writer_id>.lease``, held while a writer writes as that id (module docstring).

    A lease held by a dead process of this host is taken at once. One held elsewhere is watched for up to
    ``wait_seconds``: a holder that renews meanwhile is alive (refused); one whose term runs out is gone (taken),
    so a Ray task rerun on another node follows its dead predecessor within one term."""

    def __init__(self, bucket: Bucket, path: str, *, uri: str, writer_id: str, seconds: float = LEASE_SECONDS,
                 wait_seconds: float = LEASE_SECONDS):
        if seconds < MIN_LEASE_SECONDS:
            raise ValueError(f"a lease term of {seconds} s is too short; give at least {MIN_LEASE_SECONDS:.0f} s")
        self.bucket, self.path, self.uri, self.writer_id = bucket, path, uri, writer_id
        self.seconds, self.wait_seconds = seconds, wait_seconds
        self.token = f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:12]}"  # this claim's; in every write
        self.took_over = False  # the lease was another process's: its manifest may have moved since
        self.lost: str | None = None  # why the lease is gone (renewal lost to another process)
        self._etag: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _body(self) -> bytes:
        # The token makes this holder's body differ from any other's: S3's ETag is a hash of the content, and
        # If-Match fences only writes whose content differs.
        return json.dumps({"writer_id": self.writer_id, **process_identity(os.getpid()), "seconds": self.seconds,
                           "token": self.token}).encode()

    def acquire(self) -> None:
        try:
            self._etag = self.bucket.put(self.path, self._body(), create=True)
        except PreconditionFailed:
            self._take_over()
        self._thread = threading.Thread(target=self._renew_loop, name="rollshard-s3-lease", daemon=True)
        self._thread.start()

    def _take_over(self) -> None:
        first_written, deadline = None, time.monotonic() + self.wait_seconds
        while True:
            held = self.bucket.get(self.path)
            if held is None:  # released meanwhile
                self._etag = self._claim(self.bucket.put, create=True)
                return
            data, etag, written, now = held
            try:
                holder = json.loads(data)
            except ValueError:
                holder = {}
            left = float(holder.get("seconds", self.seconds)) - (now - written)
            if left <= 0 or _dead_here(holder):
                self._etag = self._claim(self.bucket.put, match=etag)
                self.took_over = True
                return
            renewed = first_written is not None and written > first_written
            if renewed or time.monotonic() + min(left, 2.0) > deadline or _here(holder):
                raise S3Error(
                    f"another process is writing into {self.uri} as writer {self.writer_id!r} (pid "
                    f"{holder.get('pid')} on {holder.get('host')}, its lease runs {left:.0f} s more); give each "
                    "process its own writer id, or wait for the lease to expire if that process is gone")
            if first_written is None:
                first_written = written
                log.warning("writer %r of %s is leased by pid %s on %s; waiting up to %.0f s for it to renew or lapse",
                            self.writer_id, self.uri, holder.get("pid"), holder.get("host"), min(left, self.wait_seconds))
            time.sleep(min(left, 2.0))  # a lease held elsewhere: its holder renews every third of its term

    def _claim(self, put, **condition) -> str:
        try:
            return put(self.path, self._body(), **condition)
        except PreconditionFailed as e:
            raise S3Error(f"another process took writer {self.writer_id!r} of {self.uri} at the same moment; "
                          "give each process its own writer id") from e

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
        except S3Error as e:
            if e.code in ("NoSuchKey", "404"):  # deleted under it: another process may open this id now
                self.lost = f"the lease of writer {self.writer_id!r} on {self.uri} was deleted by another process"
                return False
            # a network blip: the next renewal retries; the term covers two misses
        return True

    def check(self) -> None:
        if self.lost:
            raise S3Error(f"{self.lost}; this writer stopped (what it committed stays)")

    def release(self) -> None:
        """Stop renewing and delete the lease; best effort (a lease left behind lapses after its term)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.lost is None and self._etag is not None:
            try:
                self.bucket.delete(self.path, match=self._etag)
            except S3Error as e:
                log.warning("could not release %s (it lapses in %.0f s): %s", self.path, self.seconds, e)


def _here(holder: dict[str, Any]) -> bool:
    """The holder is a live process of this host and pid namespace (its lease will not lapse while we wait)."""
    me = process_identity(os.getpid())
    return "boot" in me and all(holder.get(k) == me.get(k) for k in ("host", "boot", "pidns"))


class Claim:
    """What a writer holds on S3 while it writes as one writer id: the lease, and its fenced manifest."""

    def __init__(self, bucket: Bucket, root: str, *, uri: str, writer_id: str, manifest_rel: str,
                 lease_seconds: float = LEASE_SECONDS, lease_wait_seconds: float = LEASE_SECONDS):
        bucket.check_conditional_writes(root)
        self.bucket, self.root, self.writer_id = bucket, root, writer_id
        self._manifest = f"{root}/{manifest_rel}"
        self._etag: str | None = None
        self.lease = Lease(bucket, f"{root}/_manifests/{writer_id}.lease", uri=uri, writer_id=writer_id,
                           seconds=lease_seconds, wait_seconds=lease_wait_seconds)
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
