"""Decode benchmark of the embedded engine on a real model: where a decode step's time goes, and response tokens/s
against transformers ``generate()`` on the same batches, side by side in one run.

    .venv/bin/python tests/bench/bench_decode.py [--model smollm2|tiny|PATH] [--batches 1,8,32,64]
        [--answers 48,192] [--rounds 3] [--threads N] [--parts profile,speed,groups,threads,eval,compile]
        [--groups 32,8,48] [--compare-threads 1,2] [--eval 32,48] [--max-batch-size N] [--engine-src DIR]
        [--json]

(a) profile: per batch size and answer length, one batch of requests (32-token chat prompts, temperature 1 over the
    whole vocabulary, ``ignore_eos``) runs through the engine's own prefill, decode and bookkeeping methods, in this
    thread (torch's profiler records only the thread that started it), under ``torch.profiler`` with the step's
    parts labelled. Shares of the decode steps' time:
    * ``kernels``: the model's aten operators (self time, outside the cache's writes);
    * ``sampler``: the sampler, operators and Python (``SamplingRows.sample``);
    * ``cache``: the KV buffers: the column writes inside the forward, growth, and the copies when rows finish;
    * ``python``: the rest: the model's Python between its operators, the step's bookkeeping (tokens appended,
      stop rules, finished rows answered).
    The profiler adds a few microseconds per operator, so ``python`` is an upper bound; ``step_ms`` beside it is
    timed without the profiler.
(b) speed: per batch size and answer length, ``batch`` requests through the embedded engine (``max_batch_size`` =
    batch) and through ``generate()`` (one static batch, left-padded, sampling at temperature 1 over the whole
    vocabulary, eos off: it returns no logprobs), in turn, ``--rounds`` rounds in one process, so a busy machine
    slows both alike. Figures: response tokens/s, the best round of each, and the median of the per-round ratios
    embedded / generate(). Both run at the same torch thread count (``--threads``).
(c) groups (``--parts groups``): GRPO-shaped, ``--groups P,S,N``: P prompts x S samples of N new tokens, all
    submitted at once to the engine at its own ``max_batch_size`` (``--max-batch-size`` to set it);
    ``generate()`` on the same requests in static batches of that size, in order. Same rounds and ratios.
(d) threads (``--parts threads``): the groups workload at each of ``--compare-threads`` (default 1,2): per
    round and count, ``generate()`` and a fresh engine at that count, in turn.

(e) eval (``--parts eval``): ``rollshard-generate eval``'s requests, ``--eval P,N``: the first P held-out arithmetic
    prompts through the tokenizer's chat template, greedy, up to N new tokens, ending at eos, all at once. The
    engine as it is, the same engine prefilling each prompt whole (the tokens every prompt starts with not run
    once: the prefill before), and ``generate()`` (one static batch, greedy, ending each row at eos), in turn;
    seconds per round, the speedups per round (median, range), and how many answers the two prefills share.
(f) compile (``--parts compile``): whether ``torch.compile`` pays on this CPU, in its best case. Per batch size, the
    model's decode forward (one token per row after a 54-token prompt, 24 steps, greedy) over transformers'
    ``StaticCache``, whose shapes never change (the engine's own steps change shape: rows finish, columns grow), eager
    and through ``torch.compile(model, dynamic=False)`` (inductor's C++ kernels), in turn, ``--rounds`` rounds:
    the first compiled call's seconds (the compilation) and the median step of each, eager / compiled per round.

``--engine-src DIR`` imports rollshard from DIR instead (a ``git archive`` of an older commit, laid out as
``DIR/rollshard/{generate,store,train}``), to profile an older engine with this bench. The profile part drives the
engine's worker steps (``EmbeddedEngine.admit``, ``decode_step``, ``finish_rows``, ``Request``), public since they
were renamed from ``_admit``, ``_decode``, ``_finish_rows``, ``_Request``: for a source older than that, run that
commit's own bench_decode.py. The JSON records the load average before and after each part (the machine may be
shared) and the thread count.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import statistics
import sys
import time
from pathlib import Path

PROMPT_TOKENS = 32
SECTIONS = ("model", "sampler", "cache", "bookkeeping")


def model_path(name: str, root: Path) -> Path:
    from rollshard.generate.models import init_model

    if name == "smollm2":  # the conversion cached once per machine (what init-model copies from)
        from rollshard.generate.models import preset_gguf
        from rollshard.store.models.gguf import gguf_folder

        return gguf_folder(preset_gguf("smollm2-135m-instruct"), quiet=True)
    if name == "tiny":
        return init_model(root / "tiny-qwen3", preset="tiny-qwen3", seed=0)
    return Path(name)


def prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` chat prompts of exactly PROMPT_TOKENS tokens (a question, cut or padded with its own text)."""
    out = []
    for i in range(n):
        text = f"Question {i}: what is {17 * i + 3} plus {29 * i + 11}? Think step by step, then answer. " * 4
        ids = tokenizer(text)["input_ids"]
        out.append(ids[:PROMPT_TOKENS])
    return out


