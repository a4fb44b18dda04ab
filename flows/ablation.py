"""The DAPO paper's ablation table as DVC experiments: the grid and the summary (pure; `flows.ablation_run`
runs it).

The rows are cumulative, as in the paper's table: "naive GRPO" (all five switches off), then each technique
switched on in the paper's order, ending at DAPO. Each technique is one config key:

| technique | key | off | on |
|---|---|---|---|
| overlong filtering | `actor_rollout_ref.actor.mask_truncated_responses` | false | true |
| clip-higher | `actor_rollout_ref.actor.clip_ratio_high` | 0.2 (= `clip_ratio_low`) | 0.28 |
| soft overlong punishment | `reward_model.overlong_buffer.enable` | false | true |
| token-level loss | `actor_rollout_ref.actor.loss_agg_mode` | seq-mean-token-mean | token-mean |
| dynamic sampling | `algorithm.filter_groups.enable` | false | true |

Every experiment sets all five switches, the seed (`trainer.seed` and `data.seed`), the step budget
(`trainer.total_training_steps`) and the validation interval (`trainer.test_freq`), so two experiments'
configs differ only in the switches of their rows and in their seeds, whatever the params file held before.

The budget is equal in training steps, not minutes: the paper compares its rows at equal steps, a step is one
optimizer update on the same number of prompts in every row, and a step count gives the same experiment on any
machine, while the minutes a step takes depend on the machine's load and on the row itself (dynamic sampling
generates up to `max_num_gen_batches` batches per step). Each row's time per step is in its curves
(`step_s`), so the cost of a technique is visible beside its effect.

The summary turns `dvc exp show --json` into the results table: per row, held-out greedy accuracy and mean@k
with their standard error over seeds and problems, and the final training entropy and response length.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "ROWS",
    "SEED_KEYS",
    "SWITCHES",
    "ExpRecord",
    "Experiment",
    "MetricFiles",
    "Row",
    "RowSummary",
    "Switch",
    "done_names",
    "exp_records",
    "format_table",
    "grid",
    "mismatches",
    "param_args",
    "parse_rows",
    "parse_seeds",
    "summarize",
]


@dataclass(frozen=True)
class Switch:
    """One technique of the table: the config key that turns it on and its two values."""

    technique: str
    """The paper's name for it."""
    key: str
    """The dotted config key."""
    off: Any
    """Its value in the rows before the technique is added."""
    on: Any
    """Its value from the technique's row on."""


SWITCHES: tuple[Switch, ...] = (
    Switch("overlong filtering", "actor_rollout_ref.actor.mask_truncated_responses", False, True),
    Switch("clip-higher", "actor_rollout_ref.actor.clip_ratio_high", 0.2, 0.28),
    Switch("soft overlong punishment", "reward_model.overlong_buffer.enable", False, True),
    Switch("token-level loss", "actor_rollout_ref.actor.loss_agg_mode", "seq-mean-token-mean", "token-mean"),
    Switch("dynamic sampling", "algorithm.filter_groups.enable", False, True),
)
"""The five techniques in the order the paper's table adds them."""

SEED_KEYS: tuple[str, ...] = ("trainer.seed", "data.seed")
"""The keys an experiment's seed sets: sampling and initialisation, and the order of the training prompts."""


@dataclass(frozen=True)
class Row:
    """One row of the table: the first `switches_on` techniques of `SWITCHES` on, the others off."""

    index: int
    """Position in the table (0: naive GRPO)."""
    title: str
    """The paper's label ("naive GRPO", "+ clip-higher", ...)."""
    slug: str
    """The label in experiment names (lower case, digits and dashes)."""
    switches_on: int
    """How many of `SWITCHES` (from the first) this row turns on."""

    def values(self) -> dict[str, Any]:
        """The five switch keys with this row's values."""
        return {s.key: (s.on if i < self.switches_on else s.off) for i, s in enumerate(SWITCHES)}


