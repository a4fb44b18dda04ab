"""The file and folder checks of the preflight, each raising a `PreflightError` (one paragraph naming the
file / row / key and the fix): a **data file** (parquet, verl column types, clean rows, a scorer per
`data_source` that parses every ground truth); a **model folder** (`config.json`, safetensors header and
size, a tokenizer) and whether **the model fits the run** (positions, tokenizer vs embedding, chat template,
the CPU memory plan); a **checkpoint** (`CheckpointDir.verify`); a **writable folder** and **free disk**.
`dapo_core.preflight.run` runs them for a phase. Nothing here imports prefect, ray or torch.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

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
    "available_memory",
    "check_checkpoint",
    "check_cpu_memory",
    "check_data_file",
    "check_free_disk",
    "check_model_fits",
    "check_model_folder",
    "check_tiny_positions",
    "check_writable",
    "model_folder_of",
]

MIN_FREE_BYTES = 256 * 2**20
"""Free space the run store's file system must have at the start (room for a tiny run's files)."""


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
        return _with_base(p, key)
    if (p / "actor" / "config.json").exists():
        return _with_base(p / "actor", key)
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


def _with_base(folder: Path, key: str) -> str:
    """`folder`; for a LoRA checkpoint's adapter folder, first a `PreflightError` when its base model is gone
    (evaluation merges the adapter into it)."""
    from dapo_core.compute.lora_checkpoint import base_model_of, is_adapter_folder

    if is_adapter_folder(folder):
        try:
            base_model_of(folder)
        except DapoUserError as exc:
            raise PreflightError(exc.what, where=f"{key}: {exc.where}", fix=exc.fix) from None
    return str(folder)


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
