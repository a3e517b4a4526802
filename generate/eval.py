"""``rollshard-generate eval``: score a model on held-out prompts.

A thin layer over the batch command: it runs ``rollshard-generate`` with one policy
(``--agents single``) on the task's held-out split (``--split eval`` unless given) and reads
the figures off the rows it wrote. Everything the batch command takes passes through
(``--task``, ``--task-option``, ``--limit``, ``--max-new-tokens``, ``--concurrency``, ...).

* ``--model`` is a model folder, a rollshard checkpoint or a ``.gguf`` file (served by the
  embedded engine); ``--engine`` instead scores what an SGLang server serves.
* One sample per prompt (the default) is greedy: **pass@1**. ``--n-samples k`` samples ``k``
  answers per prompt at ``--temperature`` (1.0 unless given): **mean@k** (the share of all
  answers that are correct) and the unbiased **pass@j** of Chen et al. (2021),
  ``1 - C(n - c, j) / C(n, j)`` averaged over prompts, for j = 1, 2, 4, ... up to k.
* An answer is correct when the verifier says so (``metadata.verdict.correct``); for a
  verifier that gives no verdict, when its reward is at least 1.
* ``--out DIR`` keeps the rows as a dataset (``rollshard-store inspect``/``report`` read it;
  rerunning the same command resumes it) and writes ``DIR/eval.json`` with the figures;
  without it the rows go to a temporary folder, removed afterwards. ``--json`` prints the
  figures as one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from rollshard.store.common import EXIT_OK, EXIT_USAGE, print_error

PROG = "rollshard-generate eval"
EVAL_FILE = "eval.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Score a model on held-out prompts: greedy pass@1, or with --n-samples k mean@k and unbiased "
        "pass@k. Any other rollshard-generate option passes through (--task, --task-option, --limit, "
        "--max-new-tokens, ...).",
        epilog="example: rollshard-generate eval --model runs/smollm2 --task arithmetic --limit 128 --max-new-tokens 48",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", metavar="PATH", help="model folder, rollshard checkpoint or .gguf file (embedded engine)")
    what.add_argument("--engine", metavar="SPEC", help="an engine spec as rollshard-generate takes it (SGLang URL[,URL])")
    p.add_argument("--split", default="eval", help="prompt split (default: %(default)s, the task's held-out prompts)")
    p.add_argument("--n-samples", type=int, default=1, metavar="K", help="answers per prompt (default: 1, greedy)")
    p.add_argument(
        "--temperature", type=float, metavar="T",
        help="sampling temperature (default: 0, greedy, for one sample; 1.0 for several)",
    )
    p.add_argument("--out", metavar="DIR", help="keep the rows here as a dataset, with DIR/eval.json (default: not kept)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    try:
        gen_argv, temperature = _generate_argv(args, rest)
    except ValueError as e:
        print_error(PROG, e)
        return EXIT_USAGE
    from rollshard.generate.run import main as generate_main

    if "--check-args" in rest:  # the batch command's own check of these flags (rollshard-loop --eval); no run
        return generate_main([*gen_argv, "--out", args.out or tempfile.gettempdir()])
    out = args.out or tempfile.mkdtemp(prefix="rollshard-eval-")
    try:
        code = generate_main([*gen_argv, "--out", out])
        if code != EXIT_OK:
            return code
        figures = evaluate(out, n_samples=args.n_samples)
        figures.update(
            model=args.model or args.engine, split=args.split, n_samples=args.n_samples, temperature=temperature
        )
        if args.out:
            _write(out, figures)
    finally:
        if not args.out:
            shutil.rmtree(out, ignore_errors=True)
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        print(summary_line(figures))
    return EXIT_OK


def _generate_argv(args: argparse.Namespace, rest: list[str]) -> tuple[list[str], float]:
    """The batch command's arguments for this evaluation, and the temperature it samples at."""
    owned = {"--agents", "--out", "--n-samples", "--temperature", "--split", "--engine"}
    given = sorted({a.split("=", 1)[0] for a in rest} & owned)
    if given:
        raise ValueError(f"{', '.join(given)}: set by eval itself; give eval's own option (see --help)")
    if args.model and not Path(args.model).expanduser().exists():
        raise ValueError(f"--model {args.model}: no such model folder, checkpoint or .gguf file")
    if args.n_samples < 1:
        raise ValueError("--n-samples must be >= 1")
    temperature = args.temperature if args.temperature is not None else (0.0 if args.n_samples == 1 else 1.0)
    if temperature < 0:
        raise ValueError(f"--temperature must be >= 0 (0 is greedy); got {temperature:g}")
    if args.n_samples > 1 and temperature == 0:
        raise ValueError(f"--n-samples {args.n_samples} at --temperature 0 draws one answer {args.n_samples} times; "
                         "give --temperature T > 0 or one sample")
    engine = f"embedded:{args.model}" if args.model else args.engine
    argv = [
        "--engine", engine, "--agents", "single", "--split", args.split, "--n-samples", str(args.n_samples),
        "--temperature", repr(temperature), *rest,
    ]  # fmt: skip
    return argv, temperature


