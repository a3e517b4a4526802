"""``rollshard-train``: GRPO on a rollout dataset.

    rollshard-train --data DATASET --model PATH --out DIR [--config run.yaml] [flags]
    rollshard-train --data a:0.7,b:0.3 ...       several datasets mixed by weight (rollshard.store.loader.mixture)
    rollshard-train audit --data DATASET --model PATH [--out AUDIT.parquet]   the trainer's logprobs against
                                                 the stored ones, no optimizer step (rollshard.train.audit)

Every config field is a flag (``--help`` lists them by section); a YAML file given
with ``--config`` sets them first and the flags given override it (``examples/train.yaml``
lists every field; ``--print-config`` prints the resolved config, and needs no data or
model). Defaults: bypass mode (ratio against the stored rollout logprobs), eps 0.2 / 0.28
(3e-4 / 4e-4 with ``--ratio-level sequence``, GSPO, which needs ``--mode decoupled``),
token-mean. For several processes (GPUs, or a CPU gloo world) launch it with torchrun:

    torchrun --nproc_per_node 8 -m rollshard.train --data ... --model ... --out ...

Exit status: 0 done; 1 a non-finite loss or gradient (the step is not saved) or an I/O
failure; 2 a usage or data error (one line: what is wrong, how to fix it); 130 stopped
by SIGINT/SIGTERM (the last finished step is saved; a second signal stops at once).
"""

from __future__ import annotations

import argparse
import sys

from rollshard.store.common import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, UsageError, print_error
from rollshard.train.config import TrainConfig, add_config_flags, resolve

PROG = "rollshard-train"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Train a policy with GRPO from rollout shards (importance ratios against the stored logprobs).",
        epilog="rollshard-train audit --data DATASET --model PATH: the trainer's logprobs of the dataset against the "
        "stored engine logprobs, with no optimizer step (rollshard-train audit --help).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--config", metavar="YAML", help="config file (sections data, model, optim, advantage, loss, trainer)")
    parser.add_argument(
        "--print-config", action="store_true",
        help="print the resolved config as YAML and exit (without --data/--model/--out: a template)",
    )
    add_config_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["audit"]:  # the subcommand; any other first word is the training command's, as before
        from rollshard.train.audit import main as audit_main

        return audit_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        config = resolve(args, require_paths=not args.print_config)
    except ValueError as e:
        print_error(PROG, e)
        return EXIT_USAGE
    if args.print_config:
        print(config.to_yaml(), end="")
        return EXIT_OK
    return train(config)


def train(config: TrainConfig) -> int:
    """Build the trainer on every process, run it, say how it ended; the command's exit status."""
    from rollshard.store.io.dataset import DatasetNotFoundError
    from rollshard.train.backends import close_env, parallel_env
    from rollshard.train.backends.distributed import close_distributed, init_distributed
    from rollshard.train.trainer import NonFiniteError, Trainer

    env = init_distributed()
    trainer = None
    try:
        env = parallel_env(config, env)  # megatron: the data-parallel ranks
        trainer = Trainer(config, env=env)
        trainer.run()
    except NonFiniteError as e:
        print_error(PROG, e)
        return EXIT_FAILED
    except (ValueError, DatasetNotFoundError, UsageError) as e:  # usage, data and loader-state errors
        print_error(PROG, e)
        return EXIT_USAGE
    except KeyboardInterrupt:  # a second Ctrl-C, or one before training started
        print(f"{PROG}: interrupted; stopped without saving ({_latest(config.trainer.out)})", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as e:  # the output folder failed under us (disk full, permissions)
        print_error(PROG, f"{e}; finished steps up to the latest checkpoint are intact, rerun with --resume")
        return EXIT_FAILED
    finally:
        if trainer is not None:
            trainer.close()
        close_env(env)
        close_distributed(env)
    if trainer.stopped_by is not None:
        if env.is_main:
            print(_interrupted(trainer), file=sys.stderr)
        return EXIT_INTERRUPTED
    if env.is_main:
        print(summary_line(trainer))
    return EXIT_OK


def _interrupted(trainer) -> str:
    """One line: which signal stopped the run, and what was saved."""
    if trainer.saved_in_run:
        where = f"saved step {trainer.step} to {trainer.checkpoint_path()}; rerun with --resume to continue"
    elif trainer.last_saved is not None:  # resumed, then stopped before a new step finished
        where = (
            f"no new step finished; the latest checkpoint is {trainer.checkpoint_path()} "
            f"(step {trainer.last_saved}); rerun with --resume to continue"
        )
    else:
        where = "no step had finished, nothing to save"
    return f"{PROG}: interrupted ({trainer.stopped_by}); {where}"


def _latest(out: str) -> str:
    from rollshard.train.checkpoint import latest_checkpoint

    try:
        ckpt = latest_checkpoint(out)
    except ValueError:
        ckpt = None
    return f"the latest checkpoint is {ckpt.path} (step {ckpt.step})" if ckpt else f"no checkpoint in {out}"


def summary_line(trainer) -> str:
    """One line: steps, wall time, throughput, where everything is, last loss and reward."""
    last = trainer.history[-1] if trainer.history else {}
    ran, wall = len(trainer.history), trainer.run_seconds
    tb = f", TensorBoard {trainer.out / 'tb'}" if trainer.cfg.trainer.tensorboard else ""
    kind = "model only, " if trainer.saved_model_only else ""
    return (
        f"{PROG}: {trainer.step} steps ({ran} in this run, {wall:.1f} s, {trainer.run_tokens / max(wall, 1e-9):,.0f} "
        f"tokens/s); checkpoint {trainer.checkpoint_path()} ({kind}weight version {trainer.version}, linked as "
        f"{trainer.out / 'checkpoints' / 'latest'}); metrics {trainer.out / 'metrics.jsonl'}{tb}; "
        f"last loss {last.get('loss/total', float('nan')):.5f}, reward {last.get('reward/mean', float('nan')):.4f}"
    )
