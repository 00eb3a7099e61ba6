"""The threads that complete emulated collectives (an alarm at modeled ends) and see gloo finish
(watchers): off the caller's thread, because a compiled graph waits late on purpose.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

logger = logging.getLogger(__name__)


def sleep_until(deadline: float) -> None:
    # time.sleep can wake a little early on some clocks; loop, but never spin.
    while (remaining := deadline - time.monotonic()) > 0:
        time.sleep(remaining)


class Alarm:
    """One daemon thread that runs callbacks at given times (futures at their modeled end)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: list[tuple[float, int, Callable, tuple]] = []
        self._order = itertools.count()
        self._thread: threading.Thread | None = None

    def at(self, when: float, fn: Callable, *args: Any) -> None:
        if when <= time.monotonic():
            fn(*args)
            return
        with self._cond:
            heapq.heappush(self._due, (when, next(self._order), fn, args))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="emulated-network-alarm", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._due or (wait := self._due[0][0] - time.monotonic()) > 0:
                    self._cond.wait(None if not self._due else wait)
                _, _, fn, args = heapq.heappop(self._due)
            try:
                fn(*args)
            except Exception:  # keep the thread: later futures still have to complete
                logger.exception("emulated network: completing a future failed")


class Watchers:
    """Daemon threads that each wait for one gloo work and report when it finished (gloo's
    reduce-scatters have no future to hang a callback on). A thread starts only when all are busy.
    Not for send and receive: each wait consumes a completion, so the caller's would hang.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0

    def watch(self, work: dist.Work, done: Callable[[float, BaseException | None], None]) -> None:
        with self._lock:
            if self._idle == 0:
                threading.Thread(target=self._run, name="emulated-network-watch", daemon=True).start()
            else:
                self._idle -= 1
        self._queue.put((work, done))

    def _run(self) -> None:
        while True:
            work, done = self._queue.get()
            try:
                try:
                    work.wait()
                    error = None
                except BaseException as exc:  # the caller's own wait raises it; here it ends the watch
                    error = exc
                done(time.monotonic(), error)
            finally:
                del work, done
                with self._lock:
                    self._idle += 1
