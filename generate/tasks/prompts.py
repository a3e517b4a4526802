"""Load prompts from a JSONL file, a Parquet file or a Hugging Face dataset (Hub name or data folder).

Each record gives the prompt under ``input_key`` (a string, or a list of
``{"role", "content"}`` chat messages, as slime's ``--input-key``/``--apply-chat-template``
take them), the label under ``label_key`` and optionally an id under ``id_key``. A
record without an id gets its 0-based position as id (``"000017"``), so ids stay the
same when the file is read again or split across hosts. An id may not contain ``/``:
group and sample ids are ``{prompt_id}/{agent}/{round}[/{index}]``, so a ``/`` inside
it could make two different samples share an id.

Every malformed record is found before anything runs: the error is one line naming the
file and line (JSONL, 1-based) or row (Parquet / dataset, 0-based) of the first
problem, and the line numbers of the others.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from rollshard.generate.tasks.base import Prompt

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")
MAX_LISTED = 10  # further bad line numbers are counted, not listed
ID_SEPARATOR = "/"  # joins prompt id, agent, round and index into group and sample ids


class PromptSourceError(ValueError):
    """The prompt source is missing or malformed; the message names the place."""


def load_prompts(
    source: str | os.PathLike,
    *,
    input_key: str = "prompt",
    label_key: str = "label",
    id_key: str = "id",
    label_required: bool = True,
    split: str = "train",
) -> list[Prompt]:
    path = Path(source)
    if path.is_file():
        if path.suffix in PARQUET_SUFFIXES:
            records, name, unit = _parquet_records(path), str(path), " row "
        elif path.suffix in JSONL_SUFFIXES:
            records, name, unit = _jsonl_records(path), str(path), ""
        else:
            raise PromptSourceError(
                f"{path}: unknown prompt file type {path.suffix!r}; use .jsonl (one JSON object a line) or .parquet"
            )
    elif not path.is_dir() and str(source).endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES):
        raise PromptSourceError(f"{source}: no such prompt file")
    else:  # a dataset folder or a Hub name
        records, name, unit = _hf_records(str(source), split), f"{source}[{split}]", " row "
    return _to_prompts(records, name, unit, input_key, label_key, id_key, label_required)


def _jsonl_records(path: Path) -> Iterable[tuple[int, Any, str | None]]:
    """(1-based line, parsed object or None, parse error) for every non-blank line."""
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line), None
                except json.JSONDecodeError as e:
                    yield lineno, None, f"not valid JSON ({e.msg} at column {e.colno})"
    except UnicodeDecodeError as e:
        raise PromptSourceError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from e


def _parquet_records(path: Path) -> Iterable[tuple[int, Any, str | None]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise PromptSourceError(f"{path}: not a readable Parquet file ({e})") from e
    for i, rec in enumerate(table.to_pylist()):
        yield i, rec, None


def _hf_records(name: str, split: str) -> Iterable[tuple[int, Any, str | None]]:
    import datasets

    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # datasets raises many types (FileNotFound, ConnectionError, ValueError, ...)
        raise PromptSourceError(
            f"{name}: not a prompt file, and not a loadable Hugging Face dataset ({type(e).__name__}: {e})"
        ) from e
    for i, rec in enumerate(ds):
        yield i, rec, None


def _check_messages(value: list) -> str | None:
    for m in value:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            return "chat prompt must be a list of {\"role\": str, \"content\": str} objects"
    return None if value else "chat prompt is an empty list"


def _to_prompts(
    records, name: str, unit: str, input_key: str, label_key: str, id_key: str, label_required: bool
) -> list[Prompt]:
    prompts: list[Prompt] = []
    errors: list[tuple[int, str]] = []
    first_line_of: dict[str, int] = {}
    for index, (lineno, rec, err) in enumerate(records):
        if err is None and not isinstance(rec, dict):
            err = f"expected a JSON object, got {type(rec).__name__}"
        if err is None and input_key not in rec:
            err = f"no {input_key!r} field (fields: {', '.join(sorted(rec)) or 'none'}); pass --input-key"
        if err is None:
            content = rec[input_key]
            if isinstance(content, list):
                err = _check_messages(content)
            elif not isinstance(content, str) or not content.strip():
                err = f"{input_key!r} must be a non-empty string or a list of chat messages"
        if err is None and label_required and rec.get(label_key) is None:
            err = f"no {label_key!r} label; this task's verifier needs one (pass --label-key)"
        if err is None:
            pid = str(rec[id_key]) if rec.get(id_key) is not None else f"{index:06d}"
            if ID_SEPARATOR in pid:
                err = (
                    f"prompt id {pid!r} contains {ID_SEPARATOR!r}, which separates the parts of group and sample "
                    f"ids (prompt/agent/round/index); change the {id_key!r} field (e.g. '/' -> '_') or pass "
                    "--id-key pointing at another field"
                )
            elif pid in first_line_of:
                err = f"duplicate prompt id {pid!r} (first at {first_line_of[pid]})"
            else:
                first_line_of[pid] = lineno
                prompts.append(Prompt(prompt_id=pid, index=index, content=content, label=rec.get(label_key)))
        if err is not None:
            errors.append((lineno, err))
    if errors:
        lineno, msg = errors[0]
        others = [str(n) for n, _ in errors[1:]]
        more = ""
        if others:
            listed = ", ".join(others[:MAX_LISTED])
            if len(others) > MAX_LISTED:
                listed += f" and {len(others) - MAX_LISTED} more"
            more = f" (also malformed: {listed})"
        raise PromptSourceError(f"{name}:{unit}{lineno}: {msg}{more}")
    if not prompts:
        raise PromptSourceError(f"{name}: no prompts in it")
    return prompts
