"""The call machinery between the driver and its workers: handles, typed proxies and futures.

A `Handle` starts a method, by name, on a Ray actor (`dapo_core.compute.host._RayHost`) or on an in-process
object and resolves the result (a wait on Ray gives up at a recorded stop signal,
`dapo_core.compute.signals`, and after the handle's `timeout_s`, `trainer.stage_timeout_s`, with
`WorkerHung`; an in-process call cannot time out: it runs in the caller). `proxy(handle, ActorWorker)` is
typed as the worker class, so calls are checked against it (and block); `submit(...)` starts one without
waiting (a `Future`). `Cluster` (`dapo_core.compute.cluster`) creates the workers and hands out their handles.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, ParamSpec, TypeVar, cast

from dapo_core.compute.signals import _ray_get
from dapo_core.errors import DapoUserError

T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")


class WorkerHung(DapoUserError, TimeoutError):
    """A call to a Ray worker made no progress (did not return) within its handle's `timeout_s`
    (`trainer.stage_timeout_s`): a hung collective, a rank stuck in I/O. The worker is left as it is; the
    caller decides (the training flow kills and restarts the run's workers)."""

    def __init__(self, role: str, method: str, timeout_s: float) -> None:
        super().__init__(
            f"worker '{role}' did not return from {method} within {timeout_s:g}s (trainer.stage_timeout_s)",
            fix="find what it waits for (a hung collective, a stuck disk), or raise trainer.stage_timeout_s",
        )
        self.role = role
        self.method = method
        self.timeout_s = timeout_s


@dataclass
class Handle:
    """The untyped plumbing under a worker proxy: starts a method, by name, on a Ray actor (`ray_actor`) or on
    a local object (`local`). Use `proxy(handle, WorkerClass)` rather than naming methods by string.

    `submit` returns a reference to the result (a Ray ObjectRef, or the value already computed in-process) and
    `wait` resolves it.
    """

    role: str
    ray_actor: Any = None
    local: Any = None
    timeout_s: float | None = None
    """How long `wait` waits for a Ray worker's result before raising `WorkerHung` (None: for ever; the
    `Cluster` sets `trainer.stage_timeout_s` on the handles it owns)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def is_ray(self) -> bool:
        return self.ray_actor is not None

    def submit(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Start `method` and return a reference to its result (Ray ObjectRef, or the value in-process)."""
        if self.is_ray:
            return self.ray_actor.call.remote(method, args, kwargs)
        with self._lock:  # in-process workers are not thread-safe; serialise calls like an actor would
            return getattr(self.local, method)(*args, **kwargs)

    def wait(self, ref: Any, method: str = "a call") -> Any:
        """Resolve a reference returned by `submit` (of `method`, named in a `WorkerHung`)."""
        if self.is_ray:
            try:
                return _ray_get(ref, timeout=self.timeout_s)
            except TimeoutError as exc:
                if self.timeout_s is None or type(exc) is not TimeoutError:  # the worker's own error
                    raise
                raise WorkerHung(self.role, method, self.timeout_s) from None
        return ref

    def passable(self, ref: Any) -> Any:
        """The Ray ObjectRef of a `submit` result to hand to another actor (`chain`)."""
        return ref

    def kill(self) -> None:
        """Kill the Ray actor(s) behind this handle."""
        import ray

        ray.kill(self.ray_actor)


class Future(Generic[R]):
    """The pending result of a worker call started with `submit`; `result()` waits for it."""

    def __init__(self, handle: Handle, ref: Any, method: str = "a call") -> None:
        self._handle = handle
        self._ref = ref
        self._method = method

    def result(self) -> R:
        """Block until the call has finished and return its result (the worker's exception is raised here; a
        Ray worker that does not return within the handle's `timeout_s` is a `WorkerHung`)."""
        return cast(R, self._handle.wait(self._ref, self._method))


class _RemoteMethod:
    """`<proxy>.<method>`: calling it runs the method on the worker and waits for the result."""

    def __init__(self, handle: Handle, name: str) -> None:
        self.handle = handle
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.handle.wait(self.handle.submit(self.name, *args, **kwargs), self.name)

    def __repr__(self) -> str:
        return f"<method {self.name} of worker '{self.handle.role}'>"


class _WorkerProxy:
    """Stands for a worker of class `cls` behind `handle`: attribute `m` is a blocking remote `cls.m`."""

    def __init__(self, handle: Handle, cls: type) -> None:
        self._handle = handle
        self._cls = cls

    def __getattr__(self, name: str) -> _RemoteMethod:
        if name.startswith("_"):  # private names, and the copy/pickle protocol, are not forwarded
            raise AttributeError(name)
        if not callable(getattr(self._cls, name, None)):
            raise AttributeError(
                f"worker '{self._handle.role}' ({self._cls.__name__}) has no method {name!r}; only "
                f"methods of {self._cls.__name__} can be called through its proxy"
            )
        return _RemoteMethod(self._handle, name)

    def __repr__(self) -> str:
        return f"<{self._cls.__name__} proxy of worker '{self._handle.role}'>"


def proxy(handle: Handle, cls: type[T]) -> T:
    """The worker behind `handle`, typed as `cls`: `proxy(h, ActorWorker).update_actor(table, 3)` runs
    `ActorWorker.update_actor` on the worker (Ray actor or in-process object), waits and returns its result.

    Arguments that are Ray ObjectRefs are resolved inside the actor (worker-to-worker data, see `chain`).
    """
    return cast(T, _WorkerProxy(handle, cls))


def handle_of(worker: Any) -> Handle:
    """The handle behind a worker proxy (`proxy`)."""
    if not isinstance(worker, _WorkerProxy):
        raise TypeError(f"handle_of() takes a worker proxy, not {worker!r}")
    return worker._handle


def group_size(worker: Any) -> int:
    """How many processes a worker proxy's calls run on: the ranks of a worker group, else 1."""
    return len(getattr(handle_of(worker), "ranks", None) or [None])


def submit(method: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> Future[R]:
    """Start a worker call without waiting: `fut = submit(rollout.generate, table, gen_step)`, later
    `fut.result()`. A Ray actor runs it while the driver goes on; an in-process worker computes it here, at
    submission (nothing overlaps). `method` must be a method of a `proxy`."""
    if not isinstance(method, _RemoteMethod):
        raise TypeError(
            f"submit() takes a method of a worker proxy (e.g. rt.rollout.generate), not {method!r}"
        )
    return Future(method.handle, method.handle.submit(method.name, *args, **kwargs), method.name)