# ---- (a) profile ---------------------------------------------------------------------------------------------


def _label(owner, name: str, label: str) -> None:
    """Wrap ``owner.name`` in a profiler range called ``label``."""
    from torch.profiler import record_function

    inner = getattr(owner, name)

    def wrapped(*args, **kwargs):
        with record_function(label):
            return inner(*args, **kwargs)

    setattr(owner, name, wrapped)


def _instrument(engine) -> None:
    from rollshard.generate.engines import kv_cache
    from rollshard.generate.engines.sampler import SamplingRows

    for fn in ("reserve", "select", "merge"):
        _label(kv_cache, fn, "cache")
    _label(kv_cache.column_cache_class(), "update", "cache")
    _label(SamplingRows, "sample", "sampler")
    _label(engine.model, "forward", "model")
    _label(engine, "record", "bookkeeping")
    _label(engine, "finish_rows", "bookkeeping")


def _requests(engine, ids: list[list[int]], new_tokens: int, loop):
    """The engine's request records for ``ids`` (its worker's input), seeded."""
    import torch

    from rollshard.generate.engines import SamplingParams
    from rollshard.generate.engines.embedded import Request

    out = []
    for i, prompt in enumerate(ids):
        sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True, sampling_seed=i)
        out.append(
            Request(
                rid=str(i), input_ids=prompt, sampling=sp, seed=i, loop=loop, future=loop.create_future(),
                start=time.perf_counter(), stop_ids=frozenset(), max_new_tokens=new_tokens,
                generator=torch.Generator().manual_seed(i),
            )
        )  # fmt: skip
    return out


def _run_steps(engine, reqs, profiler=None) -> list[float]:
    """The worker's loop for one batch, in this thread: prefill, then decode steps until every row finished.
    Returns each decode step's seconds (bookkeeping included)."""
    import torch

    from rollshard.generate.engines.batch import Batch

    steps = []
    with torch.inference_mode():
        batch = engine.finish_rows(engine.admit(Batch(), reqs))
        while batch.rows:
            t0 = time.perf_counter()
            if profiler is not None:
                with torch.profiler.record_function("step"):
                    engine.decode_step(batch)
                    batch = engine.finish_rows(batch)
            else:
                engine.decode_step(batch)
                batch = engine.finish_rows(batch)
            steps.append(time.perf_counter() - t0)
    return steps


def _shares(events) -> dict[str, float]:
    """Per-share microseconds of the ``step`` ranges' time (see the module docstring); the prefill is outside."""
    totals = dict.fromkeys(("kernels", "sampler", "cache", "python"), 0.0)

    def ranges(e) -> list[str]:  # the labelled ranges around e, innermost first
        out = []
        while e is not None:
            if e.name in SECTIONS or e.name == "step":
                out.append(e.name)
            e = e.cpu_parent
        return out

    for e in events:
        around = ranges(e.cpu_parent)
        if "step" not in around:
            continue
        if e.name in ("sampler", "cache") and not {"sampler", "cache"} & set(around):
            totals[e.name] += e.cpu_time_total  # a range inside another of these is counted once
        elif e.name.startswith("aten::") and around[0] == "model":
            totals["kernels"] += e.self_cpu_time_total
    step_total = sum(e.cpu_time_total for e in events if e.name == "step")
    totals["python"] = step_total - totals["kernels"] - totals["sampler"] - totals["cache"]
    return totals


