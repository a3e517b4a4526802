"""The GRPO loop: loader steps in, one (or ``mini_batches``) optimizer update per step.

Before anything is loaded, :func:`rollshard.train.setup.prepare_config` resolves the
settings that depend on files (the model folder, the initial weight version, ``--out``).

One step, on every data-parallel rank:

1. advantages over the step's whole groups (the loader never splits a group across
   ranks or micro-batches), broadcast to the response tokens;
2. in decoupled mode with more than one mini-batch the proximal logprobs, and with a
   KL term the reference logprobs, for every micro-batch, once, before any update
   (with one mini-batch the proximal policy is the policy of the gradient pass itself,
   so its detached logprobs serve and no extra forward runs);
3. per mini-batch: the global normalizers (valid tokens and sequences, summed over its
   micro-batches and the ranks), then forward + loss + backward per micro-batch
   (gradients accumulate), a check that every loss was finite, then one optimizer
   update (the backend skips an update whose gradient norm is not finite, and the step
   stops);
4. metrics of all micro-batches and ranks merged, logged, and a checkpoint when due.

Where a micro-batch carries sampling supports (schema 1.1: top-p/top-k rows), the ratio is
taken over the support the engine sampled from (``--renormalize-support``, the default):
the policy's and the proximal policy's logprobs renormalized over it against the stored
``sampling_logprobs``; the KL stays on the full distributions (rollshard.train.support).

A non-finite loss or gradient stops the run (:class:`NonFiniteError`) before that
update; the failed step is neither logged nor saved, so the latest checkpoint and
``metrics.jsonl`` end at the last finished step. SIGINT/SIGTERM stop the run at the
next step boundary with a checkpoint of the last finished step (:attr:`Trainer.stopped_by`);
a second one stops at once without saving.

Every rank runs the same number of forward/backward passes (FSDP's collectives need
it): a rank with fewer micro-batches runs zero-weight passes on a two-token dummy
batch. The policy's weight version is ``initial_version + step``; the loader's
staleness filter follows it.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from rollshard.store.common import progress
from rollshard.store.loader import FILTER_KEYS, NO_VERSION, NoStepError, NoStepWarning, Step, StepLoader
from rollshard.store.loader.filters import int_version
from rollshard.store.loader.packing import PackedBatch
from rollshard.train.advantages import step_advantages
from rollshard.train.backends import build_backend
from rollshard.train.backends.distributed import DistEnv
from rollshard.train.checks import mismatch_line, mismatch_warning, no_signal_warning, recorded_models
from rollshard.train.checkpoint import (
    CKPT_DIR, Checkpoint, architecture_mismatch, checkpoint_name, drop_optimizer_state, export_policy,
    latest_checkpoint, recover, save_checkpoint,
)
from rollshard.train.config import TrainConfig
from rollshard.train.losses import LossNorm, effective_sample_size, policy_loss
from rollshard.train.loggers import MetricsLogger
from rollshard.train.metrics import MetricAccumulator, mean_std, to_host
from rollshard.train.routing import check_datasets, reads_routing
from rollshard.train.support import policy_logprobs, rollout_logprobs, support_metrics
from rollshard.train.setup import prepare_config, run_norm_len  # noqa: F401  (prepare_config: the trainer's API)

# Step.metrics of the loader are this rank's (each rank reads its own share of the blocks): the packing figures and
# the filter counts are summed over ranks; anything else (a source's epoch) is averaged.
LOADER_PER_RANK = frozenset(
    {"groups", "sequences", "tokens", "loss_tokens", "micro_batches", "zero_variance_groups", *FILTER_KEYS}
)
class NonFiniteError(RuntimeError):
    """A loss or gradient of a step is not finite; the run stops before that update is saved."""


def build_loader(config: TrainConfig, env: DistEnv):
    """The store's streaming loader for this rank, from the data section of the config: one dataset, or a
    weighted mixture of several (``--data a:0.7,b:0.3``, rollshard.store.loader.mixture)."""
    from rollshard.store.loader import LoaderConfig
    from rollshard.store.loader.follow import FollowLoader
    from rollshard.store.loader.mixture import open_loader

    d = config.data
    loader_cfg = LoaderConfig(
        groups_per_step=d.groups_per_step,
        micro_batch_tokens=d.micro_batch_tokens,
        micro_batch_support=d.micro_batch_support,
        seed=d.shuffle_seed,
        shuffle=d.shuffle,
        shuffle_window=d.shuffle_window,
        statuses=tuple(d.statuses),
        agents=tuple(d.agents) if d.agents else None,
        max_staleness=d.max_staleness,
        current_version=str(config.trainer.initial_version or 0),
        drop_zero_variance=d.drop_zero_variance,
        num_epochs=d.num_epochs,
        prefetch=d.prefetch,
        tail=d.tail,
        pin_memory=torch.cuda.is_available(),
        # A MoE policy reads the rows' stored routing (schema 1.2) for replay and the agreement (train/routing.py).
        routed_experts=reads_routing(config.model.path),
    )
    if d.follow:
        return FollowLoader(d.path, loader_cfg, wait_s=d.follow_wait, world_size=env.world_size)
    return open_loader(d.path, loader_cfg, rank=env.rank, world_size=env.world_size, sync=_agreement(env))


def check_same_data(loader: StepLoader, env: DistEnv) -> None:
    """Every rank deals the shares from its own open of the dataset: refuse ranks that opened different ones (a
    writer committed between their opens, or paths that differ per node), which would deal different shares."""
    mine = [d.fingerprint for d in loader.datasets]
    every = env.all_gather_json(mine)
    differ = [r for r, other in enumerate(every) if other != mine]
    if differ:
        raise ValueError(
            f"the ranks opened different datasets (rank {env.rank} and ranks {differ}): a writer committed between "
            "their opens, or --data names other data on other nodes; start once the data is complete, on a path "
            "every rank sees"
        )


def _agreement(env: DistEnv):
    """The loader's agreement callback: the least of every rank's state (a step, its epoch ended, its loader
    raised; store/loader), an all-reduce with min, called on the training thread inside ``next(loader)`` the
    same number of times on every rank. None for one process."""
    if not env.enabled:
        return None
    return lambda state: int(env.all_reduce([float(state)], "min")[0])


def dummy_batch() -> PackedBatch:
    """Two tokens, one of them scored: a pass that keeps a rank in step with the others at zero weight."""
    return PackedBatch(
        input_ids=torch.zeros(2, dtype=torch.int64),
        cu_seqlens=torch.tensor([0, 2], dtype=torch.int32),
        loss_mask=torch.tensor([0.0, 1.0]),
        rollout_logprobs=torch.zeros(2),
        temperatures=torch.ones(1),
        response_start=torch.tensor([1]),
        seq_group=torch.tensor([0]),
        rewards=torch.zeros(1),
        agents=["-"],
        sample_ids=["-"],
        weight_versions=[None],
        num_tokens=2,
        num_loss_tokens=1,
    )


def mini_batch_norms(mbs: list[PackedBatch], parts: list[np.ndarray], env: DistEnv, *, norm_len: float) -> list[LossNorm]:
    """Normalizers of each mini-batch (``parts``: micro-batch indices) over every rank, so accumulating its
    micro-batches equals one batch: its own token and sequence counts, and the run's ``norm_len``."""
    out = []
    for part in parts:
        local = LossNorm.combine([LossNorm.of(mbs[i].loss_mask, mbs[i].cu_seqlens) for i in part])
        tokens, seqs = env.all_reduce([local.tokens, local.sequences], "sum")
        out.append(LossNorm(tokens=tokens, sequences=seqs, norm_len=float(norm_len)))
    return out


