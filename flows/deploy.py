"""Register and serve the `dapo-train/<name>` deployment on a Prefect server.

    infra/prefect_server.sh start               # a local Prefect server (UI at http://127.0.0.1:4200)
    export PREFECT_API_URL=http://127.0.0.1:4200/api
    dapo deploy --config configs/tiny_cpu.yaml --name tiny   # serves; leave it running
    prefect deployment run dapo-train/tiny --watch           # from another shell; retry steps in the UI

`serve` keeps a runner in this process that picks up flow runs of the deployment. The resolved config is the
deployment's default `config_yaml` parameter; `run_id` defaults to `trainer.experiment_name` (or the
deployment name), so re-running the deployment resumes the same run, and a parameter override starts another.
"""

from __future__ import annotations

import os

from dapo_core.config import load_config_text, typed


def deploy(cfg_yaml: str, name: str, run_id: str | None = None, serve: bool = True):
    """Create the deployment `dapo-train/<name>`; with `serve=True` block serving it (Ctrl-C to stop)."""
    if not os.environ.get("PREFECT_API_URL"):
        raise SystemExit(
            "PREFECT_API_URL is not set: start a server (infra/prefect_server.sh start) and export "
            "PREFECT_API_URL=http://127.0.0.1:4200/api so `prefect deployment run` can reach it"
        )
    from flows.dapo_train import dapo_train

    rid = run_id or typed(load_config_text(cfg_yaml)).trainer.experiment_name or name
    params = {"config_yaml": cfg_yaml, "run_id": rid}
    if serve:
        dapo_train.serve(
            name=name,
            parameters=params,
            tags=["dapo"],
            description=f"DAPO training, run id {rid} (resumes on re-run)",
        )
        return None
    return dapo_train.to_deployment(name=name, parameters=params, tags=["dapo"])
