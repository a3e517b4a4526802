"""Learning benchmark: a real pretrained model learns a real task through rollshard, against TRL on the same work.

    .venv/bin/python tests/bench/bench_learning.py [--rounds 3] [--prompts 64] [--samples 4] [--groups-per-step 8]
        [--lr 2e-5] [--temperature 1.0] [--max-new-tokens 48] [--eval-prompts 128] [--no-trl] [--out DIR] [--json]

Model: SmolLM2-135M-Instruct (``init-model --preset smollm2-135m-instruct``, fp32, CPU). Task: ``arithmetic``
(two 2-digit numbers, + and -), trained on the first ``--prompts`` problems of its train split, evaluated greedy on
the first ``--eval-prompts`` of its disjoint held-out split by ``rollshard-generate eval`` (pass@1).

* rollshard: ``rollshard-loop --rounds R --eval ...``: each round generates ``--samples`` answers to each prompt
  with the round's policy (embedded engine), trains on them (``--prompts / --groups-per-step`` steps, decoupled
  PPO, one epoch) and evaluates the checkpoint. Wall time per round split into generate / train / eval (from
  ``loop.json``), response tokens/s of generation and training.
* TRL (bench-only dependency, ``pip install trl``): ``GRPOTrainer`` on the same model, prompts (rendered by the
  same chat template), samples per prompt, temperature, completion length, learning rate and number of optimizer
  steps (R x prompts / groups-per-step, one group of ``--samples`` completions per prompt, ``--groups-per-step``
  prompts a step), reward = the task's own verifier; then the same eval command on its saved model.

Each side runs in a process of its own, one after the other; its peak memory is the largest resident set of that
process and its children (``wait4``). The figure of merit is the held-out gain per wall minute (evaluation time
excluded on both sides) and its ratio rollshard / TRL. Markdown on stdout, or ``--json``: one object.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable


def log(msg: str) -> None:
    print(f"[bench_learning] {msg}", file=sys.stderr, flush=True)


def run_side(argv: list[str]) -> tuple[int, float, float]:
    """Run a side in its own process: (exit code, wall seconds, peak RSS GiB of it and its children)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=REPO, stdout=sys.stderr)  # stdout is the bench's figures
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, time.perf_counter() - start, usage.ru_maxrss / 2**20  # ru_maxrss: KiB


def eval_command(model: str, args, out: Path) -> list[str]:
    return [
        PY, "-m", "rollshard.generate", "eval", "--model", model, "--task", "arithmetic", "--limit",
        str(args.eval_prompts), "--max-new-tokens", str(args.max_new_tokens), "--out", str(out), "--no-progress",
    ]  # fmt: skip


def steps_per_round(args) -> int:
    return args.prompts // args.groups_per_step


# -- rollshard ---------------------------------------------------------------------------------------------------


def rollshard_side(args, model: str, out: Path) -> dict:
    loop = [
        PY, "-m", "rollshard.train.loop", "--model", model, "--out", str(out), "--rounds", str(args.rounds),
        "--no-report", "--no-progress", "--json",
        "--generate", f"--task arithmetic --limit {args.prompts} --n-samples {args.samples} "
                      f"--max-new-tokens {args.max_new_tokens} --temperature {args.temperature}",
        "--train", f"--groups-per-step {args.groups_per_step} --num-epochs 1 --lr {args.lr} --mode decoupled "
                   f"--micro-batch-tokens {args.micro_batch_tokens} --warmup-steps {args.warmup_steps} --no-tensorboard",
        "--eval", f"--task arithmetic --limit {args.eval_prompts} --max-new-tokens {args.max_new_tokens}",
    ]  # fmt: skip
    log("rollshard: " + shlex.join(loop))
    code, wall, peak = run_side(loop)
    if code != 0:
        raise SystemExit(f"rollshard-loop exited {code}")
    state = json.loads((out / "loop.json").read_text())
    from rollshard.store.io.dataset import RolloutDataset

    rounds = []
    for r in state["rounds"]:
        data = RolloutDataset.open(out / f"round_{r['round']:03d}" / "data")
        s = r["seconds"]
        rounds.append({
            "round": r["round"], "accuracy": r["checkpoint_eval"]["pass@1"], "train_reward": r["data"]["reward_mean"],
            "generate_s": s["generate"], "train_s": s["train"], "eval_s": s["eval"],
            "generate_tokens_per_s": data.num_response_tokens / s["generate"],
            "train_tokens_per_s": data.num_tokens / s["train"],
            "step0_mismatch_max": r["train"]["mismatch_max"],
        })  # fmt: skip
    base = state["rounds"][0]["eval"]
    return {"base_accuracy": base["pass@1"], "rounds": rounds, "wall_s": wall, "peak_rss_gib": peak,
            "eval_s": sum(r["eval_s"] for r in rounds)}  # fmt: skip


# -- TRL ---------------------------------------------------------------------------------------------------------


def trl_side(args, model: str, out: Path) -> dict:
    argv = [PY, __file__, "--trl-worker", "--model", model, "--out", str(out), *_shared_flags(args)]
    log("trl: " + shlex.join(argv))
    code, wall, peak = run_side(argv)
    if code != 0:
        raise SystemExit(f"the TRL worker exited {code}")
    train_s = json.loads((out / "trl_time.json").read_text())["train_s"]
    start = time.perf_counter()
    code = subprocess.run(eval_command(str(out / "model"), args, out / "eval"), cwd=REPO, stdout=sys.stderr).returncode
    eval_s = time.perf_counter() - start
    if code != 0:
        raise SystemExit(f"eval of the TRL model exited {code}")
    accuracy = json.loads((out / "eval" / "eval.json").read_text())["pass@1"]
    return {"accuracy": accuracy, "train_s": train_s, "wall_s": wall, "eval_s": eval_s, "peak_rss_gib": peak}


