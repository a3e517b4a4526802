"""``rollshard-store inspect --sample``: one row looked up (by sample_id, first, random, or the worst trainer vs
rollout mismatch of an ``--audit`` report), its tokens decoded and, with ``--audit``, the trainer's logprob beside
each rollout one. What is shown: :mod:`.sample_tables`."""

from __future__ import annotations

import argparse
import os
import random
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl

from rollshard.store.commands.console import warning
from rollshard.store.common import UsageError, one_line
from rollshard.store.inspection.stats import decode_each, find_sample
from rollshard.store.inspection.views.paths import dataset_tokenizer
from rollshard.store.io.dataset import RolloutDataset
from rollshard.store.models.tokenizer import load_decoder

WORST_MISMATCH = "worst-mismatch"
PER_TOKEN = ("response_tokens", "rollout_logprobs", "loss_mask", "sampling_logprobs", "sampling_support")


@dataclass(frozen=True, kw_only=True)
class SampleView:
    """One row as inspect shows it: its scalar fields and its response tokens, one dict per token (pos, id,
    text, logprob, mask; sampling_logprob and support_size with a sampling support; trainer_logprob and diff with
    an audit)."""

    scalars: dict[str, Any]
    tokens: list[dict[str, Any]]
    decoded_with: str | None  # the tokenizer folder; None: token ids only
    has_support: bool  # the row records its sampling support (schema 1.1)
    audited: bool  # --audit was given

    def to_dict(self) -> dict[str, Any]:
        doc = {"sample": self.scalars, "tokenizer": self.decoded_with, "tokens": self.tokens}
        if self.audited:
            doc["audit"] = audit_line(self.tokens)
        return doc


def look_up(ds: RolloutDataset, args: argparse.Namespace) -> SampleView:
    audit, sources = audit_tokens(args, ds)
    if args.sample == WORST_MISMATCH:
        row, sources = _worst(ds, args, audit, sources)
    else:
        row = pick(ds, args.sample) if args.sample in ("first", "random") else None
        row = row or find_sample(ds, args.sample)
    if row is None:
        first = ds.scan().select("sample_id").head(1).collect()["sample_id"].to_list()
        hint = f"; ids look like {first[0]!r}" if first else "; the dataset has no rows"
        raise UsageError(f"no sample_id {args.sample!r} in {ds.storage.uri}{hint}")
    ids = list(row["response_tokens"])
    texts, decoded_with = _decode(ids, args.tokenizer or dataset_tokenizer(ds.config, ds.storage.uri),
                                  given=bool(args.tokenizer))
    tokens = [
        {"pos": i, "id": t, "text": texts[i] if texts else None, "logprob": lp, "mask": m}
        for i, (t, lp, m) in enumerate(zip(ids, row["rollout_logprobs"], row["loss_mask"]))
    ]
    if audit is not None:  # the trainer's logprob of each audited (trained) token, by position
        from rollshard.store.inspection.views.mismatch import sample_tokens

        got = sample_tokens(audit, row["sample_id"], sources[0] if sources else None)
        trainer = dict(zip(got["position"].to_list(), got["trainer_logprob"].to_list()))
        if not trainer:
            print(f"note: sample {row['sample_id']!r} is not in the audit report {args.audit}", file=sys.stderr)
        for t in tokens:
            tl = trainer.get(t["pos"])
            t["trainer_logprob"] = tl
            t["diff"] = None if tl is None else tl - t["logprob"]
    support = row.get("sampling_support")  # schema 1.1: per token, its sampling logprob and support size
    if support is not None:
        for t, slp, sup in zip(tokens, row["sampling_logprobs"], support):
            t["sampling_logprob"], t["support_size"] = slp, len(sup)
    scalars = {k: v for k, v in row.items() if k not in PER_TOKEN}
    scalars["prompt_tokens"] = list(row["prompt_tokens"])
    if scalars.get("reward") is not None:  # stored as float32: its shortest decimal, not the float64 widening
        scalars["reward"] = float(str(np.float32(scalars["reward"])))
    return SampleView(scalars=scalars, tokens=tokens, decoded_with=decoded_with, has_support=support is not None,
                      audited=audit is not None)


def _worst(ds: RolloutDataset, args: argparse.Namespace, audit, sources):
    """The row of the audit's largest |trainer - rollout| logprob, and the source it was audited as."""
    if audit is None:
        raise UsageError(f"--sample {WORST_MISMATCH} needs --audit AUDIT.parquet (written by rollshard-train audit)")
    from rollshard.store.inspection.views.mismatch import worst_sample

    worst = worst_sample(audit)
    if worst is None:
        raise UsageError(f"--audit {args.audit}: the audit report has no tokens")
    source, sid = worst
    sources = [source] if sources is not None else None  # the worst token's source, when the report names it
    row = find_sample(ds, sid)
    if row is None:
        raise UsageError(f"--audit {args.audit}: its worst sample {sid!r} is not in {ds.storage.uri} "
                         "(an audit of another dataset?)")
    return row, sources


def _decode(ids: list[int], path: str | None, *, given: bool) -> tuple[list[str] | None, str | None]:
    """Each token's text and the tokenizer folder that decoded them; (None, None) without one. A ``--tokenizer``
    that does not load is a usage error, the run config's a note."""
    if not path:
        return None, None
    try:
        return decode_each(load_decoder(path), ids), path
    except (OSError, ValueError) as e:
        if given:
            raise UsageError(f"cannot load a tokenizer from {path}: {one_line(e)}") from e
        print(f"note: showing token ids; the run config's tokenizer {path} did not load: {one_line(e)}",
              file=sys.stderr)
        return None, None


def audit_tokens(args: argparse.Namespace, ds: RolloutDataset):
    """The tokens of ``--audit`` that are of ``ds`` and the report's sources that are ``ds`` (None, None without
    --audit; the whole report and None for a report naming no dataset, with a warning); a bad file, or an audit
    of another dataset, is a one-line usage error."""
    if args.audit is None:
        return None, None
    from rollshard.store.inspection.views.mismatch import UNPAIRED, AuditDatasetError, load, pair

    if "://" not in args.audit and not os.path.isfile(args.audit):
        raise UsageError(f"--audit {args.audit}: no such file")
    report = load(args.audit)
    try:
        pairing = pair(report, [ds], audit=args.audit)
    except AuditDatasetError as e:
        raise UsageError(f"--audit {e}") from e
    if pairing.audited is None:
        warning(f"--audit {args.audit} {UNPAIRED}")
        return report, None
    return pairing.tokens(report), pairing.sources_of(ds)


def audit_line(tokens: list[dict[str, Any]]) -> dict[str, Any]:
    """The audited tokens' count, mean and largest |trainer - rollout| logprob, and where the largest is."""
    diffs = [(abs(t["diff"]), t["pos"]) for t in tokens if t.get("diff") is not None]
    worst = max(diffs, default=(None, None))
    return {"tokens": len(diffs), "abs_diff_mean": sum(d for d, _ in diffs) / len(diffs) if diffs else None,
            "abs_diff_max": worst[0], "worst_position": worst[1]}


def pick(ds: RolloutDataset, which: str) -> dict[str, Any] | None:
    """The first row of the dataset, or one drawn at random (None when it has no rows)."""
    lf = ds.scan()
    if which == "first":
        df = lf.head(1).collect()
    else:
        n = lf.select(pl.len()).collect().item()
        df = lf.slice(random.randrange(n), 1).collect() if n else lf.head(0).collect()
    return df.row(0, named=True) if df.height else None
