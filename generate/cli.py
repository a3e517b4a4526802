"""``rollshard-generate``: batch generation (default), ``serve``, ``eval``, ``rescore`` and ``init-model`` subcommands."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "serve":
        from rollshard.generate.server import main as serve_main

        return serve_main(argv[1:])
    if argv and argv[0] == "rescore":
        from rollshard.generate.rescore import main as rescore_main

        return rescore_main(argv[1:])
    if argv and argv[0] == "eval":
        from rollshard.generate.eval import main as eval_main

        return eval_main(argv[1:])
    if argv and argv[0] == "init-model":
        from rollshard.generate.models import main as init_model_main

        return init_model_main(argv[1:])
    from rollshard.generate.run import main as run_main

    return run_main(argv)


if __name__ == "__main__":
    sys.exit(main())
