"""Which prompts a run takes: this host's shard of the source (``--shard-index i --num-shards n``), and the passes
of ``--repeat`` (pass k >= 1 of prompt ``ID`` is named ``ID~k``)."""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Iterator

from rollshard.generate.tasks.base import Prompt

PASS_SUFFIX = re.compile(r"~\d+$")  # --repeat names pass k >= 1 of prompt ID "ID~k"


def writer_id_for(shard_index: int, num_shards: int) -> str:
    """The dataset writer of shard ``shard_index`` of ``num_shards``."""
    return f"gen-{shard_index}-of-{num_shards}"


def shard_prompts(prompts: list[Prompt], shard_index: int, num_shards: int) -> list[Prompt]:
    """This host's prompts: those whose position in the source is ``shard_index`` modulo ``num_shards``."""
    return [p for p in prompts if p.index % num_shards == shard_index]


def repeat_prompts(prompts: list[Prompt]) -> Iterator[Prompt]:
    """``prompts`` over and over, without end (``--repeat``): pass 0 as they are, pass k >= 1 renamed ``ID~k``.
    Sample ids and sampling seeds are functions of the prompt id, so each pass samples afresh, and a rerun skips
    exactly the passes' prompts already in the dataset."""
    assert prompts, "an empty source would cycle without ever yielding"
    for k in itertools.count():
        for p in prompts:
            yield p if k == 0 else dataclasses.replace(p, prompt_id=f"{p.prompt_id}~{k}")


def source_prompt_id(prompt_id: str) -> str:
    """The source's id of a :func:`repeat_prompts` id: ``ID~k`` -> ``ID``; others unchanged."""
    return PASS_SUFFIX.sub("", prompt_id)
