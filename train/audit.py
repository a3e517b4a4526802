"""``rollshard-train audit``: how far the trainer's logprobs are from a dataset's stored engine logprobs.

    rollshard-train audit --data DATASET --model PATH [--out AUDIT.parquet] [--json] [--top N] [--max-abs-diff X]

Before a run spends GPU-hours on a dataset, this recomputes the trainer's logprob of every token it would
train on and compares it with the stored ``rollout_logprobs``: no optimizer step, no gradient. It is the
trainer's own path, not a copy of it: the store's loader streams and packs the rows (one pass in stored
order, every agent unless ``--agents``, the rows ``--statuses`` keeps: the trainer's defaults), and the
``hf`` backend computes ``logprobs(batch, grad=False)``: the fp32 log softmax of ``logits / T`` with each
row's own temperature, the output head in fp32 (rollshard.train.logprobs), after the same start-up model
check. Both sides are full-softmax logprobs: ``rollout_logprobs`` is the engine's full-softmax logprob also
for top-p/top-k rows (their renormalized ratio is the trainer's support path, rollshard.train.support).

Every trained token (loss_mask 1) is one row of the report (:data:`rollshard.store.inspection.audit.AUDIT_SCHEMA`),
written atomically to ``--out`` (local or s3://; checked before the model loads: the folder or bucket exists,
``--out`` is not a folder), its metadata naming each source's dataset URI and fingerprint (what ``rollshard-store
report --audit`` and ``inspect --audit`` pair the rows by); the summary (rollshard.store.inspection.audit.summarize, the numbers
``rollshard-store report`` shows for the same file) is printed as tables, or as one JSON object with
``--json`` (train/audit_output.py). The report is held in memory until written (~90 bytes a token with
ids of ~20 characters: 90 MB per million trained tokens);
``--max-rows N`` audits the first N rows (whole groups) of a large dataset.

Exit status: 0 within the thresholds; 1 flagged: ``max |logp - rollout_logp|`` over ``--max-abs-diff``
(or the mean over ``--max-mean-abs-diff``), one line on stderr with the numbers and where the report is;
2 no answer: bad input (no dataset, no model, a model whose vocabulary the token ids do not fit, a model
the trainer's check refuses, no trained token under the filters, an --out that cannot be written), one line
saying what is wrong and how to fix it; 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
import warnings

import numpy as np
import pyarrow as pa
import torch

from rollshard.store.inspection.audit import AUDIT_SCHEMA
from rollshard.store.common import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, UsageError, print_error, progress
from rollshard.store.format.schema import STATUS_VALUES
from rollshard.train.backends.distributed import DistEnv
from rollshard.train.config import ATTN_AUTO, DataConfig, LossConfig, ModelConfig, TrainConfig, flag_of
from rollshard.train.corrections import AUDIT_DEFAULTS, counterfactual
from rollshard.train.losses import LOG_RATIO_CLAMP
from rollshard.train.routing import check_datasets, reads_routing
from rollshard.train.segments import segment_sum

PROG = "rollshard-train audit"
EXIT_FLAGGED = EXIT_FAILED  # a threshold exceeded
# fp32 engines agree with the trainer's recomputation to ~2e-5 nats (SGLang measured, DESIGN.md; the embedded
# engine to ~1e-6 here), so 1e-3 passes any fp32 engine and flags a wrong model, temperature or token alignment.
# A bf16 engine is ~0.1-1 nats off at its worst token: raise it (and watch the mean) there.
DEFAULT_MAX_ABS_DIFF = 1e-3
DEFAULT_TOP = 10
# Groups per loader step: only how many rows are packed together (a micro-batch holds whole rows up to
# --micro-batch-tokens); the audit takes no optimizer step, so it changes no number. With --max-rows a step is
# one group, so the audit stops at the first whole group that reaches N rows.
GROUPS_PER_STEP = 16
# The trainer's loss flags the audit takes: the parameters of the corrections it counts.
CORRECTION_FLAGS = (
    "eps_low", "eps_high", "dual_clip_c", "tis_c", "sapo_tau_pos", "sapo_tau_neg", "dppo_mask_low", "dppo_mask_high",
    "opsm_delta", "m2po_tau", "geo_rs", "k3_rs", "k3_rs_reduce",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OneDevice(DistEnv):
    """One process on the device the audit was given (the trainer's DistEnv picks CUDA whenever it exists)."""

    where: str = "cpu"

    def device(self) -> torch.device:
        return torch.device(self.where)


def _field(kls: type, name: str) -> dataclasses.Field:
    return next(f for f in dataclasses.fields(kls) if f.name == name)


def _help(kls: type, name: str) -> str:
    """A flag's help as the trainer's config says it (one wording for both commands)."""
    f = _field(kls, name)
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    shown = ",".join(default) if isinstance(default, tuple) else default
    return f.metadata["help"] + ("" if default is None else f" (default: {shown})")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Recompute the trainer's logprobs of a dataset's trained tokens (no optimizer step) and report "
        "how far they are from the stored engine logprobs: |logp - rollout_logp| overall and by agent, weight "
        "version, response position and temperature, the ratio band, k3, and the worst tokens.",
        epilog="Exit status: 0 within the thresholds; 1 flagged (one line on stderr: what exceeded what, the numbers, "
        "where the report is); 2 bad input or no answer (one line: what is wrong, how to fix it).",
    )
    p.add_argument("--data", required=True, help=_help(DataConfig, "path") + "; every source is audited whole")
    p.add_argument("--model", required=True, help="Hugging Face model folder to audit the data against (the policy "
                   "that generated it, e.g. the --engine embedded:MODEL folder or the checkpoint served)")
    p.add_argument("--out", metavar="AUDIT.parquet", help="write the per-token report here (local path or s3://), "
                   "atomically; rollshard-store report --audit reads it (default: not written)")
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object instead of tables")
    p.add_argument("--top", type=int, default=DEFAULT_TOP, metavar="N",
                   help="worst tokens shown, with context (default: %(default)s)")
    p.add_argument("--max-abs-diff", type=float, default=DEFAULT_MAX_ABS_DIFF, metavar="X",
                   help="flag (exit 1) when max |logp - rollout_logp| over the trained tokens exceeds X nats "
                   "(default: %(default)g, for fp32 engines; a bf16 engine needs more)")
    p.add_argument("--max-mean-abs-diff", type=float, default=None, metavar="X",
                   help="flag (exit 1) when the mean |logp - rollout_logp| exceeds X nats (default: not checked)")
    p.add_argument("--agents", help=_help(DataConfig, "agents"))
    p.add_argument("--statuses", default=",".join(DataConfig().statuses), help=_help(DataConfig, "statuses"))
    p.add_argument("--max-rows", type=int, default=None, metavar="N",
                   help="audit only the first N rows in stored order, rounded up to whole groups (default: all)")
    p.add_argument("--device", default="cpu",
                   help="torch device of the forward: cpu, cuda, cuda:1 (default: %(default)s)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto", help=_help(ModelConfig, "dtype"))
    p.add_argument("--attn-implementation", default=ATTN_AUTO,
                   help=_help(ModelConfig, "attn_implementation"))
    p.add_argument("--fp32-lm-head", action=argparse.BooleanOptionalAction, default=True,
                   help=_help(ModelConfig, "fp32_lm_head"))
    p.add_argument("--micro-batch-tokens", type=int, default=DataConfig().micro_batch_tokens, metavar="N",
                   help=_help(DataConfig, "micro_batch_tokens") + "; changes no number, only memory")
    p.add_argument("--logprob-chunk-mib", type=float, default=ModelConfig().logprob_chunk_mib, metavar="MIB",
                   help=_help(ModelConfig, "logprob_chunk_mib"))
    p.add_argument("--routing-replay", choices=("auto", "on", "off"), default="auto",
                   help=_help(ModelConfig, "routing_replay") + "; on MoE rows with stored routing the audit also "
                   "recomputes every token the other way and reports both mismatches and the routing agreement")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="progress bar on stderr (default: on)")
    group = p.add_argument_group(
        "off-policy corrections",
        "the table of what each correction would mask, clip or damp if this policy trained on these rows now; "
        "the trainer's flags and defaults, except that a correction the trainer leaves off is counted at the "
        "peers' default",
    )
    for name in CORRECTION_FLAGS:
        f = _field(LossConfig, name)
        help = f.metadata["help"]
        if name in AUDIT_DEFAULTS:  # off in the trainer, counted here at the peers' default
            value = AUDIT_DEFAULTS[name]
            shown = ",".join(f"{v:g}" for v in value) if isinstance(value, tuple) else f"{value:g}"
            help = help.removesuffix("; default off") + f" (audit default: {shown})"
        group.add_argument(flag_of(f), dest=f"loss.{name}", default=argparse.SUPPRESS, metavar=name.upper(), help=help)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from rollshard.store.io.dataset import DatasetNotFoundError
    from rollshard.train.audit_output import exceeded, print_json, print_tables

    try:
        result = run_audit(args)
    except (ValueError, DatasetNotFoundError, UsageError) as e:  # usage and data errors (DataError, ModelCheckError)
        print_error(PROG, e)
        return EXIT_USAGE
    except OSError as e:  # a read or write failed under us (permissions, disk full, S3 refused)
        print_error(PROG, e)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted; no report written", file=sys.stderr)
        return EXIT_INTERRUPTED
    (print_json if args.json else print_tables)(result)
    flags = exceeded(result.summary, max_abs_diff=args.max_abs_diff, max_mean_abs_diff=args.max_mean_abs_diff)
    if flags:
        where = f"report {result.report}" if result.report else "no report written (pass --out AUDIT.parquet)"
        worst = result.worst[0] if result.worst else None
        at = f" at sample {worst['sample_id']} ({worst['agent']}, position {worst['position']})" if worst else ""
        print(f"{PROG}: flagged: {'; '.join(flags)}{at}; {where}", file=sys.stderr)
        return EXIT_FLAGGED
    return EXIT_OK


