"""Configuration of rollshard-train: one keyword-only dataclass per component.

:class:`TrainConfig` nests :class:`DataConfig`, :class:`ModelConfig`,
:class:`OptimConfig`, :class:`AdvantageConfig`, :class:`LossConfig`,
:class:`TrainerConfig` and :class:`WandbConfig`. A run resolves its config from, in increasing precedence:
the defaults below, a YAML file (``--config``, the same nesting as
:meth:`TrainConfig.to_dict`), then command-line flags. Every field is a flag
(``--eps-high 0.3``; the field name with ``-`` for ``_``, or the ``flag`` named in
its metadata), so the command line and the YAML file say the same things. The
resolved config is written next to every checkpoint as ``config.yaml``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

LossMode = Literal["bypass", "decoupled"]
RatioLevel = Literal["token", "sequence"]
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
ISCorrection = Literal["tis", "mis", "none"]
ISLevel = Literal["token", "sequence", "geometric"]
KLType = Literal["k1", "k2", "k3"]
PGLoss = Literal["ppo", "cispo", "sapo", "dppo"]
LRDecay = Literal["constant", "linear", "cosine"]
DType = Literal["auto", "float32", "bfloat16"]

# Default PPO clip range (eps_low, eps_high) per ratio level. Token ratios: DAPO's clip-higher
# 0.2 / 0.28. Sequence ratios (GSPO) are geometric means over a whole response and sit much
# closer to 1, so GSPO clips at 3e-4 / 4e-4 (Zheng et al. 2025); token-level eps would almost never clip.
CLIP_EPS_DEFAULTS: dict[str, tuple[float, float]] = {"token": (0.2, 0.28), "sequence": (3e-4, 4e-4)}
# CISPO clips the weight of its gradient, not the gradient itself: MiniMax-M1 bounds it from above only (eps_low 1
# puts the lower bound at 0, which no ratio crosses) at 1 + 4 = 5 (TRL's documented epsilon_high=5.0, slime's
# recommended --eps-clip 1.0 --eps-clip-high 4.0), whatever the ratio level.
CISPO_EPS_DEFAULTS: tuple[float, float] = (1.0, 4.0)


# --attn-implementation auto. rollshard_varlen is registered with transformers by rollshard.train.attention
# (imported by the logprob path): exact per-sequence sdpa, no T x T mask; the module docstring says why it is
# the default wherever flash-attention's varlen kernel cannot run.
ATTN_AUTO = "auto"
VARLEN_ATTENTION = "rollshard_varlen"


def default_attention(dtype: str) -> str:
    """What ``--attn-implementation auto`` means on this machine for compute dtype ``dtype``: ``flash_attention_2``
    (varlen, half precision only) on a bf16 CUDA device with flash-attn installed, else ``rollshard_varlen``.
    Imports torch only when flash-attn is installed, so resolving a config stays light."""
    import importlib.util

    if dtype == "float32" or importlib.util.find_spec("flash_attn") is None:
        return VARLEN_ATTENTION
    import torch

    return "flash_attention_2" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else VARLEN_ATTENTION


def _f(default: Any, help: str, *, flag: str | None = None) -> Any:
    """A dataclass field with its command-line help (and flag name when it is not the field name)."""
    meta = {"help": help, "flag": flag}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(kw_only=True)
class DataConfig:
    """The dataset and the loader (``rollshard.store.loader.LoaderConfig``) settings."""

    path: str = _f(
        "",
        "rollout dataset directory (or s3:// URI) written by rollshard-generate; several, mixed by weight: "
        "a:0.7,b:0.3 (each [NAME=]PATH:WEIGHT; rollshard.store.loader.mixture)",
        flag="data",
    )
    groups_per_step: int = _f(8, "GRPO groups per optimizer step (per data-parallel rank)")
    micro_batch_tokens: int = _f(8192, "token budget of one packed micro-batch (gradient accumulation unit)")
    micro_batch_support: int | None = _f(
        None,
        "support-id budget of one packed micro-batch (schema 1.1 top-k / top-p supports; a sequence over it gets "
        "one of its own); default 64 x --micro-batch-tokens, which never binds at top-k <= 64",
    )
    shuffle: bool = _f(True, "shuffle groups (deterministic for --shuffle-seed and epoch)")
    shuffle_seed: int = _f(0, "seed of the loader's shuffle")
    shuffle_window: int = _f(1024, "groups in the loader's shuffle window")
    statuses: tuple[str, ...] = _f(("completed", "truncated"), "row statuses to train on (comma-separated)")
    agents: tuple[str, ...] | None = _f(None, "train only rows of these agents (comma-separated); default all")
    max_staleness: int | None = _f(
        None, "skip rows whose oldest token's policy version (the rows' weight_versions spans) is more than this many "
        "versions behind the policy"
    )
    drop_zero_variance: bool = _f(
        False,
        "skip groups of two or more rows whose rewards are all equal (zero advantage); one-row groups are kept "
        "and trained as --single-member says",
    )
    num_epochs: int | None = _f(1, "passes over the dataset; 'none' repeats forever (bound it with --max-steps)")
    prefetch: int = _f(4, "steps the loader prepares ahead on its background thread")
    tail: Literal["drop", "partial"] = _f("drop", "last incomplete step of an epoch: drop it or train on it")
    follow: bool = _f(
        False,
        "train on a dataset while it is written: groups in commit order as their shards land, each once (no "
        "shuffle, no epochs); ends at --max-steps or when every writer of the dataset marked its run complete",
    )
    follow_wait: float = _f(600.0, "with --follow: give up after this many seconds without a new commit")


@dataclasses.dataclass(kw_only=True)
class ModelConfig:
    """The policy model and its backend."""

    path: str = _f("", "Hugging Face model folder of the policy (the one that generated the data)", flag="model")
    backend: Literal["hf", "megatron"] = _f(
        "hf", "model backend: hf (transformers; FSDP2 under torchrun) or megatron (megatron-core; --tp, --pp, --ep)"
    )
    tp: int = _f(1, "megatron backend: tensor-parallel size (torchrun processes = tp x pp x data-parallel)")
    pp: int = _f(1, "megatron backend: pipeline-parallel size (stages of the decoder layers)")
    ep: int = _f(1, "megatron backend: expert-parallel size (mixture-of-experts models)")
    dtype: DType = _f("auto", "compute dtype: auto = bfloat16 autocast where the device supports it, else float32")
    attn_implementation: str = _f(
        ATTN_AUTO,
        f"transformers attention implementation: {VARLEN_ATTENTION} (each packed sequence alone, no T x T mask; "
        "rollshard.train.attention), flash_attention_2, sdpa or eager (dense T x T block-diagonal mask), "
        f"flex_attention; {ATTN_AUTO}: flash_attention_2 on CUDA with bf16 compute and flash-attn installed, "
        f"else {VARLEN_ATTENTION}",
    )
    gradient_checkpointing: bool = _f(False, "recompute activations in backward to save memory")
    fp32_lm_head: bool = _f(
        True, "output head and log softmax in fp32 under bf16 autocast/FSDP (a bf16 head adds ~0.025 nats of noise)"
    )
    logprob_chunk_mib: float = _f(
        512.0, "MiB of fp32 logits computed at once (chunks of response positions; beyond one chunk, backward recomputes)"
    )
    routing_replay: Literal["auto", "on", "off"] = _f(
        "auto",
        "mixture-of-experts routing replay (R3): force each MoE layer's top-k to the experts the engine chose, as "
        "stored in the rows (rollshard-generate --routed-experts). auto: wherever a row has them; on: also refuse a "
        "dense model or a row without them; off: never (the agreement is still measured)",
    )

    def __post_init__(self):
        # Resolved here, so the config logged with the run and stored next to checkpoints names the kernel used.
        if self.attn_implementation == ATTN_AUTO:
            self.attn_implementation = default_attention(self.dtype)


@dataclasses.dataclass(kw_only=True)
class OptimConfig:
    """AdamW, gradient clipping and the learning-rate schedule."""

    lr: float = _f(1e-6, "peak learning rate")
    betas: tuple[float, ...] = _f((0.9, 0.999), "AdamW betas (comma-separated)")
    adam_eps: float = _f(1e-8, "AdamW epsilon")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    max_grad_norm: float | None = _f(1.0, "clip the global gradient norm to this ('none': no clipping)")
    warmup_steps: int = _f(0, "linear warmup steps from 0 to --lr")
    lr_decay: LRDecay = _f("constant", "schedule after warmup: constant, linear or cosine to --min-lr-ratio")
    min_lr_ratio: float = _f(0.0, "final learning rate as a fraction of --lr (linear/cosine)")
    decay_steps: int | None = _f(None, "steps of the whole schedule; default --max-steps")


@dataclasses.dataclass(kw_only=True)
class AdvantageConfig:
    """GRPO advantages (rollshard.train.advantages)."""

    normalize_std: bool = _f(True, "divide by the group reward std (GRPO); --no-normalize-std is Dr. GRPO")
    adv_eps: float = _f(1e-6, "added to the group std before dividing")
    single_member: Literal["reward", "zero"] = _f(
        "reward",
        "advantage of a one-row group (e.g. a multi-agent selector; not a zero-variance group): its reward "
        "(verl: mean 0, std 1) or zero",
    )


@dataclasses.dataclass(kw_only=True)
class LossConfig:
    """Policy loss (rollshard.train.losses)."""

    pg_loss: PGLoss = _f(
        "ppo",
        "policy surrogate: ppo (clipped ratio), cispo (MiniMax-M1: -sg(clip(r)) A log pi, clipped tokens keep their "
        "gradient; default clip 1 - 1 / 1 + 4), sapo (sigmoid gate instead of the clip, --sapo-tau-pos / -neg) or "
        "dppo (prime-rl's default: -A r unclipped, tokens dropped by the binary TV mask --dppo-mask-low / -high, "
        "plus --dppo-kl-tau (log pi - log mu)^2)",
    )
    mode: LossMode = _f(
        "bypass",
        "bypass: ratio against the stored rollout logprobs; decoupled: ratio against a proximal policy "
        "recomputed once per step, times an importance weight pi_prox/pi_rollout",
    )
    eps_low: float | None = _f(
        None,
        "PPO / CISPO clip: ratio lower bound 1 - eps_low; default 0.2 with --ratio-level token, 3e-4 with sequence "
        "(GSPO), 1 (no lower bound) with --pg-loss cispo",
    )
    eps_high: float | None = _f(
        None,
        "PPO / CISPO clip: ratio upper bound 1 + eps_high (clip-higher); default 0.28 with --ratio-level token, "
        "4e-4 with sequence (GSPO), 4 with --pg-loss cispo",
    )
    dual_clip_c: float | None = _f(3.0, "dual clip for negative advantages: loss <= c * |A| ('none': off)")
    ratio_level: RatioLevel = _f(
        "token",
        "token ratio (PPO/GRPO) or sequence ratio (GSPO; its default clip range is 3e-4 / 4e-4; needs --mode decoupled)",
    )
    agg: Aggregation = _f("token-mean", "loss aggregation: token-mean, seq-mean-token-mean, seq-mean-token-sum-norm")
    norm_len: int | None = _f(
        None,
        "length constant of seq-mean-token-sum-norm (Dr. GRPO), one for the whole run; default: the most loss "
        "tokens a row can hold by the dataset's generation config (sampling.max_new_tokens x model turns per row)",
    )
    is_correction: ISCorrection = _f(
        "tis", "decoupled mode: truncated (tis) or masked (mis) weight pi_prox/pi_rollout, or none"
    )
    is_level: ISLevel = _f("token", "importance weight per token, per sequence (product) or geometric mean")
    tis_c: float = _f(2.0, "TIS: weight truncated at C")
    mis_low: float = _f(0.5, "MIS: weight kept only when mis_low <= w")
    mis_high: float = _f(2.0, "MIS: weight kept only when w <= mis_high")
    sapo_tau_pos: float = _f(1.0, "SAPO: gate temperature where A > 0 (AReaL, TRL, verl: 1.0)")
    sapo_tau_neg: float = _f(1.05, "SAPO: gate temperature where A <= 0 (AReaL, TRL, verl: 1.05)")
    dppo_mask_low: float = _f(0.2, "DPPO: drop a token with A <= 0 when p_theta - p_mu < -low (prime-rl dppo_mask_low)")
    dppo_mask_high: float = _f(0.2, "DPPO: drop a token with A > 0 when p_theta - p_mu > high (prime-rl dppo_mask_high)")
    dppo_kl_tau: float = _f(1e-3, "DPPO: coefficient of (log pi - log mu)^2 on every loss token (prime-rl kl_tau)")
    opsm_delta: float | None = _f(
        None,
        "OPSM (DeepSeek-V3.2): drop a sequence with A < 0 whose mean log(mu / pi) over its tokens exceeds delta "
        "(slime --use-opsm --opsm-delta, default there 1e-4; TRL off_policy_mask_threshold); default off",
    )
    m2po_tau: float | None = _f(
        None,
        "M2PO: drop a micro-batch's tokens of largest (log pi_prox - log mu)^2 until their mean is below tau "
        "(AReaL actor.m2_threshold, 0.04 in its example); default off",
    )
    geo_rs: tuple[float, ...] | None = _f(
        None,
        "Geo-RS: keep a sequence only when the geometric mean of pi_prox / mu over its tokens is in [LO,HI] "
        "(verl rollout_rs=seq_mean_k1, preset 0.999,1.001); default off",
    )
    k3_rs: float | None = _f(
        None,
        "K3-RS: keep a sequence only when the mean (--k3-rs-reduce) of rho - 1 - log rho, rho = pi_prox / mu, over "
        "its tokens is at most this (verl rollout_rs=seq_mean_k3, preset 0.01); default off",
    )
    k3_rs_reduce: Literal["mean", "sum"] = _f("mean", "K3-RS over a sequence's tokens: mean (seq_mean_k3) or sum")
    kl_coef: float = _f(0.0, "coefficient of the KL to the frozen reference model (the --model weights)")
    kl_type: KLType = _f("k3", "KL estimator: k1, k2 or k3")
    entropy_coef: float = _f(0.0, "entropy bonus coefficient")
    renormalize_support: bool = _f(
        True,
        "where a token has a stored sampling support (top-p/top-k, schema 1.1), take the ratio between the "
        "trainer's logprob renormalized over that support and the stored sampling logprob; "
        "--no-renormalize-support: the full-softmax ratio against rollout_logprobs everywhere",
    )

    def clip_range(self) -> tuple[float, float]:
        """``(eps_low, eps_high)``: the values set, else the default of the surrogate (:data:`CISPO_EPS_DEFAULTS`) or
        of the ratio level (:data:`CLIP_EPS_DEFAULTS`)."""
        if self.pg_loss == "cispo":
            low, high = CISPO_EPS_DEFAULTS
        else:
            low, high = CLIP_EPS_DEFAULTS.get(self.ratio_level, CLIP_EPS_DEFAULTS["token"])
        return (
            float(self.eps_low) if self.eps_low is not None else low,
            float(self.eps_high) if self.eps_high is not None else high,
        )


@dataclasses.dataclass(kw_only=True)
class TrainerConfig:
    """The training loop, checkpoints and logging."""

    out: str = _f("", "output directory: checkpoints, metrics.jsonl, TensorBoard events", flag="out")
    max_steps: int | None = _f(None, "stop after this many optimizer steps ('none': when the data ends)")
    mini_batches: int = _f(1, "optimizer updates per loader step (its micro-batches split in this many parts)")
    save_every: int = _f(0, "checkpoint every N steps (0: only at the end)")
    export_every: int = _f(
        0,
        "write the policy's weights alone (no optimizer state) every N steps as OUT/policy/v_<version>, for an engine "
        "to load (rollshard-loop --async pushes them); 0: never",
    )
    keep_last: int = _f(2, "checkpoints kept on disk (the newest)")
    final_checkpoint: Literal["full", "model"] = _f(
        "full",
        "what the checkpoint at the run's end holds: full (the optimizer state too, so a --resume with more steps or "
        "data trains on); model (the model folder and the data cursor, no optimizer state: a third of an AdamW "
        "checkpoint's bytes, for a run nothing continues, such as a rollshard-loop round, each of which starts a "
        "fresh optimizer). A checkpoint written before the end (--save-every, a signal) is always full",
    )
    resume: bool = _f(False, "continue from the newest checkpoint in --out")
    seed: int = _f(0, "torch seed")
    initial_version: int | None = _f(
        None,
        "weight version of --model; default: the weight_version of a rollshard checkpoint folder, else 0. "
        "The policy after step k has version initial + k",
    )
    logger: tuple[str, ...] | None = _f(
        None,
        "where each step's metrics go, comma-separated: jsonl (--out/metrics.jsonl, always written: --resume and "
        "the notebooks read it), tensorboard (--out/tb), wandb (Weights & Biases, see the wandb section); "
        "default jsonl,tensorboard",
    )
    tensorboard: bool | None = _f(
        None,
        "TensorBoard events under --out/tb: --no-tensorboard is --logger without tensorboard; default: as --logger "
        "says",
    )
    progress: bool = _f(True, "progress bar on the terminal")


@dataclasses.dataclass(kw_only=True)
class WandbConfig:
    """Weights & Biases, with --logger ...,wandb (rank 0 logs; rollshard.train.loggers). A field left unset takes
    wandb's environment variable (WANDB_PROJECT, WANDB_NAME, WANDB_ENTITY, WANDB_DIR, WANDB_TAGS), then the default
    said here; WANDB_MODE=offline writes the run under the wandb dir only (`wandb sync` uploads it later)."""

    project: str | None = _f(None, "wandb project; default $WANDB_PROJECT, else rollshard", flag="wandb-project")
    name: str | None = _f(None, "wandb run name; default $WANDB_NAME, else the --out folder's name", flag="wandb-name")
    entity: str | None = _f(None, "wandb team or user; default $WANDB_ENTITY, else the account's", flag="wandb-entity")
    dir: str | None = _f(
        None, "folder under which wandb writes its wandb/ folder; default $WANDB_DIR, else --out", flag="wandb-dir"
    )
    tags: tuple[str, ...] | None = _f(None, "wandb run tags, comma-separated; default $WANDB_TAGS", flag="wandb-tags")
    resume: Literal["allow", "rewind"] = _f(
        "allow",
        "how --resume continues the wandb run recorded in --out/wandb_run.json: allow (the steps wandb already "
        "holds keep their values and are not logged again) or rewind (wandb cuts the run's history after the "
        "checkpoint's step and the later steps are logged again; a preview feature of W&B servers)",
        flag="wandb-resume",
    )


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "optim": OptimConfig,
    "advantage": AdvantageConfig,
    "loss": LossConfig,
    "trainer": TrainerConfig,
    "wandb": WandbConfig,
}


@dataclasses.dataclass(kw_only=True)
class TrainConfig:
    """Everything one training run needs."""

    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    advantage: AdvantageConfig = dataclasses.field(default_factory=AdvantageConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    trainer: TrainerConfig = dataclasses.field(default_factory=TrainerConfig)
    wandb: WandbConfig = dataclasses.field(default_factory=WandbConfig)

    # -- conversion ---------------------------------------------------------------------------

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict (tuples as lists), the YAML layout."""
        return {
            name: {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(getattr(self, name)).items()}
            for name in SECTIONS
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, where: str = "config", flags: bool = False) -> "TrainConfig":
        """Strict: an unknown section or key is an error naming it. ``flags``: the values came from the command
        line, so a value of the wrong kind is named by its flag (``--mode``), not by its key (``loss.mode``)."""
        unknown = set(d) - set(SECTIONS)
        if unknown:
            raise ValueError(f"{where}: unknown section(s) {sorted(unknown)}; sections are {list(SECTIONS)}")
        sections = {}
        for name, kls in SECTIONS.items():
            raw = d.get(name) or {}
            hints = typing.get_type_hints(kls)
            bad = set(raw) - set(hints)
            if bad:
                raise ValueError(f"{where}: unknown key(s) {sorted(bad)} in section {name!r}; known: {sorted(hints)}")
            kw = {}
            if name == "data" and isinstance(raw.get("path"), list):  # a YAML list of {path, weight[, name]}
                from rollshard.store.loader.mixture import sources_text

                raw = {**raw, "path": sources_text(raw["path"])}
            fields = {f.name: f for f in dataclasses.fields(kls)}
            for key, value in raw.items():
                try:
                    kw[key] = _coerce(value, hints[key])
                except (TypeError, ValueError) as e:
                    raise ValueError(f"{flag_of(fields[key])}: {e}" if flags else f"{where}: {name}.{key}: {e}") from e
            sections[name] = kls(**kw)
        return cls(**sections)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @classmethod
    def from_yaml(cls, path: str | Path) -> "TrainConfig":
        try:
            d = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ValueError(f"cannot read config file {path}: {e}") from e
        if not isinstance(d, dict):
            raise ValueError(f"{path}: a config file is a mapping of sections (data:, model:, loss:, ...)")
        return cls.from_dict(d, where=str(path))

    def validate(self, *, require_paths: bool = True) -> "TrainConfig":
        """Fill in the settings whose default depends on others (the clip range of the ratio level), so the
        config written next to a checkpoint shows the values used; raise ValueError with the fix for any
        setting a run cannot use. ``require_paths=False`` accepts a config without dataset, model or output
        (a template, ``--print-config``). Defaults that depend on files (the model's weight version, the
        dataset's length constant) are the trainer's to resolve (``rollshard.train.setup.prepare_config``)."""
        low, high = self.loss.clip_range()
        self.loss = dataclasses.replace(self.loss, eps_low=low, eps_high=high)
        self.trainer = resolve_loggers(self.trainer)
        if require_paths:
            from rollshard.train.loggers import require_loggers

            require_loggers(self.trainer.logger)  # a missing wandb stops the run here, before anything is loaded
        loss, opt, data, tr = self.loss, self.optim, self.data, self.trainer
        checks = [
            (bool(data.path) or not require_paths, "no dataset: pass --data DATASET"),
            (bool(self.model.path) or not require_paths, "no model: pass --model PATH (the policy that generated the data)"),
            (bool(tr.out) or not require_paths, "no output directory: pass --out DIR"),
            # Against the stored rollout logprobs the sequence ratio carries the engine's numerical noise: with
            # a per-token mismatch of 0.01 nats, 11% of sequences fall outside GSPO's 3e-4 clip (zero gradient).
            (
                not (loss.ratio_level == "sequence" and loss.mode == "bypass"),
                "--ratio-level sequence (GSPO, clip 3e-4 / 4e-4) with --mode bypass clips on the inference "
                "noise of the stored rollout logprobs; use --mode decoupled",
            ),
            (0 <= loss.eps_low <= 1, f"--eps-low {loss.eps_low} must be in [0, 1] (1: no lower bound)"),
            (loss.eps_high >= 0, f"--eps-high {loss.eps_high} must be >= 0"),
            (loss.dual_clip_c is None or loss.dual_clip_c > 1, f"--dual-clip-c {loss.dual_clip_c} must be > 1"),
            (loss.tis_c > 0, f"--tis-c {loss.tis_c} must be > 0"),
            (0 <= loss.mis_low < loss.mis_high, "MIS bounds need 0 <= --mis-low < --mis-high"),
            (loss.kl_coef >= 0 and loss.entropy_coef >= 0, "--kl-coef and --entropy-coef must be >= 0"),
            # each value compared on its own: min() passes a NaN that is not its first argument
            (
                all(0 < t < math.inf for t in (loss.sapo_tau_pos, loss.sapo_tau_neg)),
                "--sapo-tau-pos and --sapo-tau-neg must be finite and > 0",
            ),
            (
                all(0 <= v < math.inf for v in (loss.dppo_mask_low, loss.dppo_mask_high, loss.dppo_kl_tau)),
                "--dppo-mask-low, --dppo-mask-high and --dppo-kl-tau must be finite and >= 0",
            ),
            (loss.opsm_delta is None or loss.opsm_delta >= 0, f"--opsm-delta {loss.opsm_delta} must be >= 0"),
            (loss.m2po_tau is None or loss.m2po_tau > 0, f"--m2po-tau {loss.m2po_tau} must be > 0"),
            (
                loss.geo_rs is None or (len(loss.geo_rs) == 2 and 0 < loss.geo_rs[0] <= 1 <= loss.geo_rs[1]),
                f"--geo-rs takes two numbers LO,HI with 0 < LO <= 1 <= HI (e.g. 0.999,1.001), got {loss.geo_rs}",
            ),
            (loss.k3_rs is None or loss.k3_rs >= 0, f"--k3-rs {loss.k3_rs} must be >= 0"),
            (loss.norm_len is None or loss.norm_len > 0, "--norm-len must be > 0"),
            (opt.lr >= 0 and opt.warmup_steps >= 0, "--lr and --warmup-steps must be >= 0"),
            (len(opt.betas) == 2, f"--betas takes two numbers, got {opt.betas}"),
            (data.groups_per_step > 0 and data.micro_batch_tokens > 0, "--groups-per-step, --micro-batch-tokens: > 0"),
            (data.micro_batch_support is None or data.micro_batch_support > 0, "--micro-batch-support: > 0 or none"),
            (tr.mini_batches >= 1, "--mini-batches must be >= 1"),
            (tr.save_every >= 0 and tr.export_every >= 0, "--save-every and --export-every must be >= 0 (0: off)"),
            (tr.max_steps is None or tr.max_steps >= 1, "--max-steps must be >= 1 (or 'none': until the data ends)"),
            (tr.max_steps is not None or data.num_epochs is not None, "--num-epochs none never ends: add --max-steps"),
            (data.follow_wait > 0, f"--follow-wait {data.follow_wait} must be > 0 (seconds)"),
            (
                not data.follow or "," not in data.path,
                "--follow reads one dataset as it is written: pass one --data path, not a mixture",
            ),
            (self.model.logprob_chunk_mib > 0, "--logprob-chunk-mib must be > 0"),
            (min(self.model.tp, self.model.pp, self.model.ep) >= 1, "--tp, --pp and --ep must be >= 1"),
            (
                self.model.backend == "megatron" or (self.model.tp, self.model.pp, self.model.ep) == (1, 1, 1),
                "--tp, --pp and --ep split a megatron model; add --backend megatron (the hf backend shards with FSDP)",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if data.path:
            from rollshard.store.loader.mixture import parse_sources

            parse_sources(data.path)  # a bad --data weight is a usage error here, before anything is loaded
        return self


def resolve_loggers(tr: TrainerConfig) -> TrainerConfig:
    """``logger`` as the full list of loggers in their fixed order, jsonl always first (the default: jsonl and
    tensorboard, or jsonl alone with ``--no-tensorboard``), and ``tensorboard`` as whether it is among them; a
    ``--[no-]tensorboard`` that contradicts ``--logger`` is refused."""
    from rollshard.train.loggers import LOGGERS

    given = tr.logger if tr.logger is not None else (("jsonl",) if tr.tensorboard is False else ("jsonl", "tensorboard"))
    unknown = [name for name in given if name not in LOGGERS]
    if unknown:
        raise ValueError(f"--logger {','.join(given)}: unknown logger {unknown[0]!r}; choose from {', '.join(LOGGERS)}")
    if tr.tensorboard is not None and tr.tensorboard != ("tensorboard" in given):
        flag = "--tensorboard" if tr.tensorboard else "--no-tensorboard"
        raise ValueError(
            f"{flag} contradicts --logger {','.join(given)}; say it once: add or remove tensorboard in --logger"
        )
    names = tuple(name for name in LOGGERS if name == "jsonl" or name in given)
    return dataclasses.replace(tr, logger=names, tensorboard="tensorboard" in names)


def _coerce(value: Any, hint: Any) -> Any:
    """A YAML/CLI value -> the field's type (tuples from lists or comma strings, None from 'none')."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            if type(None) in args:
                return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0])
    if origin is Literal:
        if value not in args:
            raise ValueError(f"{value!r} is not one of {', '.join(map(str, args))}")
        return value
    if origin is tuple:
        items = value.split(",") if isinstance(value, str) else list(value)
        return tuple(_coerce(v.strip() if isinstance(v, str) else v, args[0]) for v in items if v != "")
    if hint is bool:
        if isinstance(value, str):
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(f"{value!r} is not a boolean")
        return bool(value)
    if hint is float and isinstance(value, (int, float, str)):
        return float(value)
    if hint is int and not isinstance(value, bool) and isinstance(value, (int, str)):
        return int(value)
    if hint is str:
        return str(value)
    raise TypeError(f"{value!r} is not a {getattr(hint, '__name__', hint)}")


def flag_of(field: dataclasses.Field) -> str:
    return "--" + (field.metadata.get("flag") or field.name).replace("_", "-")


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field, grouped by section; unset flags do not override the YAML."""
    for name, kls in SECTIONS.items():
        group = parser.add_argument_group(name, kls.__doc__)
        hints = typing.get_type_hints(kls)
        for field in dataclasses.fields(kls):
            hint = hints[field.name]
            default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
            shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
            kw: dict[str, Any] = dict(
                dest=f"{name}.{field.name}", default=argparse.SUPPRESS, help=field.metadata["help"]
            )
            if not (default is None and "default" in kw["help"]):  # else the help says what None means
                kw["help"] += f" (default: {shown})"
            if hint is bool or hint == bool | None:
                kw["action"] = argparse.BooleanOptionalAction
            else:
                choices = typing.get_args(hint) if typing.get_origin(hint) is Literal else None
                kw["metavar"] = "{" + ",".join(choices) + "}" if choices else field.name.upper()
            group.add_argument(flag_of(field), **kw)


def resolve(args: argparse.Namespace, *, require_paths: bool = True) -> TrainConfig:
    """Defaults < YAML file (``args.config``) < the flags that were given."""
    config_path = getattr(args, "config", None)
    base = TrainConfig.from_yaml(config_path).to_dict() if config_path else TrainConfig().to_dict()
    for dest, value in vars(args).items():
        if "." in dest:
            section, key = dest.split(".", 1)
            base[section][key] = value
    # The file's values were checked as it was read (from_yaml): a value that does not fit here is a flag's.
    return TrainConfig.from_dict(base, where="command line", flags=True).validate(require_paths=require_paths)
