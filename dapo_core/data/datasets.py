"""Datasets in verl's DAPO parquet schema: synthetic arithmetic, parquet I/O, DAPO-Math loading, prompt sampling.

Row schema (docs/REFERENCE.md §8.1, one dict per problem):
``data_source: str``, ``prompt: [{"role": "user", "content": str}]``, ``ability: "MATH"``,
``reward_model: {"ground_truth": str, "style": str}``, ``extra_info: {...}``.

- :func:`make_synthetic_math` generates short integer-arithmetic problems whose prompt asks for a final
  ``Answer: <n>`` line, so ``math_dapo.compute_score`` grades them exactly like DAPO-Math.
- :func:`write_parquet` / :func:`read_parquet` store rows in that schema (any fsspec URL).
- :func:`load_dapo_math` concatenates parquet files and reports (optionally removes) duplicated prompts:
  DAPO-Math-17k repeats each problem ~100x, AIME-2024 each 32x.
- :class:`PromptSampler` walks a table in seeded epochs and yields Arrow batches of tokenised prompts
  (``prompt_id, data_source, ground_truth, prompt_ids``) with a resumable ``state_dict``.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from dapo_core.errors import DapoUserError

__all__ = [
    "SYNTHETIC_DATA_SOURCE",
    "SYNTHETIC_TEMPLATE",
    "DataError",
    "PromptSampler",
    "load_dapo_math",
    "make_synthetic_math",
    "make_synthetic_splits",
    "problem_key",
    "read_parquet",
    "tokenize_prompt",
    "write_parquet",
]

SYNTHETIC_DATA_SOURCE = "synthetic_arith"
"""``data_source`` of synthetic rows (the reward router must send it to ``math_dapo``)."""

SYNTHETIC_TEMPLATE = "{expr}=? End with Answer: N"
"""User message of a synthetic problem: short, because the tiny model's context is small."""

_REQUIRED_COLUMNS = ("data_source", "prompt", "reward_model")
_OPS = {"+", "-", "*"}

PROMPT_TYPE = pa.list_(pa.struct([("content", pa.string()), ("role", pa.string())]))
REWARD_MODEL_TYPE = pa.struct([("ground_truth", pa.string()), ("style", pa.string())])


class DataError(DapoUserError, ValueError):
    """A dataset, row or sampler argument is malformed; the message names the field and the fix."""


# --------------------------------------------------------------------------------------------------
# Synthetic arithmetic
# --------------------------------------------------------------------------------------------------
def _evaluate(operands: Sequence[int], ops: Sequence[str]) -> int:
    """Evaluate ``operands[0] ops[0] operands[1] ...`` with the usual precedence (``*`` before ``+``/``-``)."""
    terms: list[int] = [operands[0]]
    signs: list[int] = [1]
    for op, value in zip(ops, operands[1:], strict=True):
        if op == "*":
            terms[-1] *= value
        else:
            terms.append(value)
            signs.append(1 if op == "+" else -1)
    return sum(s * t for s, t in zip(signs, terms, strict=True))


def problem_key(row: dict[str, Any]) -> str:
    """The text a row is identified by for split-disjointness and dedup: its joined prompt contents."""
    prompt = row.get("prompt")
    if not isinstance(prompt, (list, tuple)) or not prompt:
        raise DataError("row field 'prompt' must be a non-empty list of {'role', 'content'} messages")
    return "\x1f".join(str(m["content"]) for m in prompt)


