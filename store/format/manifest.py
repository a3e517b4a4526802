"""Manifests: the list of committed shards, one manifest per writer.

A shard is part of a dataset exactly when an entry for it is in some manifest under
``_manifests/``. Each writer (one per generating host or process) owns
``_manifests/<writer_id>.json`` and rewrites it whole (write-new-then-rename) after
each shard it commits, so several writers never contend for one file and the dataset
is the union of their manifests.

A shard path in a manifest is relative to the dataset root and lies under ``shards/``
(the writer's ``shards/<writer_id>-<n>.parquet``; subfolders of ``shards/`` are allowed):
forward slashes, no empty, ``.`` or ``..`` component, no backslash, not absolute, no
URI scheme. A manifest that lists anything else is refused when it is loaded, so no
reader (validate included) opens a file outside the dataset because a manifest says so.

**Row groups** (manifest version 2). Each entry written by :class:`~rollshard.store.io.writer.ShardWriter`
also lists its shard's row groups (:class:`RowGroupInfo`): rows, tokens, and the 64-bit hashes of the
group ids in it (:func:`group_hash`, in order of first appearance), so that the loader builds its blocks
and checks that no group spans two shards without reading any row group (store/loader/blocks.py). An
entry without them (a version-1 manifest, or a shard adopted from a foreign writer) still reads: the
loader then scans that shard's ``group_id`` column as before. They are derived from the shard's bytes
(which its sha256 covers), so they do not enter the fingerprint; ``rollshard-store validate`` checks them.
A manifest of version 1 reads here; one of version 2 is refused by a rollshard that only reads 1.

**Byte ranges** (manifest version 3). Each row group also carries the byte range of its column chunks
(``offset``, ``length``: from its first chunk's start, the dictionary page if any, to its last chunk's end)
and their sha256, and the shard its ``footer_sha256``: the sha256 of everything after the last row group
(the Thrift footer, its length and the closing magic). The ranges are contiguous, so the 4-byte magic
``PAR1`` at the start, the ranges and the footer tile the file: the loader verifies each block it reads on
the bytes it reads, and the footer, instead of hashing whole shards (store/io/integrity.py). The writer records
them at commit, from the bytes it writes (store/io/storage.py :class:`~rollshard.store.io.storage.HashingFile`);
an entry without them (an older manifest, or a shard pyarrow laid out otherwise) has its whole file hashed.
The whole-file ``sha256`` stays (``validate``, copying, the fingerprint).

**Fast hashes** (manifest version 4). Beside each range's sha256 the writer records its XXH3-128
(``RowGroupInfo.xxh3``, ``ShardInfo.footer_xxh3``, hex), hashed from the same bytes as they are written.
The loader checks a block (and a footer) against it when the entry has it, against the sha256 otherwise
(an older manifest reads and verifies as before): XXH3 is not a cryptographic hash, but the loader's
check is against damage (a flipped bit, a cut or overwritten range), which a 128-bit checksum of the
range catches, at ~10x the speed of sha256 here (measured: 11 GB/s against 1.2 GB/s on one busy core),
so on a machine whose cores are busy decoding, it no longer competes with the decode for them.
``rollshard-store validate`` still checks every sha256. A rollshard that reads only version 3 refuses a
version 4 manifest by its version (its row groups carry a field it does not know).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import time
from typing import Any

from rollshard.store.common import DataError, backoff_delay, utc_now
from rollshard.store.format.schema import SCHEMA_VERSION
from rollshard.store.io.storage import Storage

MANIFEST_DIR = "_manifests"
SHARD_DIR = "shards"
FAILURE_DIR = "_failures"  # rollshard-generate's ledgers of the prompts that failed, one per writer
MANIFEST_FORMAT = "rollshard-manifest"
# 2: ShardInfo.row_groups; 3: their byte ranges and sha256, ShardInfo.footer_sha256; 4: the ranges' and the
# footer's XXH3-128 (RowGroupInfo.xxh3, ShardInfo.footer_xxh3)
MANIFEST_VERSION = 4
WRITER_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def group_hash(group_ids: list[str]) -> bytes:
    """The group ids' 64-bit hashes (blake2b, little-endian) concatenated: stable across processes and machines."""
    return b"".join(hashlib.blake2b(g.encode(), digest_size=8).digest() for g in group_ids)


@dataclasses.dataclass(kw_only=True, frozen=True)
class RowGroupInfo:
    """One row group of a shard, as the writer recorded it at commit."""

    rows: int
    tokens: int  # prompt + response tokens
    group_hashes: str  # hex of :func:`group_hash` of the group ids in it, in order of first appearance
    offset: int | None = None  # byte range of its column chunks in the file (module docstring; None: not recorded)
    length: int | None = None
    sha256: str | None = None  # of those bytes
    xxh3: str | None = None  # XXH3-128 of those bytes, hex (module docstring; None: not recorded)

    def content(self) -> tuple[int, int, str]:
        """What the row group's rows determine (``validate`` compares these with the file's rows)."""
        return self.rows, self.tokens, self.group_hashes

    @property
    def groups(self) -> int:
        return len(self.group_hashes) // 16


