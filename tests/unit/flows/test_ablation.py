"""The ablation grid (rows, seeds, `-S` overrides, names) and the summary of `dvc exp show --json`."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped]

from flows.ablation import (
    ROWS,
    SEED_KEYS,
    SWITCHES,
    MetricFiles,
    accuracy_estimate,
    done_names,
    exp_records,
    format_table,
    grid,
    param_args,
    parse_rows,
    parse_seeds,
    summarize,
)

ROOT = Path(__file__).resolve().parents[3]
PARAMS = "pipelines/smollm2/params.yaml"
FILES = MetricFiles(
    "metrics/smollm2/train.json", "metrics/smollm2/eval.json", "metrics/smollm2/eval_greedy.json"
)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_rows_are_cumulative_from_naive_grpo_to_dapo():
    assert [r.index for r in ROWS] == list(range(6)) and len(SWITCHES) == 5
    assert ROWS[0].values() == {s.key: s.off for s in SWITCHES}
    assert ROWS[-1].values() == {s.key: s.on for s in SWITCHES}
    for before, row in itertools.pairwise(ROWS):
        changed = {k for k, v in row.values().items() if before.values()[k] != v}
        assert changed == {SWITCHES[row.index - 1].key}, row.title


def test_the_dapo_row_is_the_real_model_lineage_with_overlong_filtering_added():
    lineage = _flat(yaml.safe_load((ROOT / PARAMS).read_text()))
    dapo = ROWS[-1].values()
    for key, value in dapo.items():
        if key == "actor_rollout_ref.actor.mask_truncated_responses":
            assert lineage[key] is False  # off in the lineage, as in every config by default
        else:
            assert lineage[key] == value, key
    assert lineage["actor_rollout_ref.actor.clip_ratio_low"] == ROWS[0].values()[SWITCHES[1].key] == 0.2


def test_grid_names_order_and_parameters():
    exps = grid(ROWS, [1, 2], steps=20, test_freq=5)
    assert [e.name for e in exps][:2] == ["r0-naive-grpo-s1", "r1-overlong-filtering-s1"]
    assert [e.seed for e in exps] == [1] * 6 + [2] * 6  # seed-major: an interrupted grid has whole seeds
    assert len({e.name for e in exps}) == 12
    for e in exps:
        assert {e.params[k] for k in SEED_KEYS} == {e.seed}
        assert e.params["trainer.total_training_steps"] == 20 and e.params["trainer.test_freq"] == 5
    a, b = exps[2], exps[3]  # + clip-higher, + soft overlong punishment at seed 1
    assert {k for k in a.params if a.params[k] != b.params[k]} == {"reward_model.overlong_buffer.enable"}
    with pytest.raises(ValueError, match="total_training_steps"):
        grid(ROWS, [1], steps=0, test_freq=5)
    with pytest.raises(ValueError, match="test_freq"):
        grid(ROWS, [1], steps=2, test_freq=0)


def test_set_param_arguments_parse_to_the_typed_values_dvc_writes(tmp_path):
    from dvc.utils.hydra import apply_overrides

    exp = grid([ROWS[0]], [3], steps=2, test_freq=-1)[0]
    args = param_args(exp, "params.yaml")
    assert args[0] == "-S" and args[1].startswith("params.yaml:++")
    params = tmp_path / "params.yaml"
    params.write_text("trainer:\n  seed: 1\nactor_rollout_ref:\n  actor:\n    clip_ratio_high: 0.28\n")
    apply_overrides(str(params), [a.split(":", 1)[1] for a in args[1::2]])
    written = _flat(yaml.safe_load(params.read_text()))
    assert written == exp.params
    assert written["actor_rollout_ref.actor.loss_agg_mode"] == "seq-mean-token-mean"
    assert written["actor_rollout_ref.actor.mask_truncated_responses"] is False
    assert written["actor_rollout_ref.actor.clip_ratio_high"] == 0.2 and written["trainer.seed"] == 3


def test_rows_and_seeds_options():
    assert [r.index for r in parse_rows("dapo,0")] == [0, 5]
    assert parse_rows("all") == list(ROWS)
    with pytest.raises(ValueError, match="no row '7'"):
        parse_rows("0,7")
    assert parse_seeds("2,1") == [2, 1]
    for bad in ("", "1,1", "x"):
        with pytest.raises(ValueError, match="--seeds"):
            parse_seeds(bad)


def _eval(acc: float, k: int, problems: int = 200) -> dict:
    return {"data": {"metrics": {f"val-core/word/acc/mean@{k}": acc, "eval/num_prompts": float(problems)}}}


def _exp(
    name: str, params: dict, *, greedy: float, sampled: float, entropy: float, length: float, state="success"
):
    tree: dict = {}
    for key, value in params.items():
        node = tree
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    metrics = {
        FILES.train: {"data": {"final": {"entropy": entropy, "response_len": length}}},
        FILES.sampled: _eval(sampled, 4),
        FILES.greedy: _eval(greedy, 1),
    }
    rev: dict[str, Any] = {
        "rev": "abc",
        "name": name,
        "error": None,
        "data": {"params": {PARAMS: {"data": tree}}, "metrics": metrics},
    }
    if state == "failed":
        rev["error"] = {"msg": "Experiment run failed", "type": ""}
        rev["data"]["metrics"] = {FILES.train: {"error": {"type": "FileNotFoundError", "msg": "no"}}}
    return {"revs": [rev], "name": name, "executor": {"state": state, "local": {}}}


def _show(*experiments) -> list:
    baseline: dict[str, Any] = {
        "rev": "workspace",
        "name": None,
        "data": {"params": {}, "metrics": {}},
        "experiments": None,
    }
    return [baseline, {"rev": "f00", "name": "main", "data": {}, "experiments": list(experiments)}]


def test_finished_experiments_with_the_same_parameters_are_not_run_again():
    exps = grid(ROWS[:3], [1], steps=2, test_freq=1)
    show = _show(
        _exp(exps[0].name, exps[0].params, greedy=0.2, sampled=0.1, entropy=0.5, length=30),
        _exp(exps[1].name, exps[1].params, greedy=0.2, sampled=0.1, entropy=0.5, length=30, state="failed"),
        _exp(exps[2].name, {**exps[2].params, "trainer.seed": 9}, greedy=0, sampled=0, entropy=0, length=0),
        _exp("unrelated", {}, greedy=0, sampled=0, entropy=0, length=0, state="queued"),
    )
    records = exp_records(show)
    assert [r.state for r in records] == ["success", "failed", "success", "queued"]
    done, clashes = done_names(records, exps, PARAMS)
    assert done == {exps[0].name}
    assert list(clashes) == [exps[2].name] and clashes[exps[2].name] == ["trainer.seed: 9 -> 1"]


def test_summary_table_from_a_synthetic_exp_show():
    exps = grid(ROWS[:2], [1, 2], steps=2, test_freq=1)
    values = {  # (greedy, mean@4, entropy, length) per experiment
        exps[0].name: (0.30, 0.20, 0.60, 31.0),
        exps[1].name: (0.40, 0.30, 0.50, 29.0),
        exps[2].name: (0.34, 0.22, 0.64, 33.0),
        # exps[3] (row 1, seed 2) failed: row 1 has one seed
    }
    show = _show(
        *(
            _exp(e.name, e.params, greedy=g, sampled=s, entropy=h, length=n)
            for e in exps[:3]
            for g, s, h, n in [values[e.name]]
        ),
        _exp(exps[3].name, exps[3].params, greedy=1, sampled=1, entropy=1, length=1, state="failed"),
    )
    rows = summarize(exp_records(show), exps, FILES, PARAMS)
    naive, plus = rows
    assert naive.seeds == [1, 2] and plus.seeds == [1]
    p = 0.32  # mean of 0.30, 0.34: SE² = s²/2 + p(1-p)/200, s² = 0.0008
    assert naive.greedy is not None and naive.greedy.mean == pytest.approx(p)
    assert naive.greedy.se == pytest.approx(math.sqrt(0.0008 / 2 + p * (1 - p) / 200))
    assert naive.entropy is not None and naive.entropy.mean == pytest.approx(0.62)
    assert naive.entropy.se == pytest.approx(0.02)
    assert plus.sampled is not None and plus.sampled.se == pytest.approx(math.sqrt(0.3 * 0.7 / 200))
    assert plus.entropy is not None and plus.entropy.se is None  # one seed: no spread to estimate
    table = format_table(rows).splitlines()
    assert table[0].startswith("| row | seeds | held-out greedy | held-out mean@4 |")
    assert table[2] == "| naive GRPO | 1,2 | 32.0 % ± 3.9 | 21.0 % ± 3.0 | 0.620 ± 0.020 | 32.0 ± 1.0 |"
    assert table[3] == "| + overlong filtering | 1 | 40.0 % ± 3.5 | 30.0 % ± 3.2 | 0.500 | 29.0 |"


def test_a_row_without_a_finished_seed_has_no_numbers_and_estimates_need_problems_or_seeds():
    exps = grid(ROWS[:1], [1], steps=2, test_freq=1)
    rows = summarize(exp_records(_show()), exps, FILES, PARAMS)
    assert rows[0].seeds == [] and rows[0].greedy is None
    assert "| naive GRPO | none finished | n/a | n/a | n/a | n/a |" in format_table(rows)
    assert accuracy_estimate([0.5], 0).se is None
