"""Fingerprints of a run's inputs, so that a resume or retry with changed inputs is noticed.

`input_fingerprints` records, in `runs/<id>/inputs.json`:

- **data**: for each of the training and validation file lists, every file's sha256 (and size, mtime) and one
  sha256 of the rows as read (Arrow table without schema metadata, so re-writing identical rows with another
  writer is not a change);
- **model**: the sha256 of every file of the base model folder (weights, config, tokenizer) and of the
  tokenizer folder when it is another one;
- **config**: one short hash per training-relevant config key (values are not stored: a key may hold a
  secret), i.e. every key except those that only name places, logging, resume bookkeeping or performance knobs
  (`NOT_TRAINING_KEYS`, `NOT_TRAINING_LEAVES`).

`changes(old, new)` lists what differs, one line per input. Files of unchanged size and mtime: not re-hashed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from dapo_core.errors import DapoUserError

__all__ = [
    "NOT_TRAINING_KEYS",
    "NOT_TRAINING_LEAVES",
    "InputsChanged",
    "changes",
    "config_fingerprint",
    "data_fingerprint",
    "file_fingerprint",
    "folder_fingerprint",
    "table_sha256",
]

NOT_TRAINING_KEYS = (
    "eval",
    "data.train_files",
    "data.val_files",
    "data.synthetic",
    "data.source_files",
    "actor_rollout_ref.model.path",
    "actor_rollout_ref.model.tokenizer_path",
    "actor_rollout_ref.model.tiny",
    "actor_rollout_ref.model.sft",
    "trainer.project_name",
    "trainer.experiment_name",
    "trainer.runs_dir",
    "trainer.models_dir",
    "trainer.save_freq",
    "trainer.test_freq",
    "trainer.val_before_train",
    "trainer.resume_mode",
    "trainer.resume_from_path",
    "trainer.max_actor_ckpt_to_keep",
    "trainer.max_critic_ckpt_to_keep",
    "trainer.device",
    "trainer.use_ray",
    "trainer.ray_address",
    "trainer.ray_resources",
    "trainer.nnodes",
    "trainer.n_gpus_per_node",
    "trainer.logger",
    "trainer.allow_changed_inputs",
)
"""Config keys (and sections) that do not change what is trained: where files are (their content is
fingerprinted instead), logging, checkpoint cadence, resume bookkeeping, and where the workers run."""

NOT_TRAINING_LEAVES = (
    "log_prob_micro_batch_size_per_gpu",
    "ppo_micro_batch_size_per_gpu",
    "log_prob_max_token_len_per_gpu",
    "ppo_max_token_len_per_gpu",
    "log_prob_use_dynamic_bsz",
    "use_dynamic_bsz",
    "enable_gradient_checkpointing",
    "use_remove_padding",
    "use_shared_prompt",
    "gpu_memory_utilization",
    "tensor_model_parallel_size",
    "enforce_eager",
    "free_cache_engine",
    "max_num_seqs",
    "max_num_batched_tokens",
    "enable_chunked_prefill",
    "num_workers",
)
"""Last key components of performance knobs (micro-batching, memory, engine settings): changing them to get a
run through (after an out-of-memory error, say) is not a change of inputs."""

_CHUNK = 8 << 20


class InputsChanged(DapoUserError, ValueError):
    """A resume or retry would train on other data, another base model or another training config than the
    run recorded."""


def _sha256_path(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def file_fingerprint(path: str | Path, known: Mapping[str, Any] | None = None) -> dict:
    """`{"path", "sha256", "bytes", "mtime_ns"}` of a file; `known` (an earlier fingerprint of the same path)
    is reused without reading the file when its size and mtime are unchanged."""
    path = Path(path)
    st = path.stat()
    if known and known.get("bytes") == st.st_size and known.get("mtime_ns") == st.st_mtime_ns:
        return dict(known)
    return {"path": str(path), "sha256": _sha256_path(path), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def folder_fingerprint(folder: str | Path, known: Mapping[str, Any] | None = None) -> dict:
    """Fingerprints of every regular, non-hidden file directly in `folder` (a model folder), by name;
    `{"path": folder, "files": {...}}`. A folder that does not exist gives an empty `files`."""
    folder = Path(folder)
    old = (known or {}).get("files", {})
    files = {}
    if folder.is_dir():
        for p in sorted(folder.iterdir()):
            if p.is_file() and not p.name.startswith("."):
                files[p.name] = file_fingerprint(p, old.get(p.name))
    return {"path": str(folder), "files": files}


def table_sha256(table: pa.Table) -> str:
    """sha256 of a table's rows and column types (schema metadata and chunking ignored)."""
    table = table.replace_schema_metadata(None).combine_chunks()
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return hashlib.sha256(sink.getvalue()).hexdigest()


