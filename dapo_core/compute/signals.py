"""Stopping the driver at SIGTERM/SIGINT while it waits on Ray workers.

`ray.init` installs a SIGTERM handler that kills Ray's processes and calls `sys.exit(1)` in the middle of
whatever runs; `Cluster` (`dapo_core.compute.cluster`) replaces it with one that records the signal and
chains to the handler that was there before. A signal handler must not raise inside Ray's blocking wait (the
exception is lost), so every wait on a worker polls (`_ray_get`) and raises `StopRequested` at the next poll
once a signal was recorded.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from dapo_core.errors import StopRequested

_STOP_SIGNALS: list[int] = []
"""Signals recorded by the handler `Cluster` installs after `ray.init`, local or joined (first one wins)."""

_IN_RAY_WAIT: list[int] = []
"""Non-empty while the main thread blocks in `_ray_get` (a handler must not raise inside Ray's C++ wait:
the exception is lost, or surfaces as a SystemError)."""

_WAIT_POLL_S = 0.5
"""How often a wait on a Ray worker looks for a recorded stop signal."""


def _check_stop() -> None:
    """Raise `StopRequested` if a SIGTERM/SIGINT was recorded."""
    if _STOP_SIGNALS:
        raise StopRequested(_STOP_SIGNALS[0])


def _ray_get(ref: Any, timeout: float | None = None) -> Any:
    """`ray.get(ref)` that gives up at a recorded stop signal (polls with `ray.wait`)."""
    import ray

    t0 = time.monotonic()
    _IN_RAY_WAIT.append(1)
    try:
        while True:
            _check_stop()
            ready, _ = ray.wait([ref], timeout=_WAIT_POLL_S)
            if ready:
                _check_stop()
                return ray.get(ready[0])
            if timeout is not None and time.monotonic() - t0 > timeout:
                raise TimeoutError(f"no result within {timeout:.0f}s")
    finally:
        _IN_RAY_WAIT.pop()


def _main_thread_sigterm_handler() -> Any:
    """The SIGTERM handler installed now (None off the main thread, where it cannot be changed)."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.getsignal(signal.SIGTERM)


def _restore_sigterm_handler(handler: Any) -> None:
    """Replace the SIGTERM handler `ray.init` installed (it kills Ray's processes and calls `sys.exit(1)` in
    the middle of whatever runs) by one that records the signal for `Handle.wait` and then calls the handler
    that was there before (Prefect's, which raises inside the flow; the `dapo` CLI's outside it). With the
    default handler before, the recorded signal alone stops the run at the next wait. Main thread only."""
    import signal

    if threading.current_thread() is not threading.main_thread():
        return

    def record_then_chain(signum: int, frame: Any) -> None:
        if not _STOP_SIGNALS:
            _STOP_SIGNALS.append(signum)
        if _IN_RAY_WAIT:
            return  # `_ray_get` raises StopRequested at its next poll
        if callable(handler):
            handler(signum, frame)
        else:
            raise StopRequested(signum)

    _STOP_SIGNALS.clear()
    signal.signal(signal.SIGTERM, record_then_chain)
