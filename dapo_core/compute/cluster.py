"""Where the workers live: long-lived named Ray actors, or plain in-process objects with the same interface.

`Cluster` starts a local Ray (or joins `trainer.ray_address` / `RAY_ADDRESS`), creates one named actor
`dapo/<run_id>/<role>` (namespace `dapo`) per role (`rollout`, `actor`, `ref`, `critic`, `reward`) and hands
out `Handle`s; a task looks a worker up by run id and role (`Cluster.lookup`). `proxy(handle, ActorWorker)`
is typed as the worker class, so calls are checked against it (and block); `submit(...)` starts one without
waiting (a `Future`); `create_many` starts several workers at once. With `trainer.use_ray=False` the roles
are plain objects in this process. `shutdown()` kills only the actors this object created and stops Ray
only if it started it; `kill_workers()` kills them and keeps Ray, so a restarted run can start new ones (a
hung worker too: Ray kills its process). `stage_timeout_s` bounds every wait on a Ray worker of this object
(`WorkerHung`). The call machinery (`Handle`, `proxy`, `submit`, `Future`) is
`dapo_core.compute.rpc`; the worker process's set-up is `dapo_core.compute.host`.

On CPU each actor asks for `num_cpus=1` and runs torch with one thread; on GPU the model-holding roles ask
for `num_gpus` each. `trainer.ray_resources.<role>` places a worker on nodes advertising a custom resource
(a request no live node can satisfy is a `DapoUserError`); `Cluster.placement` and `Cluster.workers` record
where each landed. Workers are quiet unless `DAPO_WORKER_LOGS=1`. More in
docs/ARCHITECTURE.md (Workers and Ray).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Self, TypeVar

from dapo_core.compute.host import WORKER_LOGS_ENV, HostOptions, _RayHost
from dapo_core.compute.placement import RESOURCES_KEY, PlacementError, check_feasible, checked_resources
from dapo_core.compute.rpc import Handle
from dapo_core.compute.signals import _main_thread_sigterm_handler, _ray_get, _restore_sigterm_handler

log = logging.getLogger(__name__)

T = TypeVar("T")

NAMESPACE = "dapo"
_LOCAL_REGISTRY: dict[tuple[str, str], Handle] = {}
_REGISTRY_LOCK = threading.Lock()


def actor_name(run_id: str, role: str) -> str:
    """The Ray actor name of `role` in run `run_id`."""
    return f"dapo/{run_id}/{role}"


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
    Ray: in this process, restored by `shutdown`); `start_timeout_s`, how long a new worker may take to be
    placed and built (`PlacementError` after it); `stage_timeout_s`, how long a call to one of its Ray
    workers may go without returning (`WorkerHung` after it; None or 0: no limit; in-process calls have none).
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
        stage_timeout_s: float | None = None,
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
        self.stage_timeout_s = stage_timeout_s or None
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
                sigterm = _main_thread_sigterm_handler()  # `ray.init` replaces it, joining or starting
                if address:
                    ray.init(address=address, namespace=NAMESPACE, log_to_driver=True)
                else:
                    # Logical CPUs: every worker (rollout, actor, reward, ref, critic) holds one for its
                    # lifetime, even on a 2-core machine, where the sync step order runs them one after
                    # another.
                    ncpu = num_cpus or max(8, os.cpu_count() or 2)
                    kwargs = local_ray_options()
                    ray.init(
                        num_cpus=ncpu,
                        include_dashboard=False,
                        namespace=NAMESPACE,
                        log_to_driver=True,
                        configure_logging=False,
                        **kwargs,
                    )
                    self._started_ray = True
                _restore_sigterm_handler(sigterm)

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
        self.own(role, handle)
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
        """Take `handle` (e.g. a worker group's) into the workers `shutdown` kills; a Ray worker's calls get
        this cluster's `stage_timeout_s`."""
        if handle.is_ray:
            handle.timeout_s = self.stage_timeout_s
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

    def dead_workers(self, timeout_s: float = 15.0) -> list[BaseException]:
        """Ray's actor-died errors of the workers this object owns that are dead (each rank of a group on its
        own), from a ping to each, waited for at most `timeout_s` in all (one that does not answer in time
        counts as alive). Empty without Ray. A rank that failed a collective because a peer died says so
        only as its own error; this names the dead peer."""
        if not self.use_ray:
            return []
        import ray
        from ray.exceptions import RayActorError

        dead: list[BaseException] = []
        refs = []
        for handle in self._owned.values():
            ranks = getattr(handle, "ranks", None) or ([handle.ray_actor] if handle.is_ray else [])
            for actor in list(ranks):
                try:
                    refs.append(actor.ping.remote())
                except RayActorError as exc:
                    dead.append(exc)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        for ref in ready:
            try:
                ray.get(ref)
            except RayActorError as exc:
                dead.append(exc)
            except Exception as exc:  # a worker that answers with an error is alive
                log.debug("ping: %s", exc)
        return dead

    @property
    def started_ray(self) -> bool:
        """Whether this object started the (local) Ray it uses, rather than joining a cluster."""
        return self._started_ray

    def kill_workers(self, free_within_s: float = 30.0) -> None:
        """Kill the workers this object created (dead, hung or well: Ray kills the process) and release the
        colocated pool, keeping Ray up so that new workers can start in their place (their records in
        `workers` and `placement` are cleared); waits up to `free_within_s` for the actor names to be free."""
        names = self._kill_owned()
        self.placement.clear()
        self.workers.clear()
        _await_names_free(names, free_within_s)

    def shutdown(self) -> None:
        """Kill the actors this object created; stop Ray only if this object started it."""
        self._kill_owned()
        if self._restore_numerics is not None:
            import torch

            torch.set_num_threads(self._restore_numerics[0])
            torch.use_deterministic_algorithms(self._restore_numerics[1])
            self._restore_numerics = None
        if self._started_ray:
            import ray

            ray.shutdown()
            self._started_ray = False

    def _kill_owned(self) -> list[str]:
        """Kill the Ray actors (close the in-process workers) this object owns and its pool; returns the
        killed actors' names."""
        names: list[str] = []
        for role, handle in list(self._owned.items()):
            if handle.is_ray:
                ranks = getattr(handle, "ranks", None)
                base = actor_name(self.run_id, role)
                names += [f"{base}/{i}" for i in range(len(ranks))] if ranks else [base]
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
        return names

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def start_when_placed(
    start: Callable[[float], T],
    wait_s: float,
    *,
    what: str,
    nodes: Callable[[], list[Mapping[str, Any]]],
    clean_up: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    poll_s: float = 1.0,
) -> T:
    """`start(seconds_left)`, which starts workers within the seconds it is given, once the cluster can place
    them, waiting up to `wait_s` seconds in all (`trainer.restart_wait_s`; `what` names the waiter, e.g. "the
    restart of run X"). While `start` raises `PlacementError` (no live node offers what a worker asks for: its
    node is gone, or the one that would fit has not joined), log one paragraph saying what it waits for (the
    error names the role, the resources and the live nodes) and for how long, call `clean_up` (kill what was
    started), and try again once the live nodes (`nodes()`, `ray.nodes()`'s entries) or what they offer
    change. When the time runs out, a `PlacementError` paragraph says what was waited for and how long."""
    deadline = clock() + wait_s
    said = ""
    while True:
        try:
            return start(max(deadline - clock(), 1.0))
        except PlacementError as exc:
            clean_up()
            seen = _capacity(nodes())
            left = deadline - clock()
            if left <= 0:
                raise PlacementError(
                    f"{what} found no room for its workers within trainer.restart_wait_s={wait_s:g}s: "
                    f"{exc.what.rstrip('.')}; the run ends here",
                    where=exc.where,
                    fix=f"{exc.fix.rstrip('.') or 'add capacity'}, then resume with the same command and run "
                    "id (or raise trainer.restart_wait_s)",
                ) from None
            if exc.what != said:
                said = exc.what
                log.warning(
                    "%s waits up to %.0fs more (trainer.restart_wait_s) for capacity: %s. It goes on as soon "
                    "as the cluster can place it (%s)",
                    what,
                    left,
                    exc.what.rstrip("."),
                    exc.fix.rstrip(".") or "add a node",
                )
            while clock() < deadline and _capacity(nodes()) == seen:
                sleep(poll_s)


def _capacity(nodes: list[Mapping[str, Any]]) -> frozenset[tuple[str, frozenset[tuple[str, float]]]]:
    """What the live nodes offer: (node id, its total resources) for each."""
    return frozenset(
        (str(n.get("NodeID", "")), frozenset((k, float(v)) for k, v in n.get("Resources", {}).items()))
        for n in nodes
        if n.get("Alive", True)
    )


def _await_names_free(names: list[str], timeout_s: float) -> None:
    """Wait until no live actor holds any of `names` (after `ray.kill`), for at most `timeout_s`."""
    import ray

    deadline = time.monotonic() + timeout_s
    for name in names:
        while time.monotonic() < deadline:
            try:
                ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:
                break
            time.sleep(0.2)