@dataclasses.dataclass(kw_only=True)
class AuditResult:
    summary: dict
    worst: list[dict]  # rollshard.store.inspection.audit.token_contexts of the --top worst tokens
    report: str | None  # where the report was written
    info: dict  # what was audited: data, model, device, dtype, seconds, rows
    corrections: list[dict] = dataclasses.field(default_factory=list)  # CorrectionTally.summary()
    routing: dict | None = None  # RoutingTally.summary(): MoE rows with stored routing only


def run_audit(args: argparse.Namespace) -> AuditResult:
    """Check the inputs, build the trainer's backend, stream every row through it, write and summarize."""
    from rollshard.store.inspection.audit import (AuditedDataset, check_destination, is_audit_report, summarize,
                                                  worst_tokens, write_audit)
    from rollshard.store.io.destination import check_out_file
    from rollshard.store.loader.mixture import parse_sources
    from rollshard.train.audit_output import worst_with_context
    from rollshard.train.setup import check_model_path

    _check_numbers(args)
    loss = _loss_config(args)
    device = _device(args.device)
    sources = parse_sources(args.data)
    model = check_model_path(args.model)
    if args.out:
        check_destination(args.out)  # a bad --out said now, not after the model load and the whole pass
        check_out_file(args.out, own=is_audit_report, kind="a rollshard-train audit report",
                       fix="name a new file, or a report this command wrote to replace it")
    from rollshard.store.io.dataset import RolloutDataset

    datasets = {s.name: RolloutDataset.open(s.path) for s in sources}  # DatasetNotFoundError before the model loads
    if not args.progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    model_cfg = ModelConfig(path=model, dtype=args.dtype, attn_implementation=args.attn_implementation,
                            fp32_lm_head=args.fp32_lm_head, logprob_chunk_mib=args.logprob_chunk_mib,
                            routing_replay=args.routing_replay)
    from rollshard.train.backends import build_backend

    started = time.perf_counter()
    backend = build_backend(TrainConfig(model=model_cfg), env=OneDevice(where=str(device)), total_updates=None)
    check_datasets(list(datasets.values()), backend.routing_shape, args.routing_replay)
    tally = CorrectionTally(loss)
    routing = RoutingTally() if backend.routing is not None else None
    batches, rows = _stream(backend, datasets, args, model=model, tally=tally, routing=routing)
    table = pa.Table.from_batches(batches, schema=AUDIT_SCHEMA)
    if table.num_rows == 0:
        raise ValueError(
            f"no trained token to audit in --data {args.data}: {rows} rows pass --statuses {args.statuses}"
            f"{' --agents ' + args.agents if args.agents else ''}, with no loss_mask 1 token among them; "
            "loosen the filters or check the dataset with rollshard-store stats"
        )
    seconds = time.perf_counter() - started
    dtype = "bfloat16" if backend.bf16 else "float32"  # the compute dtype; the head and log softmax are fp32 anyway
    info = {"data": args.data, "model": model, "device": str(device), "dtype": dtype,
            "attn_implementation": model_cfg.attn_implementation, "rows": rows, "seconds": round(seconds, 3)}
    report = None
    if args.out:
        try:
            audited = [AuditedDataset.of(name, ds) for name, ds in datasets.items()]
            report = write_audit(table, args.out, datasets=audited, metadata={k: str(v) for k, v in info.items()})
        except OSError as e:
            raise ValueError(f"cannot write --out {args.out} ({e}); choose another path") from e
    worst = worst_tokens(table, args.top)
    worst = worst_with_context(worst, datasets, model)
    return AuditResult(summary=summarize(table), worst=worst, report=report, info=info, corrections=tally.summary(),
                       routing=routing.summary() if routing is not None and routing.tokens else None)