ROWS: tuple[Row, ...] = (
    Row(0, "naive GRPO", "naive-grpo", 0),
    Row(1, "+ overlong filtering", "overlong-filtering", 1),
    Row(2, "+ clip-higher", "clip-higher", 2),
    Row(3, "+ soft overlong punishment", "soft-overlong", 3),
    Row(4, "+ token-level loss", "token-loss", 4),
    Row(5, "+ dynamic sampling (DAPO)", "dapo", 5),
)
"""The paper's six rows, each adding the next technique to the one above."""


@dataclass(frozen=True)
class Experiment:
    """One cell of the grid: a row at one seed, as a named DVC experiment."""

    name: str
    """The DVC experiment name (`r<row>-<slug>-s<seed>`)."""
    row: Row
    """Its row."""
    seed: int
    """Its seed."""
    params: dict[str, Any] = field(default_factory=dict)
    """Every dotted key the experiment sets, with its value."""


def grid(rows: Sequence[Row], seeds: Sequence[int], *, steps: int, test_freq: int) -> list[Experiment]:
    """The experiments of `rows` × `seeds` (seed-major: every row at the first seed before the second, so an
    interrupted grid has whole seeds), each training `steps` steps and validating every `test_freq`."""
    if steps < 1:
        raise ValueError(f"the step budget must be >= 1 (trainer.total_training_steps), got {steps}")
    if test_freq == 0 or test_freq < -1:
        raise ValueError(f"the validation interval must be >= 1 or -1 (trainer.test_freq), got {test_freq}")
    out = []
    for seed in seeds:
        for row in rows:
            params: dict[str, Any] = dict(row.values())
            params.update(dict.fromkeys(SEED_KEYS, seed))
            params["trainer.total_training_steps"] = steps
            params["trainer.test_freq"] = test_freq
            out.append(Experiment(f"r{row.index}-{row.slug}-s{seed}", row, seed, params))
    return out


def _override_value(value: Any) -> str:
    """`value` in the override grammar `dvc exp run -S` reads: true / false, numbers as written, strings
    quoted."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    text = str(value)
    if "'" in text:
        raise ValueError(f"a switch value cannot hold a single quote: {text!r}")
    return f"'{text}'"


def param_args(exp: Experiment, params_file: str) -> list[str]:
    """`-S <params_file>:++<key>=<value>` arguments of `dvc exp run` for every key the experiment sets (`++`:
    set the key, adding it when the params file lacks it)."""
    args: list[str] = []
    for key, value in exp.params.items():
        args += ["-S", f"{params_file}:++{key}={_override_value(value)}"]
    return args


def parse_rows(text: str) -> list[Row]:
    """`all`, or comma-separated row indices (`0,1`) or slugs (`naive-grpo,dapo`), in table order."""
    if text.strip() == "all":
        return list(ROWS)
    chosen = set()
    for part in (p.strip() for p in text.split(",") if p.strip()):
        row = next((r for r in ROWS if part in (str(r.index), r.slug)), None)
        if row is None:
            known = ", ".join(f"{r.index}={r.slug}" for r in ROWS)
            raise ValueError(f"--rows: no row {part!r}; the rows are {known} (or `all`)")
        chosen.add(row.index)
    if not chosen:
        raise ValueError("--rows: name at least one row (an index, a slug, or `all`)")
    return [r for r in ROWS if r.index in chosen]


def parse_seeds(text: str) -> list[int]:
    """Comma-separated distinct integer seeds (`1,2`)."""
    try:
        seeds = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--seeds {text!r}: write comma-separated integers such as 1,2") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds {text!r}: give at least one seed, each once")
    return seeds


# ------------------------------------------------------------------------------------ dvc exp show --json
@dataclass(frozen=True)
class ExpRecord:
    """One experiment as `dvc exp show --json` reports it."""

    name: str
    """Its name."""
    params: dict[str, dict[str, Any]]
    """Per params file, the file's keys flattened to dotted paths."""
    metrics: dict[str, Any]
    """Per metrics file, its parsed content."""
    ok: bool
    """It finished (no error, not queued, running or failed)."""
    state: str | None = None
    """The queue's state of it (queued, running, success, failed), None when the queue no longer lists it."""


def _flatten(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, Mapping):
        for k, v in tree.items():
            yield from _flatten(v, f"{prefix}{k}.")
    else:
        yield prefix[:-1], tree


