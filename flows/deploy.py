"""Register and serve the `dapo-train/<name>` deployment on a Prefect server.

    infra/prefect_server.sh start               # a local Prefect server (UI at http://127.0.0.1:4200)
    export PREFECT_API_URL=http://127.0.0.1:4200/api
    dapo deploy --config configs/tiny_cpu.yaml --name tiny [key=value ...]   # serves; leave it running
    prefect deployment run dapo-train/tiny --watch           # from another shell; or "Run" in the UI

The deployment's parameters are what a person edits in the UI's run form, as separate fields: `config` (a
config name in configs/, e.g. `tiny_cpu`, or a path), `overrides` (dotted `key=value` items; the command
line's overrides are the default) and `run_id` (empty: a new run named after the flow run; an existing id:
resume that run). The resolved config is written with the run (`runs/<run_id>/`), not into the form.
`serve` keeps a runner in this process that picks up flow runs of the deployment.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from flows.dapo_train import CONFIGS_DIR

if TYPE_CHECKING:
    from prefect.deployments.runner import RunnerDeployment


def config_parameter(config: str) -> str:
    """The deployment's `config` value for a `--config` path: its name when it lives in configs/ (portable
    between machines), otherwise the absolute path."""
    path = Path(config).absolute()
    if path.parent.resolve() == CONFIGS_DIR.resolve() and path.suffix == ".yaml":
        return path.stem
    return str(path)


def markup_safe(override: str) -> str:
    """`override` with a space after each `[` that starts a list value (`a=[x]` → `a=[ x]`, which loads the
    same): `prefect deployment run` prints a flow run's parameters as rich markup, and `[/tmp/x]` or `[jsonl]`
    read as markup tags make it crash (`MarkupError`) after creating the run."""
    return re.sub(r"\[(?=[A-Za-z#/@])", "[ ", override)


def deploy(
    cfg_yaml: str,
    name: str,
    config: str | None = None,
    overrides: Sequence[str] = (),
    run_id: str | None = None,
    serve: bool = True,
) -> RunnerDeployment | None:
    """Create the deployment `dapo-train/<name>`; with `serve=True` block serving it (Ctrl-C to stop).

    `config` and `overrides` become the form's defaults (`cfg_yaml`, already validated by the CLI, is the
    fallback `config` when no file is named); `run_id` fixes the default run id (empty: a new run each time).
    """
    if not os.environ.get("PREFECT_API_URL"):
        raise SystemExit(
            "PREFECT_API_URL is not set: start a server (infra/prefect_server.sh start) and export "
            "PREFECT_API_URL=http://127.0.0.1:4200/api so `prefect deployment run` can reach it"
        )
    from flows.dapo_train import dapo_train

    # Flow runs of this deployment beat every 30 s (Prefect's default: 180), so the zombie automation
    # (infra/zombie_automation.py) marks a run Crashed after its `--within` without a beat (three beats).
    os.environ.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "30")
    params = {
        "config": config_parameter(config) if config else cfg_yaml,
        "overrides": [markup_safe(o) for o in overrides],
        "run_id": run_id or "",
    }
    description = (
        "DAPO training. Fields: config (name in configs/ or a path), overrides (key=value items), run_id "
        "(empty = a new run; an existing id resumes it). Artifacts: progress, per-step metrics, summary."
    )
    if serve:
        dapo_train.serve(name=name, parameters=params, tags=["dapo"], description=description)
        return None
    # called from sync code, so Prefect's async_dispatch returns the deployment itself, not a coroutine
    return dapo_train.to_deployment(  # type: ignore[return-value]
        name=name, parameters=params, tags=["dapo"], description=description
    )
