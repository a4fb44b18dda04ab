"""Where the workers live: long-lived named Ray actors, or plain in-process objects with the same interface.

`Cluster` starts a local Ray (or joins `trainer.ray_address` / `RAY_ADDRESS`), creates one named actor
`dapo/<run_id>/<role>` (namespace `dapo`) per role (`rollout`, `actor`, `ref`, `critic`, `reward`) and hands
out `Handle`s; a task looks a worker up by run id and role (`Cluster.lookup`). `proxy(handle, ActorWorker)`
is typed as the worker class, so calls are checked against it (and block); `submit(...)` starts one without
waiting (a `Future`); `create_many` starts several workers at once. With `trainer.use_ray=False` the roles
are plain objects in this process. `shutdown()` kills only the actors this object created and stops Ray
only if it started it.

On CPU each actor asks for `num_cpus=1` and runs torch with one thread; on GPU the model-holding roles ask
for `num_gpus` each. `trainer.ray_resources.<role>` places a worker on nodes advertising a custom resource
(a request no live node can satisfy is a `DapoUserError`); `Cluster.placement` and `Cluster.workers` record
where each landed. Workers are quiet unless `DAPO_WORKER_LOGS=1`. More in
docs/ARCHITECTURE.md (Workers and Ray).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, ParamSpec, Self, TypeVar, cast

from dapo_core.errors import DapoUserError

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")
S = TypeVar("S")
P = ParamSpec("P")

NAMESPACE = "dapo"
_LOCAL_REGISTRY: dict[tuple[str, str], Handle] = {}
_REGISTRY_LOCK = threading.Lock()


def actor_name(run_id: str, role: str) -> str:
    """The Ray actor name of `role` in run `run_id`."""
    return f"dapo/{run_id}/{role}"


WORKER_LOGS_ENV = "DAPO_WORKER_LOGS"
"""Environment variable of the driver: `1` leaves the workers' info lines and progress bars on (the same
switch as `flows.progress.quiet_worker_noise`, which quiets the driver's own process)."""

QUIET_WORKER_ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TQDM_DISABLE": "1",
    "VLLM_LOGGING_LEVEL": "WARNING",
}
"""What a quiet worker process sets (unless the variable is already set on its node)."""


def quiet_worker_process() -> None:
    """Switch off per-worker info lines and progress bars in this worker process: the variables of
    `QUIET_WORKER_ENV` (read by libraries imported later), and transformers' and the HF hub's settings
    directly when they are already imported (unpickling a worker factory imports them)."""
    for key, value in QUIET_WORKER_ENV.items():
        os.environ.setdefault(key, value)
    if "transformers" in sys.modules and os.environ["TRANSFORMERS_VERBOSITY"] == "error":
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    if "huggingface_hub" in sys.modules and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


def worker_threads(num_threads: int, busy_at_once: int, device: str = "cpu", cores: int | None = None) -> int:
    """Torch threads for each worker process: `trainer.num_threads` when > 0 (the CPU default, 1: the numbers
    do not depend on the machine or on the caller's environment, which is never read). With 0, on CPU, the
    cores this process may run on (its affinity mask) are shared among the `busy_at_once` workers that compute
    at the same time: 1 in the sync step order (stages run one after another, so the busy worker gets every
    core), 2 in the replay-buffer order (generation overlaps the update). On GPU the workers keep one CPU
    thread each."""
    from dapo_core.compute.numerics import resolve_threads

    threads = resolve_threads(num_threads, busy_at_once, cores)
    return 1 if device != "cpu" else threads


@dataclass(frozen=True)
class HostOptions:
    """How a worker process is set up (`Cluster.host_options`)."""

    num_threads: int = 1
    """Torch threads (`worker_threads` picks them)."""
    verbose: bool = False
    """Keep the libraries' info lines and progress bars (`DAPO_WORKER_LOGS=1`)."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms (`trainer.deterministic`)."""
    free_cuda_cache: bool = False
    """Return the CUDA caching allocator's free blocks after every call (colocated GPUs: the next role on
    the device, e.g. a waking vLLM engine, gets them)."""