def _loss_config(args: argparse.Namespace) -> LossConfig:
    """The corrections' parameters given on the command line, checked as the trainer checks them."""
    given = {k.split(".", 1)[1]: v for k, v in vars(args).items() if k.startswith("loss.")}
    return TrainConfig.from_dict({"loss": given}, where="command line").validate(require_paths=False).loss


class CorrectionTally:
    """Loss tokens and rows each off-policy correction would change (rollshard.train.corrections.counterfactual),
    summed over the audited micro-batches."""

    def __init__(self, config: LossConfig):
        self.config = config
        self.tokens = self.rows = 0
        self.hits: dict[str, list] = {}  # name -> [parameters in words, tokens, rows]

    def add(self, logp: torch.Tensor, mb, advantages: torch.Tensor) -> None:
        mask, cu = mb.loss_mask.float(), mb.cu_seqlens.long()  # [T], [S+1]
        out = counterfactual(logp, rollout_logp=mb.rollout_logprobs.float(), advantages=advantages, mask=mask,
                             cu_seqlens=cu, config=self.config, log_ratio_clamp=LOG_RATIO_CLAMP)
        self.tokens += int(mask.sum())
        self.rows += int((segment_sum(mask, cu) > 0).sum())
        for name, (words, hit) in out.items():
            entry = self.hits.setdefault(name, [words, 0, 0])
            entry[1] += int(hit.sum())
            entry[2] += int((segment_sum(hit.float(), cu) > 0).sum())

    def summary(self) -> list[dict]:
        return [
            {"correction": name, "parameters": words, "tokens": tokens, "token_share": tokens / max(self.tokens, 1),
             "rows": rows, "row_share": rows / max(self.rows, 1)}
            for name, (words, tokens, rows) in self.hits.items()
        ]


