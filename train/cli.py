"""``rollshard-train``: GRPO on a rollout dataset.

    rollshard-train --data DATASET --model PATH --out DIR [--config run.yaml] [flags]

Every config field is a flag (``--help`` lists them by section); a YAML file given
with ``--config`` sets them first and the flags given override it. Defaults: bypass
mode (ratio against the stored rollout logprobs), eps 0.2 / 0.28 (3e-4 / 4e-4 with
``--ratio-level sequence``, GSPO), token-mean. For
several processes (GPUs, or a CPU gloo world) launch it with torchrun:

    torchrun --nproc_per_node 8 -m rollshard.train --data ... --model ... --out ...
"""

from __future__ import annotations

import argparse
import sys

from rollshard.train.config import add_config_flags, resolve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rollshard-train",
        description="Train a policy with GRPO from rollout shards (importance ratios against the stored logprobs).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--config", metavar="YAML", help="config file (sections data, model, optim, advantage, loss, trainer)")
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    add_config_flags(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = resolve(args)
    except ValueError as e:
        print(f"rollshard-train: error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(config.to_yaml(), end="")
        return 0

    from rollshard.store.dataset import DatasetNotFoundError
    from rollshard.store.loader import LoaderStateError
    from rollshard.train.backends.distributed import close_distributed, init_distributed
    from rollshard.train.trainer import Trainer

    env = init_distributed()
    trainer = None
    try:
        trainer = Trainer(config, env=env)
        history = trainer.run()
    except (ValueError, DatasetNotFoundError, LoaderStateError) as e:
        print(f"rollshard-train: error: {e}", file=sys.stderr)
        return 2
    finally:
        if trainer is not None:
            trainer.close()
        close_distributed(env)
    if env.is_main:
        last = history[-1] if history else {}
        print(
            f"rollshard-train: {trainer.step} steps, checkpoint {trainer.out}/checkpoints/latest "
            f"(weight version {trainer.version}); last loss {last.get('loss/total', float('nan')):.5f}, "
            f"reward {last.get('reward/mean', float('nan')):.4f}"
        )
    return 0
