"""Sharded model and optimizer state on disk, and the model export gathered one tensor at a time.

:func:`save_sharded` / :func:`load_sharded` move a module's weights and its optimizer's state
through ``torch.distributed.checkpoint`` (DCP) with DCP's safetensors storage
(``HuggingFaceStorageWriter(save_distributed=True)`` / ``HuggingFaceStorageReader``). Under FSDP2
every parameter and AdamW moment is a DTensor sharded along dim 0: each rank writes its own
chunks to its own file and reads back only the slices it holds, so no rank ever holds more than its
share. DCP's load planner maps the saved chunks onto the live ones, so a folder written by N
processes loads into M (resharding; the trainer itself still refuses another world size, because
the loader's cursors are per rank). Each rank writes its files of that layout itself, streaming each tensor out
(:func:`write_shards`: DCP builds each file in memory first, slower and 500 MiB more memory), and DCP reads them.

A ``shards/`` folder:

* ``shard-0000R-model-0000I-of-0000N.safetensors``: the files of rank R - 1, N of them of at most
  :data:`FILE_BYTES_PER_RANK` each (unless one tensor is larger), holding tensors
  ``optim/<name>/<state>`` (AdamW ``exp_avg``, ``exp_avg_sq``, ``step``) and, unless the checkpoint keeps its weights
  in its model folder only (``weights=False``: train/checkpoint.py, format 3), ``model/<name>`` (fp32 master weights
  under transformers names), each holding that rank's chunk. Where the chunk
  sits in the whole tensor is JSON in the file's safetensors header (``DCP_SHARDING_INFO``, the
  offsets); the reader builds DCP's plan from those headers. A tensor every rank holds whole
  (AdamW's ``step``) is written once, by one rank (DCP deduplicates it).
* ``optimizer.json``: the parameter groups (hyperparameters, parameter names) and any non-tensor
  per-parameter state.

No pickle. DCP's default ``FileSystemWriter`` stores its ``.metadata`` file as a serialized Python
object (loaded back as one) and its tensors in torch's own container format; its safetensors
storage writes neither: only safetensors files and JSON. A hand-written per-rank safetensors format was the
alternative; DCP's already is one, and brings the resharding planner with it.

Tied parameters (GPT-2's ``lm_head.weight`` = ``wte.weight``) are one tensor: stored under the first
name only, as transformers saves them.

:func:`save_gathered` writes a safetensors file from sharded tensors, gathering one tensor at a time
(``DTensor.full_tensor``) and streaming its bytes, so the extra memory is one whole tensor rather
than the whole model. The safetensors library writes from a complete dict only, hence the few lines
of header here; the file is byte-identical to ``safetensors.torch.save_file`` of the same tensors
when they share one dtype (the test checks it).
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rollshard.train.backends.distributed import DistEnv

OPTIM_META = "optimizer.json"
MODEL_KEY, OPTIM_KEY = "model/", "optim/"
SAFETENSORS_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}
HEADER_ALIGN = 8  # the safetensors library pads its JSON header with spaces to a multiple of 8 bytes
# The __metadata__ keys of DCP's safetensors storage (torch.distributed.checkpoint._hf_utils): each file's chunk offsets
# as a JSON string, and the layout's version.
DCP_SHARDING_INFO, DCP_VERSION = "DCP_SHARDING_INFO", "DCP_VERSION"
# Files of at most this much per rank: DCP's layout, which rollshard's writer keeps. DCP's own writer (still used for a
# state write_shards does not take) serializes a whole file in memory before writing it; the bound caps that transient.
FILE_BYTES_PER_RANK = 256 * 2**20
# DCP warns on every call without a process group, which is how one process runs here (no_dist) by design.
SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


@contextlib.contextmanager
def _dcp_quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS_WARNING)
        yield


def _dcp_reason(e: BaseException) -> str:
    """One line of what DCP found wrong. DCP wraps each rank's exception, traceback included, in a
    ``CheckpointException`` (a BaseException; one process too): the first failed rank's message, re-raised
    as it is when it is no error (an interrupt)."""
    from torch.distributed.checkpoint.api import CheckpointException

    where = ""
    if isinstance(e, CheckpointException):
        rank = min(e.failures)
        e, where = e.failures[rank][0], f"rank {rank}: "
        if not isinstance(e, Exception):
            raise e
    return where + " ".join(str(e).split())


def tied_aliases(module: nn.Module) -> dict[str, str]:
    """Every second name of a parameter -> its first name (state-dict names of ``module``)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            aliases[name] = first[id(p)]
        else:
            first[id(p)] = name
    return aliases


def _live_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The module's and optimizer's state dicts as they are held: DTensor shards under FSDP2, the tensors
    themselves on one process (nothing gathered or copied). An optimizer that never stepped gets its state
    created first (zeros, by a step at lr 0), so that there is something to load into."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    return get_state_dict(module, optimizer)


