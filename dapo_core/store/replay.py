"""Replay buffer over the run store, for the replay-buffer step order.

Rollout work registers prompts in the ledger (``RunStore.register_prompts``; the generation task then tags
them ``status="running"``) and hands finished groups to :meth:`ReplayBuffer.add_stage`; the trainer calls
:meth:`ReplayBuffer.sample` once per global step, which never blocks: without enough sampleable groups it
returns ``None`` and says in ``metrics["refill_needed"]`` how many prompts to generate next. It also computes
the staleness and eviction metrics (``{training,validation}/off_policy/*``, §7.7).

Each add commits its trajectory rows as one stage file, ``step_<global_steps>/replay_add_<k>.arrow``: a row
selection over the committed reward stage (:meth:`~dapo_core.store.stage_files.StageFiles.write_selection`),
written after reading only uid, sample_idx, weight version and filter metric (memory-mapped). Each trajectory
key ``{uid}_{sample_idx}`` records ``uri`` + ``row`` in its tags. :meth:`ReplayBuffer.sample_selection`
answers with a :class:`Selection`, which the flow commits as the step's ``batch`` (again a row selection).
The semantics: :class:`ReplayBuffer`.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dapo_core.store.run_store import RunStore, StoreError

__all__ = ["ReplayBuffer", "ReplayError", "Selection", "referenced_steps"]

_DAPO_COUNTS_KEY = "_dapo_filtered_reward_counts"


class ReplayError(StoreError):
    """A replay-buffer call got an inconsistent table or argument."""


def _stats(prefix: str, values: Sequence[float], out: dict) -> None:
    if len(values):
        arr = np.asarray(values, dtype=np.float64)
        out[f"{prefix}/mean"] = float(arr.mean())
        out[f"{prefix}/max"] = float(arr.max())
        out[f"{prefix}/min"] = float(arr.min())


@dataclass(frozen=True)
class Selection:
    """Rows of committed stages, in order: ``concat(views of bases).take(positions)``. What a sample is
    before anything is read; commit it with ``StageFiles.write_selection(step, stage, positions,
    base=bases)``."""

    bases: list[str]
    """URIs of the ``replay_add`` stages the rows come from (order of first use)."""
    positions: np.ndarray
    """int64 positions of the rows in the concatenation of the bases' views."""


def _is_filtered(values: list[float]) -> bool:
    """DAPO group filter: more than one trajectory and population std of the metric equal to 0."""
    if len(values) <= 1:
        return False
    return float(np.std(np.asarray(values, dtype=np.float64))) == 0.0


def referenced_steps(store: RunStore, partition: str = "train") -> set[int]:
    """The steps whose ``replay_add`` files the buffer's trajectories (in the ledger) still point at: the
    ``pinned`` steps of :func:`dapo_core.store.retention.apply_retention` (the stages those files are
    selections over are kept as their base chains)."""
    uris = {t["uri"] for _, t in store.items(partition, is_prompt=False) if "uri" in t}
    return {store.ref_of(u)[0] for u in uris}


