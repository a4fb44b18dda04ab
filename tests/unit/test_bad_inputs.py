"""The bad-input probe as a table: every row feeds one bad input to the `dapo` CLI, in process
(`flows.cli.main`), and asserts what the user gets.

Each case asserts: exit code 2 (or, for the few deliberate behaviours, 0 with a note on stderr); the class of
the error (`flows.run_guard.last_user_error`); that the message names the field or file and the fix (the
`expect` substrings); that no traceback reaches stderr; and that the run store (`trainer.runs_dir`) is
byte-for-byte unchanged afterwards. The flows are replaced by recorders, so a case that got past the checks
shows up as a recorded call instead of a training run: everything here is caught before Prefect or Ray start,
which is the point of the preflight. The rest of the table (reward scores, the failure-rate limit) calls the
reward code directly; SIGTERM to a real run is in tests/integration/test_faults_cli.py.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")


# ------------------------------------------------------------------------------------------ workspace
@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """Good inputs, built once: train/val parquet files and a tiny model folder."""
    from tests.helpers import write_good_inputs

    return write_good_inputs(tmp_path_factory.mktemp("bad_inputs_base"))


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


@pytest.fixture
def ws(base: Path, tmp_path: Path) -> Ws:
    shutil.copytree(base, tmp_path / "in")
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "keep").mkdir()
    (runs / "keep" / "note.txt").write_text("an existing run's file")
    i = tmp_path / "in"
    return Ws(tmp_path, i / "train.parquet", i / "val.parquet", i / "model", runs)


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

CASES: list[Case] = [
    # --- config files and overrides
    Case(
        "empty config file",
        "config",
        _with_file("empty.yaml", ""),
        ("empty.yaml", "is empty", "configs/"),
        "ConfigError",
    ),
    Case(
        "comments-only config file",
        "config",
        _with_file("c.yaml", "# nothing\n\n"),
        ("c.yaml", "is empty"),
        "ConfigError",
    ),
    Case(
        "malformed YAML",
        "config",
        _with_file("m.yaml", "data:\n  train_batch_size: [1,\n"),
        ("m.yaml", "line 3", "fix the YAML"),
        "ConfigError",
    ),
    Case(
        "bad indentation",
        "config",
        _with_file("i.yaml", "data:\n  seed: 1\n   max: 2\n  x: [\n"),
        ("i.yaml", "line", "fix the YAML"),
        "ConfigError",
    ),
    Case(
        "random bytes as config",
        "config",
        _with_file("r.yaml", bytes(range(128, 256)) * 3),
        ("r.yaml", "not UTF-8", "--config"),
        "ConfigError",
    ),
    Case(
        "config is a list", "config", _with_file("l.yaml", "- a\n- b\n"), ("l.yaml", "mapping"), "ConfigError"
    ),
    Case(
        "config file missing",
        "config",
        lambda ws: ["train", "--config", str(ws.root / "nope.yaml")],
        ("nope.yaml", "does not exist", "--config"),
        "ConfigError",
    ),
    Case(
        "config path is a folder",
        "config",
        lambda ws: ["train", "--config", str(ws.root)],
        ("does not exist", "--config"),
        "ConfigError",
    ),
    Case(
        "base: cycle",
        "config",
        lambda ws: ["config", "--config", str(ws.root / "a.yaml")],
        ("cycle", "a.yaml"),
        "ConfigError",
        setup=_base_cycle,
    ),
    Case(
        "base: file missing",
        "config",
        _with_file("b.yaml", "base: gone.yaml\n"),
        ("gone.yaml", "does not exist"),
        "ConfigError",
    ),
    Case(
        "unknown key",
        "config",
        _config("actor_rollout_ref.actor.clip_ratio_hgh=0.3"),
        ("clip_ratio_hgh", "did you mean clip_ratio_high"),
        "ConfigError",
    ),
    Case(
        "wrong type",
        "config",
        _config("data.train_batch_size=abc"),
        ("data.train_batch_size", "type"),
        "ConfigError",
    ),
    Case("override without =", "config", _config("data.seed"), ("data.seed", "key=value"), "ConfigError"),
    Case(
        "override deleting a key", "config", _config("~data.seed"), ("~data.seed", "key=value"), "ConfigError"
    ),
    Case(
        "unset env interpolation",
        "config",
        _config("trainer.runs_dir=${oc.env:DAPO_NOT_SET_XYZ}"),
        ("trainer.runs_dir", "environment variable"),
        "ConfigError",
    ),
    Case(
        "reward timeout 0",
        "config",
        _config("reward_model.timeout_s=0"),
        ("reward_model.timeout_s", "> 0"),
        "ConfigError",
    ),
    Case(
        "reward timeout negative",
        "config",
        _config("reward_model.timeout_s=-5"),
        ("reward_model.timeout_s", "> 0"),
        "ConfigError",
    ),
    Case(
        "reward timeout NaN",
        "config",
        _config("reward_model.timeout_s=.nan"),
        ("reward_model.timeout_s", "finite"),
        "ConfigError",
    ),
    Case(
        "failure rate above 1",
        "config",
        _config("reward_model.max_failure_rate=1.5"),
        ("reward_model.max_failure_rate", "[0, 1]"),
        "ConfigError",
    ),
    Case(
        "gpu_memory_utilization 0",
        "config",
        _config("actor_rollout_ref.rollout.gpu_memory_utilization=0"),
        ("gpu_memory_utilization", "(0, 1]"),
        "ConfigError",
    ),
    Case(
        "train_batch_size 0",
        "config",
        _config("data.train_batch_size=0"),
        ("data.train_batch_size", ">= 1"),
        "ConfigError",
    ),
    Case(
        "resume_mode unknown",
        "config",
        _config("trainer.resume_mode=sometimes"),
        ("trainer.resume_mode", "auto"),
        "ConfigError",
    ),
    Case(
        "data.prompt_key set",
        "unused key",
        _config("data.prompt_key=question"),
        ("data.prompt_key", "not implemented", "remove the key"),
        "ConfigError",
    ),
    Case(
        "data.reward_fn_key set",
        "unused key",
        _config("data.reward_fn_key=src"),
        ("data.reward_fn_key", "not implemented"),
        "ConfigError",
    ),
    Case(
        "reward_manager set",
        "unused key",
        _config("reward_model.reward_manager=naive"),
        ("reward_model.reward_manager", "not implemented"),
        "ConfigError",
    ),
    Case(
        "nnodes 2 with a one-process engine",
        "config",
        _config("trainer.nnodes=2"),
        ("trainer.nnodes", "strategy=fsdp2"),
        "ConfigError",
    ),
    Case(
        "val_batch_size set (no-op)",
        "unused key",
        _train("data.val_batch_size=8"),
        ("data.val_batch_size", "no effect"),
        code=0,
        error="",
    ),
    Case(
        "rollout TP does not divide the devices",
        "config",
        _config("trainer.n_gpus_per_node=3", "actor_rollout_ref.rollout.tensor_model_parallel_size=2"),
        ("tensor_model_parallel_size", "does not divide", "trainer.n_gpus_per_node"),
        "ConfigError",
    ),
    # --- data files (read by training: checked before any worker starts)
    Case(
        "train file missing",
        "data",
        _train(),
        ("train.parquet", "does not exist", "dapo prepare"),
        "PreflightError",
        setup=lambda ws: ws.train.unlink(),
    ),
    Case(
        "train file is a folder",
        "data",
        lambda ws: [*_train()(ws), f"data.train_files=[{ws.root}]"],
        ("is a folder", "data.train_files"),
    ),
    Case(
        "random bytes .parquet",
        "data",
        _train(),
        ("train.parquet", "not a readable parquet", "dapo prepare"),
        setup=_write(lambda ws: ws.train, bytes(range(256)) * 4),
    ),
    Case(
        "CSV named .parquet",
        "data",
        _train(),
        ("train.parquet", "not a readable parquet"),
        setup=_write(lambda ws: ws.train, b"data_source,prompt\nx,y\n"),
    ),
    Case(
        "empty .parquet",
        "data",
        _train(),
        ("train.parquet", "not a readable parquet"),
        setup=_write(lambda ws: ws.train, b""),
    ),
    Case(
        "truncated .parquet",
        "data",
        _train(),
        ("train.parquet", "not a readable parquet"),
        setup=_truncate(lambda ws: ws.train, 0.5),
    ),
    Case(
        "column prompt missing",
        "data",
        _train(),
        ("train.parquet", "prompt"),
        setup=_drop_column("prompt"),
    ),
    Case(
        "column reward_model missing",
        "data",
        _train(),
        ("train.parquet", "reward_model"),
        setup=_drop_column("reward_model"),
    ),
    Case(
        "prompt is a string column",
        "data",
        _train(),
        ("train.parquet", "prompt has type string", "dapo prepare"),
        setup=_column("prompt", lambda n: ["2+2=?"] * n),
    ),
    Case(
        "reward_model is a string column",
        "data",
        _train(),
        ("train.parquet", "reward_model has type"),
        setup=_column("reward_model", lambda n: ["4"] * n),
    ),
    Case(
        "ground_truth is an int",
        "data",
        _train(),
        ("reward_model.ground_truth has type int64", "as text"),
        setup=_column("reward_model", lambda n: [{"ground_truth": 4, "style": "rule"}] * n),
    ),
    Case(
        "data_source is an int",
        "data",
        _train(),
        ("data_source has type int64",),
        setup=_column("data_source", lambda n: [1] * n),
    ),
    Case(
        "empty prompt list",
        "data",
        _train(),
        ("train.parquet", "prompt is empty", "rows [3]", "repair or drop"),
        setup=_rows(_set(3, "prompt", [])),
    ),
    Case(
        "blank prompt text",
        "data",
        _train(),
        ("prompt is empty", "rows [5]"),
        setup=_rows(_set(5, "prompt", [{"role": "user", "content": "   "}])),
    ),
    Case(
        "ground truth null",
        "data",
        _train(),
        ("ground truth is missing", "rows [2]"),
        setup=_rows(_set_gt(2, None)),
    ),
    Case(
        "ground truth 'nan'",
        "data",
        _train(),
        ("ground truth is missing, empty or NaN", "rows [4]"),
        setup=_rows(_set_gt(4, "nan")),
    ),
    Case(
        "ground truth empty",
        "data",
        _train(),
        ("ground truth", "rows [0]"),
        setup=_rows(_set_gt(0, "")),
    ),
    Case(
        "non-UTF-8 prompt bytes",
        "data",
        _train(),
        ("train.parquet", "not UTF-8"),
        setup=_non_utf8_prompt,
    ),
    Case(
        "unknown data_source",
        "data",
        _train(),
        ("row 6", "data_source 'gsm8k'", "no reward function"),
        setup=_rows(_set(6, "data_source", "gsm8k")),
    ),
    Case(
        "data_source empty",
        "data",
        _train(),
        ("data_source is missing", "rows [1]"),
        setup=_rows(_set(1, "data_source", "")),
    ),
    Case(
        "bad row in the val file",
        "data",
        _train(),
        ("val.parquet", "data.val_files", "rows [0]"),
        setup=_rows(_set_gt(0, None), which="val"),
    ),
    # --- model folder
    Case(
        "model folder missing",
        "model",
        _train(),
        ("model folder", "does not exist", "model.path"),
        setup=lambda ws: shutil.rmtree(ws.model),
    ),
    Case(
        "model path is a file",
        "model",
        lambda ws: [*_train()(ws), f"actor_rollout_ref.model.path={ws.train}"],
        ("is a file", "model.path"),
    ),
    Case(
        "no config.json",
        "model",
        _train(),
        ("config.json", "model.path"),
        setup=_model(_rm("config.json")),
    ),
    Case(
        "config.json not JSON",
        "model",
        _train(),
        ("config.json", "not readable JSON"),
        setup=_model(lambda m: (m / "config.json").write_text("{oops")),
    ),
    Case(
        "pickled weights only",
        "model",
        _train(),
        ("no *.safetensors", "safetensors"),
        setup=_model(_bin_weights),
    ),
    Case(
        "truncated model.safetensors",
        "model",
        _train(),
        ("model.safetensors", "truncated", "copy or download"),
        setup=_truncate(_M, 0.6),
    ),
    Case(
        "garbage safetensors header",
        "model",
        _train(),
        ("model.safetensors", "header"),
        setup=_model(_bad_header),
    ),
    Case(
        "no tokenizer.json",
        "model",
        _train(),
        ("tokenizer.json", "tokenizer_path"),
        setup=_model(lambda m: ((m / "tokenizer.json").unlink(), shutil.rmtree(m / "tokenizer"))),
    ),
    Case(
        "tokenizer_path missing",
        "model",
        _train("actor_rollout_ref.model.tokenizer_path=/nonexistent/tok"),
        ("tokenizer.json", "tokenizer_path"),
    ),
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
    # --- what the model can serve (checked before Prefect and Ray start)
    Case(
        "response beyond the model's positions",
        "model fit",
        _train("data.max_prompt_length=64", "data.max_response_length=300"),
        ("64 + 300 = 364", "256 positions", "data.max_response_length", "lower data.max_prompt_length"),
        "PreflightError",
    ),
    Case(
        "prompt alone beyond the model's positions",
        "model fit",
        _train("data.max_prompt_length=300", "data.max_response_length=16"),
        ("300 + 16 = 316", "256 positions", "max_position_embeddings"),
        "PreflightError",
    ),
    Case(
        "tiny model with too few positions",
        "model fit",
        lambda ws: [
            "train",
            "--config",
            TINY,
            f"trainer.runs_dir={ws.runs}",
            "actor_rollout_ref.model.tiny.max_position_embeddings=64",
        ],
        ("has 64 positions", "actor_rollout_ref.model.tiny.max_position_embeddings", "at least"),
        "PreflightError",
    ),
    Case(
        "tokenizer larger than the embedding",
        "model fit",
        _train(),
        ("100 tokens", "40 embedding rows", "vocab_size", "resize the model's embeddings"),
        "PreflightError",
        setup=_model(_model_json("config.json", vocab_size=40)),
    ),
    Case(
        "tokenizer_path with a bigger vocabulary",
        "model fit",
        lambda ws: [*_train()(ws), f"actor_rollout_ref.model.tokenizer_path={ws.root / 'other_tok'}"],
        ("160 tokens", "100 embedding rows", "actor_rollout_ref.model.tokenizer_path"),
        "PreflightError",
        setup=_bigger_tokenizer,
    ),
    Case(
        "no chat template",
        "model fit",
        _train(),
        ("no chat template", "chat messages", "chat_template"),
        "PreflightError",
        setup=_model(_rm("chat_template.jinja")),
    ),
    Case(
        "half-written tokenizer.json",
        "model fit",
        _train(),
        ("tokenizer.json is not readable JSON", "half-written", "copy the tokenizer files again"),
        "PreflightError",
        setup=_truncate(lambda ws: ws.model / "tokenizer.json", 0.5),
    ),
    Case(
        "half-written tokenizer_config.json",
        "model fit",
        _train(),
        ("tokenizer_config.json is not readable JSON", "copy the tokenizer files again"),
        "PreflightError",
        setup=_truncate(lambda ws: ws.model / "tokenizer_config.json", 0.5),
    ),
    Case(
        "sharded model, a shard not downloaded",
        "model fit",
        _train(),
        ("model-00002-of-00002.safetensors is missing", "actor_rollout_ref.model.path"),
        "PreflightError",
        setup=_model(_shard_missing),
    ),
    Case(
        "CPU memory plan beyond this machine",
        "model fit",
        _train("trainer.device=cpu"),
        ("on CPU every role shares this machine's memory", "is available", "Change:", "dapo plan"),
        "PreflightError",
        setup=_model(
            _model_json(
                "config.json",
                hidden_size=16384,
                intermediate_size=65536,
                num_hidden_layers=200,
                num_attention_heads=128,
                num_key_value_heads=128,
                head_dim=128,
            )
        ),
    ),
    # --- data that is there but empty or gone
    Case(
        "train file with zero rows",
        "data",
        _train(),
        ("train.parquet has the right columns but no rows", "data.train_files"),
        "PreflightError",
        setup=_no_rows("train"),
    ),
    Case(
        "val file with zero rows",
        "data",
        _train(),
        ("val.parquet has the right columns but no rows", "data.val_files"),
        "PreflightError",
        setup=_no_rows("val"),
    ),
    Case(
        "train file a dangling symlink (data moved)",
        "data",
        _train(),
        ("train.parquet does not exist", "data.train_files"),
        "PreflightError",
        setup=_dangling_data,
    ),
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


def _snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.read_bytes() if p.is_file() else b"")
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture
def no_flows(monkeypatch) -> list:
    """Replace the flow modules by recorders: reaching one means the input got past every check."""
    calls: list = []
    for module, attr in (
        ("flows.pipeline", "pipeline"),
        ("flows.dapo_train", "dapo_train"),
        ("flows.evaluate", "evaluate_flow"),
        ("flows.prepare_data", "prepare_data_flow"),
        ("flows.base_model", "base_model_flow"),
    ):
        mod = types.ModuleType(module)
        setattr(mod, attr, lambda *a, _m=module: calls.append((_m, a)))
        monkeypatch.setitem(sys.modules, module, mod)
    return calls


def test_the_table_has_at_least_90_bad_inputs():
    assert len(CASES) >= 90 and len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, ws: Ws, no_flows: list, monkeypatch, capsys):
    import flows.run_guard
    from flows.cli import main

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.delenv("DAPO_DEBUG", raising=False)
    monkeypatch.delenv("DAPO_SKIP_PREFLIGHT", raising=False)
    for k, v in case.env.items():
        monkeypatch.setenv(k, v)
    if case.patch is not None:
        case.patch(monkeypatch, ws)
    monkeypatch.setattr(flows.run_guard, "last_user_error", None)
    if case.setup is not None:
        case.setup(ws)
    argv = case.argv(ws)
    before = _snapshot(ws.runs)
    code = main(argv)
    err = capsys.readouterr().err
    assert code == case.code, err
    assert "Traceback" not in err and 'File "' not in err, err
    for part in case.expect:
        assert part in err, f"{part!r} not in: {err}"
    assert _snapshot(ws.runs) == before, "the run store changed"
    if case.code == 2:
        assert no_flows == [], "a flow started"
        got = flows.run_guard.last_user_error
        assert got is not None and case.error in [c.__name__ for c in type(got).__mro__], type(got)
        message = [ln for ln in err.splitlines() if ln.startswith(f"dapo {argv[0]}:")]
        assert message, err
    else:
        assert no_flows, "the run did not start"


def test_debug_shows_the_traceback(ws: Ws, no_flows: list, monkeypatch, capsys):
    """--debug (or DAPO_DEBUG=1) prints the traceback as well as the paragraph."""
    from flows.cli import main

    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    shutil.rmtree(ws.model)
    assert main([*_train()(ws), "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and "does not exist" in err


def test_an_unexpected_failure_is_one_paragraph(ws: Ws, monkeypatch, capsys, tmp_path):
    """Not an input problem (here: the flow hits a bug): what failed, where the traceback is, and --debug."""
    from flows.cli import main

    def broken(*args: object) -> None:
        raise RuntimeError("worker 3 lost its connection\nsecond line")

    mod = types.ModuleType("flows.dapo_train")
    mod.dapo_train = broken  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flows.dapo_train", mod)
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.delenv("DAPO_DEBUG", raising=False)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    assert main(_train()(ws)) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "second line" not in err, err
    line = [ln for ln in err.splitlines() if ln.startswith("dapo train: failed with RuntimeError")]
    assert line and "worker 3 lost its connection" in line[0] and "--debug" in line[0], err
    log = Path(line[0].split("the full traceback is in ")[1].split(". Run again")[0])
    assert "Traceback" in log.read_text() and "second line" in log.read_text()
    assert main([*_train()(ws), "--debug"]) == 1
    assert "Traceback" in capsys.readouterr().err


# -------------------------------------------------------------------------------- rewards (no CLI)
def _score_with(value: object) -> dict:
    from dapo_core.rewards.manager import RewardManager

    row = {
        "uid": "u1",
        "data_source": "x",
        "solution_str": "s",
        "ground_truth": "1",
        "valid_response_length": 1,
    }
    with RewardManager(lambda **kw: value, num_workers=1, inline_max_rows=8) as rm:
        res = rm.score([row])
    return {"acc": res.acc[0], "score": res.score[0], "failures": res.failures}


@pytest.mark.parametrize(
    "value", [{"score": math.nan, "acc": True}, math.nan, {"score": math.inf, "acc": True}, -math.inf]
)
def test_non_finite_score_is_a_failure_never_a_success(value):
    out = _score_with(value)
    assert out["acc"] is False and out["failures"] and "non-finite" in out["failures"][0][1]
    assert math.isfinite(out["score"])


def test_failure_rate_above_the_limit_stops_the_step(base: Path):
    from dapo_core.compute.workers.reward import RewardFailureRate, RewardWorker
    from dapo_core.errors import DapoUserError

    rows = [
        {"uid": f"u{i}", "data_source": "gsm8k" if i % 4 else "math", "ground_truth": "3"} for i in range(8)
    ]
    worker = RewardWorker(str(base / "model"), max_resp_len=8, overlong_buffer=None, num_workers=1)
    try:
        worker._check_failure_rate(rows, [(r["uid"], "no reward function") for r in rows[:4]])  # 50%: allowed
        with pytest.raises(RewardFailureRate) as exc:
            worker._check_failure_rate(
                rows, [(r["uid"], "no reward function for 'gsm8k'") for r in rows[1:6]]
            )
    finally:
        worker.close()
    msg = str(exc.value)
    assert isinstance(exc.value, DapoUserError)
    assert "reward_model.max_failure_rate=0.5" in msg and "gsm8k" in msg and "uid=u1" in msg and "Fix:" in msg


def test_scan_reports_unparsable_ground_truth_per_source():
    from dapo_core.rewards.scoring import ground_truth_problem

    assert ground_truth_problem("math", "42") is None
    assert "NaN" in (ground_truth_problem("math", math.nan) or "")
    assert "not a string" in (ground_truth_problem("math", 3) or "")
    assert "missing value" in (ground_truth_problem("math", "None") or "")


def test_worker_errors_are_unwrapped_to_the_user_error():
    """A DapoUserError raised in a Ray worker or a Prefect task reaches the CLI as itself."""
    from dapo_core.errors import DapoUserError, find_user_error

    class RayTaskErrorLike(Exception):
        def __init__(self, cause: BaseException) -> None:
            super().__init__("ray::RewardWorker.score() failed")
            self.cause = cause

    inner = DapoUserError("3 of 4 rewards failed", where="data source gsm8k", fix="fix the data")
    outer = RuntimeError("Flow run encountered an exception")
    outer.__cause__ = RayTaskErrorLike(inner)
    assert find_user_error(outer) is inner
    assert find_user_error(RuntimeError("a bug")) is None
    assert json.dumps(str(inner))  # one paragraph, printable
