"""``rollshard-generate``: run an agent system over a prompt set against an engine into a dataset.

    rollshard-generate --engine embedded:MODEL --agents multi_agent --task math --out DATASET

Steps: parse -> load task, agent system, reward and prompts -> reach the engine -> load the
tokenizer -> open the dataset (resume) -> run -> commit, report.

Bring your own (rollshard/generate/plugins.py): ``--task``, ``--agents`` and ``--reward``
take a built-in name or ``module:attr`` / ``path/to/file.py:attr``; ``--reward-url`` posts each
row to a reward server. A plugin's file and hash are recorded in the run config, and a
resume with an edited plugin is refused.

Rerunning the same command resumes: prompts already in DATASET are skipped, the rest
(including those in the failure ledger) are generated. ``--shard-index i --num-shards
n`` on n hosts split the prompts (by position modulo n) into the one dataset, each
host writing as writer ``gen-i-of-n``. ``--ray [ADDRESS] --num-shards n`` runs those n shards as
Ray tasks of this same command (:mod:`rollshard.generate.ray_run`): one progress bar, a task
that dies or leaves failed prompts rerun (``--ray-retries``), resumable like the rest.

Sampling support (``--sampling-support auto|on|off``, default auto): when sampling truncates
(top-p < 1 or a top-k, temperature > 0), each row also stores every response token's
sampling support and its logprob under the truncated, renormalized distribution (schema
1.1 ``sampling_support`` / ``sampling_logprobs``; environment tokens: [] and 0.0). SGLang
returns them only with a finite top-k (<= its ``--sampling-mask-max-tokens``): a top-p run on
SGLang needs ``--top-k K`` or ``--sampling-support off`` (a usage error otherwise). The
resolved setting is part of the run config a resume compares.

Routed experts (``--routed-experts auto|on|off``, default auto): on a mixture-of-experts model each row
also stores every MoE layer's top-k expert ids at every position the engine forwarded (schema 1.2
``routed_experts``, store/format/routing.py), which ``rollshard-train --routing-replay`` forces in training (R3).
auto: when the model is MoE and the engine returns them (an SGLang server needs
``--enable-return-routed-experts``); on: refused for a dense model or an engine that does not.

Resuming checks the settings (the first differing one is named) and every prompt
already in the dataset: its stored ``prompt_hash`` (rendered prompt ids and label) must
match the source's, so an edited or swapped prompt file is refused rather than skipped.

Asynchronous RL (a trainer following the dataset as it is written, ``rollshard-train --follow``):
``--repeat`` cycles the prompts without end, pass k >= 1 naming prompt ID ``ID~k`` (fresh sample ids
and seeds; a rerun resumes pass by pass), until interrupted or the engine is down. ``--max-ahead ETA
--step-episodes B [--first-version V0]`` starts an episode only while the episodes started (those in
the dataset plus this run's) number fewer than ``(ETA + 1 + v - V0) * B``, ``v`` the engine's
weight version (:mod:`rollshard.generate.admission`). A run that did every prompt with none failed
leaves its writer's end-of-run marker (:mod:`rollshard.store.io.live`); a --repeat run never does.

Exit status: 0 every prompt is in the dataset; 1 some prompts failed (listed in
``DATASET/_failures/``; rerun to retry) or the engine stopped answering (rerun once it
is back); 2 a usage error (bad arguments, a malformed
prompt file, an unreachable engine, a dataset made with other settings) -- nothing is
written then; 130 interrupted (complete episodes are committed).
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from typing import Callable

from rollshard.generate.admission import AdmissionGate
from rollshard.generate.agents.base import prompt_hash
from rollshard.generate.arguments import PROG, build_parser
from rollshard.generate.config import GenerateConfig
from rollshard.generate.engine_setup import (
    admission_gate, connect, context_len, model_info, quiet_model_loading, resolve_routing, tokenizer_of,
    tokenizer_path, update_weights,
)
from rollshard.generate.engines.base import Engine, SamplingParams
from rollshard.generate.inputs import Inputs, load_inputs
from rollshard.generate.resume import ExistingDataset
from rollshard.generate.rewards import RewardError, Scorer
from rollshard.generate.run_config import run_config, served_fields
from rollshard.generate.runner import EXIT_FAILURES, EXIT_INTERRUPTED, EXIT_USAGE, Runner, RunnerOptions, RunResult
from rollshard.generate.tasks.schedule import repeat_prompts, writer_id_for
from rollshard.store.common import UsageError, print_error
from rollshard.store.format.routing import CONFIG_KEY as ROUTING_KEY
from rollshard.store.io.writer import ShardWriter
from rollshard.store.models.tokenizer import TokenizerError

Progress = Callable[[int, int], None]  # (prompts done, prompts in total)


def main(argv: list[str] | None = None, *, progress: Progress | None = None) -> int:
    """The command; ``progress(done, total)`` is called as prompts finish (a Ray task reports to its driver)."""
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    args = build_parser().parse_args(argv)
    try:
        existing = ExistingDataset.open(args.out)
        config = GenerateConfig.from_args(args, existing)
        if config.check_args:
            return 0
        if config.ray_driver:
            from rollshard.generate.ray_run import launch

            return launch(argv, config, existing)
        inputs = load_inputs(config)
        return asyncio.run(_run(config, inputs, existing, progress))
    except UsageError as e:
        print_error(PROG, e)
        return EXIT_USAGE
    except KeyboardInterrupt:  # before the run started, or a second Ctrl-C: committed shards stay
        print(f"{PROG}: interrupted; rerun the same command to continue", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as e:  # the dataset location failed under us (disk full, permissions, network)
        msg = f"{PROG}: error: writing {args.out}: {e}; committed shards are intact, rerun to continue"
        print(msg, file=sys.stderr)
        return EXIT_FAILURES


async def _run(config: GenerateConfig, inputs: Inputs, existing: ExistingDataset, progress: Progress | None) -> int:
    try:
        await _probe_reward(inputs.scorer)
        return await _generate(config, inputs, existing, progress)
    finally:
        await inputs.scorer.close()


async def _probe_reward(scorer: Scorer) -> None:
    """A remote scorer (``--reward-url``) must answer before the engine starts: one that does not would fail
    every prompt of the run, after all of its generation."""
    try:
        await scorer.probe()
    except RewardError as e:
        raise UsageError(str(e)) from e


async def _generate(
    config: GenerateConfig, inputs: Inputs, existing: ExistingDataset, progress: Progress | None
) -> int:
    """Check the resume, reach the engine and read what it serves, check the prompts, run, report."""
    sampling = config.sampling_params()
    record = run_config(config, inputs, sampling)  # stored with every shard; the engine's part added below
    existing.check_run_config(record)  # before the engine: a refused resume costs no model load
    quiet_model_loading()
    engine = connect(config)
    try:
        if config.update_weights is not None:
            await update_weights(engine, config.update_weights, config.weight_version)
        info = await model_info(engine, config.engine, sampling, config.weight_version)
        gate = admission_gate(config, info)
        folder = tokenizer_path(config, info)
        tokenizer = tokenizer_of(folder, sampling)
        record.update(served_fields(
            info, tokenizer_path=folder, tokenizer=tokenizer, context_len=context_len(config, info, tokenizer),
            chat=inputs.chat,
        ))
        routing = await resolve_routing(
            config.routed_experts, config.engine, engine, [info.get("model_path"), folder], sampling
        )
        if routing is not None:
            record[ROUTING_KEY] = routing.to_config()
            sampling = dataclasses.replace(sampling, return_routed_experts=True)
        _check_prompts(config, inputs, existing, tokenizer, sampling, record["max_context_len"])
        with _open_writer(config, record) as writer:
            runner = _runner(config, inputs, engine, tokenizer, sampling, writer, record["max_context_len"], gate,
                             progress)
            result = await runner.run(repeat_prompts(inputs.prompts) if config.repeat else inputs.prompts)
        _report(config, result)
        return _exit_code(config, result)
    finally:
        await engine.close()


def _check_prompts(
    config: GenerateConfig, inputs: Inputs, existing: ExistingDataset, tokenizer, sampling: SamplingParams,
    context: int | None,
) -> None:
    """A resume refuses prompts that changed under their id (any pass of --repeat); an agent system whose calls
    may not fit the context says so."""
    def ids(messages):
        return inputs.chat.ids(tokenizer, messages)

    try:  # both render prompts with the run's chat template
        existing.check_prompts(
            inputs.prompts, lambda p: prompt_hash(ids(inputs.task.messages(p)), p.label), passes=config.repeat
        )
        warning = inputs.prompts and inputs.system.context_warning(
            sampling=sampling,
            context=context,
            task=inputs.task,
            prompt=inputs.prompts[0],
            count_tokens=lambda messages: len(ids(messages)),
        )
    except TokenizerError as e:
        raise UsageError(f"{e} (or pass --tokenizer)") from e
    if warning and not config.allow_skipped_calls:
        print(f"{PROG}: warning: {warning}", file=sys.stderr)


def _open_writer(config: GenerateConfig, record: dict) -> ShardWriter:
    try:
        return ShardWriter(config.out, writer_id=writer_id_for(config.shard_index, config.num_shards), config=record)
    except (RuntimeError, ValueError) as e:
        raise UsageError(str(e)) from e


def _runner(
    config: GenerateConfig, inputs: Inputs, engine: Engine, tokenizer, sampling: SamplingParams, writer: ShardWriter,
    context: int | None, gate: AdmissionGate | None, progress: Progress | None,
) -> Runner:
    return Runner(
        system=inputs.system,
        task=inputs.task,
        engine=engine,
        tokenizer=tokenizer,
        sampling=sampling,
        writer=writer,
        options=RunnerOptions(
            concurrency=config.concurrency,
            # The SGLang client times out (and retries) each request itself; the embedded engine does not.
            request_timeout=config.request_timeout if config.engine.embedded else None,
            retries=config.retries,
            commit_every=config.commit_every,
            commit_interval=config.commit_interval,
            seed=config.seed,
            max_context_len=context,
            allow_skipped_calls=config.allow_skipped_calls,
            progress=config.progress,
            on_progress=progress,
            admission=gate,
            mark_complete=not config.repeat,  # an endless run is never done
        ),
        scorer=inputs.scorer,
        chat=inputs.chat,
    )


def _exit_code(config: GenerateConfig, r: RunResult) -> int:
    """The run's exit code; failed prompts within ``--max-failed-prompts`` (and nothing else wrong) are 0."""
    share = len(r.failed) / max(r.prompts_total, 1)
    if r.exit_code == EXIT_FAILURES and r.engine_down is None and r.failed and share <= config.max_failed_prompts:
        print(f"{PROG}: {len(r.failed)} of {r.prompts_total} prompts failed ({share:.2%}), within --max-failed-prompts "
              f"{config.max_failed_prompts:g}: exit 0, the dataset holds the others", file=sys.stderr)
        return 0
    return r.exit_code


