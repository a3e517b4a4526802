"""Shared fixtures: tiny local models (built once per test session, never downloaded)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The real SmolLM2-135M-Instruct as an fp32 folder: the preset's GGUF file converted once per machine into
    rollshard's cache folder (what ``init-model --preset smollm2-135m-instruct`` copies from), reused by later test
    runs (tests only read it). The cache converts under a file lock: the test workers (``-n 2``) and concurrent
    runs on the machine convert it once and never see half of it."""
    from rollshard.generate.models import preset_gguf
    from rollshard.store.models.gguf import gguf_folder

    return gguf_folder(preset_gguf("smollm2-135m-instruct"), quiet=True)


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory) -> Path:
    """A tiny random GPT-2-architecture model folder (the real SGLang server can run it on CPU)."""
    from rollshard.generate.models import init_model

    return init_model(tmp_path_factory.mktemp("models") / "tiny-gpt2", preset="tiny-gpt2", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    """A tiny random Qwen3-architecture model folder."""
    from rollshard.generate.models import init_model

    return init_model(tmp_path_factory.mktemp("models") / "tiny-qwen3", preset="tiny-qwen3", seed=0)


# -- the real SGLang server (the `-m sglang` tier) --------------------------------------------

REPO = Path(__file__).resolve().parents[1]
# One per machine, outside any checkout; the script that builds it says where (ROLLSHARD_SGLANG_VENV overrides).
SGLANG_VENV = Path(
    subprocess.run(["bash", str(REPO / "scripts" / "make_sglang_env.sh"), "--path"], capture_output=True, text=True, check=True).stdout.strip()
)
SGLANG_STARTUP_TIMEOUT_S = 600  # sglang + torch import dominates; minutes on a busy 2-core machine


@contextlib.contextmanager
def launch_sglang(model: Path, log_dir: Path, *, max_total_tokens: int = 8192) -> Iterator[str]:
    """The real SGLang server on CPU for a GPT-2-architecture model, fp32; yields its URL.

    Skips without the environment of scripts/make_sglang_env.sh, and fails instead when
    ROLLSHARD_REQUIRE_SGLANG is set (the test script's SGLang tier must not skip silently).
    """
    python = SGLANG_VENV / "bin" / "python"
    if not (python.is_file() and any(SGLANG_VENV.glob("lib/python3*/site-packages/sglang/__init__.py"))):
        reason = f"no SGLang environment at {SGLANG_VENV}; build it with scripts/make_sglang_env.sh"
        if os.environ.get("ROLLSHARD_REQUIRE_SGLANG"):
            pytest.fail(reason)
        pytest.skip(reason)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = log_dir / "server.log"
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_USE_CPU_ENGINE"}  # it selects kernels PyPI lacks
    cmd = [
        str(python), "-m", "sglang.launch_server", "--model-path", str(model),
        "--dtype", "float32", "--device", "cpu", "--attention-backend", "torch_native",
        "--sampling-backend", "pytorch", "--skip-server-warmup", "--max-total-tokens", str(max_total_tokens),
        "--mem-fraction-static", "0.05", "--host", "127.0.0.1", "--port", str(port),
    ]  # fmt: skip
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + SGLANG_STARTUP_TIMEOUT_S
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"SGLang server did not start (exit {proc.poll()}); log tail:\n{log_path.read_text()[-3000:]}")
            time.sleep(1.0)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # its own process group: scheduler and detokenizer too
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory) -> Iterator[str]:
    """A real S3-protocol server (moto's standalone server) on 127.0.0.1 for the session; yields its URL."""
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log_path = tmp_path_factory.mktemp("s3") / "moto.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while not _s3_up(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"moto's S3 server did not start (exit {proc.poll()}); log:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _s3_up(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/moto-api/", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
          "AWS_EC2_METADATA_DISABLED": "true"}


@pytest.fixture
def s3_dataset(s3_endpoint, request) -> Iterator[str]:
    """``s3://<a fresh bucket>/data`` on the session's S3 server; the environment points every client
    (pyarrow, boto3, subprocesses) at it, as a user's would with ``AWS_ENDPOINT_URL``."""
    import re
    import uuid

    import boto3

    with pytest.MonkeyPatch.context() as env:  # its own: a test's monkeypatch.undo() keeps the endpoint
        for k, v in {**S3_ENV, "AWS_ENDPOINT_URL": s3_endpoint}.items():
            env.setenv(k, v)
        env.delenv("AWS_PROFILE", raising=False)
        name = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[:40].strip("-") + "-" + uuid.uuid4().hex[:8]
        boto3.client("s3").create_bucket(Bucket=name)
        yield f"s3://{name}/data"


@pytest.fixture(scope="session")
def tiny_moe(tmp_path_factory) -> Path:
    """A tiny random Qwen3-MoE model folder (2 layers of 4 experts, top-2)."""
    from rollshard.generate.models import init_model

    return init_model(tmp_path_factory.mktemp("models") / "tiny-qwen3-moe", preset="tiny-qwen3-moe", seed=0)
