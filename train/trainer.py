"""The GRPO loop: loader steps in, one (or ``mini_batches``) optimizer update per step.

One step, on every data-parallel rank:

1. advantages over the step's whole groups (the loader never splits a group across
   ranks or micro-batches), broadcast to the response tokens;
2. in decoupled mode the proximal logprobs, and with a KL term the reference
   logprobs, for every micro-batch, once, before any update;
3. the length constant of seq-mean-token-sum-norm (``--norm-len``, else the most
   loss tokens of any sequence of the step, max over ranks), once for the whole step;
   per mini-batch: the global normalizers (valid tokens and sequences, summed over
   its micro-batches and the ranks), then forward + loss + backward per micro-batch
   (gradients accumulate), then one optimizer update;
4. metrics of all micro-batches and ranks merged, logged, and a checkpoint when due.

Every rank runs the same number of forward/backward passes (FSDP's collectives need
it): a rank with fewer micro-batches runs zero-weight passes on a two-token dummy
batch. The policy's weight version is ``initial_version + step``; the loader's
staleness filter follows it.
"""

from __future__ import annotations

import collections
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollshard.store.packing import PackedBatch
from rollshard.train.advantages import grpo_advantages, token_advantages
from rollshard.train.backends import build_backend
from rollshard.train.backends.distributed import DistEnv
from rollshard.train.checkpoint import Checkpoint, latest_checkpoint, save_checkpoint
from rollshard.train.config import TrainConfig
from rollshard.train.losses import LossNorm, effective_sample_size, policy_loss
from rollshard.train.metrics import MetricAccumulator, MetricsLogger, mean_std


def build_loader(config: TrainConfig, env: DistEnv):
    """The store's streaming loader for this rank, from the data section of the config."""
    from rollshard.store.loader import LoaderConfig, RolloutLoader

    d = config.data
    loader_cfg = LoaderConfig(
        groups_per_step=d.groups_per_step,
        micro_batch_tokens=d.micro_batch_tokens,
        seed=d.shuffle_seed,
        shuffle=d.shuffle,
        shuffle_window=d.shuffle_window,
        statuses=tuple(d.statuses),
        agents=tuple(d.agents) if d.agents else None,
        max_staleness=d.max_staleness,
        current_version=str(config.trainer.initial_version),
        drop_zero_variance=d.drop_zero_variance,
        num_epochs=d.num_epochs,
        prefetch=d.prefetch,
        tail=d.tail,
        pin_memory=torch.cuda.is_available(),
    )
    return RolloutLoader(d.path, loader_cfg, rank=env.rank, world_size=env.world_size)


def dummy_batch() -> PackedBatch:
    """Two tokens, one of them scored: a pass that keeps a rank in step with the others at zero weight."""
    return PackedBatch(
        input_ids=torch.zeros(2, dtype=torch.int64),
        position_ids=torch.arange(2),
        cu_seqlens=torch.tensor([0, 2], dtype=torch.int32),
        loss_mask=torch.tensor([0.0, 1.0]),
        rollout_logprobs=torch.zeros(2),
        temperature=torch.ones(2),
        response_start=torch.tensor([1]),
        seq_group=torch.tensor([0]),
        rewards=torch.zeros(1),
        agents=["-"],
        sample_ids=["-"],
        weight_versions=[None],
        num_tokens=2,
        num_loss_tokens=1,
    )


def step_norm_len(mbs: list[PackedBatch], env: DistEnv, *, norm_len: int | None = None) -> float:
    """The length constant of seq-mean-token-sum-norm for a whole step: ``norm_len`` when set, else the
    most loss tokens (``loss_mask > 0``) of any one sequence over every micro-batch of the step and every
    rank. One value per step, so each mini-batch of it divides by the same constant (Dr. GRPO)."""
    local = max((LossNorm.of(mb.loss_mask, mb.cu_seqlens).norm_len for mb in mbs), default=0.0)
    (longest,) = env.all_reduce([local], "max")  # every rank calls it, whatever --norm-len says
    return float(norm_len if norm_len is not None else longest)