class RoutingTally:
    """MoE rows with stored routing (train/routing.py): the routing agreement of the trainer's own forward, and
    |logp - rollout_logp| over their trained tokens with and without replay."""

    def __init__(self) -> None:
        self.tokens = 0
        self.same = self.pairs = 0.0
        self.sums = {"replay": 0.0, "no_replay": 0.0}
        self.highs = {"replay": 0.0, "no_replay": 0.0}

    def add(self, diffs: dict[str, torch.Tensor], agreement: tuple[float, float]) -> None:
        self.tokens += int(diffs["replay"].numel())
        for key, d in diffs.items():
            self.sums[key] += float(d.sum())
            self.highs[key] = max(self.highs[key], float(d.max())) if d.numel() else self.highs[key]
        self.same += agreement[0]
        self.pairs += agreement[1]

    def summary(self) -> dict:
        return {"tokens": self.tokens, "agreement": self.same / self.pairs if self.pairs else None,
                **{f"{key}_mean": self.sums[key] / self.tokens for key in self.sums},
                **{f"{key}_max": self.highs[key] for key in self.highs}}


def _routing_pass(backend, mb, routing: RoutingTally) -> torch.Tensor:
    """``logp [T]`` of a micro-batch with stored routing as the audit's mode computes it, the tally given both
    ways: without replay first (the agreement of the trainer's own routing), then with."""
    out, diffs = {}, {}
    mode = backend.set_routing_replay(False)
    on = mb.loss_mask > 0
    try:
        for key, replay in (("no_replay", False), ("replay", True)):
            backend.set_routing_replay(replay)
            out[key] = backend.logprobs(mb.to(backend.device), grad=False)[0].float().cpu()  # [T]
            diffs[key] = (out[key] - mb.rollout_logprobs.float())[on].abs()
            agreement = backend.routing_agreement() if key == "no_replay" else agreement
            if key == "replay":
                backend.routing_agreement()  # (on replayed inputs: not the figure reported)
    finally:
        backend.set_routing_replay(mode)
    routing.add(diffs, agreement)
    return out["replay" if mode else "no_replay"]


