"""Preflight: the cheap checks that run before anything heavy (Prefect tasks, Ray workers, model loading).

`preflight(cfg, run_id, phase=...)` checks, in order, and raises the first problem as a `PreflightError`
(a `DapoUserError`: one paragraph naming the file / row / key and the fix): the **data files** (parquet,
verl column types, clean rows, a scorer per `data_source` that parses every ground truth); the **model
folder** (`config.json`, safetensors header and size, a tokenizer); the **checkpoint to resume**
(`CheckpointDir.verify`; a run resumed where it was written); writable **folders**; **free disk**; **the model
fits the run** (positions, tokenizer vs embedding, chat template, the CPU memory plan). docs/ARCHITECTURE.md
(Preflight) lists each check.

Files that a prior stage of the same job writes (the prepared data and the tiny base model of `dapo train`)
are skipped in phase "pipeline" and checked in phase "train", which the training flow runs at its start
(so a deployment gets the same checks). Nothing here imports prefect, ray or torch.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlparse

import pyarrow as pa
import pyarrow.compute as pc

from dapo_core.config.schema import DapoConfig
from dapo_core.data.dataset_checks import DatasetError, validate_dataset
from dapo_core.data.datasets import DataError, read_parquet
from dapo_core.errors import DapoUserError
from dapo_core.rewards.scoring import MATH_DAPO_SOURCES, ground_truth_problem, has_scorer

__all__ = [
    "MIN_FREE_BYTES",
    "PreflightError",
    "check_checkpoint",
    "check_cpu_memory",
    "check_data_file",
    "check_free_disk",
    "check_model_fits",
    "check_model_folder",
    "check_writable",
    "model_folder_of",
    "preflight",
]

MIN_FREE_BYTES = 256 * 2**20
"""Free space the run store's file system must have at the start (room for a tiny run's files)."""

Phase = Literal["pipeline", "train", "eval"]

SKIP_ENV = "DAPO_SKIP_PREFLIGHT"
"""Environment variable: `1` skips the file checks (data, model, checkpoint; the store and disk checks stay),
e.g. for data on a remote file system that is slow to read twice."""


class PreflightError(DapoUserError, ValueError):
    """A problem found before the run starts (data file, model folder, checkpoint, store, disk)."""


# ------------------------------------------------------------------------------------------------ data
def check_data_file(path: str, *, key: str = "data.train_files") -> pa.Table:
    """Read and validate one dataset file: readable parquet, verl types, clean rows, scorable data sources
    and ground truths. Returns the table; raises a `DapoUserError` naming the file, row and `key`."""
    if "://" not in path and not Path(path).exists():
        raise PreflightError(
            f"the dataset file {path} does not exist",
            where=key,
            fix=f"run `dapo prepare` to write it, or point {key} at an existing parquet file",
        )
    try:
        table = read_parquet(path)
        validate_dataset(table, name=path)
    except (DataError, DatasetError) as e:
        raise PreflightError(f"{e} (read through {key})") from e
    if table.num_rows == 0:
        raise PreflightError(
            f"the dataset file {path} has the right columns but no rows",
            where=key,
            fix=f"write rows into it (`dapo prepare` writes the default data), or drop it from {key}",
        )
    _check_scorable(table, path)
    return table


def _check_scorable(table: pa.Table, path: str) -> None:
    """Every data_source has a scorer and every ground truth parses (checked once per distinct value)."""
    sources = table.column("data_source")
    for ds in pc.unique(sources).to_pylist():
        if not has_scorer(ds):
            row = int(pc.index(sources, ds).as_py())
            raise PreflightError(
                f"{path} row {row}: data_source {ds!r} has no reward function, so every reward of its rows "
                f"would fail",
                fix=f"use one of {sorted(MATH_DAPO_SOURCES)} or a name starting with 'aime' in the "
                "data_source column (or register a scorer in dapo_core/rewards/scoring.py)",
            )
    gt = pc.struct_field(table.column("reward_model").combine_chunks(), "ground_truth")
    pairs = pa.table({"ds": sources.combine_chunks(), "gt": gt}).group_by(["ds", "gt"]).aggregate([])
    for ds, value in zip(pairs.column("ds").to_pylist(), pairs.column("gt").to_pylist(), strict=True):
        why = ground_truth_problem(ds, value)
        if why is not None:
            mask = pc.and_(pc.equal(sources, ds), pc.equal(gt, value))
            row = int(pc.index(mask, True).as_py())
            raise PreflightError(
                f"{path} row {row}: {why} (data_source {ds!r})",
                fix="repair reward_model.ground_truth in that row (the final answer as text, e.g. '42') or "
                "drop the row",
            )


# ----------------------------------------------------------------------------------------------- model
def _safetensors_problem(path: Path) -> str | None:
    """Why a .safetensors file is unreadable (bad header, or shorter than its header says), else None."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"it has {size} bytes, too short for a safetensors header"
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 * 2**20:
                return f"its header claims {n} bytes but the file has {size}: truncated, or not safetensors"
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        return f"its header cannot be read ({type(e).__name__}: {e})"
    ends = [
        int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__" and "data_offsets" in v
    ]
    need = 8 + n + (max(ends) if ends else 0)
    if size < need:
        return (
            f"it has {size} bytes but its tensors need {need}: the file is truncated (an interrupted copy?)"
        )
    return None


