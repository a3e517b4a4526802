"""The settings of one ``rollshard-generate`` run: :class:`GenerateConfig`, built once from the command line.

:meth:`GenerateConfig.from_args` checks every value a run cannot start with (one-line :class:`UsageError`) and
resolves the defaults that depend on others: the shard of this host, the engine spec (:class:`EngineSpec`), whether
the run stores the sampling support. The run reads its settings from the config; the argparse Namespace is not
used after it.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from typing import Any

from rollshard.generate.engines.base import SamplingParams
from rollshard.generate.engines.spec import EngineSpec
from rollshard.generate.resume import ExistingDataset
from rollshard.store.common import UsageError
from rollshard.store.format.schema import GREEDY_TEMPERATURE_EPS


@dataclasses.dataclass(frozen=True, kw_only=True)
class GenerateConfig:
    # what to run
    engine: EngineSpec
    agents: str
    agent_options: dict[str, str]
    task: str
    task_options: tuple[str, ...]  # KEY=VALUE as given; the task resolves them (inputs.py)
    reward: str | None
    reward_url: str | None
    reward_concurrency: int
    reward_timeout: float
    system_prompt: str | None
    chat_template: str | None
    no_chat_template: bool
    prompts: str | None  # as given; None: the task's own
    input_key: str
    label_key: str
    id_key: str
    split: str
    limit: int | None
    out: str
    # sampling
    n_samples: int
    temperature: float
    top_p: float
    top_k: int
    sampling_support: str  # the mode as given: auto, on, off
    return_sampling_mask: bool  # what it resolved to
    routed_experts: str
    max_new_tokens: int
    stop: tuple[str, ...] | None
    ignore_eos: bool
    seed: int
    max_context_len: int | None
    tokenizer: str | None
    device: str | None
    dtype: str
    threads: int | None
    weight_version: str | None
    update_weights: str | None
    # running
    concurrency: int
    shard_index: int
    num_shards: int
    commit_every: int
    commit_interval: float
    request_timeout: float
    retries: int
    allow_skipped_calls: bool
    max_failed_prompts: float
    progress: bool
    check_args: bool
    # following a trainer
    repeat: bool
    max_ahead: int | None
    step_episodes: int | None
    first_version: int
    # Ray
    ray: str | None
    ray_retries: int
    ray_runtime_env: str | None
    ray_task: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace, existing: ExistingDataset) -> "GenerateConfig":
        """The run's config; UsageError (one line) for a value no run can start with. ``existing``: what ``--out``
        holds, for the sampling support's ``auto``."""
        try:
            engine = EngineSpec.parse(args.engine)
        except ValueError as e:
            raise UsageError(f"cannot start engine {args.engine!r}: {e}") from e
        ray_driver = args.ray is not None and not args.ray_task
        shard_index, num_shards = _shard(args, engine, ray_driver=ray_driver)
        _check_running(args)
        _check_sampling(args)
        _check_engine_flags(args, engine)
        _check_following(args, engine, num_shards)
        resolved: dict[str, Any] = dict(
            engine=engine,
            agent_options=dict(_key_value(o) for o in args.agent_option),
            task_options=tuple(args.task_option),
            stop=tuple(args.stop) if args.stop is not None else None,
            return_sampling_mask=_sampling_support(args, engine, existing),
            shard_index=shard_index,
            num_shards=num_shards,
            progress=not args.no_progress,
        )
        given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name not in resolved}
        return cls(**given, **resolved)

    @property
    def ray_driver(self) -> bool:
        """This process starts the Ray tasks (``--ray``), rather than running a shard itself."""
        return self.ray is not None and not self.ray_task

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_new_tokens,
            stop=list(self.stop) if self.stop is not None else None,
            ignore_eos=self.ignore_eos,
            return_sampling_mask=self.return_sampling_mask,
        )


def _shard(args: argparse.Namespace, engine: EngineSpec, *, ray_driver: bool) -> tuple[int, int]:
    """This host's (shard index, number of shards); a Ray driver's default is one task per server."""
    shard_index, num_shards = args.shard_index, args.num_shards
    if ray_driver:
        if shard_index is not None:
            raise UsageError("--shard-index is not for --ray: each task gets its own; give --num-shards only")
        if num_shards is None:  # one task per server
            num_shards = 1 if engine.embedded else len(engine.urls)
        if args.ray_retries < 0:
            raise UsageError("--ray-retries must be >= 0")
    shard_index = 0 if shard_index is None else shard_index
    num_shards = 1 if num_shards is None else num_shards
    if num_shards < 1 or not 0 <= shard_index < num_shards:
        raise UsageError(f"--shard-index must be in [0, --num-shards); got {shard_index} of {num_shards}")
    return shard_index, num_shards


