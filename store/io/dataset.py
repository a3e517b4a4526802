"""A rollout dataset: the committed shards of every writer's manifest, and ways to read them.

Counts come from the manifests without touching the data. Reading goes through the
standard tools: a ``pyarrow.dataset``, a polars ``LazyFrame`` or a HF ``datasets``
``IterableDataset`` over exactly the committed shard files, so a shard that is being
written (or was left behind by a crash) is never read.

Opening reads every shard's footer (on a few threads): a shard that is missing, whose
footer does not read, whose size is not the manifest's, or that was written with a
newer schema major is refused then (:class:`rollshard.store.common.DataError`,
:class:`rollshard.store.format.schema.SchemaVersionError`), naming the shard, so no count or
scan mixes it in silently. Checksums and row invariants are ``rollshard-store
validate``'s and the loader's (store/io/integrity.py).

Every reader here has the columns of the current schema: a shard of schema 1.0 (without the
1.1 sampling columns) reads as rows whose ``sampling_logprobs`` and ``sampling_support``
are null, alone or mixed with 1.1 shards.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from rollshard.store.io import destination
from rollshard.store.io.integrity import open_shard, verify_shard
from rollshard.store.io.live import COMPLETE_DIR
from rollshard.store.format.manifest import FAILURE_DIR, MANIFEST_DIR, SHARD_DIR, Manifest, ShardInfo, fingerprint, load_manifests
from rollshard.store.format.schema import ROW_SCHEMA, cast_table, check_schema_version, config_of
from rollshard.store.io.storage import TMP_DIR, Storage

OPEN_THREADS = 8  # footers read at once when a dataset is opened (I/O bound, small reads)


# What a dataset folder holds: its shards, manifests (and their locks), the writers' temporary files, failure
# ledgers, end-of-run markers, a derive's state (_derive) and an evaluation's figures (eval.json, written by
# rollshard-generate eval beside its rows). Anything else is another kind of folder (a model, a run).
DATASET_ENTRIES = frozenset({SHARD_DIR, MANIFEST_DIR, TMP_DIR, FAILURE_DIR, COMPLETE_DIR, "_derive", "eval.json"})


def check_dataset_out(path: str | os.PathLike, *, fix: str, also: frozenset[str] = frozenset()) -> None:
    """Refuse (:class:`~rollshard.store.common.UsageError`) an ``--out`` that is a file or a folder holding more
    than a dataset does (and the names in ``also``: a command's own files beside the dataset)."""
    destination.check_out_folder(path, accepts=DATASET_ENTRIES | also, kind="a rollshard dataset", fix=fix)


class DatasetNotFoundError(FileNotFoundError):
    pass


class RolloutDataset:
    """Read-only view of a dataset directory (local path or pyarrow filesystem URI)."""

    def __init__(self, storage: Storage, manifests: list[Manifest]):
        self.storage = storage
        self.manifests = manifests
        self.shards: list[ShardInfo] = sorted((s for m in manifests for s in m.shards), key=lambda s: s.path)
        self._metadata: list[dict[bytes, bytes]] | None = None  # each shard's footer key/value metadata
        self._footers: list[pq.FileMetaData] | None = None  # each shard's footer (row groups, schema)

    @classmethod
    def open(cls, path: str | os.PathLike | Storage) -> "RolloutDataset":
        storage = path if isinstance(path, Storage) else Storage(path)
        manifests = load_manifests(storage)
        if not manifests:
            raise DatasetNotFoundError(
                f"{storage.uri}: no rollshard dataset here (no _manifests/*.json); "
                "check the path, or write one with rollshard-generate"
            )
        ds = cls(storage, manifests)
        ds._open_shards()
        return ds

    def _open_shards(self) -> list[dict[bytes, bytes]]:
        """Every shard's footer metadata, after :func:`rollshard.store.io.integrity.open_shard`'s checks."""
        if self._metadata is None:

            def footer(shard: ShardInfo) -> pq.FileMetaData:
                f, pf = open_shard(self.storage, shard)
                with f:
                    return pf.metadata

            with ThreadPoolExecutor(max_workers=min(OPEN_THREADS, max(1, len(self.shards)))) as pool:
                self._footers = list(pool.map(footer, self.shards))  # raises the first bad shard's error, by path
            self._metadata = [m.schema.to_arrow_schema().metadata or {} for m in self._footers]
        return self._metadata

    def footer(self, i: int) -> pq.FileMetaData:
        """Shard ``i``'s Parquet footer, as read (and checked) when the dataset was opened."""
        self._open_shards()
        return self._footers[i]

    # -- counts (manifest only) -------------------------------------------------------------

    @property
    def num_rows(self) -> int:
        return sum(s.rows for s in self.shards)

    @property
    def num_groups(self) -> int:
        return sum(s.groups for s in self.shards)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(s.prompt_tokens for s in self.shards)

    @property
    def num_response_tokens(self) -> int:
        return sum(s.response_tokens for s in self.shards)

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + self.num_response_tokens

    @property
    def num_bytes(self) -> int:
        return sum(s.bytes for s in self.shards)

    @property
    def fingerprint(self) -> str:
        """Changes whenever a shard is added, removed or rewritten."""
        return fingerprint(self.shards)

    @property
    def files(self) -> list[str]:
        """Filesystem paths of the committed shards."""
        return [self.storage.path(s.path) for s in self.shards]

    @property
    def _first_metadata(self) -> dict[bytes, bytes]:
        return self._open_shards()[0] if self.shards else {}

    @property
    def schema_version(self) -> str | None:
        """The first shard's schema version (every shard's major was checked when the dataset was opened)."""
        if not self.shards:
            return None
        return check_schema_version(self._first_metadata, self.shards[0].path)

    @property
    def config(self) -> dict[str, Any]:
        """The run config recorded by the writers (first writer's, by writer id)."""
        for m in self.manifests:
            if m.config:
                return m.config
        return config_of(self._first_metadata)

    # -- reading ----------------------------------------------------------------------------

    def parquet_file(self, shard: ShardInfo) -> pq.ParquetFile:
        """One shard, after :func:`rollshard.store.io.integrity.open_shard`'s checks."""
        return open_shard(self.storage, shard)[1]

    def to_arrow(self) -> pads.Dataset:
        """A ``pyarrow.dataset`` over the committed shards."""
        return pads.dataset(self.files, schema=ROW_SCHEMA, format="parquet", filesystem=self.storage.fs)

    def verify(self) -> None:
        """Every shard's bytes against its manifest (:func:`rollshard.store.io.integrity.verify_shard`): what a command
        that reads every row runs before it uses any; :class:`DataError` naming the first shard that differs."""
        for shard in self.shards:
            verify_shard(self.storage, shard)

    def read(self, columns: list[str] | None = None) -> pa.Table:
        """The whole dataset in memory (small datasets and tests only)."""
        return self.to_arrow().to_table(columns=columns)

    def scan(self):
        """A polars ``LazyFrame`` over the committed shards."""
        import polars as pl

        if not self.storage.local:
            return pl.scan_pyarrow_dataset(self.to_arrow())
        if not self.files:
            return pl.LazyFrame(schema=pl.from_arrow(ROW_SCHEMA.empty_table()).schema)
        # Shards of schema 1.0 lack the 1.1 sampling columns: scan with the whole schema, inserting them as nulls.
        schema = pl.from_arrow(ROW_SCHEMA.empty_table()).schema
        return pl.scan_parquet(self.files, schema=schema, missing_columns="insert")

    def to_hf(self, streaming: bool = True):
        """A HF ``datasets`` dataset (``IterableDataset`` when streaming) over the committed shards.

        Local shards go to HF's Parquet builder; remote ones (S3) are read with pyarrow's filesystem, one HF
        shard per file (HF's own remote reads need fsspec's s3fs and its credentials, not the standard chain)."""
        import datasets

        # The schema's features: HF takes the columns of the first file otherwise, and a 1.1 shard after a 1.0 one
        # would not match them (with the features, a 1.0 shard's sampling columns read as None).
        features = datasets.Features.from_arrow_schema(ROW_SCHEMA)
        if self.storage.local:
            return datasets.load_dataset("parquet", data_files=self.files, split="train", streaming=streaming,
                                         features=features)
        kind = datasets.IterableDataset if streaming else datasets.Dataset
        return kind.from_generator(_remote_rows, features=features,
                                   gen_kwargs={"uri": self.storage.uri, "shards": [s.path for s in self.shards]})

    def __repr__(self) -> str:
        return (
            f"RolloutDataset({self.storage.uri!r}, shards={len(self.shards)}, rows={self.num_rows}, "
            f"tokens={self.num_tokens})"
        )


def open_dataset(path: str | os.PathLike) -> RolloutDataset:
    return RolloutDataset.open(path)


def _remote_rows(uri: str, shards: list[str]):
    """The rows of ``shards`` of the dataset at ``uri``, each shard cast to the current schema (``to_hf``)."""
    storage = Storage(uri)
    for rel in shards:
        with storage.fs.open_input_file(storage.path(rel)) as f:
            pf = pq.ParquetFile(f)
            for batch in pf.iter_batches():
                yield from cast_table(pa.Table.from_batches([batch])).to_pylist()
