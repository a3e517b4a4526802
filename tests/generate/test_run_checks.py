"""rollshard-generate refuses what cannot work before any engine starts: sampling settings no engine samples
with, a ``--check-args`` dry parse, and a ``--reward-url`` that does not answer."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
from aiohttp import web

from rollshard.generate.run import main


class EngineStarted(AssertionError):
    """An engine was asked for: the checks under test must have refused the command before."""


@pytest.fixture
def no_engine(monkeypatch):
    """Any engine start fails the test at once (an unchecked command would otherwise load the model and run)."""

    def refuse(*args, **kwargs):
        raise EngineStarted("an engine was started")

    monkeypatch.setattr("rollshard.generate.engines.make_engine", refuse)


def args(model, out, *extra):
    return [
        "--engine", f"embedded:{model}", "--task", "toy", "--out", str(out), "--n-samples", "2",
        "--max-new-tokens", "4", "--limit", "2", "--no-progress", *map(str, extra),
    ]  # fmt: skip


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rollshard-generate: error:"), err
    return err[0]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--temperature", "-0.5"], "--temperature -0.5 must be a finite number >= 0 (0 is greedy)"),
        (["--temperature", "nan"], "--temperature nan must be a finite number >= 0"),
        (["--top-p", "0"], "--top-p 0 must be in (0, 1]"),
        (["--top-p", "1.5"], "--top-p 1.5 must be in (0, 1]"),
        (["--top-k", "0"], "--top-k 0 must be -1 (no top-k) or >= 1"),
        (["--top-k", "-2"], "--top-k -2 must be -1 (no top-k) or >= 1"),
        (["--max-context-len", "0"], "--max-context-len 0 must be >= 1"),
        (["--request-timeout", "0"], "--request-timeout 0 must be > 0 seconds"),
    ],
)
def test_sampling_settings_are_refused_before_the_engine_starts(tiny_gpt2, tmp_path, capsys, no_engine, extra, message):
    out = tmp_path / "ds"
    assert main(args(tiny_gpt2, out, *extra)) == 2
    assert message in one_line_error(capsys)
    assert not out.exists()


@pytest.mark.parametrize("extra", [[], ["--temperature", "0"], ["--top-p", "1", "--top-k", "1"], ["--top-k", "-1"]])
def test_check_args_passes_a_good_command_without_starting_anything(tiny_gpt2, tmp_path, capsys, no_engine, extra):
    out = tmp_path / "ds"
    assert main(args(tiny_gpt2, out, "--check-args", *extra)) == 0
    assert capsys.readouterr().err == "" and not out.exists()


def test_check_args_says_what_is_wrong_in_one_line(tiny_gpt2, tmp_path, capsys, no_engine):
    out = tmp_path / "ds"
    assert main(args(tiny_gpt2, out, "--check-args", "--top-p", "2")) == 2
    assert "--top-p 2 must be in (0, 1]" in one_line_error(capsys)
    assert not out.exists()


# -- --reward-url is probed before the first prompt ----------------------------------------------------


class ScoreServer:
    """A reward server on 127.0.0.1 with one route, POST /score; counts what reaches it."""

    def __init__(self):
        self.posts = 0
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        assert self.ready.wait(30)

    async def _score(self, request):
        self.posts += 1
        return web.json_response({"reward": 1.0})

    def _serve(self):
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/score", self._score)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self.ready.set()
        self.loop.run_forever()

    def close(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@pytest.fixture
def score_server():
    server = ScoreServer()
    yield server
    server.close()


def closed_port() -> int:
    """A port nothing listens on (bound, then released): a connection to it is refused at once."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_reward_url_fails_before_the_engine(tiny_gpt2, tmp_path, capsys, no_engine, monkeypatch):
    monkeypatch.setattr("rollshard.generate.rewards.HTTP_BACKOFF_S", 0.0)
    url = f"http://127.0.0.1:{closed_port()}/score"
    out = tmp_path / "ds"
    assert main(args(tiny_gpt2, out, "--reward-url", url)) == 2
    line = one_line_error(capsys)
    assert f"--reward-url {url} does not answer:" in line and "after 3 attempts" in line, line
    assert "check the reward server is up at that URL" in line
    assert not out.exists()


def test_a_reward_url_without_its_route_fails_before_the_engine(tiny_gpt2, tmp_path, capsys, no_engine, score_server):
    out = tmp_path / "ds"
    assert main(args(tiny_gpt2, out, "--reward-url", f"{score_server.base}/nowhere")) == 2
    line = one_line_error(capsys)
    assert f"--reward-url {score_server.base}/nowhere answered HTTP 404" in line, line
    assert not out.exists() and score_server.posts == 0


def test_a_reward_url_whose_route_takes_posts_passes_the_probe(tiny_gpt2, tmp_path, capsys, no_engine, score_server):
    # The probe's GET is answered 405 (a POST-only route exists): the run goes on to start its engine, where the
    # fixture stops it. No reward was asked for by the probe.
    with pytest.raises(EngineStarted):
        main(args(tiny_gpt2, tmp_path / "ds", "--reward-url", f"{score_server.base}/score"))
    assert score_server.posts == 0
