"""The bad-input table's parts: a case's workspace (`Ws`, copies of the good inputs), the `dapo` command lines
that read it, the breakers that spoil one input, and `Case`, one row of the table."""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[3]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")


@dataclass
class Ws:
    """One case's workspace: copies of the good inputs it may break, and the run store to watch."""

    root: Path
    train: Path
    val: Path
    model: Path
    runs: Path

    def rows(self) -> list[dict]:
        """The good training rows (to break and write back)."""
        return pq.read_table(self.train).to_pylist()

    def write_rows(self, rows: list[dict], path: Path | None = None, schema: pa.Schema | None = None) -> None:
        """Write rows to the training file (or `path`)."""
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), path or self.train)


def _good(ws: Ws) -> list[str]:
    """Overrides that make a flow-only `dapo train` / `dapo eval` read the workspace's good inputs."""
    return [
        f"trainer.runs_dir={ws.runs}",
        f"data.train_files=[{ws.train}]",
        f"data.val_files=[{ws.val}]",
        f"actor_rollout_ref.model.path={ws.model}",
        "data.synthetic.enable=false",
    ]


def _train(*extra: str) -> Callable[[Ws], list[str]]:
    return lambda ws: ["train", "--flow-only", "--config", TINY, *_good(ws), *extra]


def _config(*extra: str) -> Callable[[Ws], list[str]]:
    return lambda ws: ["config", "--config", TINY, f"trainer.runs_dir={ws.runs}", *extra]


def _with_file(name: str, text: str | bytes, *extra: str) -> Callable[[Ws], list[str]]:
    """`dapo train --config <a file holding text>`."""

    def argv(ws: Ws) -> list[str]:
        p = ws.root / name
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        return ["train", "--config", str(p), f"trainer.runs_dir={ws.runs}", *extra]

    return argv


# --------------------------------------------------------------------------------------- breakers
def _rows(fn: Callable[[list[dict]], None], which: str = "train") -> Callable[[Ws], None]:
    def setup(ws: Ws) -> None:
        path = ws.train if which == "train" else ws.val
        rows = pq.read_table(path).to_pylist()
        fn(rows)
        schema = pq.read_schema(path)
        ws.write_rows(rows, path, schema.remove_metadata())

    return setup


def _set_gt(i: int, value: object) -> Callable[[list[dict]], None]:
    def fn(rows: list[dict]) -> None:
        rows[i]["reward_model"] = {"ground_truth": value, "style": "rule"}

    return fn


def _set(i: int, key: str, value: object) -> Callable[[list[dict]], None]:
    def fn(rows: list[dict]) -> None:
        rows[i][key] = value

    return fn


def _column(name: str, values: Callable[[int], list]) -> Callable[[Ws], None]:
    """Replace a whole column of the training file (a wrong type)."""

    def setup(ws: Ws) -> None:
        t = pq.read_table(ws.train)
        t = t.set_column(t.column_names.index(name), name, pa.array(values(t.num_rows)))
        pq.write_table(t, ws.train)

    return setup


def _drop_column(name: str) -> Callable[[Ws], None]:
    def setup(ws: Ws) -> None:
        t = pq.read_table(ws.train)
        pq.write_table(t.drop_columns([name]), ws.train)

    return setup


def _write(path: Callable[[Ws], Path], data: bytes) -> Callable[[Ws], None]:
    def setup(ws: Ws) -> None:
        path(ws).write_bytes(data)

    return setup


def _truncate(path: Callable[[Ws], Path], keep: float) -> Callable[[Ws], None]:
    def setup(ws: Ws) -> None:
        p = path(ws)
        data = p.read_bytes()
        p.write_bytes(data[: int(len(data) * keep)])

    return setup


def _non_utf8_prompt(ws: Ws) -> None:
    """Flip bytes inside a prompt's text in the parquet file (Arrow does not check UTF-8 on read)."""
    pq.write_table(
        pq.read_table(ws.train), ws.train, compression="none", use_dictionary=False, write_statistics=False
    )
    data = ws.train.read_bytes()
    i = data.find(b"=? End")
    ws.train.write_bytes(data[:i] + b"\xff\xfe" + data[i + 2 :])


def _model(fn: Callable[[Path], None]) -> Callable[[Ws], None]:
    return lambda ws: fn(ws.model)


def _rm(name: str) -> Callable[[Path], None]:
    return lambda m: (m / name).unlink()


def _bin_weights(m: Path) -> None:
    (m / "model.safetensors").rename(m / "pytorch_model.bin")


def _bad_header(m: Path) -> None:
    (m / "model.safetensors").write_bytes(struct.pack("<Q", 10**12) + b"{}")


def _runs_file(ws: Ws) -> None:
    (ws.root / "afile").write_text("not a folder")


def _ckpt_without_latest(ws: Ws) -> None:
    (ws.runs / "r1" / "ckpt").mkdir(parents=True)


def _adapter_without_base(ws: Ws) -> None:
    """A LoRA checkpoint's adapter folder (`lora_checkpoint`) whose base model was moved away."""
    folder = ws.root / "adapter"
    folder.mkdir()
    shutil.copy2(ws.model / "config.json", folder / "config.json")
    gone = ws.root / "moved_base"
    (folder / "lora_base.json").write_text(json.dumps({"base_model": str(gone), "absolute": str(gone)}))


def _base_cycle(ws: Ws) -> None:
    (ws.root / "a.yaml").write_text("base: b.yaml\n")
    (ws.root / "b.yaml").write_text("base: a.yaml\n")


def _model_json(name: str, **changes: object) -> Callable[[Path], None]:
    """Change keys of a JSON file of the model folder (config.json, tokenizer_config.json)."""

    def fn(m: Path) -> None:
        d = json.loads((m / name).read_text())
        d.update(changes)
        (m / name).write_text(json.dumps(d))

    return fn


