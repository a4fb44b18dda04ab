"""`dapo submit`: send a training run to a Ray cluster's job server, so its driver runs on the cluster.

The job's entrypoint is `python -m flows.cli train ... trainer.experiment_name=<run_id>`, the run id fixed
here, so the submitting shell may close: logs, status and stop go through Ray's own job commands (`ray job
logs|status|stop`), and `dapo submit --resume <run_id>` (the same config and overrides) resumes a stopped run
under the same id. The job carries a runtime environment: the checkout as `working_dir` (uploaded without
`WORKING_DIR_EXCLUDES`), or none with `--installed` (the package and the config are on every node); the
variables of `FORWARDED_ENV` that are set here, and each `--env K=V`. Relative paths of the config
(`PATH_KEYS`) are resolved against the submitting shell's directory, as `dapo train` would, and passed as
overrides: runs, models and data must be at those paths on every node (a shared filesystem).

Before anything is submitted the config is loaded and validated, the job server must answer, and no job of
the same run may be pending or running; each refusal is one paragraph (`DapoUserError`).
"""

from __future__ import annotations

import contextlib
import os
import shlex
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from dapo_core.errors import DapoUserError

__all__ = [
    "FORWARDED_ENV",
    "PATH_KEYS",
    "WORKING_DIR_EXCLUDES",
    "Submission",
    "build_submission",
    "job_server_address",
    "submit",
]

FORWARDED_ENV = (
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "HF_DATASETS_OFFLINE",
    "PREFECT_API_URL",
    "DAPO_WORKER_LOGS",
    "DAPO_DEBUG",
)
"""Variables of the submitting shell the job's driver and workers get when they are set here."""

WORKING_DIR_EXCLUDES = [
    ".git",
    ".venv*",
    "/runs/",
    "/models/",
    "/data/",
    "/metrics/",
    "/bench/out/",
    ".dvc/cache",
    ".dvc/tmp",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
    ".hypothesis",
    ".import_linter_cache",
    ".prefect",
    "__pycache__",
    "*.egg-info",
    "*.log",
]
"""What the uploaded checkout leaves out (gitignore syntax, from its root): environments, run stores, models,
data, caches. Ray also honours the checkout's `.gitignore` and a `.rayignore`."""

PATH_KEYS = (
    "trainer.runs_dir",
    "trainer.models_dir",
    "data.synthetic.out_dir",
    "data.train_files",
    "data.val_files",
    "eval.files",
    "eval.output",
    "eval.checkpoint",
    "trainer.resume_from_path",
)
"""Config keys holding filesystem paths: a relative value is made absolute against the submitting shell's
directory. `actor_rollout_ref.model.path` and `.tokenizer_path` are too when the relative path exists here
(otherwise they may be a hub name)."""

MAYBE_PATH_KEYS = ("actor_rollout_ref.model.path", "actor_rollout_ref.model.tokenizer_path")

ADDRESS_ENV = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")
"""Where the job server's address comes from without `--address`, in this order (as Ray's job CLI)."""

ACTIVE = ("PENDING", "RUNNING")
"""Ray job states of a job that may still write its run."""


def job_server_address(explicit: str | None) -> str:
    """`explicit`, else `RAY_API_SERVER_ADDRESS`, else `RAY_ADDRESS`; a `DapoUserError` when none is set
    (Ray's own fallback, a cluster found on this machine, could be someone else's)."""
    for value in (explicit, *(os.environ.get(k) for k in ADDRESS_ENV)):
        if value and value.strip():
            return value.strip()
    raise DapoUserError(
        "dapo submit needs the address of a Ray cluster's job server and none is given",
        where="--address, RAY_API_SERVER_ADDRESS, RAY_ADDRESS",
        fix="pass --address http://<head-node>:8265 (the dashboard URL `ray start --head` prints), or export "
        "RAY_API_SERVER_ADDRESS; the head must run the dashboard (ray start --head --include-dashboard=true, "
        "which needs ray[default])",
    )


