"""The ledger writes of the synchronous step order: prompts drawn inside the generate task enter the ledger
`running` in one transaction, the reward task records the trajectories and finishes the prompts in one
transaction. A run SIGKILLed right after step 2's prompts are committed (before the ledger knows them)
resumes to the same ledger and weights as the uninterrupted reference run. The reward task also filters the
groups and assembles the step's batch once the kept groups suffice (no filter_groups or assemble_batch
task)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from dapo_core.config import load_config, typed
from dapo_core.store import RunStore
from tests.integration.conftest import (
    CONFIG,
    SHORT_RUN,
    kill_and_resume,
    tiny_overrides,
    train_cmd,
    train_here,
)

pytestmark = pytest.mark.slow

COMMON = dict(SHORT_RUN)


def _ledger(run: Path) -> dict[str, dict]:
    store = RunStore(run)
    try:
        return dict(store.items("train"))
    finally:
        store.close()


@pytest.mark.timeout(900)
def test_ledger_after_a_kill_between_prompt_commit_and_generation_equals_the_straight_run(
    tiny_assets, short_reference
):
    straight = short_reference
    ledger = _ledger(straight)
    prompts = {k: t for k, t in ledger.items() if t["is_prompt"]}
    n = 4  # actor_rollout_ref.rollout.n of tiny_overrides
    assert len(prompts) == 3 * 8  # gen_batch_size 8, one generation batch per step (no filtering)
    assert {t["status"] for t in ledger.values()} == {"finished"}
    for uid, tags in prompts.items():  # each prompt's n trajectories, at the prompt's step
        trajectories = {k: t for k, t in ledger.items() if k.startswith(f"{uid}_")}
        assert sorted(trajectories) == [f"{uid}_{s}" for s in range(n)]
        assert {t["global_steps"] for t in trajectories.values()} == {tags["global_steps"]}
    assert sorted({t["global_steps"] for t in prompts.values()}) == [1, 2, 3]

    def killed_after_step_2s_prompts(run: Path) -> None:
        assert (run / "ckpt" / "latest").read_text().strip() == "1"

    run = tiny_assets / "runs" / "ledger-killed"
    ov = tiny_overrides(tiny_assets, **COMMON, **{"trainer.experiment_name": "ledger-killed"})
    kill_and_resume(
        train_cmd(ov),
        run,
        "step_000002/prompts_g0.manifest.json",
        after_kill=killed_after_step_2s_prompts,
        resume=lambda: train_here(ov),
        reference=straight,
    )
    assert _ledger(run) == ledger


def _scored(uids: list[str], spread: list[bool], n: int, width: int) -> pa.Table:
    """A reward-stage table: `n` rows per uid, `acc` varying within a group where `spread` says so, responses
    of `width + group index` tokens (so the assembled batch's order can be told apart)."""
    rows = []
    for g, (uid, varies) in enumerate(zip(uids, spread, strict=True)):
        for s in range(n):
            rows.append(
                {
                    "uid": uid,
                    "sample_idx": s,
                    "prompt_ids": [1, 2, 3],
                    "response_ids": [4] * (width + g),
                    "acc": bool(s % 2) if varies else False,
                }
            )
    return pa.Table.from_pylist(rows)


def test_reward_filters_and_assembles_the_batch_once_the_kept_groups_suffice(tiny_assets):
    """Two generation batches (2 of 4 groups kept, then 3 of 4), their scored stages committed (the reward
    task replays them): the first reward task returns no batch, the second assembles it from both kept
    selections, truncated to train_batch_size groups (surplus discarded), every group whole, with the assemble
    metrics; a retry of the task returns the same. Without dynamic sampling the batch is assembled at once."""
    import flows.run_setup as rs
    from tasks.rollout import reward

    cfg = typed(load_config(CONFIG, tiny_overrides(tiny_assets, **{"trainer.use_ray": "false"})))
    rt = rs.open_run(cfg, "filterfold")
    try:
        n, need = rt.n, cfg.data.train_batch_size
        assert need == 4 and cfg.algorithm.filter_groups.enable
        gens, scored = [], []
        for k, (uids, accs, length) in enumerate(
            [(["a0", "a1", "a2", "a3"], [1, 0, 1, 0], 8), (["b0", "b1", "b2", "b3"], [1, 1, 0, 1], 20)]
        ):
            table = _scored(uids, accs, n, length)
            rt.store.register_prompts(uids, 1)  # what the generate task did
            gens.append(rt.store.write_stage(1, f"generate_g{k}", table))
            scored.append(rt.store.write_stage(1, f"reward_g{k}", table, base=gens[k]))
        first = reward.fn(rt, 1, 0, gens[0], [], need)
        assert first.uri == scored[0] and first.batch is None
        assert (
            first.kept_metrics["train/num_kept_groups"] == 2 and first.kept_metrics["train/num_groups"] == 4
        )
        assert not rt.store.is_committed(1, "batch")
        second = reward.fn(rt, 1, 1, gens[1], [first.kept_uri], need - 2)
        assert second.kept_metrics["train/num_kept_groups"] == 3 and second.batch is not None
        batch_uri, bm = second.batch
        assert bm["train/num_gen_batches"] == 2.0 and bm["train/discarded_surplus_groups"] == 1.0
        table = rt.store.read_uri(batch_uri)
        counts = table.group_by("uid").aggregate([("sample_idx", "count")]).to_pydict()
        assert sorted(counts["uid"]) == ["a0", "a2", "b0", "b1"] and set(counts["sample_idx_count"]) == {n}
        assert reward.fn(rt, 1, 1, gens[1], [first.kept_uri], need - 2) == second
    finally:
        rs.close_run(rt)
    off = {"trainer.use_ray": "false", "algorithm.filter_groups.enable": "false"}
    cfg = typed(load_config(CONFIG, tiny_overrides(tiny_assets, **off)))
    rt = rs.open_run(cfg, "nofilter")
    try:
        table = _scored(["c0", "c1", "c2", "c3"], [1, 1, 1, 1], rt.n, 8)
        rt.store.register_prompts(["c0", "c1", "c2", "c3"], 1)
        gen = rt.store.write_stage(1, "generate_g0", table)
        rt.store.write_stage(1, "reward_g0", table, base=gen)
        out = reward.fn(rt, 1, 0, gen)
        assert out.kept_uri == out.uri and out.kept_metrics == {} and out.batch is not None
        assert out.batch[1]["train/num_gen_batches"] == 1.0
        assert rt.store.read_uri(out.batch[0]).num_rows == 4 * rt.n  # all-equal groups kept: no filter
    finally:
        rs.close_run(rt)


def test_replayed_reward_stage_records_what_the_ledger_lacks(tiny_assets):
    """A run killed after a reward stage was committed but before its ledger transaction resumes with those
    prompts re-issued (pending, no trajectories); replaying the committed stage records the trajectories and
    finishes the prompts, and replaying it again changes nothing."""
    import flows.run_setup as rs
    from tasks.rollout import reward

    cfg = typed(load_config(CONFIG, tiny_overrides(tiny_assets, **{"trainer.use_ray": "false"})))
    rt = rs.open_run(cfg, "rewardreplay")
    try:
        n = rt.n
        table = _scored(["c0", "c1"], [True, False], n, 8)
        gen_uri = rt.store.write_stage(1, "generate_g0", table)
        rt.store.write_stage(1, "reward_g0", table, base=gen_uri)
        rt.store.register_prompts(["c0", "c1"], 1)
        rt.store.update_tags(["c1"], status="finished")  # a prompt the lost transaction had not reached
        reward.fn(rt, 1, 0, gen_uri)
        ledger = dict(rt.store.items("train"))
        assert sorted(ledger) == sorted(["c0", "c1", *(f"{u}_{s}" for u in ("c0", "c1") for s in range(n))])
        assert {t["status"] for t in ledger.values()} == {"finished"}
        assert {t["global_steps"] for t in ledger.values()} == {1}
        reward.fn(rt, 1, 0, gen_uri)
        assert dict(rt.store.items("train")) == ledger
    finally:
        rs.close_run(rt)