def _check_running(args: argparse.Namespace) -> None:
    for name in ("concurrency", "n_samples", "max_new_tokens", "commit_every"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1")
    if args.retries < 0:
        raise UsageError("--retries must be >= 0")
    if not args.request_timeout > 0:  # NaN too
        raise UsageError(f"--request-timeout {args.request_timeout:g} must be > 0 seconds")


def _check_sampling(args: argparse.Namespace) -> None:
    """The sampling settings, before any engine starts: a value no engine samples with (SGLang refuses it per
    request, the writer refuses its rows) would otherwise fail every prompt of the run, at its end."""
    if not (math.isfinite(args.temperature) and args.temperature >= 0.0):
        raise UsageError(f"--temperature {args.temperature:g} must be a finite number >= 0 (0 is greedy)")
    if not (math.isfinite(args.top_p) and 0.0 < args.top_p <= 1.0):
        raise UsageError(f"--top-p {args.top_p:g} must be in (0, 1] (1 keeps every token)")
    if args.top_k == 0 or args.top_k < -1:
        raise UsageError(f"--top-k {args.top_k} must be -1 (no top-k) or >= 1")
    if args.max_context_len is not None and args.max_context_len < 1:
        raise UsageError(f"--max-context-len {args.max_context_len} must be >= 1 (or left out: the engine's)")
    if not 0.0 <= args.max_failed_prompts <= 1.0:
        raise UsageError(f"--max-failed-prompts must be a fraction in [0, 1]; got {args.max_failed_prompts:g}")


def _check_engine_flags(args: argparse.Namespace, engine: EngineSpec) -> None:
    """Flags of one kind of engine, given with the other."""
    if args.update_weights is not None and engine.embedded:
        raise UsageError(f"--update-weights is for SGLang servers; the embedded engine loads its model from the "
                         f"spec: --engine embedded:{args.update_weights}")
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads must be >= 1 (torch threads of the embedded engine's decode); got {args.threads}")
    if not engine.embedded and args.threads is not None:
        raise UsageError("--threads is for the embedded engine; an SGLang server sets its own")
    if not engine.embedded and (args.device is not None or args.dtype != "float32"):
        raise UsageError("--device and --dtype are for the embedded engine; an SGLang server has its own "
                         "(its --device and --dtype)")


def _check_following(args: argparse.Namespace, engine: EngineSpec, num_shards: int) -> None:
    """``--repeat`` and the admission gate (``--max-ahead``): what one writer against a moving engine needs."""
    if args.ray is not None and (args.repeat or args.max_ahead is not None):
        raise UsageError("--repeat and --max-ahead are for one writer, not --ray: run rollshard-generate on its own")
    if (args.max_ahead is None) != (args.step_episodes is None):
        raise UsageError("--max-ahead and --step-episodes go together: the bound is (ETA + 1 + v - V0) * B episodes")
    if args.max_ahead is None:
        if args.first_version != 0:
            raise UsageError("--first-version is the version --max-ahead counts from; give --max-ahead too")
        return
    if args.max_ahead < 0 or args.step_episodes < 1:
        raise UsageError(f"--max-ahead must be >= 0 and --step-episodes >= 1; got {args.max_ahead} and "
                         f"{args.step_episodes}")
    if num_shards > 1:
        raise UsageError("--max-ahead counts the episodes of one writer against the trainer's steps; run one "
                         "writer (no --num-shards) and give it every engine URL")
    if engine.embedded:
        raise UsageError("--max-ahead needs an engine whose weight version moves as the trainer steps; the "
                         "embedded engine's never does: run `rollshard-generate serve --model MODEL` and point "
                         "--engine at its URL")


def _sampling_support(args: argparse.Namespace, engine: EngineSpec, existing: ExistingDataset) -> bool:
    """Whether the run asks the engine for the sampling support (``--sampling-support``); usage errors for what
    cannot work: ``on`` with nothing truncated (the support would be the vocabulary, per token), and an SGLang
    engine asked without a top-k (SGLang refuses every such request; its top-k cap is checked on connect)."""
    greedy = args.temperature < GREEDY_TEMPERATURE_EPS
    truncates = not greedy and (args.top_p < 1.0 or args.top_k > 0)
    if args.sampling_support == "off":
        return False
    if args.sampling_support == "auto" and existing.holds_rows_without_supports():
        return False  # rerunning the command that made it resumes it, as before supports were stored
    if args.sampling_support == "on" and not (truncates or greedy):
        raise UsageError(
            "--sampling-support on: nothing truncates (--top-p 1, no --top-k), so the support would be the whole "
            "vocabulary; set --top-k K or --top-p P < 1, or use --sampling-support auto/off"
        )
    ask = args.sampling_support == "on" or truncates
    if ask and not engine.embedded and not greedy and args.top_k < 1:
        raise UsageError(
            f"--sampling-support {args.sampling_support} with --top-p {args.top_p:g} and no --top-k: SGLang returns "
            "the sampling support only with a top-k; add --top-k K (K <= the server's --sampling-mask-max-tokens, "
            "4096 by default) or pass --sampling-support off"
        )
    return ask


def _key_value(option: str) -> tuple[str, str]:
    key, sep, value = option.partition("=")
    if not sep or not key:
        raise UsageError(f"--agent-option {option!r}: expected KEY=VALUE")
    return key.strip(), value.strip()