class ReplayBuffer:
    """Oldest-first, non-blocking replay buffer of complete groups kept in a :class:`RunStore`.

    Semantics (docs/REFERENCE.md §9.3 / §7.7, simplified to a single driver):
    - Oldest first by the prompt's ``global_steps`` (ties: registration order).
    - DAPO filter: a finished group with more than one trajectory whose ``filter_groups_metric`` has
      population std 0 is evicted (``…/filter_groups/evicted_samples``, ``_dapo_filtered_reward_counts``).
    - Off-policy: span = ``global_steps − prompt_global_steps + 1``. ``drop``: finished groups with
      span > threshold are evicted (``…/off_policy/evicted_samples`` + staleness of the evicted spans).
      ``wait``: nothing is evicted for staleness; when an in-flight prompt has span ≥ threshold, ``sample``
      returns ``None`` with ``metrics["must_wait"] = True`` (finish those prompts first; they are the oldest).
    - Finished groups without trajectories and ``failure`` groups are evicted
      (``…/rollout_failure/evicted_samples``).
    - The validation partition (anything but ``train``; metric prefix ``validation/``) never evicts.
    - Eviction counts are in groups (prompts), as in the reference's replay buffer.
    - Surplus: groups beyond ``batch_size`` stay for the next step, unless ``discard_surplus=True`` (then
      they are deleted and counted in ``…/filter_groups/discarded_surplus_samples``).
    - Selected prompts are tagged ``consumed_step=global_steps``; calling ``sample`` again with the same
      step returns the same batch (crash-replay). :meth:`release` deletes consumed keys once a checkpoint
      covers them.
    """

    def __init__(
        self,
        store: RunStore,
        *,
        train_batch_size: int,
        n: int,
        filter_groups_metric: str | None = None,
        max_off_policy_threshold: int = 8,
        max_off_policy_strategy: str = "drop",
        partition: str = "train",
        discard_surplus: bool = False,
    ) -> None:
        if train_batch_size < 1 or n < 1:
            raise ReplayError(f"ReplayBuffer: train_batch_size ({train_batch_size}) and n ({n}) must be >= 1")
        if max_off_policy_strategy not in ("drop", "wait"):
            raise ReplayError(
                f"trainer.max_off_policy_strategy={max_off_policy_strategy!r}: use 'drop' or 'wait'"
            )
        if max_off_policy_threshold < 1:
            raise ReplayError(f"trainer.max_off_policy_threshold={max_off_policy_threshold}: must be >= 1")
        self.store = store
        self.train_batch_size = int(train_batch_size)
        self.n = int(n)
        self.filter_groups_metric = filter_groups_metric
        self.threshold = int(max_off_policy_threshold)
        self.strategy = max_off_policy_strategy
        self.partition = partition
        self.discard_surplus = bool(discard_surplus)
        self.prefix = "training" if partition == "train" else "validation"

    # ------------------------------------------------------------------ producer side
    def _next_add_stage(self, global_steps: int) -> str:
        d = self.store.step_dir(global_steps)
        k = 0
        if d.is_dir():
            for p in d.iterdir():
                name = p.name.lstrip(".")
                if name.startswith("replay_add_"):
                    digits = name[len("replay_add_") :].split(".")[0]
                    if digits.isdigit():
                        k = max(k, int(digits) + 1)
        return f"replay_add_{k:05d}"

    def add_stage(self, uri: str, global_steps: int, uids: Sequence[str] | None = None) -> int:
        """Register the complete groups of the committed stage at ``uri`` (all of them, or those of ``uids``);
        returns the number of groups added.

        Only ``uid``, ``sample_idx``, the weight-version columns and the filter metric are read
        (memory-mapped); the ``replay_add`` file is a row selection over ``uri`` (row ids and positions), so
        nothing token-level is read or written here. ``uri``'s rows follow the batch contract (``uid``,
        ``sample_idx``, and ``weight_version`` or ``min_global_steps``/``max_global_steps``; the filter metric
        column when filtering is on); every uid must have exactly ``n`` rows. Prompts already in the ledger
        keep their ``global_steps``; new ones get ``global_steps``.
        """
        ref = self.store.ref_of(uri)
        columns = self.store.manifest(*ref).get("columns")
        if columns is None:  # a whole-table file of an older run folder: its schema, memory-mapped
            columns = self.store.read_uri(uri, verify=False).column_names
        wanted = ["uid", "sample_idx", "min_global_steps", "max_global_steps", "weight_version"]
        if self.filter_groups_metric is not None:
            wanted.append(self.filter_groups_metric)
        ids = self.store.read_uri(
            uri, verify=False, columns=[c for c in dict.fromkeys(wanted) if c in columns]
        )
        if uids is None:
            positions = np.arange(ids.num_rows, dtype=np.int64)
        else:
            mask = pc.is_in(ids.column("uid"), value_set=pa.array(list(uids), pa.string()))
            positions = np.flatnonzero(mask.to_numpy(zero_copy_only=False)).astype(np.int64)
            ids = ids.take(pa.array(positions))
        groups = self._check_groups(ids)
        if not groups:
            return 0
        add_uri = self.store.write_selection(
            global_steps,
            self._next_add_stage(global_steps),
            positions,
            base=[uri],
            meta={"kind": "replay_add", "groups": len(groups)},
        )
        self._register(ids, groups, add_uri, global_steps)
        return len(groups)

    def _check_groups(self, table: pa.Table) -> dict[str, list[int]]:
        """The rows of each uid of ``table``, after checking the batch contract (module docstring)."""
        for col in ("uid", "sample_idx"):
            if col not in table.column_names:
                raise ReplayError(f"replay add: column {col!r} is missing (batch contract)")
        if not ("min_global_steps" in table.column_names and "max_global_steps" in table.column_names) and (
            "weight_version" not in table.column_names
        ):
            raise ReplayError(
                "replay add: need column 'weight_version' (or 'min_global_steps' and "
                "'max_global_steps') to stamp trajectory staleness"
            )
        metric = self.filter_groups_metric
        if metric is not None and metric not in table.column_names:
            raise ReplayError(
                f"replay add: filter_groups metric column {metric!r} is missing; add it "
                f"(reward stage) or set algorithm.filter_groups.metric to an existing column"
            )
        uids = table.column("uid").to_pylist()
        sidx = table.column("sample_idx").to_pylist()
        groups: dict[str, list[int]] = defaultdict(list)
        for i, u in enumerate(uids):
            groups[u].append(i)
        for u, rows in groups.items():
            if len(rows) != self.n:
                raise ReplayError(
                    f"replay add: group uid={u!r} has {len(rows)} trajectories, expected n={self.n}; "
                    f"pass only complete groups (or tag the uid status='failure')"
                )
            if len({sidx[i] for i in rows}) != len(rows):
                raise ReplayError(f"replay add: group uid={u!r} has duplicate sample_idx values")
        return groups

    def _register(self, table: pa.Table, groups: dict[str, list[int]], uri: str, global_steps: int) -> None:
        """The ledger transaction of an add: row ``i`` of ``table`` is row ``i`` of the view at ``uri``."""
        if "min_global_steps" in table.column_names and "max_global_steps" in table.column_names:
            vmin = table.column("min_global_steps").to_pylist()
            vmax = table.column("max_global_steps").to_pylist()
        else:
            vmin = vmax = table.column("weight_version").to_pylist()
        metric = self.filter_groups_metric
        mvals = None if metric is None else table.column(metric).to_pylist()
        sidx = table.column("sample_idx").to_pylist()
        existing = self.store.get_many(list(groups))
        puts, merges = [], {}
        for u, rows in groups.items():
            if u in existing:
                pgs = existing[u].get("global_steps", global_steps)
                merges[u] = {"status": "finished", "num_trajectories": len(rows)}
            else:
                pgs = int(global_steps)
                puts.append(
                    (
                        u,
                        {
                            "is_prompt": True,
                            "status": "finished",
                            "global_steps": pgs,
                            "num_trajectories": len(rows),
                        },
                    )
                )
            for i in rows:
                tags: dict[str, Any] = {
                    "status": "success",
                    "global_steps": pgs,
                    "sample_idx": int(sidx[i]),
                    "min_global_steps": int(vmin[i]),
                    "max_global_steps": int(vmax[i]),
                    "uri": uri,
                    "row": i,
                }
                if mvals is not None:
                    v = mvals[i]
                    tags["metric"] = None if v is None else float(v)
                puts.append((f"{u}_{int(sidx[i])}", tags))
        # trajectories of a re-added group replace the old ones (same keys); prompts are merged
        self.store.apply(puts=puts, merges=merges, partition=self.partition)

    # ------------------------------------------------------------------ consumer side
    def _trajectories(self, uids: Sequence[str]) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {u: [] for u in uids}
        if not uids:
            return out
        uids = list(uids)
        for i in range(0, len(uids), 500):
            for key, tags in self.store.items(self.partition, is_prompt=False, uid=uids[i : i + 500]):
                out[key.partition("_")[0]].append(tags)
        for group in out.values():
            group.sort(key=lambda t: t.get("sample_idx", 0))
        return out

    def _selection(self, selected: Sequence[str], trajs: dict[str, list[dict]]) -> Selection:
        """The rows of the ``selected`` groups (group order, then ``sample_idx``) as positions in the
        concatenated views of the files that hold them (row counts from their manifests; nothing read)."""
        order: list[tuple[str, int]] = [(t["uri"], int(t["row"])) for u in selected for t in trajs[u]]
        bases = list(dict.fromkeys(uri for uri, _ in order))
        offsets, offset = {}, 0
        for uri in bases:
            offsets[uri] = offset
            rows = self.store.manifest(*self.store.ref_of(uri)).get("rows")
            offset += int(rows) if rows is not None else self.store.read_uri(uri, verify=False).num_rows
        return Selection(bases, np.asarray([offsets[uri] + row for uri, row in order], dtype=np.int64))

    def read(self, selection: Selection) -> pa.Table:
        """The rows of ``selection`` as a table (what committing it as a stage and reading it back gives)."""
        views = [self.store.read_uri(u) for u in selection.bases]
        table = pa.concat_tables(views, promote_options="default") if len(views) > 1 else views[0]
        return table.take(pa.array(selection.positions, pa.int64()))

    def _staleness_metrics(self, global_steps: int, trajs: Iterable[dict], metrics: dict) -> None:
        spans, stale, worst = [], [], []
        for t in trajs:
            lo, hi = t.get("min_global_steps"), t.get("max_global_steps")
            if lo is None or hi is None:
                continue
            spans.append(hi - lo + 1)
            stale.append((global_steps - 1) - hi)
            worst.append((global_steps - 1) - lo)
        p = f"{self.prefix}/off_policy"
        _stats(f"{p}/trajectory_spans", spans, metrics)
        _stats(f"{p}/trajectory_staleness", stale, metrics)
        _stats(f"{p}/trajectory_staleness_worst", worst, metrics)

    def sample(self, global_steps: int, batch_size: int | None = None) -> tuple[pa.Table | None, dict]:
        """:meth:`sample_selection`, with the rows read as a table (``(None, metrics)`` when short)."""
        selection, metrics = self.sample_selection(global_steps, batch_size)
        return (None if selection is None else self.read(selection)), metrics

    def sample_selection(
        self, global_steps: int, batch_size: int | None = None
    ) -> tuple[Selection | None, dict]:
        """Take ``batch_size`` (default ``train_batch_size``) complete groups for ``global_steps``, oldest
        first, from the ledger alone (no stage file is read).

        Returns ``(selection, metrics)``, or ``(None, metrics)`` when not enough groups are sampleable
        (generate ``metrics["refill_needed"]`` more prompts) or when ``metrics["must_wait"]`` is True.
        Evictions are committed in the same transaction that marks the selected groups consumed.
        """
        batch_size = self.train_batch_size if batch_size is None else int(batch_size)
        if batch_size < 1:
            raise ReplayError(f"sample: batch_size={batch_size} must be >= 1")
        p = self.prefix
        metrics: dict[str, Any] = {f"{p}/global_step": global_steps, "must_wait": False, "refill_needed": 0}

        prompts = self.store.items(self.partition, is_prompt=True)
        again = [k for k, t in prompts if t.get("consumed_step") == global_steps]
        if again:  # crash-replay of an already sampled step: same groups, same order
            order_of = {k: t.get("consume_order", 0) for k, t in prompts}
            again.sort(key=lambda k: order_of[k])
            trajs = self._trajectories(again)
            self._staleness_metrics(global_steps, (t for u in again for t in trajs[u]), metrics)
            metrics[f"{p}/replay/resampled"] = 1
            return self._selection(again, trajs), metrics

        live = [(k, t) for k, t in prompts if t.get("consumed_step") is None]
        finished = [(k, t) for k, t in live if t.get("status") in ("finished", "failure")]
        inflight = [(k, t) for k, t in live if t.get("status") in ("pending", "running")]
        trajs = self._trajectories([k for k, _ in finished])
        evict_train = self.partition == "train"

        evict: list[str] = []
        stale_spans: list[int] = []
        n_filtered = n_failed = 0
        dapo_counts: Counter = Counter()
        sampleable: list[tuple[int, int, str]] = []
        for order, (uid, tags) in enumerate(finished):
            pgs = int(tags.get("global_steps", global_steps))
            span = global_steps - pgs + 1
            group = trajs[uid]
            if evict_train and (tags.get("status") == "failure" or not group):
                evict.append(uid)
                n_failed += 1
                continue
            if evict_train and self.strategy == "drop" and span > self.threshold:
                evict.append(uid)
                stale_spans.append(span)
                continue
            if evict_train and self.filter_groups_metric is not None:
                vals = [t.get("metric") for t in group]
                present = [v for v in vals if v is not None and not (isinstance(v, float) and math.isnan(v))]
                if len(present) == len(vals) and _is_filtered(present):
                    evict.append(uid)
                    n_filtered += 1
                    dapo_counts[vals[0]] += 1
                    continue
            sampleable.append((pgs, order, uid))

        metrics[f"{p}/off_policy/evicted_samples"] = len(stale_spans)
        _stats(f"{p}/off_policy/evicted_samples_staleness", stale_spans, metrics)
        metrics[f"{p}/filter_groups/evicted_samples"] = n_filtered
        metrics[f"{p}/rollout_failure/evicted_samples"] = n_failed
        if self.filter_groups_metric is not None:
            metrics[_DAPO_COUNTS_KEY] = dict(dapo_counts)
        metrics[f"{p}/replay/inflight_prompts"] = len(inflight)

        must_wait = (
            evict_train
            and self.strategy == "wait"
            and any(
                global_steps - int(t.get("global_steps", global_steps)) + 1 >= self.threshold
                for _, t in inflight
            )
        )
        evict_keys = self._group_keys(evict, trajs)
        sampleable.sort()
        if must_wait or len(sampleable) < batch_size:
            if evict_keys:
                self.store.delete(evict_keys)
            metrics["must_wait"] = bool(must_wait)
            metrics["refill_needed"] = max(0, batch_size - len(sampleable) - len(inflight))
            metrics[f"{p}/replay/sampleable_groups"] = len(sampleable)
            return None, metrics

        selected = [uid for _, _, uid in sampleable[:batch_size]]
        surplus = [uid for _, _, uid in sampleable[batch_size:]]
        if self.discard_surplus and surplus:
            evict_keys += self._group_keys(surplus, trajs)
            metrics[f"{p}/filter_groups/discarded_surplus_samples"] = len(surplus)
            remaining = 0
        else:
            remaining = len(surplus)
        merges = {uid: {"consumed_step": global_steps, "consume_order": i} for i, uid in enumerate(selected)}
        self.store.apply(merges=merges, deletes=evict_keys, partition=self.partition)

        metrics[f"{p}/replay/sampleable_groups"] = remaining
        metrics["refill_needed"] = max(0, batch_size - remaining - len(inflight))
        sel_trajs = [t for u in selected for t in trajs[u]]
        self._staleness_metrics(global_steps, sel_trajs, metrics)
        return self._selection(selected, trajs), metrics

    @staticmethod
    def _group_keys(uids: Iterable[str], trajs: dict[str, list[dict]]) -> list[str]:
        keys = []
        for u in uids:
            keys.append(u)
            keys.extend(f"{u}_{t['sample_idx']}" for t in trajs.get(u, []))
        return keys

    def release(self, up_to_step: int) -> int:
        """Delete the ledger keys of groups consumed at steps ``<= up_to_step`` (after a checkpoint covers
        them).

        Returns the number of groups released. Stage files stay (they are the step's record).
        """
        uids = [
            k
            for k, t in self.store.items(self.partition, is_prompt=True)
            if t.get("consumed_step") is not None and t["consumed_step"] <= up_to_step
        ]
        if not uids:
            return 0
        trajs = self._trajectories(uids)
        self.store.delete(self._group_keys(uids, trajs))
        return len(uids)