@contextlib.contextmanager
def _without_address_env() -> Iterator[None]:
    """Hide `ADDRESS_ENV` while a client is built: Ray lets them override an explicit address."""
    saved = {k: os.environ.pop(k) for k in ADDRESS_ENV if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def connect(address: str) -> Any:
    """A `JobSubmissionClient` of the job server at `address`, or a `DapoUserError` when it does not
    answer."""
    from ray.job_submission import JobSubmissionClient

    try:
        with _without_address_env():
            return JobSubmissionClient(address)
    except Exception as exc:  # ConnectionError, an unreachable GCS, a refused token: all the same to the user
        reason = " ".join(str(exc).split())[:300]
        raise DapoUserError(
            f"no Ray job server answers at {address} ({type(exc).__name__}: {reason}); nothing was submitted",
            where="--address / RAY_API_SERVER_ADDRESS / RAY_ADDRESS",
            fix="give the head node's dashboard URL (http://<head>:8265, `ray start --head "
            "--include-dashboard=true --dashboard-host=0.0.0.0`), check the head is up (`ray status`) and, "
            "with token auth, export the cluster's RAY_AUTH_MODE=token and RAY_AUTH_TOKEN",
        ) from None


def _absolute(value: str, base: Path) -> str:
    return value if not value or os.path.isabs(value) or "://" in value else str(base / value)


def path_overrides(cfg: DictConfig, base: Path) -> list[str]:
    """Overrides that make every relative filesystem path of `cfg` (`PATH_KEYS`, `MAYBE_PATH_KEYS` when the
    path exists under `base`) absolute against `base`."""
    out: list[str] = []
    for key in (*PATH_KEYS, *MAYBE_PATH_KEYS):
        value = OmegaConf.select(cfg, key, default=None)
        if value is None:
            continue
        if isinstance(value, str):
            if key in MAYBE_PATH_KEYS and not (value and (base / value).exists()):
                continue
            new = _absolute(value, base)
            if new != value:
                out.append(f"{key}={new}")
        elif OmegaConf.is_list(value):
            items = [str(v) for v in value]
            new_items = [_absolute(v, base) for v in items]
            if new_items != items:
                out.append(f"{key}=[{','.join(new_items)}]")
    return out


def _parse_env(pairs: Sequence[str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key or not key.replace("_", "a").isalnum() or key[0].isdigit():
            raise DapoUserError(
                f"--env {pair!r} is not NAME=VALUE",
                where="dapo submit --env",
                fix="write --env NCCL_SOCKET_IFNAME=eth0 (a variable name, '=', its value)",
            )
        env[key] = value
    return env


@dataclass
class Submission:
    """What `dapo submit` sends: the job's id, run id, entrypoint, runtime environment and metadata."""

    submission_id: str
    run_id: str
    entrypoint: str
    runtime_env: dict[str, Any]
    metadata: dict[str, str] = field(default_factory=dict)


def build_submission(
    *,
    config: str,
    overrides: Sequence[str],
    cfg: DictConfig,
    run_id: str,
    flow_only: bool,
    installed: bool,
    working_dir: Path,
    env_pairs: Sequence[str] = (),
    python: str = "python",
    cwd: Path | None = None,
    attempt: int = 0,
) -> Submission:
    """The job for run `run_id`: `cfg` is the validated config of `config` + `overrides`; `working_dir` the
    checkout uploaded unless `installed`; `cwd` the directory relative paths resolve against (default the
    current one); `attempt` numbers the job id (0: `dapo-<run_id>`, else `dapo-<run_id>-<attempt>`)."""
    cwd = (cwd or Path.cwd()).resolve()
    cfg_path = (cwd / config).resolve()
    if installed or not cfg_path.is_relative_to(working_dir.resolve()):
        config_arg = str(cfg_path)  # must exist at this path on the head node
    else:
        config_arg = str(cfg_path.relative_to(working_dir.resolve()))
    args = [a for a in overrides if not a.startswith("trainer.experiment_name=")]
    args += path_overrides(cfg, cwd)
    args.append(f"trainer.experiment_name={run_id}")
    cmd = [
        python,
        "-m",
        "flows.cli",
        "train",
        *(["--flow-only"] if flow_only else []),
        "--config",
        config_arg,
    ]
    entrypoint = " ".join(shlex.quote(a) for a in [*cmd, *args])
    env = {k: os.environ[k] for k in FORWARDED_ENV if os.environ.get(k)}
    env.update(_parse_env(env_pairs))
    runtime_env: dict[str, Any] = {"env_vars": env}
    if not installed:
        runtime_env["working_dir"] = str(working_dir.resolve())
        runtime_env["excludes"] = list(WORKING_DIR_EXCLUDES)
    sid = f"dapo-{run_id}" if attempt == 0 else f"dapo-{run_id}-{attempt}"
    return Submission(sid, run_id, entrypoint, runtime_env, {"dapo_run_id": run_id})


def _jobs_of_run(client: Any, run_id: str) -> list[Any]:
    return [j for j in client.list_jobs() if (j.metadata or {}).get("dapo_run_id") == run_id]


def _next_attempt(run_id: str, taken: set[str]) -> int:
    """The first attempt number whose job id (`build_submission`'s) the cluster does not have yet."""
    attempt = 0
    while (f"dapo-{run_id}" if attempt == 0 else f"dapo-{run_id}-{attempt}") in taken:
        attempt += 1
    return attempt


def submit(
    *,
    address: str | None,
    config: str,
    overrides: Sequence[str],
    cfg: DictConfig,
    run_id: str,
    resuming: bool,
    flow_only: bool,
    installed: bool,
    working_dir: Path,
    env_pairs: Sequence[str],
    python: str,
    resume_command: str,
) -> Submission:
    """Submit run `run_id` to the job server at `address` (see `job_server_address`) and print its job id
    and the commands that follow it; refuses (one paragraph, nothing submitted) when the server does not
    answer or a job of the run is pending or running."""
    url = job_server_address(address)
    env = _parse_env(env_pairs)  # refused before the server is asked
    client = connect(url)
    previous = _jobs_of_run(client, run_id)
    active = [j for j in previous if str(getattr(j.status, "value", j.status)) in ACTIVE]
    if active:
        raise DapoUserError(
            f"run {run_id} already has an active Ray job ({active[0].submission_id}, "
            f"{getattr(active[0].status, 'value', active[0].status)}); one process writes a run at a time",
            where=url,
            fix=f"wait for it, or stop it first: ray job stop --address {url} {active[0].submission_id}",
        )
    if previous and not resuming:
        print(
            f"dapo submit: note: run {run_id} had {len(previous)} job(s) on this cluster; this one resumes it"
        )
    sub = build_submission(
        config=config,
        overrides=overrides,
        cfg=cfg,
        run_id=run_id,
        flow_only=flow_only,
        installed=installed,
        working_dir=working_dir,
        env_pairs=[f"{k}={v}" for k, v in env.items()],
        python=python,
        attempt=_next_attempt(run_id, {j.submission_id for j in previous}),
    )
    try:
        with _without_address_env():
            client.submit_job(
                entrypoint=sub.entrypoint,
                submission_id=sub.submission_id,
                runtime_env=sub.runtime_env,
                metadata=sub.metadata,
            )
    except (ValueError, RuntimeError) as exc:  # over Ray's upload limit, a refused runtime env, an id taken
        raise DapoUserError(
            f"the Ray job server refused the job: {' '.join(str(exc).split())[:400]}",
            where=f"working_dir {sub.runtime_env.get('working_dir', '(none)')}",
            fix="leave large files out of the checkout (a .rayignore), or install the package on every node "
            "and submit with --installed",
        ) from None
    where = "uploaded checkout" if not installed else "package installed on the nodes"
    print(f"submitted run {run_id} as Ray job {sub.submission_id} to {url} ({where})", flush=True)
    print(f"  logs:   ray job logs --address {url} --follow {sub.submission_id}")
    print(f"  status: ray job status --address {url} {sub.submission_id}")
    print(f"  stop:   ray job stop --address {url} {sub.submission_id}")
    print(f"  resume: {resume_command}", flush=True)
    return sub