def bench_profile(engine, tokenizer, batches: list[int], answers: list[int]) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    loop = asyncio.new_event_loop()
    _instrument(engine)
    figures = []
    for batch in batches:
        for new_tokens in answers:
            engine.max_batch_size = batch
            ids = prompts(tokenizer, batch)
            _run_steps(engine, _requests(engine, ids, 4, loop))  # warm
            steps = _run_steps(engine, _requests(engine, ids, new_tokens, loop))
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                _run_steps(engine, _requests(engine, ids, new_tokens, loop), profiler=prof)
            shares = _shares(prof.events())
            total = sum(shares.values())
            row = {
                "batch": batch,
                "new_tokens": new_tokens,
                "step_ms": round(1000 * statistics.median(steps), 2),
                "decode_tok_s": round(batch / statistics.median(steps), 1),
                "shares": {k: round(v / total, 3) for k, v in shares.items()},
                "profiled_step_ms": round(total / 1000 / max(len(steps), 1), 2),
                "loadavg": os.getloadavg(),
            }
            figures.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    loop.close()
    return figures


# ---- (b) speed -----------------------------------------------------------------------------------------------


def run_generate(model, ids: list[list[int]], new_tokens: int, pad_id: int, eos_ids=None) -> float:
    """transformers generate(): one static batch, sampling at T = 1 over the whole vocabulary, eos off; or, with
    ``eos_ids``, greedy, each row ending at one of them (as ``rollshard-generate eval`` asks)."""
    import torch
    from transformers import GenerationConfig

    if eos_ids is None:
        config = GenerationConfig(
            do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad_id, eos_token_id=None,
            max_new_tokens=new_tokens,
        )  # fmt: skip
    else:
        config = GenerationConfig(do_sample=False, pad_token_id=pad_id, eos_token_id=list(eos_ids),
                                  max_new_tokens=new_tokens)
    length = max(len(p) for p in ids)
    t0 = time.perf_counter()
    with torch.inference_mode():
        x = torch.tensor([[pad_id] * (length - len(p)) + p for p in ids])
        mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in ids])
        out = model.generate(input_ids=x, attention_mask=mask, generation_config=config)
    assert eos_ids is not None or out.shape[1] == length + new_tokens, (out.shape, length, new_tokens)
    return time.perf_counter() - t0


async def run_embedded(engine, ids: list[list[int]], new_tokens: int) -> float:
    from rollshard.generate.engines import SamplingParams

    sp = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(p, sp) for p in ids))
    seconds = time.perf_counter() - t0
    assert all(len(r.output_ids) == new_tokens for r in results)
    return seconds


def bench_speed(engine, model, tokenizer, batches: list[int], answers: list[int], rounds: int) -> list[dict]:
    pad = tokenizer.pad_token_id or 0
    figures = []

    async def embedded(ids, new_tokens):
        return await run_embedded(engine, ids, new_tokens)

    for batch in batches:
        for new_tokens in answers:
            engine.max_batch_size = batch
            ids = prompts(tokenizer, batch)
            tokens = batch * new_tokens
            run_generate(model, ids[:2], 2, pad)  # warm both
            asyncio.run(embedded(ids[:2], 2))
            load0 = os.getloadavg()
            rates: dict[str, list[float]] = {"embedded": [], "generate": []}
            for r in range(rounds):
                # Alternate which goes first, so a load change within a round falls on both alike.
                order = ("embedded", "generate") if r % 2 == 0 else ("generate", "embedded")
                for key in order:
                    if key == "embedded":
                        seconds = asyncio.run(embedded(ids, new_tokens))
                    else:
                        seconds = run_generate(model, ids, new_tokens, pad)
                    rates[key].append(tokens / seconds)
            row = {"batch": batch, "new_tokens": new_tokens, **rate_figures(rates, load0)}
            figures.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return figures


def rate_figures(rates: dict[str, list[float]], load0) -> dict:
    """Per-round tokens/s of the embedded engine and generate(): the best of each, the rounds, and the median and
    range of the per-round ratios; the load average before and now."""
    ratios = sorted(e / g for e, g in zip(rates["embedded"], rates["generate"]))
    return {
        "embedded_tok_s_best": round(max(rates["embedded"]), 1),
        "generate_tok_s_best": round(max(rates["generate"]), 1),
        "embedded_tok_s": [round(x, 1) for x in rates["embedded"]],
        "generate_tok_s": [round(x, 1) for x in rates["generate"]],
        "ratio_median": round(statistics.median(ratios), 3),
        "ratio_range": [round(ratios[0], 3), round(ratios[-1], 3)],
        "loadavg_before": load0,
        "loadavg_after": os.getloadavg(),
    }