def _report(config: GenerateConfig, r: RunResult) -> None:
    seconds = max(r.seconds, 1e-9)
    rate = f"{r.rows / seconds:.1f} rows/s, {r.response_tokens / seconds:.0f} response tokens/s"
    skipped = f"; {r.prompts_skipped} already there" if r.prompts_skipped else ""
    print(
        f"{PROG}: {r.episodes} of {r.prompts_total} prompts done in {r.seconds:.1f} s{skipped}: "
        f"{r.rows} rows, {r.response_tokens} response tokens ({rate}) -> {config.out}",
        file=sys.stderr,
    )
    if r.rows_by_agent or r.skipped_calls:
        by_agent = ", ".join(f"{agent} {n}" for agent, n in sorted(r.rows_by_agent.items())) or "none"
        line = f"{PROG}: rows by agent: {by_agent}"
        if r.skipped_calls:
            skipped = ", ".join(f"{agent} {n}" for agent, n in sorted(r.skipped_calls.items()))
            line += f"; calls skipped (prompt over the context, --allow-skipped-calls): {skipped}"
        print(line, file=sys.stderr)
    if r.engine_down:
        print(
            f"{PROG}: gave up on the engine: {r.engine_down}; complete prompts are committed; "
            "rerun the same command once it is back",
            file=sys.stderr,
        )
    if r.exit_code == EXIT_INTERRUPTED:
        print(f"{PROG}: interrupted; complete prompts are committed; rerun the same command to finish", file=sys.stderr)
    if r.failed:
        first_id, first = next(iter(r.failed.items()))
        print(
            f"{PROG}: {len(r.failed)} prompts failed (first: {first_id}: {first['error']}); "
            f"ledger {r.ledger}; rerun the same command to retry them",
            file=sys.stderr,
        )