def make_synthetic_math(
    num: int,
    *,
    min_value: int = 0,
    max_value: int = 99,
    num_operands: int = 2,
    ops: Sequence[str] = ("+",),
    seed: int = 0,
    exclude: Iterable[str | dict[str, Any]] = (),
    split: str = "train",
) -> list[dict[str, Any]]:
    """Generate ``num`` distinct integer-arithmetic problems as verl/DAPO rows.

    Each problem is ``a op b [op c ...]`` with operands drawn uniformly from ``[min_value, max_value]`` and
    operators from ``ops`` (``+``, ``-``, ``*``; usual precedence). The prompt is
    :data:`SYNTHETIC_TEMPLATE`; the ground truth is the integer result as a string. ``exclude`` holds rows
    or problem keys (see :func:`problem_key`) that must not be generated, which makes a held-out split
    disjoint from a training split. ``extra_info`` carries ``index``, ``split`` and the bare ``expression``.
    Raises :class:`DataError` when the problem space (minus ``exclude``) is too small for ``num``.
    """
    if num < 0:
        raise DataError(f"num={num} must be >= 0")
    if max_value < min_value:
        raise DataError(f"max_value={max_value} < min_value={min_value}; swap them")
    if num_operands < 2:
        raise DataError(f"num_operands={num_operands} must be >= 2")
    ops = tuple(ops)
    bad = [o for o in ops if o not in _OPS]
    if not ops or bad:
        raise DataError(f"ops={list(ops)} must be a non-empty subset of {sorted(_OPS)}")
    excluded = {e if isinstance(e, str) else problem_key(e) for e in exclude}
    span = max_value - min_value + 1
    space = span**num_operands * len(ops) ** (num_operands - 1)
    if num > space - len(excluded):
        raise DataError(
            f"num={num} exceeds the {space} distinct problems (minus {len(excluded)} excluded) of "
            f"[{min_value}, {max_value}]^{num_operands} x ops {list(ops)}; widen max_value or num_operands"
        )
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    max_tries = 50 * num + 1000
    tries = 0
    while len(rows) < num:
        tries += 1
        if tries > max_tries:
            raise DataError(
                f"could only draw {len(rows)} of num={num} distinct problems after {max_tries} tries; "
                "widen max_value/num_operands or shrink exclude"
            )
        operands = [rng.randint(min_value, max_value) for _ in range(num_operands)]
        chosen = [rng.choice(ops) for _ in range(num_operands - 1)]
        expr = str(operands[0]) + "".join(f"{o}{v}" for o, v in zip(chosen, operands[1:], strict=True))
        content = SYNTHETIC_TEMPLATE.format(expr=expr)
        if content in seen or content in excluded:
            continue
        seen.add(content)
        answer = _evaluate(operands, chosen)
        rows.append(
            {
                "data_source": SYNTHETIC_DATA_SOURCE,
                "prompt": [{"role": "user", "content": content}],
                "ability": "MATH",
                "reward_model": {"ground_truth": str(answer), "style": "rule"},
                "extra_info": {"index": len(rows), "split": split, "expression": expr},
            }
        )
    return rows


