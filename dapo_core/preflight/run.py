"""The run-level preflight: `preflight(cfg, phase=...)` runs, in order, the run settings (threads, lease
timeout, a run id that names one folder), writable **folders** and **free disk**, the **run to resume**
(not moved from where it was written, its checkpoint complete), the **data files**, the **model folder** and
whether **the model fits the run**, and the **checkpoint** given; it raises the first problem as a
`PreflightError`. The file and folder checks themselves are `dapo_core.preflight.files`.

Files that a prior stage of the same job writes (the prepared data and the tiny base model of `dapo train`)
are skipped in phase "pipeline" and checked in phase "train", which the training flow runs at its start
(so a deployment gets the same checks). Nothing here imports prefect, ray or torch.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlparse

from dapo_core.config.schema import DapoConfig
from dapo_core.errors import DapoUserError
from dapo_core.preflight.files import (
    PreflightError,
    check_checkpoint,
    check_cpu_memory,
    check_data_file,
    check_free_disk,
    check_model_fits,
    check_model_folder,
    check_tiny_positions,
    check_writable,
)

__all__ = [
    "SKIP_ENV",
    "Phase",
    "bf16_on_plain_cpu",
    "check_not_moved",
    "check_resume",
    "check_run_settings",
    "preflight",
]

Phase = Literal["pipeline", "train", "eval"]
"""Where the preflight runs: `dapo train` before its first flow, the training flow, an evaluation."""

SKIP_ENV = "DAPO_SKIP_PREFLIGHT"
"""Environment variable: `1` skips the file checks (data, model, checkpoint; the store and disk checks stay),
e.g. for data on a remote file system that is slow to read twice."""


# ---------------------------------------------------------------------------------------- run settings
def bf16_on_plain_cpu(cfg: DapoConfig, cpuinfo: str | None = None) -> str | None:
    """A note when the rollout generates, or the actor computes, in bfloat16 on a CPU without bf16
    instructions, where it runs slower than float32 (a setting that runs, so not an error); None otherwise."""
    from dapo_core.compute.numerics import cpu_has_bf16
    from dapo_core.config import resolve_device
    from dapo_core.config.checks import train_dtype

    arr = cfg.actor_rollout_ref
    actor_dtype = train_dtype(arr.actor.fsdp_config.mixed_precision.param_dtype)
    keys = []
    if arr.rollout.dtype == "bfloat16":
        keys.append("actor_rollout_ref.rollout.dtype")
    if arr.actor.strategy != "deepspeed" and actor_dtype == "bfloat16":
        keys.append("actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype")
    if not keys or cfg.trainer.device == "cuda":
        return None
    if resolve_device(cfg) == "cuda" or cpu_has_bf16(cpuinfo) is not False:
        return None
    return (
        f"{' and '.join(k + '=bfloat16' for k in keys)} on a CPU without bfloat16 instructions (no "
        "avx512_bf16, amx_bf16 or bf16 among /proc/cpuinfo's flags): bf16 is emulated and may run slower "
        f"than float32; set {' and '.join(k + '=float32' for k in keys)} for speed on this machine"
    )


def check_run_settings(cfg: DapoConfig) -> None:
    """Run settings that would otherwise fail once the workers start: threads, the lease timeout, and a run
    id that names one folder of `trainer.runs_dir`."""
    from dapo_core.compute.numerics import resolve_threads

    resolve_threads(cfg.trainer.num_threads)
    name = cfg.trainer.experiment_name
    if (
        name is not None
        and name != ""
        and ("/" in name or "\\" in name or name.strip() in (".", "..") or name != name.strip())
    ):
        raise PreflightError(
            f"trainer.experiment_name={name!r} is not a run id: it must name one folder of trainer.runs_dir "
            f"({cfg.trainer.runs_dir}), not a path (a path would start a new, empty run elsewhere instead of "
            "resuming)",
            where="trainer.experiment_name",
            fix=f"give the run folder's name only (e.g. {Path(name.strip()).name or 'my-run'!r}) and set "
            "trainer.runs_dir to the folder that holds it",
        )
    if not cfg.trainer.lease_timeout_s > 0 or cfg.trainer.lease_wait_s < 0:
        raise PreflightError(
            f"trainer.lease_timeout_s={cfg.trainer.lease_timeout_s} must be > 0 and trainer.lease_wait_s="
            f"{cfg.trainer.lease_wait_s} >= 0",
            where="trainer.lease_timeout_s / trainer.lease_wait_s",
            fix="set lease_timeout_s to e.g. 120 (seconds without a heartbeat before a run may be taken "
            "over) and lease_wait_s to 0 (refuse a second writer at once) or a wait in seconds",
        )


# ---------------------------------------------------------------------------------------------- resume
def check_resume(
    cfg: DapoConfig, note: Callable[[str], object] = lambda _: None, *, checkpoints: bool = True
) -> None:
    """The run named by `trainer.experiment_name`, when it exists, can be resumed where it is
    (`resume_mode` auto): it was not moved from the folder its replay buffer names (`check_not_moved`), and
    (with `checkpoints`) its checkpoint to resume from is complete (read only: the `latest` pointer's, sizes
    checked; without a usable pointer the newest that verifies, `note`-ing what is skipped)."""
    from dapo_core.store.checkpoint import CheckpointDir
    from dapo_core.store.lease import read_holder, stale_reason

    tr = cfg.trainer
    if not tr.experiment_name or tr.resume_mode != "auto":
        return
    run = Path(tr.runs_dir) / tr.experiment_name
    if not run.is_dir():
        return
    holder = read_holder(run)
    if holder is not None and stale_reason(holder, tr.lease_timeout_s) is None:
        return  # a live writer holds it: the run's open waits for it or refuses, and then looks again
    check_not_moved(run)
    if not checkpoints or not (run / "ckpt").is_dir():
        return
    ckpts = CheckpointDir(run)
    step = ckpts.resume_step(warn=note, repair=False)
    if step is None:
        return
    try:
        ckpts.verify(step, checksum=False)
    except DapoUserError as e:
        raise PreflightError(
            f"run {run.name} would resume from its latest checkpoint {ckpts.path(step)}, which is "
            f"incomplete: {e.what}",
            where=str(ckpts.dir / "latest"),
            fix=f"restore that checkpoint from a backup, or delete {ckpts.dir / 'latest'} to resume from the "
            "newest checkpoint that is complete (or start a new run: a new trainer.experiment_name)",
        ) from None


def check_not_moved(run: Path) -> None:
    """A run whose ledger names its stage files at another folder (a replay-buffer run folder that was moved
    or copied) is refused: those files are read by their recorded location. Read only; a run without such
    records (the sync step order) resumes anywhere."""
    recorded = _recorded_location(run / "ledger.sqlite")
    here = run.absolute()
    if recorded is None or recorded == here:
        return
    raise PreflightError(
        f"run {run.name} was written at {recorded} and has been moved (or copied) to {here}: its replay "
        "buffer names its stage files by their absolute location, so it cannot resume here",
        where=str(run / "ledger.sqlite"),
        fix=f"resume it at {recorded}: move the folder back, or link it (`ln -s {here} {recorded}`), and set "
        f"trainer.runs_dir={recorded.parent}",
    )


def _recorded_location(ledger: Path) -> Path | None:
    """The run folder of the first stage file URI in the ledger's tags (`"uri": "file://..."` in
    ledger.sqlite or its -wal file, scanned as bytes: opening SQLite, even read-only, would create files in
    the run); None without one."""
    pattern = re.compile(rb'"uri": "(file://[^"]{1,4096})"')
    for path in (ledger, ledger.with_name(ledger.name + "-wal")):
        try:
            with path.open("rb") as f:
                tail = b""
                while chunk := f.read(1 << 20):
                    found = pattern.search(tail + chunk)
                    if found:
                        uri = found.group(1).decode("utf-8", "replace")
                        return Path(unquote(urlparse(uri).path)).parent.parent
                    tail = chunk[-8192:]
        except OSError:
            continue
    return None


def _prepared_by_pipeline(cfg: DapoConfig) -> set[str]:
    """Data files that `dapo prepare` (the pipeline's first flow) writes, as resolved paths."""
    out = Path(cfg.data.synthetic.out_dir)
    names = ("train", "val") if cfg.data.synthetic.enable else ("dapo-math-17k", "aime-2024")
    return {str((out / f"{n}.parquet").resolve()) for n in names}


def _files(cfg: DapoConfig, phase: Phase) -> Iterable[tuple[str, str]]:
    """(path, config key) of every dataset file the phase reads."""
    if phase == "eval":
        yield from ((f, "eval.files") for f in (cfg.eval.files or cfg.data.val_files))
        return
    yield from ((f, "data.train_files") for f in cfg.data.train_files)
    yield from ((f, "data.val_files") for f in cfg.data.val_files)


def preflight(
    cfg: DapoConfig,
    *,
    phase: Phase,
    checkpoint: str = "",
    model_path: str | None = None,
    note: Callable[[str], object] = lambda _: None,
) -> list[str]:
    """Run every check for `phase` ("pipeline": `dapo train` before the first flow; "train": the training
    flow; "eval": an evaluation); raise the first problem as a `DapoUserError`. Returns what was checked;
    `note` gets what is fine but worth saying (a checkpoint skipped on resume)."""
    done: list[str] = []
    tr = cfg.trainer
    if phase != "eval":
        check_run_settings(cfg)
    check_writable(tr.runs_dir, key="trainer.runs_dir")
    check_free_disk(tr.runs_dir)
    done.append(f"store {tr.runs_dir} writable")
    if phase == "pipeline":  # the pipeline's flows write the data, the base and final models, the metrics
        check_writable(cfg.data.synthetic.out_dir, key="data.synthetic.out_dir")
        check_writable(tr.models_dir, key="trainer.models_dir")
    if phase != "train":
        check_writable(Path(cfg.eval.output).parent, key="eval.output")
    if phase != "eval":
        check_resume(cfg, note, checkpoints=os.environ.get(SKIP_ENV, "") in ("", "0"))
    if os.environ.get(SKIP_ENV, "") in ("", "0"):
        pending = _prepared_by_pipeline(cfg) if phase == "pipeline" else set()
        if phase == "pipeline" and not cfg.data.synthetic.enable:
            for src, key in ((cfg.data.source_files.train, "data.source_files.train"),
                             (cfg.data.source_files.val, "data.source_files.val")):  # fmt: skip
                if src:
                    check_data_file(src, key=key)
                    done.append(src)
        for path, key in _files(cfg, phase):
            if "://" not in path and str(Path(path).resolve()) in pending:
                continue
            check_data_file(path, key=key)
            done.append(path)
    if os.environ.get(SKIP_ENV, "") not in ("", "0"):
        return done
    model = model_path if model_path is not None else cfg.actor_rollout_ref.model.path
    if model is None and phase != "pipeline":
        model = str(Path(tr.models_dir) / "tiny_base")
    if model:
        check_model_folder(model, tokenizer=cfg.actor_rollout_ref.model.tokenizer_path)
        check_model_fits(cfg, model)
        done.append(model)
    elif phase == "pipeline":  # the tiny base model the pipeline builds
        check_tiny_positions(cfg)
    if phase != "eval":
        slow = bf16_on_plain_cpu(cfg)
        if slow:
            note(slow)
        config_json = (
            str(Path(model) / "config.json") if model and Path(model, "config.json").is_file() else None
        )
        check_cpu_memory(cfg, config_json)
        done.append("memory plan fits")
    if checkpoint:
        check_checkpoint(checkpoint, key="eval.checkpoint" if phase == "eval" else "trainer.resume_from_path")
        done.append(checkpoint)
    elif phase != "eval" and tr.resume_mode == "resume_path" and tr.resume_from_path:
        check_checkpoint(tr.resume_from_path)
        done.append(tr.resume_from_path)
    return done