def bench_groups(engine, model, tokenizer, n_prompts: int, samples: int, new_tokens: int, rounds: int) -> dict:
    """GRPO-shaped: ``n_prompts`` prompts x ``samples`` samples, all submitted at once to the engine (its own
    ``max_batch_size``, continuous batching); ``generate()`` on the same requests in static batches of that size."""
    pad = tokenizer.pad_token_id or 0
    ids = [p for p in prompts(tokenizer, n_prompts) for _ in range(samples)]  # the samples of a prompt together
    batch = engine.max_batch_size
    tokens = len(ids) * new_tokens

    def generate_all() -> float:
        return sum(run_generate(model, ids[i : i + batch], new_tokens, pad) for i in range(0, len(ids), batch))

    load0 = os.getloadavg()
    rates: dict[str, list[float]] = {"embedded": [], "generate": []}
    for r in range(rounds):
        order = ("embedded", "generate") if r % 2 == 0 else ("generate", "embedded")
        for key in order:
            seconds = asyncio.run(run_embedded(engine, ids, new_tokens)) if key == "embedded" else generate_all()
            rates[key].append(tokens / seconds)
    row = {"prompts": n_prompts, "samples": samples, "new_tokens": new_tokens, "batch": batch,
           **rate_figures(rates, load0)}  # fmt: skip
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def bench_thread_counts(path, model, tokenizer, n_prompts, samples, new_tokens, rounds, counts, batch) -> dict:
    """The groups workload at each torch thread count in ``counts``: per round and count, a fresh engine with
    ``threads`` = count (its worker sets the count when it starts) and ``generate()`` at that count, in turn."""
    import torch

    from rollshard.generate.engines.embedded import EmbeddedEngine

    pad = tokenizer.pad_token_id or 0
    ids = [p for p in prompts(tokenizer, n_prompts) for _ in range(samples)]
    tokens = len(ids) * new_tokens
    rates: dict[str, list[float]] = {}
    load0 = os.getloadavg()
    for _ in range(rounds):
        for n in counts:
            torch.set_num_threads(n)
            seconds = sum(run_generate(model, ids[i : i + batch], new_tokens, pad) for i in range(0, len(ids), batch))
            rates.setdefault(f"generate@{n}", []).append(tokens / seconds)
            engine = EmbeddedEngine(path, threads=n, max_batch_size=batch)
            rates.setdefault(f"embedded@{n}", []).append(tokens / asyncio.run(run_embedded(engine, ids, new_tokens)))
            asyncio.run(engine.close())
    row: dict = {"prompts": n_prompts, "samples": samples, "new_tokens": new_tokens, "batch": batch}
    for key, values in rates.items():
        row[f"{key}_tok_s"] = [round(x, 1) for x in values]
    for n in counts:
        ratios = [e / g for e, g in zip(rates[f"embedded@{n}"], rates[f"generate@{n}"])]
        row[f"embedded_vs_generate@{n}"] = round(statistics.median(ratios), 3)
    base = counts[0]
    for n in counts[1:]:
        ratios = [a / b for a, b in zip(rates[f"embedded@{base}"], rates[f"embedded@{n}"])]
        row[f"embedded@{base}_vs_embedded@{n}"] = round(statistics.median(ratios), 3)
    row["loadavg_before"], row["loadavg_after"] = load0, os.getloadavg()
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def eval_prompts(tokenizer, n: int) -> list[list[int]]:
    """The first ``n`` held-out arithmetic prompts as ``rollshard-generate eval`` sends them (the tokenizer's chat
    template: SmolLM2's puts its system turn before every question)."""
    from rollshard.generate.chat import ChatFormat
    from rollshard.generate.tasks import get_task

    task = get_task("arithmetic")
    chosen = task.generator.prompts("eval", task.generator.resolve({}, "eval"))[:n]
    return [ChatFormat().ids(tokenizer, task.messages(p)) for p in chosen]


