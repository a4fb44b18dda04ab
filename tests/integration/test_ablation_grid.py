"""`dapo ablate` on the tiny lineage: two rows of the DAPO ablation table (naive GRPO, + overlong filtering)
at one seed and two steps, through real `dvc exp run --queue` and `dvc exp run --run-all` in a fresh clone.

The clone's root lineage gets what `pipelines/smollm2/dvc.yaml` has for the grid: its train and evaluate
commands reach the venv through `$DVC_ROOT` (the queue runs them in temporary copies of the clone), train
tracks the switches and the seeds, and its plots (a curve each) are the real-model lineage's. Its data and
base model are the test run's tiny assets (built by the same flows), recorded with `dvc commit`;
`tests/integration/test_dvc_lineage.py` runs those stages."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml  # type: ignore[import-untyped]

from flows.ablation import ROWS, SEED_KEYS, SWITCHES, exp_records

ROOT = Path(__file__).resolve().parents[2]
DVC = ROOT / ".venv" / "bin" / "dvc"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not DVC.exists(), reason="dvc is installed in .venv by `make setup`"),
]

TINY = {  # the shapes of tests/integration/conftest.tiny_overrides, which built the tiny assets
    "data": {
        "train_batch_size": 4,
        "gen_batch_size": 8,
        "max_response_length": 12,  # below the tiny model's usual length: overlong filtering masks rows
        "synthetic": {"num_train": 400, "num_val": 16},
    },
    "actor_rollout_ref": {
        "model": {"sft": {"steps": 40}},
        "actor": {"ppo_mini_batch_size": 2, "ppo_micro_batch_size_per_gpu": 8},
        "rollout": {"n": 4},
    },
    "trainer": {"save_freq": 1, "use_ray": False, "logger": ["jsonl"]},
    "eval": {"n": 2},
}
TRACKED = {  # the keys the grid sets that train must track, at the tiny config's values
    **{s.key: s.on for s in SWITCHES},
    SWITCHES[0].key: False,  # overlong filtering: off in every config
    "actor_rollout_ref.actor.clip_ratio_low": 0.2,
    "data.seed": 1,
}
ABLATE = ["--pipeline", "dvc.yaml", "--rows", "0,1", "--seeds", "1", "--steps", "2", "--test-freq", "2"]


def _merge(dst: dict, src: dict) -> dict:
    for k, v in src.items():
        dst[k] = _merge(dst.get(k, {}), v) if isinstance(v, dict) else v
    return dst


def _set(tree: dict, key: str, value: object) -> None:
    *parents, leaf = key.split(".")
    for p in parents:
        tree = tree.setdefault(p, {})
    tree[leaf] = value


def _run(cmd: list[str], cwd: Path, env: dict, *, stdout_only: bool = False) -> str:
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False, timeout=900)
    assert p.returncode == 0, f"{' '.join(cmd)}:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return p.stdout if stdout_only else p.stdout + p.stderr


def _tiny_grid_lineage(repo: Path, assets: Path, env: dict) -> None:
    """The clone's root lineage made ready for the grid (see the module docstring), committed."""
    spec = yaml.safe_load((repo / "dvc.yaml").read_text().replace("milestones: 10,30", "milestones: 1,2"))
    for stage in spec["stages"].values():
        cmd = stage["cmd"].replace(".venv/bin/dapo ", ".venv/bin/python -m flows.cli ")
        stage["cmd"] = cmd.replace(".venv/bin/python ", '"$DVC_ROOT"/.venv/bin/python ')
    spec["stages"]["train"]["params"] += list(TRACKED)
    real = yaml.safe_load((repo / "pipelines" / "smollm2" / "dvc.yaml").read_text())["plots"]
    spec["plots"] = yaml.safe_load(yaml.safe_dump(real).replace("../../metrics/smollm2/", "metrics/"))
    (repo / "dvc.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    params = _merge(yaml.safe_load((repo / "params.yaml").read_text()), TINY)
    for key, value in TRACKED.items():
        _set(params, key, value)
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    shutil.copytree(assets / "data", repo / "data", dirs_exist_ok=True)
    shutil.copytree(assets / "models" / "tiny_base", repo / "models" / "tiny_base")
    _run([str(DVC), "commit", "-f", "prepare", "base_model"], repo, env)
    _run(["git", "add", "-A"], repo, env)
    _run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "tiny grid lineage"], repo, env
    )