def loss_shares(norms: list[LossNorm], agg: str) -> list[float]:
    """Each mini-batch's weight in the step's ``loss/*`` metrics: its share of the step's normalizer (valid
    tokens for token-mean, sequences for the sequence means), so the logged loss is that of the step as one
    batch (each mini-batch's loss is already normalized by its own counts)."""
    sizes = [n.tokens if agg == "token-mean" else n.sequences for n in norms]
    total = sum(sizes)
    return [size / total if total > 0 else 0.0 for size in sizes]


class _StopSignals:
    """SIGINT/SIGTERM while training: the first sets :attr:`name`, read by the loop at the next step
    boundary (the step in progress finishes; its weights are saved); a second raises KeyboardInterrupt at
    once. Installed only on the main thread (the only one Python delivers signals to)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self) -> "_StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __init__(self, on_stop: Callable[[], None] | None = None) -> None:
        self.name: str | None = None
        self._previous: dict[int, Any] = {}
        self._on_stop = on_stop  # told at the first signal (a loader waiting for data stops waiting)

    def _handle(self, signum, frame) -> None:
        if self.name is not None:
            raise KeyboardInterrupt
        self.name = signal.Signals(signum).name
        if self._on_stop is not None:
            self._on_stop()

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


class Trainer:
    """Builds the loader, backend and logger from a config (resuming when asked) and runs the loop."""

    def __init__(self, config: TrainConfig, *, env: DistEnv | None = None, loader: StepLoader | None = None):
        self.cfg = config = prepare_config(config)
        self.env = env or DistEnv()
        tr = config.trainer
        self.out = Path(tr.out)
        torch.manual_seed(tr.seed)
        ckpt = self._resume_point()
        self.step = ckpt.step if ckpt else 0
        self.loader = loader if loader is not None else build_loader(config, self.env)
        if not isinstance(self.loader, StepLoader):
            raise TypeError(f"loader is a {type(self.loader).__name__}; the trainer takes a "
                            "rollshard.store.loader.StepLoader")
        check_same_data(self.loader, self.env)
        if ckpt:
            self.loader.load_state_dict(ckpt.loader_states[self.env.rank])
        self.loader.set_current_version(self.version)
        self.norm_len = self._norm_len()
        if not (tr.progress and self.env.is_main):
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()  # its loading/writing bars would break --no-progress output
        total = tr.max_steps * tr.mini_batches if tr.max_steps is not None else None
        self.backend = build_backend(config, env=self.env, total_updates=total, weights_from=ckpt.weights_from if ckpt else None)
        check_datasets(self.loader.datasets, self.backend.routing_shape, config.model.routing_replay)  # MoE routing (R3)
        if ckpt:
            ckpt.restore(self.backend)  # optimizer state, update count and (format 2) weights
        self.logger = self.open_logger(resume_step=self.step if ckpt else None)
        self.last_saved = self.step if ckpt else None
        # The latest checkpoint holds the model only (--final-checkpoint model): it ends a run, and no step is trained
        # from it (it has no optimizer state); within a run only the save after the last step makes one.
        self.saved_model_only = ckpt is not None and not ckpt.optimizer
        self.saved_in_run = False  # whether this run wrote a checkpoint (a resumed one may stop before any)
        self.history: list[dict[str, float]] = []
        self.stopped_by: str | None = None  # the signal that stopped run() at a step boundary
        self.exit_status: int | None = None  # how run() ended, for the loggers: 0 done, 130 stopped; None failed
        self.run_seconds = 0.0  # wall time of run(), and the tokens it trained on
        self.run_tokens = 0.0
        # A fresh run's step-0 mismatch (tokens, mean, max; rollshard.train.checks), measured by its first step.
        self.initial_mismatch: tuple[float, float, float] | None = None

    @property
    def version(self) -> int:
        return self.cfg.trainer.initial_version + self.step

    def checkpoint_path(self, step: int | None = None) -> Path:
        return self.out / CKPT_DIR / checkpoint_name(self.last_saved if step is None else step)

    def open_logger(self, *, resume_step: int | None) -> MetricsLogger:
        """Rank 0's loggers (``--logger``). When they cannot start (``wandb.init`` failed), every rank raises
        the message, so no rank is left waiting in a collective."""
        tr = self.cfg.trainer
        logger, failure = MetricsLogger(self.out, enabled=False), None
        if self.env.is_main:
            try:
                logger = MetricsLogger(
                    self.out, tensorboard="tensorboard" in tr.logger,
                    wandb=self.cfg.wandb if "wandb" in tr.logger else None, run_config=self.cfg.to_dict(),
                    resume_step=resume_step,
                )
            except ValueError as e:
                failure = e
        message = self.env.all_gather_json(None if failure is None else str(failure))[0]
        if failure is not None:
            raise failure
        if message is not None:
            raise ValueError(message)
        return logger

    def _resume_point(self) -> Checkpoint | None:
        recover(self.out, self.env)  # a re-save torn between its renames: latest names the folder set aside
        ckpt = latest_checkpoint(self.out)
        say = print if self.env.is_main else (lambda *a, **k: None)
        if ckpt is None:
            if self.cfg.trainer.resume:
                say(f"rollshard-train: --resume: no checkpoint in {self.out}; starting fresh from --model", file=sys.stderr)
            return None
        if not self.cfg.trainer.resume:
            raise ValueError(f"{self.out} already holds checkpoints; pass --resume to continue, or choose a new --out")
        if ckpt.world_size != self.env.world_size:
            raise ValueError(
                f"checkpoint {ckpt.path} was written by {ckpt.world_size} processes, this run has "
                f"{self.env.world_size}; resume with the same number of processes ({ckpt.world_size}): each one's data "
                "cursor is saved with it"
            )
        initial = self.cfg.trainer.initial_version
        if ckpt.weight_version != str(initial + ckpt.step):
            raise ValueError(
                f"checkpoint {ckpt.path} has weight version {ckpt.weight_version}, but initial version {initial} + "
                f"step {ckpt.step} is {initial + ckpt.step}; resume with the run's --model and --initial-version"
            )
        differs = architecture_mismatch(ckpt.path, Path(self.cfg.model.path)) if ckpt.version >= 3 else None
        if differs:
            raise ValueError(
                f"checkpoint {ckpt.path} is of another model than --model {self.cfg.model.path} ({differs}); resume "
                "with the run's --model"
            )
        say(f"rollshard-train: resuming at step {ckpt.step} from {ckpt.path} (weight version {ckpt.weight_version})",
            file=sys.stderr)
        return ckpt

    def _norm_len(self) -> float:
        """The length constant of seq-mean-token-sum-norm: ``--norm-len``, else the dataset's (:func:`run_norm_len`;
        of a mixture: the largest over its sources, so that no row of any source exceeds it)."""
        loss = self.cfg.loss
        if loss.norm_len is not None or loss.agg != "seq-mean-token-sum-norm":
            return float(loss.norm_len or 0)
        datasets = self.loader.datasets
        if not datasets:  # a loader of pre-read steps names none: the config's
            from rollshard.store.io.dataset import RolloutDataset
            from rollshard.store.loader.mixture import parse_sources

            datasets = [RolloutDataset.open(s.path) for s in parse_sources(self.cfg.data.path)]
        configs = [c for ds in datasets for c in ([m.config for m in ds.manifests if m.config] or [ds.config])]
        length = run_norm_len(configs)
        if length is None:
            raise ValueError(
                f"--agg seq-mean-token-sum-norm needs a length constant and {self.cfg.data.path} does not record the "
                "longest response (sampling.max_new_tokens and the model turns per row); pass --norm-len N"
            )
        self.cfg = dataclasses.replace(self.cfg, loss=dataclasses.replace(loss, norm_len=length))  # in the saved config
        return float(length)

    def _say(self, message: str) -> None:
        if self.env.is_main:
            print(f"rollshard-train: {message}", file=sys.stderr, flush=True)

    def _check_signal(self) -> None:
        """Before the first step: one warning when every group would train at advantage 0 (rollshard.train.checks)."""
        datasets = self.loader.datasets
        if not (self.env.is_main and datasets):
            return
        d = self.cfg.data
        warning = no_signal_warning(
            datasets, statuses=d.statuses, agents=d.agents, drop_zero_variance=d.drop_zero_variance,
            single_member=self.cfg.advantage.single_member,
        )
        if warning:
            self._say(f"warning: {warning}")

    def _report_mismatch(self) -> None:
        """After a fresh run's first step: its step-0 mismatch, and a warning when it is far above fp32 rounding on
        rows another model generated (rollshard.train.checks)."""
        if not self.env.is_main or self.initial_mismatch is None:
            return
        tokens, mean, high = self.initial_mismatch
        self._say(mismatch_line(tokens, mean, high))
        warning = mismatch_warning(high, recorded_models(self.loader.datasets), self.cfg.model.path)
        if warning:
            self._say(f"warning: {warning}")

    def planned_steps(self) -> int | None:
        """Steps of the whole run, for the progress bar: ``--max-steps``, capped by the steps the data holds when
        the epochs are bounded (from its group count before filtering: an upper bound when filters drop groups)."""
        tr, d = self.cfg.trainer, self.cfg.data
        groups = self.loader.num_groups
        if groups is None or d.num_epochs is None:
            return tr.max_steps
        full = d.groups_per_step * self.env.world_size
        mixed = self.loader.groups_before_end  # a mixture: one run until a source runs out
        if mixed is not None:
            in_data = mixed // full if d.tail == "drop" else -(-mixed // full)
            return in_data if tr.max_steps is None else min(tr.max_steps, in_data)
        per_epoch = groups // full if d.tail == "drop" else -(-groups // full)
        in_data = per_epoch * d.num_epochs
        return in_data if tr.max_steps is None else min(tr.max_steps, in_data)

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> list[dict[str, float]]:
        """Train until ``max_steps``, the end of the data or a stop signal; return the metrics of every step run.

        Raises :class:`NoStepError` when no step was ever trained (no checkpoint exists), and
        :class:`NonFiniteError` at a non-finite loss or gradient."""
        tr = self.cfg.trainer
        bar = progress(self.planned_steps(), unit="step", initial=self.step, file=sys.stderr,
                       disable=not (self.env.is_main and tr.progress))
        started = time.perf_counter()
        signal_checked = False  # after the first step's rows were read: a damaged shard is said alone, first
        try:
            with _StopSignals(self.loader.stop_waiting) as stop, warnings.catch_warnings():
                warnings.filterwarnings("ignore", category=NoStepWarning)  # said in flags below (NoStepError)
                it = iter(self.loader)
                while tr.max_steps is None or self.step < tr.max_steps:
                    # The boundary: every rank agrees (FSDP's collectives), and the loader cursor is that of
                    # the last finished step (taking the next step would move it).
                    if self.env.all_reduce([1.0 if stop.name else 0.0], "max")[0]:
                        self.stopped_by = stop.name or "a signal to another rank"
                        break
                    t0 = time.perf_counter()
                    step = self._next_step(it)
                    waited = time.perf_counter() - t0
                    if self.env.all_reduce([0.0 if step is None else 1.0], "min")[0] == 0.0:
                        # A signal that ended a wait for data (--follow), or None; agreed, since it decides what
                        # the save below writes (every rank makes the same collective calls)
                        signalled = self.env.all_reduce([1.0 if stop.name else 0.0], "max")[0]
                        self.stopped_by = (stop.name or "a signal to another rank") if signalled else None
                        if stop.name is None and bar.total is not None and bar.n < bar.total:
                            bar.total = bar.n  # the plan was an upper bound (filters dropped groups): all done
                            bar.refresh()
                        break  # the data ended (on some rank: all stop together)
                    if not signal_checked:
                        self._check_signal()
                        signal_checked = True
                    if self.saved_model_only:  # resumed from one
                        raise ValueError(
                            f"checkpoint {self.checkpoint_path()} holds the model only (--final-checkpoint model), "
                            "no optimizer state to train on from it; train it as --model into a new --out"
                        )
                    fresh = self.step == 0
                    metrics = self.train_step(step)
                    self.step += 1
                    if fresh:
                        self._report_mismatch()
                    self.loader.set_current_version(self.version)
                    self._log_step(metrics, waited=waited, elapsed=time.perf_counter() - t0, bar=bar)
                    if tr.save_every and self.step % tr.save_every == 0:
                        if not (tr.final_checkpoint == "model" and self.step == tr.max_steps):  # saved below
                            self.save()
                    elif tr.export_every and self.step % tr.export_every == 0:  # a checkpoint is a policy folder too
                        export_policy(self.out, step=self.step, backend=self.backend,
                                      weight_version=str(self.version), env=self.env)
                if self.step > 0 and self.last_saved != self.step:
                    self.save(final=self.stopped_by is None)
                elif (self.step > 0 and not self.saved_model_only and self.stopped_by is None
                      and tr.final_checkpoint == "model"):
                    # The data ended right after a --save-every checkpoint (or a rerun found nothing left after
                    # the checkpoint it resumed from): that one is the run's last.
                    drop_optimizer_state(self.checkpoint_path(), self.env)
                    self.saved_model_only = True
        except KeyboardInterrupt:  # a second signal
            self.exit_status = 130
            raise
        finally:
            bar.close()
            self.run_seconds = time.perf_counter() - started
        if self.step == 0 and self.stopped_by is None:
            raise NoStepError(self._no_step_message())
        self.exit_status = 130 if self.stopped_by is not None else 0
        return self.history

    def _next_step(self, it):
        try:
            return next(it, None)
        except NoStepError as e:  # an endless loader's epoch without a step: say it in flags
            raise NoStepError(self._no_step_message()) from e

    def _no_step_message(self) -> str:
        d, w = self.cfg.data, self.env.world_size
        stats = self.loader.epoch_stats
        if "groups_examined" in stats:
            kept = stats["groups_examined"] - stats.get("filtered_groups/empty", 0) - stats.get(
                "filtered_groups/zero_variance", 0
            )
            share = " of this process's share" if w > 1 else ""
            have = f"{kept:.0f} of {stats['groups_examined']:.0f} groups{share} pass the filters"
        else:
            have = f"the dataset holds {self.loader.num_groups if self.loader.num_groups is not None else '?'} groups"
        takes = f"--groups-per-step {d.groups_per_step}" + (f" x {w} processes" if w > 1 else "")
        return (
            f"no step to train: {have} and a step takes {d.groups_per_step * w} ({takes}); lower --groups-per-step, "
            "pass --tail partial, or loosen the filters (--statuses, --agents, --max-staleness, --drop-zero-variance)"
        )

    def _log_step(self, metrics: dict[str, float], *, waited: float, elapsed: float, bar) -> None:
        """Timing figures, then JSONL/TensorBoard and the progress bar."""
        metrics.update(
            {
                "perf/step_s": elapsed,
                "perf/tokens_per_s": metrics["data/tokens"] / elapsed,
                "perf/data_wait_share": self.env.all_reduce([waited], "max")[0] / elapsed,
                "train/weight_version": float(self.version),
            }
        )
        self.run_tokens += metrics["data/tokens"]
        self.history.append(metrics)
        self.logger.log(self.step, metrics, histograms={"staleness": self._staleness_values(metrics)})
        bar.update(1)
        bar.set_postfix(
            loss=f"{metrics.get('loss/total', 0.0):.4f}", reward=f"{metrics.get('reward/mean', 0.0):.3f}",
            ratio=f"{metrics.get('ratio/mean', 1.0):.4f}", tok_s=f"{metrics['perf/tokens_per_s']:.0f}",
        )

    def save(self, final: bool = False) -> Path:
        """A checkpoint of this step; ``final``: the run's end (a model-only one with --final-checkpoint model)."""
        states = self.env.all_gather_json(self.loader.state_dict())
        optimizer = not (final and self.cfg.trainer.final_checkpoint == "model")
        path = save_checkpoint(
            self.out,
            step=self.step,
            backend=self.backend,
            loader_states=states,
            weight_version=str(self.version),
            env=self.env,
            config_yaml=self.cfg.to_yaml(),
            keep_last=self.cfg.trainer.keep_last,
            optimizer=optimizer,
        )
        self.last_saved, self.saved_model_only = self.step, not optimizer
        self.saved_in_run = True
        return path

    def close(self) -> None:
        self.logger.close(exit_code=1 if self.exit_status is None else self.exit_status)
        self.loader.close()

    # -- one step ------------------------------------------------------------------------------

    def needs_proximal_forward(self) -> bool:
        """Decoupled mode needs a forward of its own for pi_prox only when a later mini-batch trains on updated
        weights; with one mini-batch pi_prox is the policy of the gradient pass (its logprobs detached)."""
        return self.cfg.loss.mode == "decoupled" and self.cfg.trainer.mini_batches > 1

    def train_step(self, step: Step) -> dict[str, float]:
        """One loader step: advantages, (proximal/reference logprobs), updates; merged metrics.

        The host reads the step's figures from its own copy of the micro-batches (``step.micro_batches``; the
        loader's tensors are on the host) and each mini-batch's loss metrics in one transfer after its last
        backward, so the device is not waited for once per figure (:func:`rollshard.train.metrics.to_host`)."""
        cfg, dev = self.cfg, self.backend.device
        host = step.micro_batches
        mbs = [mb.to(dev, non_blocking=dev.type == "cuda") for mb in host]
        acc = MetricAccumulator()
        adv_tok = self._advantages(step, host, acc, dev)
        n_passes = int(self.env.all_reduce([float(len(mbs))], "max")[0])
        prox = self._frozen_logprobs(mbs, n_passes, reference=False) if self.needs_proximal_forward() else None
        ref = self._frozen_logprobs(mbs, n_passes, reference=True) if cfg.loss.kl_coef > 0 else None

        parts = np.array_split(np.arange(len(mbs)), cfg.trainer.mini_batches)
        # A fresh run's step-0 mismatch is of the weights before any update: with one mini-batch every forward of
        # the step comes before it, with more a forward of its own does.
        initial = self._pre_update_mismatch(mbs, n_passes, prox) if self.step == 0 and len(parts) > 1 else None
        norms = mini_batch_norms(host, parts, self.env, norm_len=self.norm_len)
        # The routing agreement is that of the forwards the loss is computed on: each micro-batch once, at the weights
        # it is trained at (not the proximal, reference or step-0 passes above).
        self.backend.routing_agreement()
        optim_metrics = []
        for k, (part, norm, share) in enumerate(zip(parts, norms, loss_shares(norms, cfg.loss.agg))):
            n_part = int(self.env.all_reduce([float(len(part))], "max")[0])
            pending: list[dict[str, torch.Tensor]] = []  # each micro-batch's metrics, still on the device
            for j in range(n_part):
                self.backend.set_gradient_sync(j == n_part - 1)
                if j >= len(part):
                    logp, _ = self.backend.logprobs(dummy_batch().to(dev), grad=True)
                    self.backend.backward(logp.sum() * 0.0)
                    continue
                i = int(part[j])
                mb = mbs[i]
                logp, ent, sup = self.backend.logprobs(mb, grad=True, entropy=cfg.loss.entropy_coef > 0, support=True)
                renorm = cfg.loss.renormalize_support
                logp_used = policy_logprobs(logp, sup, renormalize=renorm)  # [T] (rollshard.train.support)
                old = rollout_logprobs(mb.rollout_logprobs, mb.sampling_logprobs, sup, renormalize=renorm)  # [T]
                if prox is not None:
                    prox_i = prox[i]
                else:
                    prox_i = logp_used.detach() if cfg.loss.mode == "decoupled" else None
                loss, m = policy_loss(
                    logp_used,
                    rollout_logp=old,
                    advantages=adv_tok[i],
                    loss_mask=mb.loss_mask,
                    cu_seqlens=mb.cu_seqlens,
                    config=cfg.loss,
                    norm=norm,
                    prox_logp=prox_i,
                    ref_logp=ref[i] if ref is not None else None,
                    entropy=ent,
                    kl_logp=logp,  # the KL is on the full distributions
                )
                m.update(support_metrics(
                    logp, old_logp=old, rollout_logp=mb.rollout_logprobs, sampling_logp=mb.sampling_logprobs,
                    support=sup, loss_mask=mb.loss_mask,
                ))
                self.backend.backward(loss)
                pending.append(m)
            bad: dict[str, float] = {}
            for m in to_host(pending):  # one transfer for the mini-batch, after its last backward
                acc.add_loss_metrics(m, weight=m["tokens"], loss_share=share)
                bad.update({n: v for n, v in m.items() if n.startswith("loss/") and not math.isfinite(v)})
            where = f"mini-batch {k + 1}/{len(parts)}" if len(parts) > 1 else "its loss"
            # Every rank stops together (one rank alone raising would leave the others in a collective).
            if self.env.all_reduce([1.0 if bad else 0.0], "max")[0]:
                terms = ", ".join(f"{n} = {v}" for n, v in bad.items()) or "on another rank"
                raise NonFiniteError(f"step {self.step + 1}: non-finite loss ({terms}, {where}); {self._stop_note()}")
            result = self.backend.optimizer_step()  # skips the update itself when the gradient norm is not finite
            if not math.isfinite(result["optim/grad_norm"]):
                raise NonFiniteError(
                    f"step {self.step + 1}: non-finite gradient (norm {result['optim/grad_norm']}, {where}); "
                    f"the update was skipped; {self._stop_note()}"
                )
            optim_metrics.append(result)

        self.data_metrics(step, host, acc)
        merged = MetricAccumulator.merged(self.env.all_gather_json(acc.state())).result()
        out = self._finish_metrics(merged, optim_metrics)
        same, pairs = self.env.all_reduce(list(self.backend.routing_agreement()))  # MoE rows with routing (R3)
        if pairs:
            out["routing/agreement"] = same / pairs
        if self.step == 0 and "mismatch/abs_diff_max" in out:
            self.initial_mismatch = initial or (
                out["data/loss_tokens"], out["mismatch/abs_diff_mean"], out["mismatch/abs_diff_max"]
            )
        return out

    @torch.no_grad()
    def _pre_update_mismatch(
        self, mbs: list[PackedBatch], n_passes: int, prox: list[torch.Tensor] | None
    ) -> tuple[float, float, float]:
        """(tokens, mean, max) of ``|logp - rollout_logp|`` over every rank's micro-batches at the current weights,
        of the logprobs the ratio takes (``mismatch/abs_diff_*`` of :func:`rollshard.train.losses.policy_loss`):
        the proximal policy's when decoupled mode computed them (the same weights), else a forward of its own."""
        renorm = self.cfg.loss.renormalize_support
        now = prox if prox is not None else self._frozen_logprobs(mbs, n_passes, reference=False)
        total, count, high = 0.0, 0.0, 0.0
        for mb, logp in zip(mbs, now):
            old = mb.rollout_logprobs  # [T] the ratio's rollout side (rollshard.train.support.rollout_logprobs):
            if renorm and mb.has_support is not None:  # the stored sampling logprob where the row has a support
                old = torch.where(mb.has_support, mb.sampling_logprobs, old)
            diff = (logp - old)[mb.loss_mask > 0].abs()  # [K]
            if diff.numel():
                most = diff.max().item()
                total, count = total + diff.sum().item(), count + diff.numel()
                high = most if not most <= high else high  # a NaN stays (max() would drop it)
        total, count = self.env.all_reduce([total, count], "sum")
        high = self.env.all_reduce([high], "max")[0]
        return count, total / max(count, 1.0), high

    def _stop_note(self) -> str:
        saved = (
            f"the latest checkpoint is {self.checkpoint_path()} (step {self.last_saved})"
            if self.last_saved is not None else "no checkpoint was written (--save-every N keeps finished steps)"
        )
        return f"stopped without saving this step; {saved}; lower --lr or check the data, then --resume"

    def _advantages(
        self, step: Step, host: list[PackedBatch], acc: MetricAccumulator, device: torch.device
    ) -> list[torch.Tensor]:
        """Per-token advantages of every micro-batch (on ``device``), from the whole groups of the step (read from
        the host's micro-batches)."""
        if not host:
            return []
        a = self.cfg.advantage
        out, per_mb = step_advantages(host, num_groups=len(step.group_ids), normalize_std=a.normalize_std,
                                      eps=a.adv_eps, single_member=a.single_member)
        adv = out.advantages  # [N]
        total, total_sq, low, high = torch.stack([adv.sum(), (adv * adv).sum(), adv.min(), adv.max()]).tolist()
        acc.add_sum("adv/_sum", total)
        acc.add_sum("adv/_sumsq", total_sq)
        acc.add_sum("adv/_n", float(adv.numel()))
        acc.add_min("adv/min", low)
        acc.add_max("adv/max", high)
        acc.add_sum("groups/zero_variance", float(out.zero_variance.sum()))  # >= 2 rows, equal: the loader's count
        acc.add_sum("groups/single", float((out.size == 1).sum()))
        acc.add_sum("data/groups", float(len(step.group_ids)))
        return [a_tok.to(device) for a_tok in per_mb]

    @torch.no_grad()
    def _frozen_logprobs(self, mbs: list[PackedBatch], n_passes: int, *, reference: bool) -> list[torch.Tensor]:
        """Logprobs under the proximal (current, before any update) or the reference policy; no grad. The
        proximal ones are renormalized over the sampling supports as the policy's are (rollshard.train.support);
        the reference's are of the full distribution (the KL's definition)."""
        renorm = self.cfg.loss.renormalize_support
        if reference or not renorm:
            out = [self.backend.logprobs(mb, grad=False, reference=reference)[0] for mb in mbs]
        else:
            out = []
            for mb in mbs:
                logp, _, sup = self.backend.logprobs(mb, grad=False, support=True)
                out.append(policy_logprobs(logp, sup, renormalize=True))
        for _ in range(n_passes - len(mbs)):
            self.backend.logprobs(dummy_batch().to(self.backend.device), grad=False, reference=reference)
        return out

    def data_metrics(self, step: Step, mbs: list[PackedBatch], acc: MetricAccumulator) -> None:
        """Reward by agent (and by source, for a mixture), staleness counts, sizes, and the loader's own figures
        (as sums / means; a mixture's ``source/<name>/*`` figures at the top level, not under ``loader/``)."""
        group_sources = step.group_sources  # [G] a mixture's source of each group; None for one dataset
        for mb in mbs:
            origin = [f"source/{group_sources[g]}/reward" for g in mb.seq_group.tolist()] if group_sources else None
            for s, (agent, r) in enumerate(zip(mb.agents, mb.rewards.tolist())):
                keys = ("reward", f"reward/{agent}") + ((origin[s],) if origin else ())
                for key in keys:
                    acc.add_sum(f"{key}/_sum", r)
                    acc.add_sum(f"{key}/_sumsq", r * r)
                    acc.add_sum(f"{key}/_n", 1.0)
            for lag in self._staleness(mb):
                acc.add_sum(f"staleness/hist/{lag if lag is not None else 'unknown'}", 1.0)
                if lag is not None:
                    acc.add_max("staleness/max", float(lag))
                    acc.add_sum("staleness/_sum", float(lag))
                    acc.add_sum("staleness/_n", 1.0)
        acc.add_sum("data/tokens", float(sum(mb.num_tokens for mb in mbs)))
        acc.add_sum("data/sequences", float(sum(mb.num_sequences for mb in mbs)))
        acc.add_sum("data/micro_batches", float(len(mbs)))
        for k, v in step.metrics.items():
            if k.startswith("source/"):  # source/<name>/<figure>: per rank (summed) like the packing figures
                (acc.add_sum if k.rsplit("/", 1)[1] in LOADER_PER_RANK else acc.add_mean)(k, float(v))
            elif k in LOADER_PER_RANK:
                acc.add_sum(f"loader/{k}", float(v))
            else:
                acc.add_mean(f"loader/{k}", float(v))

    def _staleness(self, mb: PackedBatch) -> list[int | None]:
        """[S] versions behind the policy of each sequence's oldest token (the staleness filter's measure), None where
        unknown; a batch without its sequences' oldest versions (built by hand) counts their weight_version."""
        if mb.oldest_versions is not None:
            versions = mb.oldest_versions.tolist()
        else:
            versions = [int_version(v) for v in mb.weight_versions]
        return [None if v == NO_VERSION else self.version - v for v in versions]

    @staticmethod
    def _staleness_values(metrics: dict[str, float]) -> list[float]:
        prefix = "staleness/hist/"
        return [
            float(k[len(prefix):]) for k, n in metrics.items()
            if k.startswith(prefix) and k[len(prefix):].lstrip("-").isdigit() for _ in range(int(n))
        ]

    def _finish_metrics(self, m: dict[str, float], optim: list[dict[str, float]]) -> dict[str, float]:
        """Derived figures (means/stds from sums, ESS, group counts and fractions) and the optimizer's."""
        out = {k: v for k, v in m.items() if "/_" not in k}
        sums = collections.defaultdict(dict)
        for k, v in m.items():
            if "/_" in k:
                base, leaf = k.rsplit("/_", 1)
                sums[base][leaf] = v
        for base, s in sums.items():
            mean, std = mean_std(s.get("sum", 0.0), s.get("sumsq", 0.0), s.get("n", 0.0))
            out[f"{base}/mean"] = mean
            if "sumsq" in s:
                out[f"{base}/std"] = std
        out["data/loss_tokens"] = out.pop("tokens", 0.0)
        groups = max(out.get("data/groups", 0.0), 1.0)
        out.setdefault("groups/zero_variance", 0.0)
        out.setdefault("groups/single", 0.0)
        out["groups/frac_zero_variance"] = out["groups/zero_variance"] / groups
        out["groups/frac_single"] = out["groups/single"] / groups
        if "is/mean" in out:
            out["is/ess"] = effective_sample_size(out["is/mean"], out.pop("is/sq_mean"))
        out["optim/grad_norm"] = optim[-1]["optim/grad_norm"]
        out["optim/grad_norm_max"] = max(o["optim/grad_norm"] for o in optim)
        out["optim/lr"] = optim[-1]["optim/lr"]
        out["optim/skipped"] = sum(o["optim/skipped"] for o in optim)
        return out