def bench_eval(engine, model, tokenizer, n_prompts: int, new_tokens: int, rounds: int) -> dict:
    """``rollshard-generate eval``'s requests: ``n_prompts`` held-out prompts, greedy, up to ``new_tokens``, ending
    at eos, all at once. The engine as it is (a prefix every prompt starts with prefilled once), the same engine
    prefilling every prompt whole (``shared_prefix`` 0: the prefill before), and ``generate()`` (one static batch,
    greedy, ending each row at eos), in turn, ``rounds`` rounds."""
    from rollshard.generate.engines import SamplingParams, embedded

    ids = eval_prompts(tokenizer, n_prompts)
    sp = SamplingParams(temperature=0.0, max_new_tokens=new_tokens)
    pad = tokenizer.pad_token_id or 0
    own = embedded.shared_prefix

    async def engine_run(shared) -> tuple[float, list[list[int]]]:
        embedded.shared_prefix = shared
        try:
            t0 = time.perf_counter()
            results = await asyncio.gather(*(engine.generate(p, sp) for p in ids))
            return time.perf_counter() - t0, [r.output_ids for r in results]
        finally:
            embedded.shared_prefix = own

    asyncio.run(engine_run(own))  # warm
    load0 = os.getloadavg()
    seconds: dict[str, list[float]] = {"shared_prefix": [], "whole_prompts": [], "generate": []}
    answers: dict[str, list[list[int]]] = {}  # the last round's, by engine variant
    for r in range(rounds):
        order = list(seconds) if r % 2 == 0 else list(seconds)[::-1]
        for key in order:
            if key == "generate":
                seconds[key].append(run_generate(model, ids, new_tokens, pad, eos_ids=engine.eos_ids))
                continue
            t, answers[key] = asyncio.run(engine_run(own if key == "shared_prefix" else (lambda prompts: 0)))
            seconds[key].append(t)
    same = sum(a == b for a, b in zip(answers["shared_prefix"], answers["whole_prompts"]))
    tokens = sum(len(o) for o in answers["shared_prefix"])
    ratio = sorted(w / s for w, s in zip(seconds["whole_prompts"], seconds["shared_prefix"]))
    vs_generate = sorted(g / s for g, s in zip(seconds["generate"], seconds["shared_prefix"]))
    row = {
        "prompts": n_prompts, "new_tokens": new_tokens, "prompt_tokens": [min(map(len, ids)), max(map(len, ids))],
        "shared_prefix_tokens": own(ids), "response_tokens": tokens, "same_answers": same,
        **{f"{k}_s": [round(x, 3) for x in v] for k, v in seconds.items()},
        "shared_over_whole_speedup_median": round(statistics.median(ratio), 3),
        "shared_over_whole_speedup_range": [round(ratio[0], 3), round(ratio[-1], 3)],
        "vs_generate_speedup_median": round(statistics.median(vs_generate), 3),
        "loadavg_before": load0, "loadavg_after": os.getloadavg(),
    }  # fmt: skip
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


# ---- the command ---------------------------------------------------------------------------------------------