def data_fingerprint(files: Sequence[str], table: pa.Table, known: Mapping[str, Any] | None = None) -> dict:
    """`{"files": [file fingerprints], "rows_sha256", "rows"}` of a list of parquet files and the rows read
    from them."""
    old = {f.get("path"): f for f in (known or {}).get("files", [])}
    fps = [file_fingerprint(f, old.get(str(Path(f)))) for f in files if "://" not in f]
    return {"files": fps, "rows_sha256": table_sha256(table), "rows": table.num_rows}


def _flatten(obj: Any, prefix: str, out: dict) -> None:
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    else:
        out[prefix] = obj


def _excluded(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in NOT_TRAINING_KEYS) or (
        key.rsplit(".", 1)[-1] in NOT_TRAINING_LEAVES
    )


def config_fingerprint(cfg: Mapping[str, Any]) -> dict[str, str]:
    """One 16-hex hash per training-relevant key of the (nested, plain) config `cfg`."""
    flat: dict[str, Any] = {}
    _flatten(cfg, "", flat)
    return {
        k: hashlib.sha256(json.dumps(v, sort_keys=True, default=str).encode()).hexdigest()[:16]
        for k, v in sorted(flat.items())
        if not _excluded(k)
    }


def _short(h: str | None) -> str:
    return "none" if not h else h[:12]


def _file_changes(label: str, old: Sequence[Mapping], new: Sequence[Mapping]) -> list[str]:
    out = []
    olds = {Path(f["path"]).name: f for f in old}
    for f in new:
        o = olds.get(Path(f["path"]).name)
        if o is not None and o.get("sha256") != f.get("sha256"):
            out.append(f"{f['path']} sha256 {_short(o.get('sha256'))}… → {_short(f.get('sha256'))}…")
    return out


def changes(
    old: Mapping[str, Any], new: Mapping[str, Any], defaults: Mapping[str, str] | None = None
) -> list[str]:
    """What differs between two `inputs.json` records, one line per input (empty: nothing changed).
    `defaults`: the `config_fingerprint` of the schema's defaults. A config key the old record lacks (the
    run was started by a version without it) is no change when it is at its default, which keeps the old
    behaviour."""
    out: list[str] = []
    for part in ("train", "val"):
        o, n = old.get("data", {}).get(part), new.get("data", {}).get(part)
        if o is None or n is None or o.get("rows_sha256") == n.get("rows_sha256"):
            continue
        files = _file_changes(part, o.get("files", []), n.get("files", []))
        out.append(
            f"{part} data: the rows read differ ({o.get('rows')} rows {_short(o.get('rows_sha256'))}… → "
            f"{n.get('rows')} rows {_short(n.get('rows_sha256'))}…)"
            + (f"; {', '.join(files)}" if files else "")
        )
    for part in ("model", "tokenizer"):
        o, n = old.get(part), new.get(part)
        if o is None or n is None:
            continue
        ofiles, nfiles = o.get("files", {}), n.get("files", {})
        diff = sorted(
            name
            for name in set(ofiles) | set(nfiles)
            if (ofiles.get(name) or {}).get("sha256") != (nfiles.get(name) or {}).get("sha256")
        )
        if diff:
            shown = ", ".join(diff[:5]) + (f" (+{len(diff) - 5} more)" if len(diff) > 5 else "")
            out.append(f"base {part} {n.get('path')}: {shown} changed, added or removed")
    oc, nc, dc = old.get("config", {}), new.get("config", {}), defaults or {}
    keys = sorted(
        k
        for k in set(oc) | set(nc)
        if oc.get(k) != nc.get(k) and not (k not in oc and k in dc and nc.get(k) == dc[k])
    )
    if keys:
        shown = ", ".join(keys[:8]) + (f" (+{len(keys) - 8} more)" if len(keys) > 8 else "")
        out.append(f"config: {shown}")
    return out
