"""The worker process: how a Ray actor that holds a worker object is set up, and its generic actor body.

`_RayHost` is the Ray actor class of every single-process worker (`dapo_core.compute.cluster` starts it;
`dapo_core.compute.groups` subclasses it for the ranks of a group): it sets up its process
(`HostOptions`: torch threads, deterministic algorithms, quiet libraries unless `DAPO_WORKER_LOGS=1`), builds
the worker object from a factory and runs the method calls that `dapo_core.compute.rpc.Handle` sends it.
`worker_threads` picks the torch threads of each worker process.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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
