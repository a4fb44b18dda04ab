"""Rows of the bad-input table: checkpoints, evaluation, the store and services; one writer per run; the
operator's machine."""

from __future__ import annotations

from tests.unit.bad_inputs.workspace import (
    TINY,
    Case,
    _adapter_without_base,
    _checkpoints,
    _ckpt_without_latest,
    _disk_free,
    _good,
    _lease,
    _model,
    _moved_replay_run,
    _only_config_json,
    _runs_file,
    _train,
)

CHECKPOINTS: list[Case] = [
    # --- checkpoints, evaluation, store, services
    Case(
        "eval checkpoint missing",
        "checkpoint",
        lambda ws: ["eval", "--config", TINY, *_good(ws), "--checkpoint", str(ws.runs / "gone")],
        ("gone", "does not exist", "--checkpoint"),
    ),
    Case(
        "eval without --checkpoint, no run",
        "checkpoint",
        lambda ws: ["eval", "--config", TINY, *_good(ws)],
        ("no checkpoint to evaluate", "--checkpoint"),
    ),
    Case(
        "eval checkpoint not a model",
        "checkpoint",
        lambda ws: ["eval", "--config", TINY, *_good(ws), "--checkpoint", str(ws.root / "in")],
        ("neither a model folder", "--checkpoint"),
    ),
    Case(
        "eval LoRA checkpoint whose base model is gone",
        "checkpoint",
        lambda ws: ["eval", "--config", TINY, *_good(ws), "--checkpoint", str(ws.root / "adapter")],
        ("base model is gone", "moved_base", "lora_base.json", "put the base model back"),
        "PreflightError",
        setup=_adapter_without_base,
    ),
    Case(
        "eval run without checkpoint",
        "checkpoint",
        lambda ws: ["eval", "--config", TINY, *_good(ws), "--checkpoint", str(ws.runs / "r1")],
        ("has no checkpoint yet", "eval.checkpoint"),
        setup=_ckpt_without_latest,
    ),
    Case(
        "resume_from_path missing",
        "checkpoint",
        _train("trainer.resume_mode=resume_path", "trainer.resume_from_path=/nonexistent/ckpt/step_3"),
        ("checkpoint", "does not exist", "resume_from_path"),
    ),
    Case(
        "runs_dir under a file",
        "store",
        lambda ws: [*_train()(ws), f"trainer.runs_dir={ws.root}/afile/runs"],
        ("cannot write", "trainer.runs_dir"),
        setup=_runs_file,
    ),
    Case(
        "dead Prefect URL",
        "services",
        _train(),
        ("Prefect API", "127.0.0.1:9", "PREFECT_API_URL"),
        env={"PREFECT_API_URL": "http://127.0.0.1:9/api"},
    ),
]


WRITERS: list[Case] = [
    # --- one writer per run
    Case(
        "second writer of a live run",
        "store",
        _train("trainer.experiment_name=r1"),
        ("being written by another process", "gpu-node-7 pid 4242", "f-1", "trainer.lease_timeout_s"),
        "LeaseHeld",
        setup=_lease("gpu-node-7", -5),
    ),
    Case(
        "lease from a host whose clock runs ahead",
        "store",
        _train("trainer.experiment_name=r1"),
        ("being written by another process", "gpu-node-8", "last heartbeat 0 s ago"),
        "LeaseHeld",
        setup=_lease("gpu-node-8", 3600),
    ),
    Case(
        "lease_timeout_s 0",
        "store",
        _train("trainer.lease_timeout_s=0"),
        ("trainer.lease_timeout_s=0", "must be > 0", "e.g. 120"),
        "PreflightError",
    ),
    Case(
        "num_threads negative",
        "config",
        _train("trainer.num_threads=-1"),
        ("trainer.num_threads=-1", "Fix: set it to 1"),
    ),
]


MACHINE: list[Case] = [
    # --- the operator's machine: disks, folders that take no files, runs moved or half copied
    Case(
        "disk almost full",
        "store",
        _train(),
        ("only 100 MiB free", "need 256 MiB", "trainer.runs_dir", "free some disk space"),
        "PreflightError",
        patch=_disk_free(100 * 2**20),
    ),
    Case(
        "runs_dir on a file system that takes no files (/proc)",
        "store",
        lambda ws: [*_train()(ws), "trainer.runs_dir=/proc/dapo-runs"],
        ("cannot write in /proc", "does not take new files", "trainer.runs_dir", "writable disk"),
        "PreflightError",
    ),
    Case(
        "data folder under a file (dapo train writes the data)",
        "store",
        lambda ws: [
            "train",
            "--config",
            TINY,
            f"trainer.runs_dir={ws.runs}",
            f"data.synthetic.out_dir={ws.root}/afile/data",
        ],
        ("cannot write in", "afile", "a path under a file", "data.synthetic.out_dir"),
        "PreflightError",
        setup=_runs_file,
    ),
    Case(
        "models_dir under a file (dapo train writes the models)",
        "store",
        lambda ws: [
            "train",
            "--config",
            TINY,
            f"trainer.runs_dir={ws.runs}",
            f"trainer.models_dir={ws.root}/afile/models",
        ],
        ("cannot write in", "afile", "trainer.models_dir"),
        "PreflightError",
        setup=_runs_file,
    ),
    Case(
        "eval --output in a folder that takes no files",
        "store",
        lambda ws: [
            "eval",
            "--config",
            TINY,
            *_good(ws),
            "--checkpoint",
            str(ws.model),
            "--output",
            "/proc/dapo/eval.json",
        ],
        ("cannot write in /proc", "/proc/dapo", "eval.output"),
        "PreflightError",
    ),
    Case(
        "experiment_name given as a path",
        "config",
        _train("trainer.experiment_name=runs/r1"),
        ("trainer.experiment_name='runs/r1' is not a run id", "not a path", "'r1'", "trainer.runs_dir"),
        "PreflightError",
    ),
    Case(
        "run folder moved (replay-buffer run)",
        "checkpoint",
        _train("trainer.experiment_name=r1"),
        (
            "was written at /srv/old-runs/r1",
            "has been moved",
            "cannot resume here",
            "ln -s",
            "trainer.runs_dir=/srv/old-runs",
        ),
        "PreflightError",
        setup=_moved_replay_run,
    ),
    Case(
        "latest names a half-copied checkpoint",
        "checkpoint",
        _train("trainer.experiment_name=r1"),
        (
            "would resume from its latest checkpoint",
            "step_2",
            "incomplete",
            "model.safetensors",
            "delete",
            "ckpt/latest",
        ),
        "PreflightError",
        setup=_checkpoints(1, half=2, latest=2),
    ),
    Case(
        "no latest, the only checkpoint half-copied",
        "checkpoint",
        _train("trainer.experiment_name=r1"),
        ("latest is missing", "none of the checkpoints", "verifies", "restore a checkpoint from a backup"),
        "CheckpointError",
        setup=_checkpoints(half=1),
    ),
    Case(
        "no latest, newest checkpoint half-copied, an older one complete",
        "checkpoint",
        _train("trainer.experiment_name=r1"),
        (
            "dapo train: warning:",
            "latest is missing",
            "using the newest checkpoint that verifies",
            "step_1",
            "skipped: step 2",
        ),
        code=0,
        error="",
        setup=_checkpoints(1, half=2),
    ),
    Case(
        "model folder with config.json only",
        "model",
        _train(),
        ("has no *.safetensors weights", "actor_rollout_ref.model.path", "save the model with safetensors"),
        "PreflightError",
        setup=_model(_only_config_json),
    ),
]
