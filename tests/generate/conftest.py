"""Fixtures for the engine tests: a second tiny checkpoint, teacher-forced logprobs, servers on 127.0.0.1."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_gpt2_seed1(tmp_path_factory, tiny_gpt2) -> Path:
    """Same architecture and tokenizer as ``tiny_gpt2``, other weights: a 'trained' checkpoint."""
    from rollshard.generate.models import init_model

    return init_model(tmp_path_factory.mktemp("models") / "tiny-gpt2-seed1", preset="tiny-gpt2", seed=1)


def teacher_forced_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> list[float]:
    """log softmax(logits / T) of each response token from one unpadded fp32 forward (greedy: T -> 1)."""
    ids = torch.tensor([prompt + response])
    with torch.inference_mode():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()  # [R, V]
    scale = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits / scale, dim=-1)  # [R, V]
    return logp.gather(-1, torch.tensor(response)[:, None])[:, 0].tolist()


def teacher_forced_logits(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + response])
    with torch.inference_mode():
        return model(ids).logits[0, len(prompt) - 1 : -1].float()  # [R, V]


READY = re.compile(r"ready on (http://[\d.]+:\d+)")


def start_embedded_server(model: Path, *extra: str, timeout: float = 120.0) -> tuple[subprocess.Popen, str]:
    """``python -m rollshard.generate serve --model M --port 0`` in a subprocess; returns (process, base URL)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollshard.generate", "serve", "--model", str(model), "--port", "0", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    deadline = time.monotonic() + timeout
    lines = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = READY.search(line)
        if m:
            # Keep draining the pipe so the server never blocks on a full one.
            threading.Thread(target=lambda: [None for _ in proc.stdout], daemon=True).start()
            return proc, m.group(1)
    proc.kill()
    raise RuntimeError("embedded server did not start:\n" + "".join(lines[-30:]))


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def teacher_forced():
    """``teacher_forced(model, prompt, response, T) -> [R] logprobs`` (see :func:`teacher_forced_logprobs`)."""
    return teacher_forced_logprobs


@pytest.fixture(scope="session")
def tf_logits():
    return teacher_forced_logits


@pytest.fixture(scope="module")
def embedded_server(tiny_gpt2):
    """One ``rollshard-generate serve`` subprocess on the tiny GPT-2 model for the module: its base URL."""
    proc, url = start_embedded_server(tiny_gpt2)
    yield url
    stop_server(proc)