def _files(section: Any) -> dict[str, Any]:
    """`{file: its data}` of a params or metrics section, leaving out files that failed to load."""
    if not isinstance(section, Mapping):
        return {}
    return {
        f: entry["data"]
        for f, entry in section.items()
        if isinstance(entry, Mapping) and "data" in entry and not entry.get("error")
    }


def exp_records(show: Sequence[Mapping[str, Any]]) -> list[ExpRecord]:
    """The experiments in `dvc exp show --json`'s output (every baseline's; the baselines themselves are not
    experiments)."""
    out = []
    for baseline in show:
        for exp in baseline.get("experiments") or []:
            revs = exp.get("revs") or []
            if not revs:
                continue
            rev = revs[0]
            data = rev.get("data") or {}
            name = exp.get("name") or rev.get("name") or rev.get("rev", "")
            executor = exp.get("executor") or {}
            state = executor.get("state") if isinstance(executor, Mapping) else None
            ok = not rev.get("error") and state in (None, "success")
            params = {f: dict(_flatten(d)) for f, d in _files(data.get("params")).items()}
            out.append(ExpRecord(str(name), params, _files(data.get("metrics")), ok, state))
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, int | float) and isinstance(b, int | float):
        return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
    return bool(a == b)


def mismatches(record: ExpRecord, exp: Experiment, params_file: str) -> list[str]:
    """The keys `exp` sets whose value in `record`'s `params_file` differs (`key: found -> wanted`)."""
    have = record.params.get(params_file, {})
    return [
        f"{k}: {have.get(k, '<absent>')!r} -> {v!r}"
        for k, v in exp.params.items()
        if not _same(have.get(k), v)
    ]


def done_names(
    records: Iterable[ExpRecord], experiments: Iterable[Experiment], params_file: str
) -> tuple[set[str], dict[str, list[str]]]:
    """(the experiments already finished with the same parameters, the names taken by a finished experiment
    with other parameters -> what differs). Unfinished records (queued, running, failed) count as neither."""
    by_name: dict[str, list[ExpRecord]] = {}
    for r in records:
        if r.ok:
            by_name.setdefault(r.name, []).append(r)
    done: set[str] = set()
    clashes: dict[str, list[str]] = {}
    for exp in experiments:
        found = by_name.get(exp.name, [])
        if any(not mismatches(r, exp, params_file) for r in found):
            done.add(exp.name)
        elif found:
            clashes[exp.name] = mismatches(found[0], exp, params_file)
    return done, clashes


# ----------------------------------------------------------------------------------------------- summary
@dataclass(frozen=True)
class MetricFiles:
    """Where a lineage's experiments write the numbers of the table (paths as `dvc exp show` names them)."""

    train: str
    """The train stage's final metrics (`final.entropy`, `final.response_len`)."""
    sampled: str
    """The held-out evaluation at the config's temperature (`val-core/<source>/acc/mean@k`)."""
    greedy: str | None = None
    """The greedy held-out evaluation, if the lineage has one."""


@dataclass(frozen=True)
class Estimate:
    """A mean with its standard error (None where it cannot be estimated)."""

    mean: float
    se: float | None


@dataclass(frozen=True)
class RowSummary:
    """One line of the results table."""

    row: Row
    seeds: list[int]
    """The seeds that finished."""
    greedy: Estimate | None
    sampled: Estimate | None
    sampled_k: int | None
    """The k of mean@k."""
    entropy: Estimate | None
    response_len: Estimate | None


def _accuracy(metrics: Any) -> tuple[float, int, int] | None:
    """(held-out accuracy mean@k, k, number of problems) of an evaluation file's content, or None."""
    values = metrics.get("metrics") if isinstance(metrics, Mapping) else None
    if not isinstance(values, Mapping):
        return None
    keys = sorted(k for k in values if k.startswith("val-core/") and "/acc/mean@" in k)
    if not keys:
        return None
    problems = int(values.get("eval/num_prompts", 0) or 0)
    return float(values[keys[0]]), int(keys[0].rsplit("@", 1)[1]), problems


