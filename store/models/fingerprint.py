"""What identifies a model folder's weights, declared once: ``rollshard-generate`` records it in the run config
(``model_fingerprint``) and ``rollshard-train`` computes it of its ``--model`` the same way, so the trainer can
tell that its policy is not the one that generated the rows (a path names a folder, not the weights in it: a
folder may move between hosts, or be overwritten).

The fingerprint is a hash of ``config.json`` and of every weight file's name, size and bytes: the whole file up
to :data:`WHOLE_FILE_BYTES`, else :data:`SAMPLES` evenly spaced blocks of :data:`SAMPLE_BYTES` (the first holds a
safetensors header), so a 100 GB model costs a few hundred MB of reads, not all of it. Training changes nearly
every element of a weight it updates, so any update shows in the samples; two folders that differ only between
them (a few small tensors of a file over :data:`WHOLE_FILE_BYTES`) look the same. The same weights saved in
another format or sharding look different.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")  # model.safetensors, pytorch_model-00001-of-00002.bin
WHOLE_FILE_BYTES = 64 << 20  # hashed whole up to this size (every tiny and small model)
SAMPLES = 64  # blocks of a larger file, evenly spaced from its first byte to its last
SAMPLE_BYTES = 64 << 10


def model_fingerprint(path: str | os.PathLike) -> str | None:
    """The fingerprint of a local model folder (module docstring); None for anything else (a hub name, a path
    on another host, a folder without weight files)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return None
    weights = sorted(f for f in folder.iterdir() if f.is_file() and f.name.endswith(WEIGHT_SUFFIXES))
    if not weights:
        return None
    h = hashlib.blake2b(digest_size=12)
    config = folder / "config.json"
    h.update(config.read_bytes() if config.is_file() else b"")
    for f in weights:
        size = f.stat().st_size
        h.update(f"\0{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            if size <= WHOLE_FILE_BYTES:
                h.update(fh.read())
                continue
            for i in range(SAMPLES):
                fh.seek((size - SAMPLE_BYTES) * i // (SAMPLES - 1))
                h.update(fh.read(SAMPLE_BYTES))
    return h.hexdigest()