def _y_fields(spec: object) -> set[str]:
    """The columns a DVC vega-lite plot draws on its y axis, wherever they are nested."""
    if isinstance(spec, dict):
        y = spec.get("y")
        own = {y["field"]} if isinstance(y, dict) and isinstance(y.get("field"), str) else set()
        dash = spec.get("strokeDash")  # several columns: told apart by their dash, listed in its scale
        if isinstance(dash, dict) and dash.get("field") == "field":
            own |= set(dash.get("scale", {}).get("domain", []))
        return own.union(*(_y_fields(v) for v in spec.values()))
    if isinstance(spec, list):
        return set().union(*(_y_fields(v) for v in spec))
    return set()


def _table_row(out: str, title: str) -> list[str]:
    lines = [ln for ln in out.splitlines() if ln.startswith(f"| {title} |")]
    assert len(lines) == 1, out[-3000:]
    return [c.strip() for c in lines[0].strip("|").split("|")]


@pytest.mark.timeout(900)
def test_two_rows_run_as_queued_dvc_experiments_and_a_second_run_reruns_nothing(tmp_path, tiny_assets):
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "DVC_NO_ANALYTICS": "1"}
    repo = tmp_path / "clone"
    _run(["git", "clone", "-q", str(ROOT), str(repo)], tmp_path, env)
    (repo / ".venv").symlink_to(ROOT / ".venv")
    _tiny_grid_lineage(repo, tiny_assets, env)

    first = _run([sys.executable, "-m", "flows.cli", "ablate", *ABLATE], repo, env)  # `dapo ablate`
    assert first.count("$ dvc exp run --queue") == 2 and "$ dvc exp run --run-all -j 1" in first
    for title in ("naive GRPO", "+ overlong filtering"):
        _, seeds, greedy, sampled, entropy, length = _table_row(first, title)
        assert seeds == "1" and greedy == "n/a"  # the tiny lineage has no greedy evaluation
        assert sampled.split()[1:3] == ["%", "±"] and 0 <= float(sampled.split()[0]) <= 100, first[-3000:]
        assert float(entropy) > 0 and float(length) > 0

    show = json.loads(_run([str(DVC), "exp", "show", "--json"], repo, env, stdout_only=True))
    records = {r.name: r for r in exp_records(show)}
    assert set(records) == {"r0-naive-grpo-s1", "r1-overlong-filtering-s1"}
    assert all(r.ok for r in records.values())
    a, b = (records[n].params["params.yaml"] for n in ("r0-naive-grpo-s1", "r1-overlong-filtering-s1"))
    assert {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)} == {SWITCHES[0].key}
    assert ROWS[0].values().items() <= a.items() and ROWS[1].values().items() <= b.items()
    assert {a[k] for k in SEED_KEYS} == {1} and a["trainer.total_training_steps"] == 2
    trained = [
        records[n].metrics["metrics/train.json"] for n in ("r0-naive-grpo-s1", "r1-overlong-filtering-s1")
    ]
    assert trained[0]["run_id"] != trained[1]["run_id"]  # two training runs, one per row
    assert trained[0]["final"] != trained[1]["final"]  # the masked truncated rows changed the first update

    second = _run([sys.executable, "-m", "flows.ablation_run", *ABLATE], repo, env)  # its light entry
    assert "2 finished, 0 in the queue, 0 to queue" in second
    assert "$ dvc exp run" not in second and "Reproducing experiment" not in second
    assert _table_row(second, "naive GRPO") == _table_row(first, "naive GRPO")
    shown = _run([str(DVC), "exp", "show", "--json"], repo, env, stdout_only=True)
    assert {r.name for r in exp_records(json.loads(shown))} == set(records)

    targets = [
        "held-out-accuracy",
        "entropy",
        "response-length",
        "clip-fractions",
        "metrics/train_curves.csv",
    ]
    assert f"--targets {' '.join(targets)}" in first
    shown = _run(
        [str(DVC), "plots", "diff", *records, "--json", "--targets", *targets], repo, env, stdout_only=True
    )
    overlaid = json.loads(shown)["data"]  # each plot with both experiments' curves
    columns = {f for plots in overlaid.values() for p in plots for f in _y_fields(p["content"])}
    assert {"val_acc", "entropy", "response_len", "clipfrac", "clipfrac_lower"} <= columns, columns
    assert all(set(p["revisions"]) == set(records) for plots in overlaid.values() for p in plots)
