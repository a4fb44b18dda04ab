"""Preflight: the cheap checks that run before anything heavy (Prefect tasks, Ray workers, model loading).

`preflight(cfg, phase=...)` checks, in order, and raises the first problem as a `PreflightError` (a
`DapoUserError`: one paragraph naming the file / row / key and the fix): the **data files**, the **model
folder**, the **checkpoint to resume**, writable **folders**, **free disk** and whether **the model fits the
run**. Two modules: `files` (each file and folder check) and `run` (the run settings, the run to resume, and
`preflight`, which runs the checks of a phase). docs/ARCHITECTURE.md (Preflight) lists each check.
"""

from __future__ import annotations

from dapo_core.preflight.files import (
    MIN_FREE_BYTES,
    PreflightError,
    available_memory,
    check_checkpoint,
    check_cpu_memory,
    check_data_file,
    check_free_disk,
    check_model_fits,
    check_model_folder,
    check_tiny_positions,
    check_writable,
    model_folder_of,
)
from dapo_core.preflight.run import (
    SKIP_ENV,
    Phase,
    bf16_on_plain_cpu,
    check_not_moved,
    check_resume,
    check_run_settings,
    preflight,
)

__all__ = [
    "MIN_FREE_BYTES",
    "SKIP_ENV",
    "Phase",
    "PreflightError",
    "available_memory",
    "bf16_on_plain_cpu",
    "check_checkpoint",
    "check_cpu_memory",
    "check_data_file",
    "check_free_disk",
    "check_model_fits",
    "check_model_folder",
    "check_not_moved",
    "check_resume",
    "check_run_settings",
    "check_tiny_positions",
    "check_writable",
    "model_folder_of",
    "preflight",
]
