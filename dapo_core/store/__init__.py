"""The run store: atomic files (`files`), the prompt/trajectory ledger and stage files (`run_store`),
checkpoints (`checkpoint`) and the replay buffer over the store (`replay`).
"""

from dapo_core.store.run_store import (
    INFLIGHT_STATUSES,
    PROMPT_STATUSES,
    RunStore,
    StageNotCommitted,
    StoreCorruption,
    StoreError,
    atomic_write_bytes,
    fsync_dir,
    schema_hash,
)

__all__ = [
    "INFLIGHT_STATUSES",
    "PROMPT_STATUSES",
    "RunStore",
    "StageNotCommitted",
    "StoreCorruption",
    "StoreError",
    "atomic_write_bytes",
    "fsync_dir",
    "schema_hash",
]