def bench_compile(model, batches: list[int], rounds: int, prompt: int = 54, steps: int = 24) -> list[dict]:
    import torch
    from transformers import StaticCache

    def decode(fwd, batch: int) -> tuple[float, float]:  # (first step s, median of the other steps s)
        cache = StaticCache(config=model.config, max_batch_size=batch, max_cache_len=prompt + steps + 8)
        ids = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(0))
        times = []
        with torch.inference_mode():
            out = model(input_ids=ids, past_key_values=cache, cache_position=torch.arange(prompt), use_cache=True)
            tok = out.logits[:, -1].argmax(-1, keepdim=True)
            for i in range(steps):
                t0 = time.perf_counter()
                out = fwd(input_ids=tok, past_key_values=cache, cache_position=torch.tensor([prompt + i]),
                          use_cache=True)
                tok = out.logits[:, -1].argmax(-1, keepdim=True)
                times.append(time.perf_counter() - t0)
        return times[0], statistics.median(times[1:])

    out = []
    for batch in batches:
        torch._dynamo.reset()
        compiled = torch.compile(model, dynamic=False)
        load0 = os.getloadavg()
        compile_s, eager_ms, compiled_ms = None, [], []
        for r in range(rounds):
            eager_ms.append(1e3 * decode(model, batch)[1])
            first, median = decode(compiled, batch)
            compile_s = first if compile_s is None else compile_s
            compiled_ms.append(1e3 * median)
        ratios = [e / c for e, c in zip(eager_ms, compiled_ms)]  # > 1: the compiled step is faster
        out.append({"batch": batch, "compile_s": compile_s, "eager_step_ms": eager_ms,
                    "compiled_step_ms": compiled_ms, "eager_over_compiled": ratios,
                    "eager_over_compiled_median": statistics.median(ratios),
                    "loadavg": [load0, os.getloadavg()]})
        print(f"batch {batch}: compiled in {compile_s:.1f} s; step eager {min(eager_ms):.1f} ms, compiled "
              f"{min(compiled_ms):.1f} ms (best); eager / compiled per round {', '.join(f'{x:.2f}' for x in ratios)}",
              file=sys.stderr)
    return out


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="smollm2 (SmolLM2-135M-Instruct, fp32), tiny, or a folder")
    ap.add_argument("--batches", type=_ints, default=[1, 8, 32, 64], help="batch sizes (default 1,8,32,64)")
    ap.add_argument("--answers", type=_ints, default=[48, 192], help="new tokens per request (default 48,192)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds of the speed part (default 3)")
    ap.add_argument("--parts", default="profile,speed",
                    help="comma-separated, of profile, speed, groups, threads, eval, compile")
    ap.add_argument("--groups", type=_ints, default=[32, 8, 48], help="groups part: prompts, samples, new tokens")
    ap.add_argument(
        "--compare-threads", type=_ints, default=None,
        help="threads part: the groups workload at each of these torch thread counts, fresh engines, in turn",
    )  # fmt: skip
    ap.add_argument("--eval", type=_ints, default=[32, 48], help="eval part: held-out prompts, new tokens (default 32,48)")
    ap.add_argument("--max-batch-size", type=int, default=None, help="groups part: the engine's (default its own)")
    ap.add_argument(
        "--threads", type=int, default=None,
        help="torch threads of the engine and generate() (default: the engine's default)",
    )  # fmt: skip
    ap.add_argument("--engine-src", default=None, help="import rollshard from this folder (an older commit)")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = ap.parse_args()
    if args.engine_src:
        sys.path.insert(0, str(Path(args.engine_src).resolve()))
    parts = [p for p in args.parts.split(",") if p]
    unknown = set(parts) - {"profile", "speed", "groups", "threads", "eval", "compile"}
    if unknown or args.rounds < 1 or min(args.batches + args.answers) < 1:
        ap.error("--parts takes profile, speed, groups, threads, eval and compile; --rounds, --batches and --answers "
                 "must be >= 1")

    import tempfile

    import torch

    from rollshard.generate.engines.embedded import EmbeddedEngine, load_causal_lm

    path = model_path(args.model, Path(tempfile.mkdtemp(prefix="rollshard-bench-decode-")))
    if args.threads is not None:
        torch.set_num_threads(args.threads)  # this thread too: the profile part and generate() run here
    options = {}
    if "threads" in inspect.signature(EmbeddedEngine).parameters:  # an older engine has no such option
        options["threads"] = args.threads
    if args.max_batch_size is not None:
        options["max_batch_size"] = args.max_batch_size
    engine = EmbeddedEngine(path, **options)
    own_batch = engine.max_batch_size
    if getattr(engine, "threads", None) is not None:
        torch.set_num_threads(engine.threads)
    reference = load_causal_lm(path)  # generate()'s own copy: the engine may lay its weights out differently
    reference.generation_config.eos_token_id = None  # else generate() takes the model's eos for the unset one
    figures: dict = {
        "model": args.model,
        "engine_src": args.engine_src or "working tree",
        "torch_threads": torch.get_num_threads(),
        "engine_threads": getattr(engine, "threads", None),  # None: an older engine, at torch's own count
        "engine_max_batch_size": own_batch,
        "cpus": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
    }
    if "profile" in parts:
        figures["profile"] = bench_profile(engine, engine.tokenizer, args.batches, args.answers)
    if "speed" in parts:
        figures["speed"] = bench_speed(engine, reference, engine.tokenizer, args.batches, args.answers, args.rounds)
    if "groups" in parts:
        engine.max_batch_size = own_batch
        figures["groups"] = bench_groups(engine, reference, engine.tokenizer, *args.groups, args.rounds)
    if "threads" in parts:
        counts = args.compare_threads or [1, 2]
        figures["threads"] = bench_thread_counts(
            path, reference, engine.tokenizer, *args.groups, args.rounds, counts, own_batch
        )
    if "eval" in parts:
        engine.max_batch_size = own_batch
        figures["eval"] = bench_eval(engine, reference, engine.tokenizer, *args.eval, args.rounds)
    if "compile" in parts:
        figures["compile"] = bench_compile(reference, args.batches, args.rounds)
    figures["loadavg_end"] = os.getloadavg()
    asyncio.run(engine.close())
    if args.json:
        print(json.dumps(figures))
        return
    print(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
