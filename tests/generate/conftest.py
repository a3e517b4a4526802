"""Fixtures for the engine tests: a second tiny checkpoint, teacher-forced logprobs, servers on 127.0.0.1."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests import forked


@pytest.fixture(scope="session")
def tiny_gpt2_seed1(tmp_path_factory, tiny_gpt2) -> Path:
    """Same architecture and tokenizer as ``tiny_gpt2``, other weights: a 'trained' checkpoint."""
    from rollshard.generate.models import init_model

    return init_model(tmp_path_factory.mktemp("models") / "tiny-gpt2-seed1", preset="tiny-gpt2", seed=1)


@pytest.fixture(scope="session")
def eos_everywhere(tiny_gpt2, tmp_path_factory) -> Path:
    """tiny_gpt2 whose generation_config declares every id an eos: any first token ends a response, certainly."""
    import json
    import shutil

    path = tmp_path_factory.mktemp("models") / "tiny-gpt2-eos-everywhere"
    shutil.copytree(tiny_gpt2, path)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    gen = path / "generation_config.json"
    cfg = json.loads(gen.read_text()) if gen.is_file() else {}
    gen.write_text(json.dumps({**cfg, "eos_token_id": list(range(vocab))}))
    return path


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


def start_embedded_server(model: Path, *extra: str, timeout: float = 120.0) -> tuple[forked.Started, str]:
    """``python -m rollshard.generate serve --model M --port 0`` as a fork of the worker's warm server
    (tests/forked.py); returns (process, base URL) once it says where it listens."""
    proc = forked.start("rollshard.generate", "serve", "--model", model, "--port", "0", *extra,
                        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = READY.search(proc.output()[0])
        if m:
            return proc, m.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.02)  # waiting for a line, with a deadline; nothing is asserted on time
    proc.kill()
    raise RuntimeError("embedded server did not start:\n" + "".join(proc.communicate())[-3000:])


def stop_server(proc: subprocess.Popen | forked.Started) -> None:
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


ROUTER_STARTUP_TIMEOUT_S = 120.0  # a deadline for a broken start, not an expectation of speed


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_router(worker_urls: list[str], log_path: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    """The real sglang-router (``python -m sglang_router.launch_router``) on 127.0.0.1 in front of
    ``worker_urls``; returns (process, URL) once it lists every worker as healthy."""
    import json
    import urllib.request

    port = free_port()
    cmd = [
        sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *worker_urls,
        "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
        "--prometheus-port", str(free_port()), "--log-level", "warn", *extra,
    ]  # fmt: skip
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + ROUTER_STARTUP_TIMEOUT_S
    while True:
        try:
            with urllib.request.urlopen(url + "/workers", timeout=2) as r:
                workers = json.load(r)["workers"]
            if sorted(w["url"] for w in workers if w.get("is_healthy")) == sorted(worker_urls):
                return proc, url
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"sglang-router did not start (exit {proc.poll()}):\n{log_path.read_text()[-3000:]}")
        time.sleep(0.1)  # waiting for a condition, with a deadline; nothing is asserted on time


@pytest.fixture(scope="module")
def two_servers(tiny_gpt2):
    """Two ``rollshard-generate serve`` subprocesses on the tiny GPT-2 model: their base URLs."""
    procs = [start_embedded_server(tiny_gpt2) for _ in range(2)]
    yield [url for _, url in procs]
    for proc, _ in procs:
        stop_server(proc)