def _shared_flags(args) -> list[str]:
    return [
        "--rounds", str(args.rounds), "--prompts", str(args.prompts), "--samples", str(args.samples),
        "--groups-per-step", str(args.groups_per_step), "--lr", str(args.lr), "--temperature", str(args.temperature),
        "--max-new-tokens", str(args.max_new_tokens), "--warmup-steps", str(args.warmup_steps),
    ]  # fmt: skip


def trl_worker(args) -> None:
    """GRPOTrainer on the task's train prompts, the same work as the rollshard side's rounds."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rollshard.generate.tasks import get_task

    task = get_task("arithmetic")
    prompts = task.generator.prompts("train", task.generator.resolve({}, "train"))[: args.prompts]
    data = Dataset.from_list([
        {"prompt": task.messages(p), "label": json.dumps(p.label)} for p in prompts
    ])  # fmt: skip

    def reward(completions, label, **_):
        verdicts = [task.verify(c[0]["content"], json.loads(lab)) for c, lab in zip(completions, label)]
        return [float(getattr(v, "reward", v)) for v in verdicts]

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    steps = args.rounds * steps_per_round(args)
    config = GRPOConfig(
        output_dir=str(args.out / "trl"), learning_rate=args.lr, per_device_train_batch_size=args.groups_per_step * args.samples,
        num_generations=args.samples, max_completion_length=args.max_new_tokens, temperature=args.temperature,
        max_steps=steps, num_iterations=1, beta=0.0, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, bf16=False, seed=0, lr_scheduler_type="constant_with_warmup", warmup_steps=args.warmup_steps, max_grad_norm=1.0,
        weight_decay=0.0,
    )  # fmt: skip
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config, train_dataset=data, processing_class=tokenizer)
    start = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - start
    trainer.model.save_pretrained(args.out / "model")
    tokenizer.save_pretrained(args.out / "model")
    (args.out / "trl_time.json").write_text(json.dumps({"train_s": train_s, "steps": steps}))


# -- main --------------------------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompts", type=int, default=64, help="train prompts per round (the same each round)")
    p.add_argument("--samples", type=int, default=4, help="answers per prompt (a GRPO group)")
    p.add_argument("--groups-per-step", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up (rollshard: of every round's training)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--micro-batch-tokens", type=int, default=2048)
    p.add_argument("--eval-prompts", type=int, default=128)
    p.add_argument("--model", help="model folder (default: the smollm2-135m-instruct preset, built once)")
    p.add_argument("--out", type=Path, default=Path("/tmp/bench_learning"))
    p.add_argument("--no-trl", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.trl_worker:
        return trl_worker(args)

    from rollshard.generate.models import preset_gguf
    from rollshard.store.models.gguf import gguf_folder

    model = args.model or str(gguf_folder(preset_gguf("smollm2"), quiet=True))  # converted once per machine
    args.out.mkdir(parents=True, exist_ok=True)
    ours = rollshard_side(args, model, args.out / "rollshard")
    theirs = None if args.no_trl else trl_side(args, model, args.out / "trl_run")
    base = ours["base_accuracy"]
    ours_minutes = sum(r["generate_s"] + r["train_s"] for r in ours["rounds"]) / 60
    result = {
        "recipe": {k: getattr(args, k) for k in ("rounds", "prompts", "samples", "groups_per_step", "lr",
                                                 "temperature", "max_new_tokens", "micro_batch_tokens", "eval_prompts",
                                                 "warmup_steps")},
        "base_accuracy": base,
        "rollshard": {**ours, "gain_per_minute": (ours["rounds"][-1]["accuracy"] - base) / ours_minutes,
                      "minutes_excluding_eval": ours_minutes},
    }  # fmt: skip
    if theirs is not None:
        theirs["gain_per_minute"] = (theirs["accuracy"] - base) / (theirs["train_s"] / 60)
        result["trl"] = theirs
        result["gain_per_minute_ratio"] = result["rollshard"]["gain_per_minute"] / theirs["gain_per_minute"] if theirs["gain_per_minute"] else None
        result["peak_rss_ratio"] = ours["peak_rss_gib"] / theirs["peak_rss_gib"]
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(f"| round | held-out pass@1 | train reward | generate s | train s | eval s | gen tok/s | train tok/s |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| base | {base:.1%} | | | | | | |")
    for r in ours["rounds"]:
        print(f"| {r['round']} | {r['accuracy']:.1%} | {r['train_reward']:.3f} | {r['generate_s']:.0f} | {r['train_s']:.0f} | "
              f"{r['eval_s']:.0f} | {r['generate_tokens_per_s']:.0f} | {r['train_tokens_per_s']:.0f} |")
    if theirs is not None:
        print(f"\nTRL: {theirs['accuracy']:.1%} after {theirs['train_s']:.0f} s of training, peak {theirs['peak_rss_gib']:.1f} GiB; "
              f"rollshard peak {ours['peak_rss_gib']:.1f} GiB; gain per minute ratio {result['gain_per_minute_ratio']:.2f}")


if __name__ == "__main__":
    main()
