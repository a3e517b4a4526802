"""Run ``rollshard-loop`` with gates in one of its stages: the kill and interrupt tests of the loop.

    python -m tests.train.loop_gated STAGE ROUND GATES_JSON LOOP_ARGS...

STAGE is ``generate`` or ``train``; that stage of round ROUND runs under :mod:`tests.gated_main` with the
gates, every other stage as the loop runs it. The loop itself runs unchanged in this process.
"""

from __future__ import annotations

import sys

from rollshard.train import loop


def main() -> int:
    stage, round_, spec, *argv = sys.argv[1:]
    build = getattr(loop.Loop, f"{stage}_command")

    def gated(self, k, policy):
        command = build(self, k, policy)
        if k != int(round_):
            return command
        python, dash_m, module, *rest = command
        return [python, dash_m, "tests.gated_main", spec, module, *rest]

    setattr(loop.Loop, f"{stage}_command", gated)
    return loop.main(argv)


if __name__ == "__main__":
    sys.exit(main())