def make_synthetic_splits(
    num_train: int, num_val: int, *, seed: int = 0, **kwargs: Any
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A training and a held-out split of :func:`make_synthetic_math`, disjoint by problem text.

    ``kwargs`` are the generator's options (``min_value``, ``max_value``, ``num_operands``, ``ops``).
    The held-out split is drawn first (seed ``seed + 1``) so its content does not depend on ``num_train``.
    """
    val = make_synthetic_math(num_val, seed=seed + 1, split="test", **kwargs)
    train = make_synthetic_math(num_train, seed=seed, split="train", exclude=val, **kwargs)
    return train, val


# --------------------------------------------------------------------------------------------------
# Parquet I/O
# --------------------------------------------------------------------------------------------------
def _rows_to_table(rows: Sequence[dict[str, Any]]) -> pa.Table:
    """Rows in verl's schema -> Arrow table with the fixed types for ``prompt`` and ``reward_model``."""
    for i, row in enumerate(rows):
        missing = [c for c in _REQUIRED_COLUMNS if c not in row]
        if missing:
            raise DataError(f"row {i} lacks field(s) {missing}; verl rows need {list(_REQUIRED_COLUMNS)}")
    columns: dict[str, pa.Array] = {
        "data_source": pa.array([r["data_source"] for r in rows], pa.string()),
        "prompt": pa.array([r["prompt"] for r in rows], PROMPT_TYPE),
        "ability": pa.array([r.get("ability", "MATH") for r in rows], pa.string()),
        "reward_model": pa.array(
            [
                {
                    "ground_truth": str(r["reward_model"]["ground_truth"]),
                    "style": r["reward_model"].get("style", "rule"),
                }
                for r in rows
            ],
            REWARD_MODEL_TYPE,
        ),
    }
    if any("extra_info" in r for r in rows):
        columns["extra_info"] = pa.array([r.get("extra_info") for r in rows])
    return pa.table(columns)


def write_parquet(rows: Sequence[dict[str, Any]] | pa.Table, path: str | Path) -> str:
    """Write rows (list of dicts or an Arrow table) in verl's parquet schema to a path or fsspec URL.

    Parent folders of local paths are created. Returns the path as a string.
    """
    table = rows if isinstance(rows, pa.Table) else _rows_to_table(rows)
    path = str(path)
    if "://" not in path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    with fsspec.open(path, "wb") as f:
        pq.write_table(table, f)
    return path


def read_parquet(path_or_url: str | Path) -> pa.Table:
    """Read a parquet file from a local path or any fsspec URL and check verl's required columns."""
    path = str(path_or_url)
    try:
        with fsspec.open(path, "rb") as f:
            table = pq.read_table(f)
    except FileNotFoundError as e:
        raise DataError(
            f"parquet file {path!r} does not exist; check data.train_files / data.val_files"
        ) from e
    except IsADirectoryError as e:
        raise DataError(f"{path!r} is a folder, not a parquet file; name the file in data.train_files") from e
    except (pa.ArrowException, OSError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(
            f"{path!r} is not a readable parquet file ({first}); regenerate it with `dapo prepare` or point "
            "data.train_files / data.val_files at a verl parquet file"
        ) from e
    missing = [c for c in _REQUIRED_COLUMNS if c not in table.column_names]
    if missing:
        raise DataError(
            f"{path!r} lacks column(s) {missing}; a verl dataset needs {list(_REQUIRED_COLUMNS)} "
            f"(found {table.column_names})"
        )
    return table


def _prompt_keys(table: pa.Table) -> pa.Array:
    """Vectorised :func:`problem_key` over a table's ``prompt`` column (list<struct{content, role}>)."""
    prompts = table.column("prompt").combine_chunks()
    if isinstance(prompts, pa.ChunkedArray):  # pragma: no cover - empty tables
        prompts = pa.concat_arrays(prompts.chunks) if prompts.num_chunks else pa.array([], PROMPT_TYPE)
    contents = pc.struct_field(prompts.flatten(), "content")
    lists = pa.ListArray.from_arrays(prompts.offsets, contents)
    return pc.binary_join(lists, "\x1f")


def load_dapo_math(paths: str | Path | Sequence[str | Path], dedup: bool) -> tuple[pa.Table, dict[str, Any]]:
    """Load one or more DAPO-style parquet files; report and optionally drop duplicated prompts.

    Duplicates are rows whose prompt contents are identical (DAPO-Math-17k holds each problem ~100x,
    AIME-2024 each 32x for avg@32). With ``dedup=True`` the first occurrence of each prompt is kept in
    file order; with ``dedup=False`` the table is returned unchanged. ``stats`` holds ``rows`` (read),
    ``unique``, ``duplicates`` (= rows - unique), ``max_copies``, ``conflicting_ground_truths`` (prompts
    seen with more than one ground truth), ``rows_out`` and ``files``.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]
    paths = [str(p) for p in paths]
    if not paths:
        raise DataError("no parquet paths given; set data.train_files (a path, URL or list of them)")
    tables = [read_parquet(p) for p in paths]
    if len(tables) == 1:
        table = tables[0]
    else:
        try:
            table = pa.concat_tables(tables, promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            # e.g. extra_info.index is a uuid string in DAPO-Math but int64 in AIME: keep common core columns.
            keep = [
                c
                for c in ("data_source", "prompt", "ability", "reward_model")
                if all(c in t.column_names for t in tables)
            ]
            table = pa.concat_tables([t.select(keep) for t in tables], promote_options="permissive")
    n = table.num_rows
    keys = _prompt_keys(table)
    gts = pc.struct_field(table.column("reward_model").combine_chunks(), "ground_truth")
    frame = pa.table({"key": keys, "row": pa.array(np.arange(n, dtype=np.int64)), "gt": gts})
    grouped = frame.group_by("key", use_threads=False).aggregate(
        [("row", "min"), ("row", "count"), ("gt", "count_distinct")]
    )
    unique = grouped.num_rows
    stats: dict[str, Any] = {
        "files": paths,
        "rows": n,
        "unique": unique,
        "duplicates": n - unique,
        "max_copies": int(pc.max(grouped.column("row_count")).as_py() or 0),
        "conflicting_ground_truths": int(
            pc.sum(pc.greater(grouped.column("gt_count_distinct"), 1)).as_py() or 0
        ),
    }
    if dedup:
        first = np.sort(grouped.column("row_min").to_numpy())
        table = table.take(pa.array(first))
    stats["rows_out"] = table.num_rows
    return table, stats


# --------------------------------------------------------------------------------------------------
# Prompt sampling
# --------------------------------------------------------------------------------------------------
def tokenize_prompt(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Chat-template a message list with the generation prompt and return its token ids."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class PromptSampler:
    """Seeded, resumable epochs over a verl table, yielding batches of tokenised prompts.

    Every epoch visits the rows in the permutation ``default_rng([seed, epoch])`` (or in order with
    ``shuffle=False``) and yields ``len(self)`` full batches (the remainder is dropped, like verl's
    ``drop_last=True``). :meth:`next_batch` returns an Arrow table with ``prompt_id: int64`` (the table
    row), ``data_source``, ``ground_truth`` and ``prompt_ids: list<int32>`` (the chat template of the
    prompt with the generation prompt). Prompts longer than ``max_prompt_length`` raise
    (``truncation="error"``) or keep their last tokens (``"left"``) / first tokens (``"right"``).
    :meth:`state_dict` / :meth:`load_state_dict` capture (epoch, position) so a resumed sampler yields
    exactly the batches the original would have yielded next.
    """

    def __init__(
        self,
        table: pa.Table,
        tokenizer: Any,
        *,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        max_prompt_length: int = 1024,
        truncation: str = "error",
    ) -> None:
        """Bind the table and tokenizer; see the class docstring for the options."""
        missing = [c for c in _REQUIRED_COLUMNS if c not in table.column_names]
        if missing:
            raise DataError(f"PromptSampler table lacks column(s) {missing}; load it with read_parquet")
        if batch_size < 1:
            raise DataError(f"batch_size={batch_size} must be >= 1 (data.train_batch_size)")
        if table.num_rows < batch_size:
            raise DataError(
                f"the dataset has {table.num_rows} rows, fewer than batch_size={batch_size}; "
                "lower data.train_batch_size / gen_batch_size or add data"
            )
        if truncation not in ("error", "left", "right"):
            raise DataError(f"truncation={truncation!r} must be 'error', 'left' or 'right' (data.truncation)")
        if max_prompt_length < 1:
            raise DataError(f"max_prompt_length={max_prompt_length} must be >= 1 (data.max_prompt_length)")
        self._table = table
        self._prompts = table.column("prompt")
        self._sources = table.column("data_source")
        self._gts = pc.struct_field(table.column("reward_model").combine_chunks(), "ground_truth")
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.max_prompt_length = max_prompt_length
        self.truncation = truncation
        self._token_cache: dict[int, np.ndarray] = {}
        self._epoch = 0
        self._position = 0
        self._order = self._permutation(0)

    def __len__(self) -> int:
        """Full batches per epoch."""
        return self._table.num_rows // self.batch_size

    @property
    def epoch(self) -> int:
        """Index of the epoch the next batch comes from (0-based)."""
        return self._epoch if self._position < len(self) else self._epoch + 1

    def _permutation(self, epoch: int) -> np.ndarray:
        """Row order of ``epoch``."""
        n = self._table.num_rows
        if not self.shuffle:
            return np.arange(n, dtype=np.int64)
        return np.random.default_rng([self.seed, epoch]).permutation(n).astype(np.int64)

    def _truncate(self, row: int, ids: list[int]) -> list[int]:
        """Token ids of table row ``row`` after truncation (or a DataError with ``truncation="error"``)."""
        if len(ids) > self.max_prompt_length:
            if self.truncation == "error":
                raise DataError(
                    f"prompt of row {row} has {len(ids)} tokens > max_prompt_length={self.max_prompt_length}; "
                    "raise data.max_prompt_length or set data.truncation=left"
                )
            ids = (
                ids[-self.max_prompt_length :] if self.truncation == "left" else ids[: self.max_prompt_length]
            )
        return ids

    def _encode(self, row: int) -> list[int]:
        """Token ids of table row ``row`` after truncation (tokenised on first use, then cached)."""
        return self.encode_rows([row])[0]

    def encode_rows(self, rows: Sequence[int] | np.ndarray) -> list[list[int]]:
        """Token ids of the table rows ``rows`` after truncation, in order. A row is tokenised once per
        sampler, the first time it is drawn (the rows not seen yet are chat-templated and tokenised in one
        batched call, the same ids as :func:`tokenize_prompt` row by row), and kept for later epochs."""
        rows = [int(r) for r in rows]
        todo = list(dict.fromkeys(r for r in rows if r not in self._token_cache))
        if todo:
            messages = [self._prompts[r].as_py() for r in todo]
            texts = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            encoded = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"]
            for r, ids in zip(todo, encoded, strict=True):
                self._token_cache[r] = np.asarray(self._truncate(r, list(ids)), dtype=np.int32)
        return [self._token_cache[r].tolist() for r in rows]

    def next_rows(self) -> np.ndarray:
        """Advance by one batch and return its table rows (a fresh permutation at the end of an epoch)."""
        if self._position >= len(self):
            self._epoch += 1
            self._position = 0
            self._order = self._permutation(self._epoch)
        start = self._position * self.batch_size
        rows = self._order[start : start + self.batch_size]
        self._position += 1
        return rows

    def batch_of(self, rows: Sequence[int] | np.ndarray) -> pa.Table:
        """The prompt table (``prompt_id``, ``data_source``, ``ground_truth``, ``prompt_ids``) of ``rows``,
        in order: what :meth:`next_batch` returns for the rows it drew."""
        rows = np.asarray(rows, dtype=np.int64)
        take = pa.array(rows)
        return pa.table(
            {
                "prompt_id": pa.array(rows, pa.int64()),
                "data_source": self._sources.take(take).combine_chunks().cast(pa.string()),
                "ground_truth": self._gts.take(take).cast(pa.string()),
                "prompt_ids": pa.array(self.encode_rows(rows), pa.list_(pa.int32())),
            }
        )

    def next_batch(self) -> pa.Table:
        """The next ``batch_size`` prompts; moves to a fresh permutation at the end of an epoch."""
        return self.batch_of(self.next_rows())

    def state_dict(self) -> dict[str, int | bool]:
        """Resume state: ``epoch``, ``position`` (batches already taken in that epoch) and identity checks."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_rows": self._table.num_rows,
            "batch_size": self.batch_size,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore (epoch, position); refuses a state taken on a different dataset, seed or batch size."""
        have = {
            "num_rows": self._table.num_rows,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
        }
        for key, value in have.items():
            if key in state and state[key] != value:
                raise DataError(
                    f"sampler state has {key}={state[key]!r} but this sampler has {value!r}; "
                    "resume with the same data files, data.seed, data.shuffle and batch size"
                )
        if "epoch" not in state or "position" not in state:
            raise DataError("sampler state needs 'epoch' and 'position' (from PromptSampler.state_dict())")
        self._epoch = int(state["epoch"])
        self._position = int(state["position"])
        if not 0 <= self._position <= len(self):
            raise DataError(f"sampler state position={self._position} outside [0, {len(self)}]")
        self._order = self._permutation(self._epoch)