def _split(
    model_sd: dict, optim_sd: dict, *, aliases: dict[str, str], strip: str
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors keyed as on disk, the JSON part)`` of the live state dicts; the tensors are the live ones."""
    def name(fqn: str) -> str:
        return fqn.removeprefix(strip)

    tensors = {MODEL_KEY + name(k): v for k, v in model_sd.items() if k not in aliases}
    scalars: dict[str, dict[str, Any]] = {}
    for fqn, entries in optim_sd["state"].items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{OPTIM_KEY}{name(fqn)}/{key}"] = value
            else:
                scalars.setdefault(name(fqn), {})[key] = value
    groups = [{**g, "params": [name(p) for p in g["params"]]} for g in optim_sd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def file_buckets(tensors: dict[str, torch.Tensor], *, world_size: int) -> dict[str, int]:
    """Tensor name -> file number (from 1), in order, a new file once a rank's part of one passes
    :data:`FILE_BYTES_PER_RANK` (a rank's part taken as 1/world_size of the whole tensors)."""
    files, index, size = {}, 1, 0
    for name, t in tensors.items():
        part = t.numel() * t.element_size() / world_size
        if size and size + part > FILE_BYTES_PER_RANK:
            index, size = index + 1, 0
        files[name] = index
        size += part
    return files


def save_sharded(
    folder: Path, module: nn.Module, optimizer: torch.optim.Optimizer, *, env: DistEnv, strip: str = "",
    weights: bool = True,
) -> None:
    """Write the weights and optimizer state of every rank into ``folder`` (collective: every rank calls it
    and writes its own files; rank 0 writes ``optimizer.json``). ``strip``: a prefix of the module's names
    that the files leave out (the policy wrapper's ``model.``). ``weights`` False: the optimizer state only (a
    checkpoint whose model folder holds the weights as they are).

    Each rank streams its files out itself (:func:`write_shards`): DCP serializes every file in memory before it
    writes it (measured on one process: 1.3-1.7x the time of the whole save, and 500 MiB more memory;
    docs/performance.md). State that only DCP's planner knows how to split (a DTensor on a mesh of more than one
    dimension, a dtype safetensors lacks) goes through ``dcp.save``, into the same layout."""
    tensors, meta = state_tensors(module, optimizer, strip=strip)
    if not weights:
        tensors = _optimizer_only(tensors)
    write = write_shards if _streamable(tensors) else write_with_dcp
    write(folder, tensors, file_buckets(tensors, world_size=env.world_size), env=env)
    if env.is_main:
        (folder / OPTIM_META).write_text(json.dumps(meta, indent=1))


def _optimizer_only(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in tensors.items() if not k.startswith(MODEL_KEY)}


def state_tensors(module: nn.Module, optimizer: torch.optim.Optimizer, *, strip: str = "") -> tuple[dict, dict]:
    """``(tensors keyed as on disk, the JSON part)`` of a module and its optimizer as they are held (DTensor shards
    under FSDP2): what :func:`save_sharded` writes."""
    model_sd, optim_sd = _live_state(module, optimizer)
    return _split(model_sd, optim_sd, aliases=tied_aliases(module), strip=strip)


def write_with_dcp(folder: Path, tensors: dict[str, torch.Tensor], files: dict[str, int], *, env: DistEnv) -> None:
    """Every rank's files of ``tensors`` through ``dcp.save`` and DCP's safetensors storage (collective): the
    layout :func:`write_shards` writes, for a state only DCP's planner splits."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    with _dcp_quiet():
        writer = HuggingFaceStorageWriter(str(folder), fqn_to_index_mapping=files, save_distributed=True)
        dcp.save(tensors, storage_writer=writer, no_dist=not env.enabled)


def _streamable(tensors: dict[str, torch.Tensor]) -> bool:
    """Whether :func:`write_shards` writes what DCP would: tensors held whole, and DTensors sharded over a
    one-dimensional mesh (FSDP2), of dtypes safetensors has."""
    from torch.distributed.tensor import DTensor

    return all(
        t.dtype in SAFETENSORS_DTYPES
        and (not isinstance(t, DTensor) or (t.device_mesh.ndim == 1 and t.placements[0].is_shard()))
        for t in tensors.values()
    )


def write_shards(folder: Path, tensors: dict[str, torch.Tensor], files: dict[str, int], *, env: DistEnv) -> None:
    """This rank's files of DCP's safetensors storage for ``tensors`` (``files``: tensor name -> file number, the
    same on every rank), streamed a tensor at a time and fsynced, as ``dcp.save`` writes them: a DTensor's local
    chunk with its offsets in the whole tensor, a tensor every rank holds whole (AdamW's ``step``) once, by rank
    0 (DCP writes each such tensor once, by one rank); the same file names, headers (the chunk offsets as JSON in
    ``__metadata__``) and data (a test compares them). Extra memory: one chunk (a device tensor is copied to the
    host one at a time)."""
    from torch.distributed.tensor import DTensor

    chunks: dict[str, tuple[torch.Tensor, list[int]]] = {}  # name -> (this rank's part, its offsets in the tensor)
    for name, t in tensors.items():
        if isinstance(t, DTensor):
            (chunk,) = t.__create_chunk_list__()  # DCP's own chunk of this rank (FSDP2: one, along dim 0)
            chunks[name] = t.to_local(), list(chunk.offsets)
        elif env.is_main:
            chunks[name] = t, [0] * t.dim()
    folder.mkdir(parents=True, exist_ok=True)
    last = max(files.values(), default=0)
    for index in range(1, last + 1):
        names = [k for k in chunks if files[k] == index]
        if not names:  # DCP writes no file without a chunk in it
            continue
        offsets = {k: {"saved_offsets": chunks[k][1]} for k in names}  # DCP's json.dumps, default spacing
        meta = {DCP_SHARDING_INFO: json.dumps(offsets), DCP_VERSION: "1.0", "format": "pt"}
        order, header = _safetensors_header({k: chunks[k][0] for k in names}, meta)
        with open(folder / f"shard-{env.rank + 1:05d}-model-{index:05d}-of-{last:05d}.safetensors", "wb") as f:
            f.write(header)
            for k in order:
                f.write(_bytes(chunks[k][0]))
            f.flush()
            os.fsync(f.fileno())  # as DCP does: on a shared file system only the writer's fsync makes it durable


def _safetensors_header(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> tuple[list[str], bytes]:
    """(the tensors' order in the file, the file's first bytes: header length and JSON header) of a safetensors
    file of ``tensors``: largest item size first, then by name (the library's order for one dtype), so that every
    offset is a multiple of its item size."""
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for k in order:
        t = tensors[k]
        size = t.numel() * t.element_size()
        header[k] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % HEADER_ALIGN)
    return order, struct.pack("<Q", len(blob)) + blob


def _bytes(t: torch.Tensor):
    """A tensor's bytes as the file holds them (on the host, C order)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def load_sharded(
    folder: Path, module: nn.Module, optimizer: torch.optim.Optimizer, *, env: DistEnv, strip: str = "",
    weights: bool = True,
) -> None:
    """Load a :func:`save_sharded` folder into ``module`` and ``optimizer`` as they are sharded now (collective;
    each rank reads the slices of its own shards, whatever the world size that wrote the folder). ``weights``
    False: the optimizer state only (the module keeps its weights)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict, set_state_dict

    model_sd, optim_sd = _live_state(module, optimizer)
    aliases = tied_aliases(module)
    tensors, live = _split(model_sd, optim_sd, aliases=aliases, strip=strip)
    if not weights:
        tensors = _optimizer_only(tensors)
    saved = json.loads((folder / OPTIM_META).read_text())
    if [g["params"] for g in saved["param_groups"]] != [g["params"] for g in live["param_groups"]]:
        raise ValueError(
            f"{folder}: the checkpoint's optimizer holds other parameters than this model; resume with the run's --model"
        )
    try:
        with _dcp_quiet():
            dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=not env.enabled)  # in place
    except (RuntimeError, ValueError, CheckpointException) as e:  # a tensor the folder lacks, or of another size
        raise ValueError(
            f"{folder} does not match this model and optimizer ({_dcp_reason(e)}); resume with the run's --model"
        ) from e
    for alias, name in aliases.items():
        model_sd[alias] = model_sd[name]
    for group, saved_group in zip(optim_sd["param_groups"], saved["param_groups"]):
        for key, value in saved_group.items():
            if key != "params":
                group[key] = tuple(value) if isinstance(group.get(key), tuple) else value  # JSON made betas a list
    for fqn in optim_sd["state"]:
        optim_sd["state"][fqn].update(saved["scalars"].get(fqn.removeprefix(strip), {}))
    if weights:
        set_state_dict(module, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    else:  # the module's weights are as they were: not copied onto themselves
        set_optimizer_state_dict(module, optimizer, optim_state_dict=optim_sd)


def read_sharded(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Every tensor of a :func:`save_sharded` folder whole, in this process, and its JSON part: the whole state
    in memory at once (for tests, inspection and conversion; training loads with :func:`load_sharded`)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    metadata = HuggingFaceStorageReader(str(folder)).read_metadata()
    tensors = {
        k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.state_dict_metadata.items()
    }
    with _dcp_quiet():
        dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=True)
    return tensors, json.loads((folder / OPTIM_META).read_text())


def save_gathered(path: Path, tensors: dict[str, torch.Tensor], *, write: bool) -> None:
    """One safetensors file of ``tensors`` (DTensors or tensors), gathered and written one tensor at a time.

    Collective under FSDP: every rank calls it with the same names (each gather is an all-gather); only
    where ``write`` the file is written. Peak memory beyond what a rank holds already: one whole tensor
    (on every rank, for the length of its gather). Tensors go largest item size first, then by name (the
    library's order for one dtype), so every offset is a multiple of its item size."""
    from torch.distributed.tensor import DTensor

    order, header = _safetensors_header(tensors, {"format": "pt"})  # what transformers' save_pretrained records
    with open(path, "wb") if write else contextlib.nullcontext() as f:
        if f is not None:
            f.write(header)
        for k in order:
            t = tensors[k]
            whole = t.full_tensor() if isinstance(t, DTensor) else t
            if f is not None:
                f.write(_bytes(whole))
            del whole