def _check_numbers(args: argparse.Namespace) -> None:
    checks = [
        (args.top >= 0, f"--top {args.top} must be >= 0"),
        (args.max_abs_diff >= 0, f"--max-abs-diff {args.max_abs_diff} must be >= 0"),
        (args.max_mean_abs_diff is None or args.max_mean_abs_diff >= 0, "--max-mean-abs-diff must be >= 0"),
        (args.max_rows is None or args.max_rows >= 1, f"--max-rows {args.max_rows} must be >= 1"),
        (args.micro_batch_tokens >= 1, f"--micro-batch-tokens {args.micro_batch_tokens} must be >= 1"),
        (args.logprob_chunk_mib > 0, "--logprob-chunk-mib must be > 0"),
        (bool(_names(args.statuses)) and set(_names(args.statuses)) <= set(STATUS_VALUES),
         f"--statuses {args.statuses}: choose one or more of {','.join(STATUS_VALUES)}"),
        (args.agents is None or bool(_names(args.agents)), f"--agents {args.agents!r}: name one or more agents"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated flag value as its names."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _device(text: str) -> torch.device:
    """``--device`` as a torch device this machine has (ValueError, one line, otherwise)."""
    try:
        dev = torch.device(text)
    except RuntimeError as e:
        raise ValueError(f"--device {text!r} is not a torch device; use cpu, cuda or cuda:N") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {text!r}: the audit runs on cpu or cuda[:N]")
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"--device {text}: torch sees no CUDA device on this machine; use --device cpu")
        if (dev.index or 0) >= count:
            raise ValueError(f"--device {text}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    return dev


def _loader_config(args: argparse.Namespace):
    from rollshard.store.loader import LoaderConfig

    return LoaderConfig(
        groups_per_step=GROUPS_PER_STEP if args.max_rows is None else 1, micro_batch_tokens=args.micro_batch_tokens,
        shuffle=False, num_epochs=1, tail="partial", statuses=_names(args.statuses),
        agents=_names(args.agents) if args.agents else None, routed_experts=reads_routing(args.model),
    )


def _stream(backend, datasets: dict, args: argparse.Namespace, *, model: str, tally: CorrectionTally,
            routing: RoutingTally | None = None) -> tuple[list[pa.RecordBatch], int]:
    """Every row of every source through the backend: the report's batches and the rows audited."""
    from rollshard.store.loader import NoStepWarning, RolloutLoader

    cfg = _loader_config(args)
    cfg.check()
    total = sum(ds.num_rows for ds in datasets.values())
    vocab = backend.vocab_size
    batches, rows = [], 0
    bar = progress(min(total, args.max_rows or total), desc="audit", unit="row", file=sys.stderr,
                   disable=not args.progress)
    try:
        for name, ds in datasets.items():
            loader = RolloutLoader(ds, cfg)
            try:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", category=NoStepWarning)  # nothing passes: said below
                    for step in loader:
                        for mb, adv in zip(step.micro_batches, _advantages(step)):
                            batches.append(audit_batch(backend, mb, step.group_ids, source=name, vocab=vocab,
                                                       model=model, advantages=adv, tally=tally, routing=routing))
                            rows += mb.num_sequences
                            bar.update(mb.num_sequences)
                        if args.max_rows is not None and rows >= args.max_rows:
                            return batches, rows
            finally:
                loader.close()
    finally:
        bar.close()
    return batches, rows


def _advantages(step) -> list[torch.Tensor]:
    """Per-token GRPO advantages of each micro-batch of a loader step (whole groups), as the trainer's defaults
    compute them."""
    from rollshard.train.advantages import step_advantages

    return step_advantages(step.micro_batches, num_groups=len(step.group_ids))[1]


@torch.no_grad()
def audit_batch(backend, mb, group_ids: list[str], *, source: str, vocab: int, model: str,
                advantages: torch.Tensor | None = None, tally: "CorrectionTally | None" = None,
                routing: RoutingTally | None = None) -> pa.RecordBatch:
    """The report rows of one packed micro-batch: each trained token's stored and recomputed logprob; with a
    ``tally``, what each off-policy correction would do to its tokens (``advantages [T]``, the step's GRPO ones)."""
    cu = mb.cu_seqlens.long()  # [S+1]
    top = int(mb.input_ids.max())
    if top >= vocab:
        s = int(torch.searchsorted(cu[1:], torch.nonzero(mb.input_ids >= vocab)[0], right=True))
        raise ValueError(
            f"sample {mb.sample_ids[s]} holds token id {top}, outside the vocabulary of --model {model} ({vocab} "
            "ids); audit with the model (and tokenizer) that generated the data"
        )
    if routing is not None and mb.routed_experts is not None:  # MoE rows with routing: both ways
        logp = _routing_pass(backend, mb, routing)
    else:
        logp, _ = backend.logprobs(mb.to(backend.device), grad=False)  # [T] 0 off the loss mask
        logp = logp.float().cpu()  # [T]
    if tally is not None:
        tally.add(logp, mb, advantages)
    at = torch.nonzero(mb.loss_mask > 0).flatten()  # [K] trained positions
    seq = torch.searchsorted(cu[1:], at, right=True)  # [K] the sequence of each: cu[s] <= at < cu[s+1]
    position = at - mb.response_start.long()[seq]  # [K] index into that row's response_tokens
    take = pa.array(seq.numpy())
    groups = [group_ids[g] for g in mb.seq_group.tolist()]  # [S]
    return pa.RecordBatch.from_pydict(
        {
            "sample_id": pa.array(mb.sample_ids, pa.string()).take(take),
            "group_id": pa.array(groups, pa.string()).take(take),
            "agent": pa.array(mb.agents, pa.string()).take(take),
            "source": pa.array([source] * len(at), pa.string()),
            "weight_version": pa.array(mb.weight_versions, pa.string()).take(take),
            "temperature": pa.array(mb.temperatures[seq].numpy().astype(np.float32)),
            "position": pa.array(position.numpy().astype(np.int32)),
            "token": pa.array(mb.input_ids[at].numpy().astype(np.int32)),
            "rollout_logprob": pa.array(mb.rollout_logprobs[at].numpy().astype(np.float32)),
            "trainer_logprob": pa.array(logp[at].numpy().astype(np.float32)),
        },
        schema=AUDIT_SCHEMA,
    )