def _no_rows(which: str) -> Callable[[Ws], None]:
    """The file keeps its schema but loses every row."""

    def setup(ws: Ws) -> None:
        path = ws.train if which == "train" else ws.val
        t = pq.read_table(path)
        pq.write_table(t.slice(0, 0), path)

    return setup


def _bigger_tokenizer(ws: Ws) -> None:
    """A second tokenizer folder whose vocabulary has 60 more tokens than the model's embedding."""
    other = ws.root / "other_tok"
    other.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (ws.model / f).exists():
            shutil.copy(ws.model / f, other / f)
    t = json.loads((other / "tokenizer.json").read_text())
    vocab = t["model"]["vocab"]
    for i in range(60):
        vocab[f"<extra_{i}>"] = len(vocab)
    (other / "tokenizer.json").write_text(json.dumps(t))


def _shard_missing(m: Path) -> None:
    """A sharded model whose download stopped after the first shard (the index names two)."""
    (m / "model.safetensors").rename(m / "model-00001-of-00002.safetensors")
    index = {"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
                                            "b": "model-00002-of-00002.safetensors"}}  # fmt: skip
    (m / "model.safetensors.index.json").write_text(json.dumps(index))


def _lease(host: str, heartbeat_offset_s: float) -> Callable[[Ws], None]:
    """runs/r1 held by another process: a lease with `host` and a heartbeat `heartbeat_offset_s` from now."""

    def setup(ws: Ws) -> None:
        import time

        run = ws.runs / "r1"
        run.mkdir()
        (run / "metrics.jsonl").write_text('{"step": 1}\n')
        now = time.time()
        lease = {"host": host, "pid": 4242, "started": 0.0, "flow_run_id": "f-1", "token": "t",
                 "acquired": now - 60, "heartbeat": now + heartbeat_offset_s}  # fmt: skip
        (run / "lease.json").write_text(json.dumps(lease))

    return setup


def _checkpoints(*complete: int, half: int | None = None, latest: int | None = None) -> Callable[[Ws], None]:
    """runs/r1 with complete checkpoints `complete`, one `half` whose weights file is gone (a copy that was
    interrupted), and a `latest` pointer naming `latest` (none when None)."""

    def setup(ws: Ws) -> None:
        from dapo_core.store.checkpoint import CheckpointDir

        run = ws.runs / "r1"
        run.mkdir()
        (run / "metrics.jsonl").write_text('{"step": 1}\n')
        ckpts = CheckpointDir(run)

        def write(d: Path) -> None:
            (d / "actor").mkdir()
            (d / "actor" / "model.safetensors").write_bytes(b"w" * 64)
            (d / "driver_state.json").write_text("{}")

        for step in (*complete, *([half] if half is not None else [])):
            ckpts.save(step, write)
        if half is not None:
            (ckpts.path(half) / "actor" / "model.safetensors").unlink()
        (ckpts.dir / "latest").unlink(missing_ok=True)
        if latest is not None:
            (ckpts.dir / "latest").write_text(f"{latest}\n")

    return setup


def _moved_replay_run(ws: Ws) -> None:
    """runs/r1 (replay-buffer order) moved here from /srv/old-runs: its ledger names its stage files there."""
    import sqlite3

    run = ws.runs / "r1"
    run.mkdir()
    con = sqlite3.connect(run / "ledger.sqlite")
    con.execute("CREATE TABLE kv (key TEXT PRIMARY KEY, tags TEXT NOT NULL)")
    uri = "file:///srv/old-runs/r1/step_000001/replay_add_00001.arrow"
    con.execute("INSERT INTO kv VALUES (?, ?)", ("u_0", json.dumps({"row": 0, "uri": uri})))
    con.commit()
    con.close()


def _only_config_json(m: Path) -> None:
    """A model folder whose download stopped after config.json."""
    for p in m.iterdir():
        if p.name != "config.json":
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def _disk_free(free: int) -> Callable[[pytest.MonkeyPatch, Ws], None]:
    """The file system of the workspace has `free` bytes left (`shutil.disk_usage` reports it)."""

    def patch(monkeypatch: pytest.MonkeyPatch, ws: Ws) -> None:
        real = shutil.disk_usage

        def usage(path: str | Path) -> object:
            u = real(path)
            if str(Path(path).absolute()).startswith(str(ws.root)):
                return type(u)(u.total, u.total - free, free)
            return u

        monkeypatch.setattr(shutil, "disk_usage", usage)

    return patch


def _dangling_data(ws: Ws) -> None:
    """The data folder was moved: the configured train file is a symlink to nothing."""
    moved = ws.root / "moved.parquet"
    ws.train.rename(moved)
    ws.train.symlink_to(ws.root / "gone" / "train.parquet")


# -------------------------------------------------------------------------------------------- table
@dataclass
class Case:
    """One bad input: how to build it and what the CLI must say."""

    id: str
    category: str
    argv: Callable[[Ws], list[str]]
    expect: tuple[str, ...]
    """Substrings of the message: the field or file, and the fix."""
    error: str = "DapoUserError"
    """Name of the error class (the class or one of its bases)."""
    setup: Callable[[Ws], None] | None = None
    code: int = 2
    env: dict[str, str] = field(default_factory=dict)
    patch: Callable[[pytest.MonkeyPatch, Ws], None] | None = None
    """A condition of the machine that cannot be built in a folder (a full disk), set with monkeypatch."""


_T = lambda ws: str(ws.train)  # noqa: E731
_M = lambda ws: ws.model / "model.safetensors"  # noqa: E731