@dataclasses.dataclass(kw_only=True, frozen=True)
class ShardInfo:
    """One committed shard, as its manifest records it."""

    path: str  # relative to the dataset root
    rows: int
    groups: int
    prompt_tokens: int
    response_tokens: int
    bytes: int
    sha256: str
    writer_id: str
    created_at: str
    row_groups: tuple[RowGroupInfo, ...] | None = None  # None: not recorded (module docstring)
    footer_sha256: str | None = None  # of the bytes after the last row group (module docstring; None: not recorded)
    footer_xxh3: str | None = None  # XXH3-128 of the same bytes, hex (None: not recorded)

    @property
    def has_ranges(self) -> bool:
        """Whether the manifest records the byte ranges and hashes that let a reader verify one block at a time."""
        return (self.footer_sha256 is not None and self.row_groups is not None
                and all(r.sha256 is not None for r in self.row_groups))

    @property
    def has_fast_hashes(self) -> bool:
        """Whether every range (and the footer) also has its XXH3-128, which the loader then checks instead."""
        return self.has_ranges and self.footer_xxh3 is not None and all(r.xxh3 is not None for r in self.row_groups)

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.response_tokens

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ShardInfo":
        """The inverse of ``dataclasses.asdict`` (JSON manifests)."""
        rgs = d.get("row_groups")
        return cls(**{**d, "row_groups": None if rgs is None else tuple(RowGroupInfo(**r) for r in rgs)})


@dataclasses.dataclass(kw_only=True)
class Manifest:
    writer_id: str
    shards: list[ShardInfo] = dataclasses.field(default_factory=list)
    config: dict[str, Any] = dataclasses.field(default_factory=dict)

    @staticmethod
    def rel_path(writer_id: str) -> str:
        return f"{MANIFEST_DIR}/{writer_id}.json"

    def to_json(self, *, owner: str | None = None) -> bytes:
        """The manifest file; ``owner`` names the writer process (on S3 it also makes each owner's writes differ
        in content, so that their ETags differ and ``If-Match`` fences them: store/io/s3.py)."""
        doc = {
            "format": MANIFEST_FORMAT,
            "manifest_version": MANIFEST_VERSION,
            "schema_version": SCHEMA_VERSION,
            "writer_id": self.writer_id,
            "updated_at": utc_now(),
            "config": self.config,
            "shards": [dataclasses.asdict(s) for s in self.shards],
        }
        if owner is not None:
            doc["owner"] = owner
        return json.dumps(doc, indent=1, sort_keys=True, default=str).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> "Manifest":
        try:
            doc = json.loads(data)
            if doc.get("format") != MANIFEST_FORMAT:
                raise ValueError(f"format is {doc.get('format')!r}, expected {MANIFEST_FORMAT!r}")
            if int(doc.get("manifest_version", 0)) > MANIFEST_VERSION:
                raise ValueError(
                    f"manifest version {doc['manifest_version']} is newer than this rollshard's {MANIFEST_VERSION}; "
                    "upgrade rollshard"
                )
            manifest = cls(
                writer_id=doc["writer_id"],
                shards=[ShardInfo.from_dict(s) for s in doc["shards"]],
                config=doc.get("config") or {},
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{where}: unreadable manifest: {e}") from e
        for shard in manifest.shards:
            check_shard_path(shard.path, where)
        return manifest

    @classmethod
    def load(cls, storage: Storage, writer_id: str) -> "Manifest | None":
        rel = cls.rel_path(writer_id)
        if not storage.exists(rel):
            return None
        return cls.from_json(storage.read_bytes(rel), storage.path(rel))

    def save(self, storage: Storage) -> None:
        storage.makedirs(MANIFEST_DIR)
        storage.write_atomic(self.rel_path(self.writer_id), self.to_json())


def check_shard_path(path: Any, where: str) -> None:
    """Raise :class:`DataError` unless ``path`` is a relative path under ``shards/`` (module docstring)."""
    parts = path.split("/") if isinstance(path, str) else []
    inside = (
        len(parts) >= 2
        and parts[0] == SHARD_DIR
        and all(p not in ("", ".", "..") for p in parts)
        and "\\" not in path
        and ":" not in path
        and "\0" not in path
    )
    if not inside:
        raise DataError(
            f"{where}: shard path {path!r} is not inside the dataset: a manifest may list only relative paths under "
            f"{SHARD_DIR}/ (no '..', not absolute); fix or remove this manifest entry"
        )


def load_manifests(storage: Storage) -> list[Manifest]:
    """Every writer's manifest in the dataset, sorted by writer id."""
    out = []
    for rel in storage.list(MANIFEST_DIR, ".json"):
        out.append(read_manifest(storage, rel))
    return sorted(out, key=lambda m: m.writer_id)


# A read of an object store is a HEAD (its size) then ranged GETs: a manifest its writer rewrites between the two
# reads as the first bytes of the new version, cut short. Such a read is not JSON; read again, a few times, after
# a backoff (store/common.py backoff_delay) from 0.025-0.05 s, doubling, at most 1 s.
REMOTE_READ_ATTEMPTS = 5
REMOTE_RETRY_S, REMOTE_RETRY_CAP_S = 0.05, 1.0


def read_manifest(storage: Storage, rel: str, where: str | None = None) -> Manifest:
    """One writer's manifest. Local manifests are replaced by rename, so a read sees one whole version; on an
    object store a torn read (not JSON) is retried, and a manifest still unreadable after that is refused."""
    attempts = 1 if storage.local else REMOTE_READ_ATTEMPTS
    for attempt in range(1, attempts + 1):
        try:
            return Manifest.from_json(storage.read_bytes(rel), where or storage.path(rel))
        except ValueError as e:
            torn = isinstance(e.__cause__, (json.JSONDecodeError, UnicodeDecodeError))
            if not torn or attempt == attempts:
                raise
            time.sleep(backoff_delay(attempt - 1, REMOTE_RETRY_S, REMOTE_RETRY_CAP_S))


def fingerprint(shards: list[ShardInfo]) -> str:
    """Content identity of a set of shards: changes when any shard is added, removed or rewritten."""
    h = hashlib.sha256()
    for s in sorted(shards, key=lambda s: s.path):
        h.update(f"{s.path}\0{s.sha256}\n".encode())
    return h.hexdigest()[:16]