def mini_batch_norms(
    mbs: list[PackedBatch], parts: list[np.ndarray], env: DistEnv, *, norm_len: int | None = None
) -> list[LossNorm]:
    """Normalizers of each mini-batch (``parts``: micro-batch indices) over every rank, so accumulating its
    micro-batches equals one batch: its own token and sequence counts, and the step's :func:`step_norm_len`."""
    length = step_norm_len(mbs, env, norm_len=norm_len)
    out = []
    for part in parts:
        local = LossNorm.combine([LossNorm.of(mbs[i].loss_mask, mbs[i].cu_seqlens) for i in part])
        tokens, seqs = env.all_reduce([local.tokens, local.sequences], "sum")
        out.append(LossNorm(tokens=tokens, sequences=seqs, norm_len=length))
    return out


class Trainer:
    """Builds the loader, backend and logger from a config (resuming when asked) and runs the loop."""

    def __init__(self, config: TrainConfig, *, env: DistEnv | None = None, loader: Any = None):
        self.cfg = config
        self.env = env or DistEnv()
        self.out = Path(config.trainer.out)
        torch.manual_seed(config.trainer.seed)
        ckpt = self._resume_point()
        self.step = ckpt.step if ckpt else 0
        self.loader = loader if loader is not None else build_loader(config, self.env)
        if ckpt:
            self.loader.load_state_dict(ckpt.loader_states[self.env.rank])
        self.loader.set_current_version(self.version)
        tr = config.trainer
        total = tr.max_steps * tr.mini_batches if tr.max_steps is not None else None
        self.backend = build_backend(config, env=self.env, total_updates=total, weights_from=ckpt.path if ckpt else None)
        if ckpt:
            self.backend.load_optimizer_state(ckpt.optimizer_state())
            self.backend.updates = ckpt.updates
        self.logger = MetricsLogger(
            self.out, enabled=self.env.is_main, tensorboard=tr.tensorboard, resume_step=self.step if ckpt else None
        )
        self.last_saved = self.step if ckpt else None
        self.history: list[dict[str, float]] = []

    @property
    def version(self) -> int:
        return self.cfg.trainer.initial_version + self.step

    def _resume_point(self) -> Checkpoint | None:
        ckpt = latest_checkpoint(self.out)
        if ckpt is None:
            if self.cfg.trainer.resume and self.env.is_main:
                print(f"rollshard-train: no checkpoint in {self.out}; starting from --model", file=sys.stderr)
            return None
        if not self.cfg.trainer.resume:
            raise ValueError(f"{self.out} already holds checkpoints; pass --resume to continue, or choose a new --out")
        if ckpt.world_size != self.env.world_size:
            raise ValueError(
                f"checkpoint {ckpt.path} was written by {ckpt.world_size} processes, this run has "
                f"{self.env.world_size}; resume with the same number of processes"
            )
        return ckpt

    # -- the loop ------------------------------------------------------------------------------

    def run(self) -> list[dict[str, float]]:
        """Train until ``max_steps`` or the end of the data; return the metrics of every step run."""
        from tqdm import tqdm

        tr = self.cfg.trainer
        bar = tqdm(
            total=tr.max_steps, initial=self.step, unit="step", file=sys.stderr,
            disable=not (self.env.is_main and tr.progress), dynamic_ncols=True,
        )
        it = iter(self.loader)
        try:
            while tr.max_steps is None or self.step < tr.max_steps:
                t0 = time.perf_counter()
                step = next(it, None)
                waited = time.perf_counter() - t0
                if self.env.all_reduce([0.0 if step is None else 1.0], "min")[0] == 0.0:
                    break  # the data ended (on some rank: all stop together)
                metrics = self.train_step(step)
                self.step += 1
                self.loader.set_current_version(self.version)
                self._log_step(metrics, waited=waited, elapsed=time.perf_counter() - t0, bar=bar)
                if tr.save_every and self.step % tr.save_every == 0:
                    self.save()
            if self.step > 0 and self.last_saved != self.step:
                self.save()
        finally:
            bar.close()
        return self.history

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
        self.history.append(metrics)
        self.logger.log(self.step, metrics, histograms={"staleness": self._staleness_values(metrics)})
        bar.update(1)
        bar.set_postfix(
            loss=f"{metrics.get('loss/total', 0.0):.4f}", reward=f"{metrics.get('reward/mean', 0.0):.3f}",
            ratio=f"{metrics.get('ratio/mean', 1.0):.4f}", tok_s=f"{metrics['perf/tokens_per_s']:.0f}",
        )

    def save(self) -> Path:
        states = self.env.all_gather_json(self.loader.state_dict())
        path = save_checkpoint(
            self.out,
            step=self.step,
            backend=self.backend,
            loader_states=states,
            weight_version=str(self.version),
            world_size=self.env.world_size,
            config_yaml=self.cfg.to_yaml(),
            is_main=self.env.is_main,
            keep_last=self.cfg.trainer.keep_last,
        )
        self.env.barrier()
        self.last_saved = self.step
        return path

    def close(self) -> None:
        self.logger.close()
        close = getattr(self.loader, "close", None)
        if close is not None:
            close()

    # -- one step ------------------------------------------------------------------------------

    def train_step(self, step: Any) -> dict[str, float]:
        """One loader step: advantages, (proximal/reference logprobs), updates; merged metrics."""
        cfg, dev = self.cfg, self.backend.device
        mbs = [mb.to(dev) for mb in step.micro_batches]
        acc = MetricAccumulator()
        adv_tok = self._advantages(step, mbs, acc)
        n_passes = int(self.env.all_reduce([float(len(mbs))], "max")[0])
        prox = self._frozen_logprobs(mbs, n_passes, reference=False) if cfg.loss.mode == "decoupled" else None
        ref = self._frozen_logprobs(mbs, n_passes, reference=True) if cfg.loss.kl_coef > 0 else None

        parts = np.array_split(np.arange(len(mbs)), cfg.trainer.mini_batches)
        norms = mini_batch_norms(mbs, parts, self.env, norm_len=cfg.loss.norm_len)
        optim_metrics = []
        for part, norm in zip(parts, norms):
            n_part = int(self.env.all_reduce([float(len(part))], "max")[0])
            for j in range(n_part):
                self.backend.set_gradient_sync(j == n_part - 1)
                if j >= len(part):
                    logp, _ = self.backend.logprobs(dummy_batch().to(dev), grad=True)
                    self.backend.backward(logp.sum() * 0.0)
                    continue
                i = int(part[j])
                mb = mbs[i]
                logp, ent = self.backend.logprobs(mb, grad=True, entropy=cfg.loss.entropy_coef > 0)
                loss, m = policy_loss(
                    logp,
                    rollout_logp=mb.rollout_logprobs,
                    advantages=adv_tok[i],
                    loss_mask=mb.loss_mask,
                    cu_seqlens=mb.cu_seqlens,
                    config=cfg.loss,
                    norm=norm,
                    prox_logp=prox[i] if prox else None,
                    ref_logp=ref[i] if ref else None,
                    entropy=ent,
                )
                self.backend.backward(loss)
                acc.add_loss_metrics(m, weight=float(m["tokens"]))
            optim_metrics.append(self.backend.optimizer_step())

        self._data_metrics(step, mbs, acc)
        merged = MetricAccumulator.merged(self.env.all_gather_json(acc.state())).result()
        return self._finish_metrics(merged, optim_metrics)

    def _advantages(self, step: Any, mbs: list[PackedBatch], acc: MetricAccumulator) -> list[torch.Tensor]:
        """Per-token advantages of every micro-batch, from the whole groups of the step."""
        if not mbs:
            return []
        a = self.cfg.advantage
        rewards = torch.cat([mb.rewards for mb in mbs])  # [N]
        groups = torch.cat([mb.seq_group for mb in mbs])  # [N]
        out = grpo_advantages(
            rewards.cpu(), groups.cpu(), num_groups=len(step.group_ids), normalize_std=a.normalize_std,
            eps=a.adv_eps, single_member=a.single_member,
        )
        adv = out.advantages
        acc.add_sum("adv/_sum", float(adv.sum()))
        acc.add_sum("adv/_sumsq", float((adv * adv).sum()))
        acc.add_sum("adv/_n", float(adv.numel()))
        acc.add_min("adv/min", float(adv.min()))
        acc.add_max("adv/max", float(adv.max()))
        acc.add_sum("groups/zero_variance", float(out.zero_variance.sum()))
        acc.add_sum("groups/single", float((out.size == 1).sum()))
        acc.add_sum("data/groups", float(len(step.group_ids)))
        per_mb = adv.to(mbs[0].loss_mask.device).split([mb.num_sequences for mb in mbs])
        return [token_advantages(a_mb, mb.cu_seqlens, mb.loss_mask) for a_mb, mb in zip(per_mb, mbs)]

    @torch.no_grad()
    def _frozen_logprobs(self, mbs: list[PackedBatch], n_passes: int, *, reference: bool) -> list[torch.Tensor]:
        """Logprobs under the proximal (current, before any update) or the reference policy; no grad."""
        out = [self.backend.logprobs(mb, grad=False, reference=reference)[0] for mb in mbs]
        for _ in range(n_passes - len(mbs)):
            self.backend.logprobs(dummy_batch().to(self.backend.device), grad=False, reference=reference)
        return out

    def _data_metrics(self, step: Any, mbs: list[PackedBatch], acc: MetricAccumulator) -> None:
        """Reward by agent, staleness counts, sizes, and the loader's own figures (as sums / means)."""
        for mb in mbs:
            for agent, r in zip(mb.agents, mb.rewards.tolist()):
                for key in ("reward", f"reward/{agent}"):
                    acc.add_sum(f"{key}/_sum", r)
                    acc.add_sum(f"{key}/_sumsq", r * r)
                    acc.add_sum(f"{key}/_n", 1.0)
            for v in mb.weight_versions:
                lag = self._staleness(v)
                acc.add_sum(f"staleness/hist/{lag if lag is not None else 'unknown'}", 1.0)
                if lag is not None:
                    acc.add_max("staleness/max", float(lag))
                    acc.add_sum("staleness/_sum", float(lag))
                    acc.add_sum("staleness/_n", 1.0)
        acc.add_sum("data/tokens", float(sum(mb.num_tokens for mb in mbs)))
        acc.add_sum("data/sequences", float(sum(mb.num_sequences for mb in mbs)))
        acc.add_sum("data/micro_batches", float(len(mbs)))
        for k, v in (getattr(step, "metrics", None) or {}).items():
            acc.add_mean(f"loader/{k}", float(v))

    def _staleness(self, version: str | None) -> int | None:
        try:
            return self.version - int(version)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return None

    @staticmethod
    def _staleness_values(metrics: dict[str, float]) -> list[float]:
        prefix = "staleness/hist/"
        return [
            float(k[len(prefix):]) for k, n in metrics.items()
            if k.startswith(prefix) and k[len(prefix):].lstrip("-").isdigit() for _ in range(int(n))
        ]

    def _finish_metrics(self, m: dict[str, float], optim: list[dict[str, float]]) -> dict[str, float]:
        """Derived figures (means/stds from sums, ESS, fractions) and the optimizer's."""
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
        out["groups/frac_zero_variance"] = out.pop("groups/zero_variance", 0.0) / groups
        out["groups/frac_single"] = out.pop("groups/single", 0.0) / groups
        if "is/mean" in out:
            out["is/ess"] = effective_sample_size(out["is/mean"], out.pop("is/sq_mean"))
        out["optim/grad_norm"] = optim[-1]["optim/grad_norm"]
        out["optim/grad_norm_max"] = max(o["optim/grad_norm"] for o in optim)
        out["optim/lr"] = optim[-1]["optim/lr"]
        out["optim/skipped"] = sum(o["optim/skipped"] for o in optim)
        for k, v in out.items():
            if not math.isfinite(v) and k.startswith("loss/"):
                print(f"rollshard-train: step {self.step + 1}: {k} is {v}", file=sys.stderr)
        return out
