"""What a run generates from, loaded from its config: the task, the agent system, the scorer, the chat format and
this host's prompts (:class:`Inputs`). Every error here is the user's to fix (one-line UsageError)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import TYPE_CHECKING, Any

from rollshard.generate.agents import AgentSystem, make_agent_system
from rollshard.generate.chat import ChatFormat
from rollshard.generate.rewards import Scorer, make_scorer
from rollshard.generate.tasks import TASKS, Prompt, PromptSourceError, Task, get_task, load_prompts, parse_task_options
from rollshard.generate.tasks.schedule import PASS_SUFFIX, shard_prompts
from rollshard.store.common import UsageError

if TYPE_CHECKING:
    from rollshard.generate.config import GenerateConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inputs:
    task: Task
    system: AgentSystem
    scorer: Scorer
    chat: ChatFormat
    prompts: list[Prompt]  # this host's: the source's first --limit, then its shard
    prompts_total: int  # of every shard
    source: str  # the prompt source's name (a file, a HF dataset, a generated task's "name[split]")
    fingerprint: str  # of the whole source (prompts_fingerprint)
    task_options: dict[str, Any] | None  # the resolved options of a task that generates its prompts


def load_inputs(config: GenerateConfig) -> Inputs:
    """Task, agent system, scorer, chat format and this host's prompts."""
    try:
        task = get_task(config.task)
        if config.system_prompt is not None:
            task = dataclasses.replace(task, system_prompt=config.system_prompt or None)
        system = make_agent_system(config.agents, n_samples=config.n_samples, options=dict(config.agent_options))
        scorer = make_scorer(
            task,
            reward=config.reward,
            reward_url=config.reward_url,
            concurrency=config.reward_concurrency,
            timeout=config.reward_timeout,
        )
        chat = ChatFormat.from_file(config.chat_template) if config.chat_template else (
            ChatFormat(mode="raw") if config.no_chat_template else ChatFormat()
        )
        source, prompts, task_options = _source_prompts(config, task)
    except (ValueError, PromptSourceError) as e:
        raise UsageError(str(e)) from e
    fingerprint = prompts_fingerprint(prompts)
    if config.limit is not None:
        prompts = prompts[: config.limit]
    total = len(prompts)
    prompts = shard_prompts(prompts, config.shard_index, config.num_shards)
    if config.repeat:
        _check_repeatable(prompts)
    return Inputs(
        task=task, system=system, scorer=scorer, chat=chat, prompts=prompts, prompts_total=total, source=str(source),
        fingerprint=fingerprint, task_options=task_options,
    )


def _source_prompts(config: GenerateConfig, task: Task) -> tuple[Any, list[Prompt], dict[str, Any] | None]:
    """The prompt source's name, its prompts, and the options of a task that generates them (else None)."""
    task_options = parse_task_options(list(config.task_options))
    if task.generator is not None and config.prompts is None:
        resolved = task.generator.resolve(task_options, config.split)
        return f"{task.name}[{config.split}]", task.generator.prompts(config.split, resolved), resolved
    if task_options:
        raise UsageError(
            "--task-option is for a task that generates its prompts "
            f"({', '.join(name for name, t in sorted(TASKS.items()) if t.generator)}), "
            f"not for task {task.name!r} reading {config.prompts or 'its prompt file'}; drop --task-option"
        )
    source = config.prompts or task.default_prompts()
    prompts = load_prompts(
        source,
        input_key=config.input_key,
        label_key=config.label_key,
        id_key=config.id_key,
        label_required=task.label_required,
        split=config.split,
    )
    return source, prompts, None


def prompts_fingerprint(prompts: list[Prompt]) -> str:
    """Content hash of the whole prompt source (ids, prompts, labels, in order), kept in the run config."""
    h = hashlib.blake2b(digest_size=12)
    for p in prompts:
        h.update(json.dumps([p.prompt_id, p.content, p.label], sort_keys=True, default=str).encode())
        h.update(b"\n")
    return h.hexdigest()


def _check_repeatable(prompts: list[Prompt]) -> None:
    """``--repeat`` names pass k of prompt ID ``ID~k``: a source id of that form would be another prompt's pass."""
    if not prompts:
        raise UsageError("--repeat: this shard has no prompts to repeat")
    for p in prompts:
        if PASS_SUFFIX.search(p.prompt_id):
            raise UsageError(
                f"--repeat names pass k of prompt ID ID~k, and the source has prompt id {p.prompt_id!r} (position "
                f"{p.index}), a pass of {PASS_SUFFIX.sub('', p.prompt_id)!r}; rename it or drop --repeat"
            )
