"""The data and evaluation jobs as deployable flows, for `prefect.yaml`'s work-pool deployments.

    dapo-data/<name>   prepare the datasets, then build the base model (`dapo prepare` + `dapo base`)
    dapo-eval/<name>   evaluate a checkpoint (`dapo eval`)

`flows.prepare_data`, `flows.base_model` and `flows.evaluate` take resolved YAML text, which is what the CLI
hands them; a deployment's run form needs what a person types instead. These flows take the same fields as
`dapo-train`: `config` (a name in configs/ or a path) and `overrides` (dotted `key=value` items), run the
checks the CLI runs, and call the flows above as subflows. `dapo-train` itself is deployed as it is.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from dapo_core.config import ConfigError, load_config, to_safe_yaml, typed
from flows.dapo_train import CONFIGS_DIR
from flows.progress import quiet_worker_noise
from flows.run_guard import cli_preflight, resolve_eval_checkpoint


def config_file(config: str) -> Path:
    """The YAML file a deployment's `config` field names: a path, or a name in configs/ (`tiny_cpu`)."""
    path = Path(config)
    if path.exists():
        return path
    named = CONFIGS_DIR / (config if config.endswith((".yaml", ".yml")) else f"{config}.yaml")
    if not named.exists():
        known = ", ".join(sorted(p.stem for p in CONFIGS_DIR.glob("*.yaml")))
        raise ConfigError(
            f"config={config!r}: no such file, and no configs/{named.name}; set the deployment's `config` "
            f"field to a path to a YAML config or one of the names in configs/: {known}"
        )
    return named


@flow(name="dapo-data", log_prints=True)
def data_job(config: str = "tiny_cpu", overrides: list[str] | None = None) -> dict:
    """Write the config's datasets, then build (or reuse) its base model; returns the stats and model path."""
    from flows.base_model import base_model_flow
    from flows.prepare_data import prepare_data_flow

    quiet_worker_noise()
    cfg = load_config(config_file(config), list(overrides or []))
    cli_preflight(typed(cfg), "prepare")
    cfg_yaml = to_safe_yaml(cfg)
    stats = prepare_data_flow(cfg_yaml)
    return {"data": stats, "model": base_model_flow(cfg_yaml)}


@flow(name="dapo-eval", log_prints=True)
def eval_job(
    config: str = "tiny_cpu", overrides: list[str] | None = None, checkpoint: str = "", output: str = ""
) -> dict:
    """Evaluate `checkpoint` (empty: the latest checkpoint of the run `trainer.experiment_name`, else of the
    newest run) into `output` (empty: `eval.output`); returns the metrics."""
    from flows.evaluate import evaluate_flow

    quiet_worker_noise()
    ov = list(overrides or [])
    ov += [f"eval.checkpoint={checkpoint}"] if checkpoint else []
    ov += [f"eval.output={output}"] if output else []
    cfg = load_config(config_file(config), ov)
    tcfg = typed(cfg)
    ckpt = resolve_eval_checkpoint(tcfg)
    cli_preflight(tcfg, "eval", checkpoint=ckpt)
    return evaluate_flow(to_safe_yaml(cfg), ckpt, tcfg.eval.output)
