"""A gate inside Ray's worker processes: ``runtime_env={"worker_process_setup_hook": "tests.ray_gates.install",
"env_vars": {"ROLLSHARD_TEST_GATE": json}}``.

Gate JSON: ``target`` (``module:Class.method``, a method of an object with ``writer_id``), ``writer_id``,
``count`` and ``signal``. The ``count``-th call of the method by that writer, once it returned, makes the first
worker to get there write its pid to ``signal`` and wait there until killed, whatever the machine's speed; a
later worker (the rerun of the task) passes, since the gate is claimed already (``signal + ".claim"``).
"""

from __future__ import annotations

import functools
import importlib
import json
import os
import time

ENV = "ROLLSHARD_TEST_GATE"
POLL_S = 0.01


def install() -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    gate = json.loads(spec)
    module_name, _, attr = gate["target"].partition(":")
    class_name, method = attr.split(".")
    owner = getattr(importlib.import_module(module_name), class_name)
    original = getattr(owner, method)
    calls = {"n": 0}

    @functools.wraps(original)
    def gated(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        if self.writer_id == gate["writer_id"]:
            calls["n"] += 1
            if calls["n"] == gate["count"]:
                _wait(gate["signal"])
        return out

    setattr(owner, method, gated)


def _wait(signal: str) -> None:
    try:
        os.close(os.open(signal + ".claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return  # claimed by an earlier worker: this one is the rerun
    with open(signal + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(signal + ".tmp", signal)
    while True:
        time.sleep(POLL_S)  # until the test kills this process