def _init_worker_process(opts: HostOptions) -> None:
    """Per-process set-up inside an actor: its torch threads and deterministic algorithms, quiet unless
    verbose. Deterministic cuBLAS needs a fixed workspace, set before CUDA starts."""
    if not opts.verbose:
        quiet_worker_process()
    os.environ.setdefault("OMP_NUM_THREADS", str(opts.num_threads))
    if opts.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    try:
        import torch

        torch.set_num_threads(opts.num_threads)
        torch.use_deterministic_algorithms(opts.deterministic)
    except ImportError:  # pragma: no cover - torch is a hard dependency
        pass


def free_cuda_cache() -> None:
    """Give the CUDA caching allocator's free blocks back to the device (no-op where CUDA never started)."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        import gc

        gc.collect()
        torch.cuda.empty_cache()


class _RayHost:
    """A generic Ray actor body: builds the worker object from a factory and forwards method calls to it."""

    def __init__(self, factory: Callable[[], Any], opts: HostOptions) -> None:
        _init_worker_process(opts)
        self._free_cuda_cache = opts.free_cuda_cache
        self._obj = factory()

    def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        import ray

        # ObjectRefs nested in the argument tuple are not resolved by Ray: fetch them here (worker-to-worker
        # data, see `chain`).
        args = tuple(ray.get(a) if isinstance(a, ray.ObjectRef) else a for a in args)
        kwargs = {k: ray.get(v) if isinstance(v, ray.ObjectRef) else v for k, v in kwargs.items()}
        try:
            return getattr(self._obj, method)(*args, **kwargs)
        finally:
            if self._free_cuda_cache:
                free_cuda_cache()

    def ping(self) -> str:
        return "ok"

    def memory(self) -> dict[str, Any]:
        """This worker process's resident memory, peak (`peak_rss_bytes`, VmHWM) and now (`rss_bytes`), and
        its CPU seconds so far (`cpu_s`)."""
        from dapo_core.compute.peak_memory import process_memory

        return process_memory()

    def where(self) -> dict[str, Any]:
        """The Ray node this worker runs on (its node id and address) and, when it holds GPUs, their ids on
        that node (`gpus`, as CUDA_VISIBLE_DEVICES names them)."""
        import ray

        here: dict[str, Any] = {
            "node_id": ray.get_runtime_context().get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
        }
        gpus = [str(i) for i in ray.get_gpu_ids()]
        if gpus:
            here["gpus"] = gpus
        return here


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

    def wait(self, ref: Any) -> Any:
        """Resolve a reference returned by `submit`."""
        if self.is_ray:
            return _ray_get(ref)
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

    def __init__(self, handle: Handle, ref: Any) -> None:
        self._handle = handle
        self._ref = ref

    def result(self) -> R:
        """Block until the call has finished and return its result (the worker's exception is raised here)."""
        return cast(R, self._handle.wait(self._ref))


class _RemoteMethod:
    """`<proxy>.<method>`: calling it runs the method on the worker and waits for the result."""

    def __init__(self, handle: Handle, name: str) -> None:
        self.handle = handle
        self.name = name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.handle.wait(self.handle.submit(self.name, *args, **kwargs))

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
    return Future(method.handle, method.handle.submit(method.name, *args, **kwargs))


RAY_BIND_ENV = "DAPO_RAY_BIND"
"""Environment variable: the address a *local* Ray listens on. Unset = loopback only (127.0.0.1); `all` =
Ray's own default (the machine's address, every interface for the gRPC servers); an IP = that address."""

WORKER_NICENESS_ENV = "DAPO_RAY_WORKER_NICENESS"
"""Environment variable: the nice value of Ray worker processes of a local Ray (default 0: the same priority
as the driver; Ray's own default, 15, starves the workers on a loaded machine)."""


def local_ray_options() -> dict[str, Any]:
    """Extra `ray.init` arguments for a local Ray: bind to loopback unless `DAPO_RAY_BIND` says otherwise, and
    run workers at normal priority (`DAPO_RAY_WORKER_NICENESS`, default 0).

    Loopback: Ray resolves its node address with `services.get_node_ip_address`, which returns 127.0.0.1 when
    `ray_constants.ENABLE_RAY_CLUSTER` is false (its macOS/Windows default). We set that flag (and its
    environment variable, read by the worker processes) so the GCS, raylet, object manager, runtime-env agent
    and every worker listen on 127.0.0.1 only; `_node_ip_address="127.0.0.1"` alone is not enough (Ray turns
    a loopback address back into the machine's address). Joining a cluster (`RAY_ADDRESS`) is unaffected.
    """
    import ray._private.ray_constants as ray_constants

    opts: dict[str, Any] = {}
    bind = os.environ.get(RAY_BIND_ENV, "").strip()
    if not bind or bind in ("127.0.0.1", "localhost", "loopback"):
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        ray_constants.ENABLE_RAY_CLUSTER = False
    elif bind != "all":
        opts["_node_ip_address"] = bind
    nice = int(os.environ.get(WORKER_NICENESS_ENV, "0"))
    opts["_system_config"] = {"worker_niceness": nice}
    return opts


RESOURCES_KEY = "trainer.ray_resources"
"""The config section that places each role's worker on nodes with Ray custom resources."""


class PlacementError(DapoUserError):
    """A worker's placement (`trainer.ray_resources.<role>`) is malformed or no node of the cluster can
    satisfy it."""


def checked_resources(role: str, resources: Mapping[str, Any] | None) -> dict[str, float]:
    """`resources` of worker `role` as {name: amount}, or a `PlacementError` naming the key and the fix.

    Amounts are finite numbers > 0; above 1 they must be whole (Ray's rule for resource quantities). The
    names CPU, GPU and memory are Ray's built-in resources and are set by the device, not here."""
    key = f"{RESOURCES_KEY}.{role}"
    out: dict[str, float] = {}
    for name, amount in (resources or {}).items():
        name = str(name)
        if name in ("CPU", "GPU", "memory", "object_store_memory"):
            raise PlacementError(
                f"{key} asks for the built-in Ray resource {name!r}",
                where=key,
                fix=(
                    "name a custom resource that the node advertises (ray start --resources "
                    "'{\"gen_node\": 1}'); CPUs and GPUs per worker follow trainer.device"
                ),
            )
        if isinstance(amount, bool) or not isinstance(amount, int | float) or not math.isfinite(amount):
            bad = f"{amount!r} is not a number"
        elif amount <= 0:
            bad = f"{amount!r} is not > 0"
        elif amount > 1 and amount != int(amount):
            bad = f"{amount!r} is above 1 and not a whole number (Ray's rule for resource amounts)"
        else:
            out[name] = float(amount)
            continue
        raise PlacementError(
            f"{key}.{name}: {bad}",
            where=key,
            fix=f"give the amount of resource {name!r} the {role} worker takes, e.g. {key}={{{name}: 1}}",
        )
    return out


def _node_summary(node: Mapping[str, Any]) -> str:
    """'192.0.2.2 (node 1a2b3c4d): CPU 2, gen_node 1' for an entry of `ray.nodes()`."""
    res = {
        k: v
        for k, v in node.get("Resources", {}).items()
        if not k.startswith("node:") and k not in ("memory", "object_store_memory")
    }
    listed = ", ".join(f"{k} {v:g}" for k, v in sorted(res.items())) or "no resources"
    return f"{node.get('NodeManagerAddress', '?')} (node {str(node.get('NodeID', '?'))[:8]}): {listed}"


def check_feasible(role: str, request: Mapping[str, float], nodes: list[Mapping[str, Any]]) -> None:
    """Raise `PlacementError` unless one live node of `nodes` (`ray.nodes()`) offers every resource of
    `request` in at least the asked amount. An infeasible actor would otherwise wait forever (Ray keeps it
    pending until such a node joins)."""
    alive = [n for n in nodes if n.get("Alive", True)]
    if any(all(n.get("Resources", {}).get(k, 0.0) >= v for k, v in request.items()) for n in alive):
        return
    custom = {k: v for k, v in request.items() if k not in ("CPU", "GPU")}
    asked = ", ".join(f"{k}={v:g}" for k, v in request.items())
    have = "; ".join(_node_summary(n) for n in alive) or "no live node"
    missing = [k for k in custom if not any(k in n.get("Resources", {}) for n in alive)]
    why = (
        f"no node of the cluster offers resource(s) {', '.join(repr(k) for k in missing)}"
        if missing
        else "no single node offers all of them in that amount"
    )
    raise PlacementError(
        f"worker '{role}' asks for {asked} ({RESOURCES_KEY}.{role}: {dict(custom) or '{}'}), but {why}; the "
        f"cluster's nodes: {have}",
        where=f"{RESOURCES_KEY}.{role}",
        fix=(
            f"start (or wait for) a node that offers them, e.g. infra/ray_cluster.sh join HEAD:PORT "
            f"--resources '{{\"{next(iter(custom), 'gen_node')}\": 1}}' (`ray status` lists what the "
            f"cluster has), or change {RESOURCES_KEY}.{role} (empty = any node)"
        ),
    )


class StopSignal(KeyboardInterrupt):
    """SIGTERM/SIGINT arrived while the driver waited on a Ray worker. Raised by `Handle.wait` (and worker
    creation) at the next safe point: Ray's blocking wait loses exceptions that signal handlers raise in it,
    so there the handler only records the signal and the wait loop raises this. A `KeyboardInterrupt`, so
    Prefect marks the flow run Crashed and `except Exception` blocks let it through."""

    def __init__(self, signum: int) -> None:
        import signal

        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_STOP_SIGNALS: list[int] = []
"""Signals recorded by the handler `Cluster` installs around a local Ray (first one wins)."""

_IN_RAY_WAIT: list[int] = []
"""Non-empty while the main thread blocks in `_ray_get` (a handler must not raise inside Ray's C++ wait:
the exception is lost, or surfaces as a SystemError)."""

_WAIT_POLL_S = 0.5
"""How often a wait on a Ray worker looks for a recorded stop signal."""


def _check_stop() -> None:
    """Raise `StopSignal` if a SIGTERM/SIGINT was recorded."""
    if _STOP_SIGNALS:
        raise StopSignal(_STOP_SIGNALS[0])


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
            return  # `_ray_get` raises StopSignal at its next poll
        if callable(handler):
            handler(signum, frame)
        else:
            raise StopSignal(signum)

    _STOP_SIGNALS.clear()
    signal.signal(signal.SIGTERM, record_then_chain)


@dataclass(frozen=True)
class WorkerSpec:
    """One worker for `Cluster.create_many`: its role, zero-argument factory and what it asks Ray for."""

    role: str
    factory: Callable[[], Any]
    num_gpus: float = 0.0
    num_cpus: float = 1.0
    resources: Mapping[str, Any] | None = None
    scheduling_strategy: Any = None


class Cluster:
    """Start or join Ray and own the named worker actors of one run.

    Parameters: `run_id`; `use_ray` (False = in-process workers); `address` (a Ray address to join; None =
    `RAY_ADDRESS` or start a local Ray); `num_cpus` for a local Ray; `device` ("cpu" | "cuda");
    `num_threads` torch threads per worker process and `deterministic` algorithms on or off in each (without
    Ray: in this process, restored by `shutdown`).
    """

    def __init__(
        self,
        run_id: str,
        *,
        use_ray: bool = True,
        address: str | None = None,
        num_cpus: int | None = None,
        device: str = "cpu",
        num_threads: int = 1,
        deterministic: bool = False,
        start_timeout_s: float = 600.0,
    ) -> None:
        self.run_id = run_id
        self.use_ray = use_ray
        self.placement: dict[str, dict[str, Any]] = {}
        """Where each Ray worker runs: role -> {"node_id", "node_ip"} (of rank 0 for a group; empty for
        in-process workers)."""
        self.workers: list[dict[str, Any]] = []
        """Every rank of every role: {"role", "rank", "node_id", "node_ip"} ("in-process" without Ray), and
        `gpus` for a worker holding GPUs."""
        self.pool: Any = None
        """The colocated `DevicePool` the workers share (GPU fsdp2 runs), released by `shutdown`."""
        self.device = device
        self.num_threads = num_threads
        self.deterministic = deterministic
        self._restore_numerics: tuple[int, bool] | None = None
        self._started_ray = False
        self._owned: dict[str, Handle] = {}
        self.start_timeout_s = start_timeout_s
        if not use_ray:  # the workers compute in this process: give it their numerics
            if deterministic:
                os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            import torch

            self._restore_numerics = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())
            torch.set_num_threads(num_threads)
            torch.use_deterministic_algorithms(deterministic)
        if use_ray:
            import ray

            address = address or os.environ.get("RAY_ADDRESS")
            if not ray.is_initialized():
                if address:
                    ray.init(address=address, namespace=NAMESPACE, log_to_driver=True)
                else:
                    # Logical CPUs: every worker (rollout, actor, reward, ref, critic) holds one for its
                    # lifetime, even on a 2-core machine, where the sync step order runs them one after
                    # another.
                    ncpu = num_cpus or max(8, os.cpu_count() or 2)
                    kwargs = local_ray_options()
                    sigterm = _main_thread_sigterm_handler()
                    ray.init(
                        num_cpus=ncpu,
                        include_dashboard=False,
                        namespace=NAMESPACE,
                        log_to_driver=True,
                        configure_logging=False,
                        **kwargs,
                    )
                    _restore_sigterm_handler(sigterm)
                    self._started_ray = True

    def create(
        self,
        role: str,
        factory: Callable[[], Any],
        *,
        num_gpus: float = 0.0,
        num_cpus: float = 1.0,
        resources: Mapping[str, Any] | None = None,
        scheduling_strategy: Any = None,
    ) -> Handle:
        """Create the worker `role` from a zero-argument `factory` (a picklable callable) and return its
        handle. `resources`: Ray custom resources the worker asks for (`trainer.ray_resources.<role>`), which
        puts it on a node that advertises them; ignored for in-process workers. `scheduling_strategy`: a
        placement-group bundle to run in (a colocated pool's GPU, `dapo_core.compute.pools`).

        An existing actor of the same name (e.g. left by a crashed driver) is killed and replaced, so a
        resumed run never talks to a worker holding stale weights. A placement no live node can satisfy
        raises `PlacementError` before anything is started.
        """
        return self.create_many(
            [
                WorkerSpec(
                    role,
                    factory,
                    num_gpus=num_gpus,
                    num_cpus=num_cpus,
                    resources=resources,
                    scheduling_strategy=scheduling_strategy,
                )
            ]
        )[0]

    def create_many(self, specs: list[WorkerSpec]) -> list[Handle]:
        """`create` for several workers at once: under Ray every actor is started before any is waited
        for, so their construction (model loads) runs in parallel; the handles come back in `specs`' order.
        A worker that fails to start kills the others started here."""
        if not self.use_ray:
            return [self._create_local(s) for s in specs]
        import ray

        started: list[tuple[WorkerSpec, Any]] = []
        try:
            for spec in specs:
                started.append((spec, self._launch(spec)))
            return [self._confirm(spec, actor) for spec, actor in started]
        except BaseException:
            for _, actor in started:
                with contextlib.suppress(Exception):
                    ray.kill(actor)
            raise

    def _create_local(self, spec: WorkerSpec) -> Handle:
        custom = checked_resources(spec.role, spec.resources)
        if custom:
            log.warning(
                "%s.%s is ignored: trainer.use_ray=false runs every worker in this process",
                RESOURCES_KEY,
                spec.role,
            )
        handle = Handle(role=spec.role, local=spec.factory())
        self.workers.append({"role": spec.role, "rank": 0, "node_id": "in-process", "node_ip": None})
        with _REGISTRY_LOCK:
            _LOCAL_REGISTRY[(self.run_id, spec.role)] = handle
        self._owned[spec.role] = handle
        return handle

    def _launch(self, spec: WorkerSpec) -> Any:
        """Start the Ray actor of `spec` (replacing a stale one of the same name) without waiting for it."""
        import ray

        custom = checked_resources(spec.role, spec.resources)
        request = {"CPU": float(spec.num_cpus), **({"GPU": float(spec.num_gpus)} if spec.num_gpus else {})}
        request.update(custom)
        if spec.scheduling_strategy is None:  # a bundle already holds what it asks for
            check_feasible(spec.role, request, ray.nodes())
        name = actor_name(self.run_id, spec.role)
        try:
            stale = ray.get_actor(name, namespace=NAMESPACE)
            log.warning("replacing existing actor %s", name)
            ray.kill(stale)
        except ValueError:
            pass
        remote_cls: Any = ray.remote(_RayHost)
        return remote_cls.options(
            name=name,
            namespace=NAMESPACE,
            num_cpus=spec.num_cpus,
            num_gpus=spec.num_gpus,
            resources=(custom or None) if spec.scheduling_strategy is None else None,
            max_concurrency=1,
            scheduling_strategy=spec.scheduling_strategy,
        ).remote(spec.factory, self.host_options())

    def _confirm(self, spec: WorkerSpec, actor: Any) -> Handle:
        """Wait for a launched actor's construction and record where it runs."""
        import ray

        role = spec.role
        try:  # construction errors surface here, with the role in the traceback
            _ray_get(actor.ping.remote(), timeout=self.start_timeout_s)
        except TimeoutError:
            ray.kill(actor)
            custom = checked_resources(role, spec.resources)
            raise PlacementError(
                f"worker '{role}' of run {self.run_id} did not start within {self.start_timeout_s:.0f}s; it "
                f"asked for num_cpus={spec.num_cpus}, num_gpus={spec.num_gpus}, resources={custom} "
                f"({RESOURCES_KEY}.{role}) and the cluster has {ray.available_resources()} free",
                fix=(
                    "free resources (other runs' workers hold them), or start Ray with more "
                    "(RAY_ADDRESS / ray start --num-cpus / --resources, infra/ray_cluster.sh)"
                ),
            ) from None
        self.placement[role] = _ray_get(actor.where.remote(), timeout=self.start_timeout_s)
        self.workers.append({"role": role, "rank": 0, **self.placement[role]})
        log.info("worker %s runs on node %s (%s)", role, self.placement[role]["node_id"][:8], actor)
        handle = Handle(role=role, ray_actor=actor)
        self._owned[role] = handle
        return handle

    def host_options(self) -> HostOptions:
        """The set-up of this run's worker processes."""
        return HostOptions(
            num_threads=self.num_threads,
            verbose=os.environ.get(WORKER_LOGS_ENV) == "1",
            deterministic=self.deterministic,
            free_cuda_cache=self.pool is not None,
        )

    def own(self, role: str, handle: Handle) -> None:
        """Take `handle` (e.g. a worker group's) into the workers `shutdown` kills."""
        self._owned[role] = handle

    @staticmethod
    def lookup(run_id: str, role: str) -> Handle:
        """Find a worker by run id and role from any process of the run (Ray) or this process (local)."""
        with _REGISTRY_LOCK:
            if (run_id, role) in _LOCAL_REGISTRY:
                return _LOCAL_REGISTRY[(run_id, role)]
        import ray

        if not ray.is_initialized():
            raise RuntimeError(
                f"worker '{role}' of run {run_id} is not in this process and Ray is not initialised"
            )
        return Handle(role=role, ray_actor=ray.get_actor(actor_name(run_id, role), namespace=NAMESPACE))

    def memory_report(self, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """The resident memory of every Ray worker process this object owns: one `{"role", "rank",
        "peak_rss_bytes", "rss_bytes", "cpu_s"}` per process (a group's ranks each), in creation order. Empty
        without Ray (the workers are this process). A worker that does not answer within `timeout_s` is
        left out with a warning."""
        out: list[dict[str, Any]] = []
        if not self.use_ray:
            return out
        for role, handle in self._owned.items():
            actors = list(getattr(handle, "ranks", None) or ([handle.ray_actor] if handle.is_ray else []))
            for rank, actor in enumerate(actors):
                try:
                    mem = _ray_get(actor.memory.remote(), timeout=timeout_s)
                except Exception as exc:  # a dead or stuck worker must not fail the end of a run
                    log.warning("no memory figure from %s rank %d: %s", role, rank, exc)
                    continue
                out.append({"role": role, "rank": rank, **mem})
        return out

    def shutdown(self) -> None:
        """Kill the actors this object created; stop Ray only if this object started it."""
        for role, handle in list(self._owned.items()):
            if handle.is_ray:
                try:
                    handle.kill()
                except Exception as exc:
                    log.warning("could not kill %s: %s", role, exc)
            else:
                close = getattr(handle.local, "close", None)
                if callable(close):
                    close()
            with _REGISTRY_LOCK:
                _LOCAL_REGISTRY.pop((self.run_id, role), None)
        self._owned.clear()
        if self.pool is not None:
            self.pool.kill()
            self.pool = None
        if self._restore_numerics is not None:
            import torch

            torch.set_num_threads(self._restore_numerics[0])
            torch.use_deterministic_algorithms(self._restore_numerics[1])
            self._restore_numerics = None
        if self._started_ray:
            import ray

            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