def evaluate(out: str, *, n_samples: int) -> dict[str, Any]:
    """The figures of the evaluation dataset at ``out`` (:func:`figures`)."""
    from rollshard.store.io.dataset import RolloutDataset

    table = RolloutDataset.open(out).read(["prompt_id", "reward", "metadata", "status"])
    return figures(table.to_pylist(), n_samples=n_samples)


def figures(rows: list[dict[str, Any]], *, n_samples: int) -> dict[str, Any]:
    """Prompts, answers, mean reward, share truncated, and pass@1 (one sample) or mean@k and pass@1, 2, 4, ... k;
    ``rows`` are dicts with ``prompt_id``, ``reward``, ``metadata`` (JSON) and ``status``."""
    by_prompt: dict[str, list[bool]] = {}
    for r in rows:
        by_prompt.setdefault(r["prompt_id"], []).append(_correct(r["reward"], r["metadata"]))
    n = len(rows)
    rewards = [r["reward"] for r in rows if r["reward"] is not None]
    out: dict[str, Any] = {
        "prompts": len(by_prompt),
        "answers": n,
        "mean_reward": sum(rewards) / len(rewards) if rewards else float("nan"),
        "truncated": sum(r["status"] == "truncated" for r in rows) / n if n else 0.0,
    }
    correct = sum(sum(c) for c in by_prompt.values())
    if n_samples == 1:
        out["pass@1"] = correct / n if n else float("nan")
        return out
    out[f"mean@{n_samples}"] = correct / n if n else float("nan")
    j, least = 1, min(len(c) for c in by_prompt.values())  # a prompt with fewer answers (some failed) bounds j
    while j <= least:
        out[f"pass@{j}"] = sum(pass_at_k(len(c), sum(c), j) for c in by_prompt.values()) / len(by_prompt)
        j *= 2
    return out


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` answers of which ``c`` are correct: ``1 - C(n - c, k) / C(n, k)``."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} answers; got {n}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def _correct(reward: float | None, metadata: str | None) -> bool:
    try:
        verdict = json.loads(metadata or "{}").get("verdict") or {}
    except ValueError:
        verdict = {}
    if isinstance(verdict.get("correct"), bool):
        return verdict["correct"]
    return reward is not None and reward >= 1.0


def summary_line(f: dict[str, Any]) -> str:
    scores = ", ".join(f"{k} {v:.1%}" for k, v in f.items() if k.startswith(("pass@", "mean@")))
    return (f"{PROG}: {f['model']} on {f['prompts']} {f['split']} prompts: {scores} (mean reward {f['mean_reward']:.3f}, "
            f"{f['truncated']:.0%} of answers truncated)")


def _write(out: str, figures: dict[str, Any]) -> None:
    from rollshard.store.io.storage import Storage

    Storage(out).write_atomic(EVAL_FILE, (json.dumps(figures, indent=2) + "\n").encode())


def read_eval(out: str) -> dict[str, Any]:
    """The figures an evaluation wrote at ``out``."""
    from rollshard.store.io.storage import Storage

    return json.loads(Storage(out).read_bytes(EVAL_FILE))
