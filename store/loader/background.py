"""The background threads: a generator run on a daemon thread, its items handed over through a bounded queue.

The loader runs two: the block reader (``prefetch`` blocks ahead) and the step producer (``prefetch``
packed steps ahead); a third hashes shards (store/io/integrity.py :class:`Checksums`). A thread told to
stop while it waits notices within ``POLL_S``; what it raises is raised by the consumer.

At interpreter exit (after the non-daemon threads are joined, before finalization) every live thread is told
to stop and given ``JOIN_S`` to leave the Arrow call it is in: a daemon thread still decoding when libarrow's
thread pools are torn down aborts the process ("terminate called without an active exception").
"""

from __future__ import annotations

import atexit
import dataclasses
import queue
import threading
import weakref
from typing import Any, Callable, Iterator

from rollshard.store.loader.config import JOIN_S, POLL_S


class Stopped(Exception):
    """Raised inside a background thread told to stop while it waits."""


END = object()


class Background:
    """Runs the generator ``produce(stop_event)`` on a daemon thread; items come through a bounded queue."""

    def __init__(self, produce: Callable[[threading.Event], Iterator[Any]], maxsize: int, name: str):
        self._queue: queue.Queue = queue.Queue(maxsize)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(produce,), name=name, daemon=True)
        self._thread.start()
        _LIVE.add(self)

    def _run(self, produce) -> None:
        gen = produce(self._stop)
        try:
            for item in gen:
                if not self._put(item):
                    return
            self._put(END)
        except Stopped:
            pass
        except BaseException as e:  # handed to the consumer, which raises it
            self._put(_Failure(e))
        finally:
            gen.close()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def get(self, stop: threading.Event | None = None):
        """The next item, or ``END``; raises what the thread raised, or ``Stopped`` once ``stop`` is set."""
        while True:
            try:
                item = self._queue.get(timeout=POLL_S)
            except queue.Empty:
                if stop is not None and stop.is_set():
                    raise Stopped from None
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("the loader's background thread ended without a result")
                continue
            if isinstance(item, _Failure):
                raise item.error
            return item

    def close(self) -> None:
        self._stop.set()
        while True:  # unblock a put
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not threading.current_thread():
            self._thread.join(JOIN_S)


@dataclasses.dataclass
class _Failure:
    error: BaseException


_LIVE: "weakref.WeakSet[Background]" = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    """Stop every live background thread before the interpreter finalizes (module docstring)."""
    live = list(_LIVE)
    for bg in live:
        bg._stop.set()
    for bg in live:
        if bg._thread is not threading.current_thread():
            bg._thread.join(JOIN_S)