def check_model_folder(
    path: str, *, key: str = "actor_rollout_ref.model.path", tokenizer: str | None = None
) -> None:
    """The model folder exists, has a readable config.json, complete safetensors weights and a tokenizer."""
    p = Path(path)
    fix_path = f"point {key} at a Hugging Face model folder (config.json, *.safetensors, tokenizer.json)"
    if not p.exists():
        raise PreflightError(f"the model folder {p} does not exist", where=key, fix=fix_path)
    if not p.is_dir():
        raise PreflightError(f"{p} is a file, not a model folder", where=key, fix=fix_path)
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise PreflightError(f"the model folder {p} has no config.json", where=key, fix=fix_path)
    try:
        json.loads(cfg_file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise PreflightError(
            f"{cfg_file} is not readable JSON ({type(e).__name__}: {e})",
            where=key,
            fix="restore config.json from the model's source (or rebuild the model)",
        ) from None
    index = p / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as e:
            raise PreflightError(
                f"{index} is not a valid weight index ({type(e).__name__})", where=key, fix=fix_path
            ) from None
        files = [p / s for s in shards]
    else:
        files = sorted(p.glob("*.safetensors"))
    if not files:
        raise PreflightError(
            f"the model folder {p} has no *.safetensors weights (pickled *.bin weights are not loaded)",
            where=key,
            fix="save the model with safetensors (`model.save_pretrained(dir)` does by default)",
        )
    for f in files:
        if not f.is_file():
            raise PreflightError(f"the weight shard {f} is missing", where=key, fix=fix_path)
        why = _safetensors_problem(f)
        if why is not None:
            raise PreflightError(
                f"the weights file {f} is unreadable: {why}",
                where=key,
                fix="copy or download the model again (compare its size with the source), or rebuild it",
            )
    tok = Path(tokenizer) if tokenizer else p
    if not any((c / "tokenizer.json").is_file() for c in (tok, tok / "tokenizer")):
        raise PreflightError(
            f"no tokenizer.json in {tok} or {tok / 'tokenizer'}",
            where="actor_rollout_ref.model.tokenizer_path" if tokenizer else key,
            fix="set actor_rollout_ref.model.tokenizer_path to a folder with tokenizer.json ",
        )


def _tokenizer_dir(model: Path, tokenizer: str | None) -> Path:
    tok = Path(tokenizer) if tokenizer else model
    return tok / "tokenizer" if not (tok / "tokenizer.json").is_file() else tok


def _tokenizer_size(tok: Path, key: str) -> int:
    """Tokens a tokenizer.json can produce: its vocabulary plus added tokens (the largest id + 1)."""
    t = _json_file(tok / "tokenizer.json", key)
    vocab = t.get("model", {}).get("vocab") or {}
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    ids += [int(a["id"]) for a in t.get("added_tokens") or [] if "id" in a]
    return max(ids, default=-1) + 1


def _json_file(path: Path, key: str) -> dict:
    """A JSON object from `path` ({} when the file is absent); a half-written or garbled one is refused."""
    if not path.is_file():
        return {}
    try:
        d = json.loads(path.read_text())
        if not isinstance(d, dict):
            raise ValueError("not a JSON object")
        return d
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise PreflightError(
            f"{path} is not readable JSON ({type(e).__name__}: {str(e)[:80]}): half-written or damaged",
            where=key,
            fix="copy the tokenizer files again from the model's source (compare the sizes), or rebuild them",
        ) from None


def _has_chat_template(tok: Path, key: str) -> bool:
    in_config = bool(_json_file(tok / "tokenizer_config.json", key).get("chat_template"))
    return in_config or (tok / "chat_template.jinja").is_file() or (tok / "chat_template.json").is_file()


def check_model_fits(cfg: DapoConfig, path: str, *, key: str = "actor_rollout_ref.model.path") -> None:
    """The model can serve the run: prompt + response fit its positions, its embedding has a row for every
    token of the tokenizer, and the tokenizer has the chat template the prompts (chat messages) need."""
    p = Path(path)
    mc = json.loads((p / "config.json").read_text())
    total = cfg.data.max_prompt_length + cfg.data.max_response_length
    positions = mc.get("max_position_embeddings")
    if isinstance(positions, int) and total > positions:
        raise PreflightError(
            f"data.max_prompt_length + data.max_response_length = {cfg.data.max_prompt_length} + "
            f"{cfg.data.max_response_length} = {total} tokens, but the model {p} has {positions} positions "
            "(max_position_embeddings in its config.json)",
            where="data.max_response_length",
            fix=f"lower data.max_prompt_length / data.max_response_length to at most {positions} together, "
            "or use a model with more positions",
        )
    tok = _tokenizer_dir(p, cfg.actor_rollout_ref.model.tokenizer_path)
    tok_key = "actor_rollout_ref.model.tokenizer_path" if cfg.actor_rollout_ref.model.tokenizer_path else key
    try:
        size = _tokenizer_size(tok, tok_key)
    except PreflightError:
        raise
    except (AttributeError, KeyError, TypeError, ValueError):
        size = 0  # an unusual tokenizer.json layout: transformers judges it
    rows = mc.get("vocab_size")
    if isinstance(rows, int) and size > rows:
        raise PreflightError(
            f"the tokenizer in {tok} has {size} tokens but the model {p} has {rows} embedding rows "
            "(vocab_size in config.json): generation would index past the embedding",
            where=tok_key,
            fix="use the tokenizer that came with the model (unset actor_rollout_ref.model.tokenizer_path), "
            "or resize the model's embeddings to the tokenizer and save it again",
        )
    if not _has_chat_template(tok, tok_key):
        raise PreflightError(
            f"the tokenizer in {tok} has no chat template, but prompts are chat messages (verl's `prompt` "
            "column) and are rendered with it",
            where=tok_key,
            fix="use an instruct model's tokenizer, or add a chat_template to its tokenizer_config.json "
            "(or a chat_template.jinja file beside it)",
        )


def check_tiny_positions(cfg: DapoConfig) -> None:
    """The embedded tiny model (built by the pipeline) has positions for prompt + response."""
    total = cfg.data.max_prompt_length + cfg.data.max_response_length
    positions = cfg.actor_rollout_ref.model.tiny.max_position_embeddings
    if total > positions:
        raise PreflightError(
            f"data.max_prompt_length + data.max_response_length = {total} tokens, but the embedded tiny "
            f"model has {positions} positions",
            where="actor_rollout_ref.model.tiny.max_position_embeddings",
            fix=f"raise actor_rollout_ref.model.tiny.max_position_embeddings to at least {total}, or shorten "
            "the lengths",
        )


# ---------------------------------------------------------------------------------------------- memory
def available_memory() -> tuple[int, str] | None:
    """Bytes this process may still allocate: MemAvailable, lowered to the cgroup's limit when it has one."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
        free, where = int(info["MemAvailable"].split()[0]) * 1024, "MemAvailable in /proc/meminfo"
    except (OSError, KeyError, ValueError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit.isdigit() and int(limit) - used < free:
            free, where = int(limit) - used, "the cgroup's memory.max"
    except (OSError, ValueError):
        pass
    return free, where


def check_cpu_memory(cfg: DapoConfig, model_config: str | None = None) -> None:
    """On CPU every role shares this machine's memory: the plan's host RAM of this node must fit what is
    available (`plan.host_ram_problem`, which names the changes that make it fit)."""
    from dapo_core.compute.plan import host_ram_problem

    have = available_memory()
    if have is None:
        return
    problem = host_ram_problem(cfg, have[0], model_config=model_config)
    if problem:
        raise PreflightError(
            f"on CPU every role shares this machine's memory ({have[1]}). {problem}",
            where="trainer.device=cpu",
            fix="apply one of the changes above, or run on GPUs",
        )


# ------------------------------------------------------------------------------------------ checkpoint
def model_folder_of(path: str, *, key: str = "eval.checkpoint") -> str:
    """The HF model folder `dapo eval` loads for `path`: the folder itself, a checkpoint step folder's
    `actor/`, or a run folder's latest checkpoint (as `flows.evaluate.resolve_checkpoint`). Raises
    `PreflightError` naming `path` when it is none of these."""
    from dapo_core.store.checkpoint import CheckpointDir

    p = Path(path)
    fix = (
        "pass a model folder, a checkpoint folder runs/<run_id>/ckpt/step_<N>, or a run folder runs/<run_id>"
    )
    if not p.exists():
        raise PreflightError(f"{p} does not exist", where=key, fix=fix)
    if (p / "config.json").exists():
        return str(p)
    if (p / "actor" / "config.json").exists():
        return str(p / "actor")
    if (p / "ckpt").is_dir():
        # A lost or damaged `latest` pointer: the newest verifying checkpoint, as `dapo eval` will resolve it
        # (it warns then; read-only here).
        step = CheckpointDir(p).resume_step(warn=lambda _: None, repair=False)
        if step is None:
            raise PreflightError(f"the run folder {p} has no checkpoint yet", where=key, fix=fix)
        return model_folder_of(str(CheckpointDir(p).path(step)), key=key)
    raise PreflightError(
        f"{p} is neither a model folder (config.json), a checkpoint step folder nor a run folder",
        where=key,
        fix=fix,
    )


def check_checkpoint(path: str | Path, *, key: str = "trainer.resume_from_path") -> None:
    """A checkpoint folder to load: it exists, and `CheckpointDir.verify` accepts it (manifest, checksums)."""
    from dapo_core.store.checkpoint import CheckpointDir

    p = Path(path)
    if not p.is_dir():
        raise PreflightError(
            f"the checkpoint {p} does not exist",
            where=key,
            fix="give a checkpoint folder such as runs/<run_id>/ckpt/step_<N>, or a run folder runs/<run_id>",
        )
    if p.name.startswith("step_") and p.parent.name == "ckpt":
        ckpts, step = CheckpointDir(p.parent.parent), p.name.removeprefix("step_")
        if not step.isdigit():
            raise PreflightError(
                f"{p} is not a step_<N> checkpoint folder", where=key, fix="name a step_<N> folder"
            )
        try:
            ckpts.verify(int(step))
        except DapoUserError:
            raise
        except (ValueError, OSError, KeyError) as e:
            raise PreflightError(
                f"the checkpoint {p} does not match its manifest ({e})",
                where=key,
                fix="resume from another step_<N> folder, or delete this one",
            ) from e


# ----------------------------------------------------------------------------------------------- store
def check_writable(folder: str | Path, *, key: str) -> None:
    """`folder` (or, when it does not exist yet, its nearest existing parent, so that it can be created) lets
    a file be written and removed in it. Nothing is left behind."""
    p = Path(folder)
    while not p.exists() and p != p.parent:
        p = p.parent
    try:
        if not p.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, f"{p} is a file, not a folder")
        with tempfile.NamedTemporaryFile(dir=p, prefix=".dapo-preflight-", delete=True) as f:
            f.write(b"ok")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        why = _WRITE_ERRORS.get(e.errno or 0, "the file system does not take new files there")
        raise PreflightError(
            f"cannot write in {p} ({e.strerror or e}: {why}), so {folder} cannot be written",
            where=key,
            fix=f"point {key} at a folder on a writable disk with free space (or fix its permissions)",
        ) from None


_WRITE_ERRORS = {
    errno.EROFS: "a read-only file system",
    errno.EACCES: "no permission",
    errno.EPERM: "no permission",
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "over the disk quota",
    errno.ENOTDIR: "a path under a file",
}
"""What a failed test write in `check_writable` means, by errno (else: a file system that takes no files,
such as /proc)."""


def check_free_disk(folder: str | Path, *, need: int = MIN_FREE_BYTES, key: str = "trainer.runs_dir") -> None:
    """The file system holding `folder` has at least `need` bytes free."""
    p = Path(folder)
    while not p.exists() and p != p.parent:
        p = p.parent
    free = shutil.disk_usage(p).free
    if free < need:
        raise PreflightError(
            f"only {free / 2**20:.0f} MiB free on the file system of {folder} (need {need / 2**20:.0f} MiB)",
            where=key,
            fix="free some disk space or point trainer.runs_dir at a larger disk",
        )


# ------------------------------------------------------------------------------------------------- all
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