def accuracy_estimate(per_seed: Sequence[float], problems: int) -> Estimate:
    """The mean accuracy over seeds, with the standard error over seeds and problems:
    `sqrt(s²/n_seeds + p(1-p)/problems)`, where `s²` is the variance of the seeds' accuracies (left out with
    one seed) and `p(1-p)/problems` the binomial variance of an accuracy over the same held-out problems (an
    upper bound for a mean of several samples per problem)."""
    p = sum(per_seed) / len(per_seed)
    var = 0.0
    if len(per_seed) > 1:
        var = sum((x - p) ** 2 for x in per_seed) / (len(per_seed) - 1) / len(per_seed)
    if problems > 0:
        var += p * (1 - p) / problems
    return Estimate(p, math.sqrt(var) if problems > 0 or len(per_seed) > 1 else None)


def mean_estimate(values: Sequence[float]) -> Estimate:
    """The mean over seeds with its standard error over seeds (None with one seed)."""
    m = sum(values) / len(values)
    if len(values) < 2:
        return Estimate(m, None)
    return Estimate(m, math.sqrt(sum((x - m) ** 2 for x in values) / (len(values) - 1) / len(values)))


def summarize(
    records: Iterable[ExpRecord], experiments: Sequence[Experiment], files: MetricFiles, params_file: str
) -> list[RowSummary]:
    """One `RowSummary` per row of `experiments`, in table order, from the finished records whose name and
    parameters match (a row none of whose seeds finished has no numbers)."""
    records = list(records)
    out = []
    for row in sorted({e.row for e in experiments}, key=lambda r: r.index):
        seeds, greedy, sampled, entropy, length = [], [], [], [], []
        problems: dict[str, int] = {}
        k = None
        for exp in (e for e in experiments if e.row == row):
            rec = next(
                (r for r in records if r.ok and r.name == exp.name and not mismatches(r, exp, params_file)),
                None,
            )
            if rec is None:
                continue
            seeds.append(exp.seed)
            acc = _accuracy(rec.metrics.get(files.sampled))
            if acc is not None:
                sampled.append(acc[0])
                k, problems["sampled"] = acc[1], acc[2]
            g = _accuracy(rec.metrics.get(files.greedy)) if files.greedy else None
            if g is not None:
                greedy.append(g[0])
                problems["greedy"] = g[2]
            final = (rec.metrics.get(files.train) or {}).get("final") or {}
            if final.get("entropy") is not None:
                entropy.append(float(final["entropy"]))
            if final.get("response_len") is not None:
                length.append(float(final["response_len"]))
        out.append(
            RowSummary(
                row,
                seeds,
                accuracy_estimate(greedy, problems["greedy"]) if greedy else None,
                accuracy_estimate(sampled, problems["sampled"]) if sampled else None,
                k,
                mean_estimate(entropy) if entropy else None,
                mean_estimate(length) if length else None,
            )
        )
    return out


def _pct(e: Estimate | None) -> str:
    if e is None:
        return "n/a"
    return f"{e.mean * 100:.1f} %" + ("" if e.se is None else f" ± {e.se * 100:.1f}")


def _num(e: Estimate | None, digits: int) -> str:
    if e is None:
        return "n/a"
    return f"{e.mean:.{digits}f}" + ("" if e.se is None else f" ± {e.se:.{digits}f}")


def format_table(summaries: Sequence[RowSummary]) -> str:
    """The results as a Markdown table (accuracies in percent ± one standard error)."""
    k = next((s.sampled_k for s in summaries if s.sampled_k), None)
    lines = [
        f"| row | seeds | held-out greedy | held-out mean@{k or 'k'} | final entropy | final response length "
        "|",
        "|---|---|---|---|---|---|",
    ]
    for s in summaries:
        seeds = ",".join(map(str, s.seeds)) or "none finished"
        lines.append(
            f"| {s.row.title} | {seeds} | {_pct(s.greedy)} | {_pct(s.sampled)} | {_num(s.entropy, 3)} | "
            f"{_num(s.response_len, 1)} |"
        )
    return "\n".join(lines)
