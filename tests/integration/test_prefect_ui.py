"""The Prefect UI as the control room: artifacts of a run and of an evaluation (ephemeral API), deployment
parameters, the fault-injection switch, and Retry / Crashed on a real Prefect server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager, suppress
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from safetensors.torch import load_file

from dapo_core.config import ConfigError, load_config, to_yaml
from flows.artifacts import STEP_COLUMNS, artifact_key, step_row
from tests.helpers import wait_for
from tests.integration.conftest import CONFIG, SHORT_RUN, tiny_overrides
from tests.integration.prefect_server import prefect_server, stop

ROOT = Path(__file__).resolve().parents[2]


def _artifacts(key: str, flow_run_id: Any = None) -> list:
    """Every version of artifact `key` (published by the flow run `flow_run_id` when given), oldest first,
    from the Prefect API the tests use (shared by every test of the run: a key two tests publish needs the
    id)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
    from prefect.client.schemas.sorting import ArtifactSort

    by_run = None if flow_run_id is None else ArtifactFilterFlowRunId(any_=[flow_run_id])
    with get_client(sync_client=True) as client:
        newest_first = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key]), flow_run_id=by_run),
            sort=ArtifactSort.CREATED_DESC,
        )
    return newest_first[::-1]


def test_artifact_keys_follow_prefects_rule():
    assert artifact_key("dapo", "DAPO-Qwen2.5-32B", "steps") == "dapo-dapo-qwen2-5-32b-steps"
    assert (
        artifact_key("dapo", "20261130-150922-3333_x", "progress") == "dapo-20261130-150922-3333-x-progress"
    )
    row = step_row(
        3, {"critic/score/mean": 0.5, "val-core/a/acc/mean@4": 0.25, "actor/entropy": float("nan")}
    )
    assert row["step"] == 3 and row["score"] == 0.5 and row["val_acc"] == 0.25
    assert row["entropy"] is None and row["clipfrac"] is None


def test_one_card_per_artifact_updated_in_place_also_across_attempts(prefect_home, tmp_path):
    """Steps within the publish interval share a table update; a validated step publishes at once, and close()
    publishes what is still queued. A second attempt of the same flow run (a Retry) updates the same progress,
    table and summary artifacts, its table starting with the steps logged before it (metrics.jsonl)."""
    from prefect import flow

    from flows.artifacts import RunArtifacts

    @flow(name="artifact-coalescing")
    def publish() -> list[int]:
        ui = RunArtifacts("coalesce", tmp_path, total_steps=8, done_steps=0, min_interval_s=3600.0)
        for step in range(1, 7):
            val = {"val-core/a/acc/mean@4": 0.5} if step == 4 else {}
            ui.step(step, {"critic/score/mean": float(step), **val})
        ui.close()
        updates = [ui.table_updates]
        with (tmp_path / "metrics.jsonl").open("w") as f:  # what the first attempt logged
            for step in range(1, 7):
                f.write(json.dumps({"step": step, "critic/score/mean": float(step)}) + "\n")
        again = RunArtifacts("coalesce", tmp_path, total_steps=8, done_steps=5, min_interval_s=3600.0)
        for step in (6, 7, 8):  # step 6 was logged but not checkpointed: redone
            again.step(step, {"critic/score/mean": 10.0 * step})
        again.summary(8, final=True)
        late = tmp_path / "late"  # killed after its last checkpoint, before the table showed it
        late.mkdir()
        first = RunArtifacts("late", late, total_steps=3, done_steps=0, min_interval_s=3600.0)
        first.step(1, {"critic/score/mean": 1.0})
        first.close()
        with (late / "metrics.jsonl").open("w") as f:
            for step in range(1, 4):
                f.write(json.dumps({"step": step, "critic/score/mean": float(step)}) + "\n")
        done = RunArtifacts("late", late, total_steps=3, done_steps=3, min_interval_s=3600.0)
        done.summary(3, final=True)  # nothing left to train: the retry publishes the history it read
        return [*updates, again.table_updates, done.table_updates]

    assert publish() == [3, 2, 1]  # [1], [2, 3, 4] (validated), [5, 6] (close); [1..6], [1..8]; [1..3]
    late = _artifacts("dapo-late-steps")
    assert len(late) == 1 and [r["step"] for r in json.loads(late[0].data)] == [3, 2, 1]
    steps = _artifacts("dapo-coalesce-steps")
    assert len(steps) == 1
    rows = json.loads(steps[0].data)
    assert [r["step"] for r in rows] == [8, 7, 6, 5, 4, 3, 2, 1]  # newest first, the whole history
    assert [r["score"] for r in rows[:3]] == [80.0, 70.0, 60.0] and rows[3]["score"] == 5.0
    progress = _artifacts("dapo-coalesce-progress")
    assert len(progress) == 1 and float(progress[0].data) == 100.0  # the same artifact, at the last step
    summary = _artifacts("dapo-coalesce-summary")
    assert len(summary) == 1 and "finished" in summary[0].data and "8 / 8" in summary[0].data


def test_config_parameter_accepts_name_path_and_yaml(prefect_home):  # Prefect reads its env at import
    from flows.dapo_train import resolve_config

    by_name = resolve_config("tiny_cpu", ["trainer.total_training_steps=3"])
    by_path = resolve_config(str(CONFIG), ["trainer.total_training_steps=3"])
    by_text = resolve_config(to_yaml(load_config(CONFIG, ["trainer.total_training_steps=3"])))
    assert by_name == by_path == by_text
    assert by_name.trainer.total_training_steps == 3
    with pytest.raises(ConfigError, match="tiny_cpu"):
        resolve_config("tiny-cpu")


@pytest.mark.slow
def test_training_and_evaluation_publish_artifacts(tiny_assets):
    from flows.dapo_train import dapo_train
    from flows.evaluate import evaluate_flow

    run = "ui-Artifacts"
    ov = tiny_overrides(
        tiny_assets,
        **{
            "trainer.use_ray": "false",
            "trainer.total_training_steps": 2,
            "trainer.save_freq": 2,
            "trainer.test_freq": 2,
            "trainer.val_before_train": "true",
            "algorithm.filter_groups.enable": "false",
            "trainer.logger": "[jsonl]",
        },
    )
    out = dapo_train("tiny_cpu", run, ov)  # the deployment's parameters: a config name, a run id, overrides
    assert out["train_step"] == 2
    assert list(Path(out["run_dir"]).glob("config*.yaml"))  # the resolved config is recorded with the run

    progress = _artifacts("dapo-ui-artifacts-progress")
    assert len(progress) == 1 and progress[0].type == "progress" and float(progress[0].data) == 100.0
    steps = _artifacts("dapo-ui-artifacts-steps")
    assert [s.type for s in steps] == ["table"]  # one table, updated in place: a row per step, newest first
    rows = json.loads(steps[0].data)[::-1]
    assert [r["step"] for r in rows] == [1, 2]
    for col in [c for c, _ in STEP_COLUMNS]:  # every column has a value
        assert isinstance(rows[0][col], float), col
    assert "val_acc" in rows[1] and "val_acc" not in rows[0]
    summary = _artifacts("dapo-ui-artifacts-summary")
    assert len(summary) == 1  # updated after the validation of step 2, and at the end
    final = summary[-1].data
    assert "finished" in final and "`ui-Artifacts`" in final and "step 0" in final and "→ step 2" in final
    assert "curves.png" in final and "data:image/png;base64," in final  # drawn when the run closed

    state = evaluate_flow(
        to_yaml(load_config(CONFIG, tiny_overrides(tiny_assets))),
        str(tiny_assets / "models" / "tiny_base"),
        output=str(tiny_assets / "eval_ui.json"),
        return_state=True,
    )
    metrics, flow_run = state.result(), state.state_details.flow_run_id  # other tests evaluate tiny_base too
    table = _artifacts("dapo-eval-tiny-base", flow_run)
    assert table, "evaluation table artifact"
    published = {r["metric"]: r["value"] for r in json.loads(table[-1].data)}
    acc_key = next(k for k in metrics if k.startswith("val-core/") and "/acc/mean@" in k)
    assert published[acc_key] == pytest.approx(metrics[acc_key])
    assert "eval_ui.json" in _artifacts("dapo-eval-tiny-base-summary", flow_run)[-1].data


def test_fault_switch_is_inert_when_unset(prefect_home, monkeypatch):
    from tasks.faults import injected_fault

    monkeypatch.delenv("DAPO_FAULT", raising=False)
    assert injected_fault("update_actor", 2, "r") is None
    monkeypatch.setenv("DAPO_FAULT", "update_actor:2")
    assert injected_fault("update_actor", 1, "r") is None
    assert injected_fault("old_log_prob", 2, "r") is None
    assert "DAPO_FAULT" in (injected_fault("update_actor", 2, "r") or "")
    monkeypatch.setenv("DAPO_FAULT", "update_actor:2:other-run")
    assert injected_fault("update_actor", 2, "r") is None
    monkeypatch.setenv("DAPO_FAULT", "update_actor:2:nightly-*")
    assert injected_fault("update_actor", 2, "nightly-1a2b") is not None
    assert injected_fault("update_actor", 2, "daily-1a2b") is None
    monkeypatch.setenv("DAPO_FAULT", "nonsense")
    with pytest.raises(ValueError, match="DAPO_FAULT"):
        injected_fault("update_actor", 2, "r")
    assert os.environ["DAPO_FAULT"] == "nonsense"


# ----------------------------------------------------------------------------- a real Prefect server
ZOMBIE_WITHIN_S = 60
"""Seconds without a heartbeat before the automation crashes a run (tests: two 30 s beats)."""
SERVED = SHORT_RUN
"""The tiny deployment: the reference run's 3 steps, a checkpoint after each, no validation, in-process
workers."""


@contextmanager
def _client(api: str):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        yield client


FAST_EVENTS = {
    "PREFECT_SERVER_EVENTS_PROACTIVE_GRANULARITY": "PT1S",  # an ISO 8601 duration (a timedelta setting)
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL": "1",
}
"""The test server's event timing: proactive automations (the zombie one) evaluated every second (Prefect's
default: 5 s, which a missed heartbeat's Crashed waits for on top of `--within`), and received events stored
within a second (default 5 s) for the events API the host-loss test reads its heartbeat from."""


@pytest.fixture(scope="module")
def server(tmp_path_factory, prefect_home):
    """`prefect server start` on a free loopback port (`FAST_EVENTS`), with infra/'s zombie automation."""
    home = tmp_path_factory.mktemp("prefect_server")
    with prefect_server(home, PREFECT_RUNNER_POLL_FREQUENCY="2", **FAST_EVENTS) as (api, env):
        auto = subprocess.run(
            [sys.executable, str(ROOT / "infra" / "zombie_automation.py"), "--within", str(ZOMBIE_WITHIN_S)],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        assert auto.returncode == 0, auto.stderr[-2000:]
        yield SimpleNamespace(api=api, env=env)


def _serve(server, assets: Path, name: str, served: dict | None = None, **env) -> subprocess.Popen:
    """`dapo deploy` serving dapo-train/<name> with the tiny overrides and `served` (default `SERVED`) in its
    own session (killable as one)."""
    ov = tiny_overrides(assets, **(SERVED if served is None else served))
    return subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "deploy", "--config", str(CONFIG), "--name", name, *ov],
        env={**server.env, **env},
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _deployment(client, name: str, serve: subprocess.Popen, timeout: float = 300):
    def found():
        try:
            return client.read_deployment_by_name(f"dapo-train/{name}")
        except Exception:
            return None

    return wait_for(found, f"deployment dapo-train/{name}", timeout, 0.5, alive=serve)


def _final_state(client, flow_run_id, timeout: float, proc=None):
    def final():
        state = client.read_flow_run(flow_run_id).state
        return state if state is not None and state.is_final() else None

    return wait_for(final, f"flow run {flow_run_id} to finish", timeout, 0.5, alive=proc)


def _heartbeats(api: str, flow_run_id) -> int:
    """How many `prefect.flow-run.heartbeat` events of `flow_run_id` the server at `api` has stored."""
    import httpx

    body = {
        "filter": {
            "event": {"name": ["prefect.flow-run.heartbeat"]},
            "resource": {"id": [f"prefect.flow-run.{flow_run_id}"]},
        },
        "limit": 1,
    }
    r = httpx.post(f"{api}/events/filter", json=body, timeout=10)
    r.raise_for_status()
    return int(r.json()["total"])


def _task_runs(client, flow_run_id) -> list:
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId

    return client.read_task_runs(
        task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run_id]))
    )


def _settled_task_runs(client, flow_run_id, timeout_s: float = 120) -> list:
    """The flow run's task runs once none of them is RUNNING. A finished run's last task states reach the
    server's database after its flow-run state (they travel as events, which the server records on its own
    schedule), so a task run that stays RUNNING past `timeout_s` is one left running for good."""
    from prefect.client.schemas.objects import StateType

    def settled() -> list | None:
        runs = _task_runs(client, flow_run_id)
        return None if any(t.state_type == StateType.RUNNING for t in runs) else runs

    return wait_for(settled, "every task run of the finished run to leave RUNNING", timeout_s, 0.5)


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc), children first."""
    parents: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _manifests(run: Path) -> dict[str, str]:
    return {str(p.relative_to(run)): p.read_text() for p in sorted(run.glob("step_*/*.manifest.json"))}


def _weights(run: Path, step: int) -> dict:
    return load_file(str(run / "ckpt" / f"step_{step}" / "actor" / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_retry_from_the_ui_continues_the_failed_run(server, tiny_assets, short_reference):
    """A stage fails at step 2 (DAPO_FAULT); Retry as the UI does it (set_state AwaitingRetry) finishes the
    run without recomputing what was committed, and the weights equal the uninterrupted reference run's (the
    deployment serves `SHORT_RUN`, as the reference was trained)."""
    from prefect.client.schemas.objects import StateType
    from prefect.states import AwaitingRetry

    serve = _serve(server, tiny_assets, "ci", DAPO_FAULT="update_actor:2:retry-me-*")
    try:
        with _client(server.api) as client:
            dep = _deployment(client, "ci", serve)
            assert dep.parameters["config"] == "tiny_cpu" and dep.parameters["run_id"] == ""
            assert "trainer.total_training_steps=3" in dep.parameters["overrides"]

            # run_id left empty: a new run named after the flow run, `retry-me-<8 hex of its id>`
            failing = client.create_flow_run_from_deployment(dep.id, name="retry-me")
            state = _final_state(client, failing.id, 600, serve)
            assert state.type == StateType.FAILED
            run = tiny_assets / "runs" / f"retry-me-{str(failing.id)[:8]}"
            before = _manifests(run)
            assert "step_000001/update_actor.manifest.json" in before
            assert "step_000002/generate_g0.manifest.json" in before
            assert "step_000002/update_actor.manifest.json" not in before
            assert (run / "ckpt" / "latest").read_text().strip() == "1"

            # the UI's Retry button: POST /flow_runs/<id>/set_state {Scheduled "AwaitingRetry"}, force=false
            result = client.set_flow_run_state(
                failing.id, AwaitingRetry(message="Retry from the UI"), force=False
            )
            assert result.status.value == "ACCEPT", result
            assert _final_state(client, failing.id, 600, serve).type == StateType.COMPLETED
            assert client.read_flow_run(failing.id).run_count == 2
    finally:
        stop(serve)
    after = _manifests(run)
    kept = {
        k: v
        for k, v in before.items()
        if k.startswith("step_000001/")
        or k.split("/")[1].startswith(("prompts_g", "generate_g", "reward_g", "batch"))
    }
    assert kept and all(
        after[k] == v for k, v in kept.items()
    )  # committed before the failure: not recomputed
    assert "step_000003/update_actor.manifest.json" in after
    a, b = _weights(short_reference, 3), _weights(run, 3)
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] == b[k]).all(), k


HOST_LOSS_RUN = {**SERVED, "trainer.total_training_steps": 2}
"""The host-loss test's deployment: `SERVED` with 2 steps (held in the last; the Retry trains that one)."""


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_host_loss_marks_the_run_crashed(server, tiny_assets):
    """Kill the serving process and the flow-run process together (SIGKILL) while the run is held in step 2
    (`DAPO_FAULT=hang@...`, once): the heartbeat automation of infra/zombie_automation.py marks the run
    Crashed within a bounded time; `dapo deploy` serves again (started while the server has yet to notice the
    loss: its start-up overlaps the wait), and Retry (the UI's button) continues the crashed run to the end,
    replaying what it had committed."""
    from prefect.client.schemas.objects import StateType
    from prefect.states import AwaitingRetry

    held = {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30", "DAPO_FAULT": "hang@generate_g0:2:zombie"}
    serve = _serve(server, tiny_assets, "zombie", HOST_LOSS_RUN, **held)
    try:
        with _client(server.api) as client:
            dep = _deployment(client, "zombie", serve)
            fr = client.create_flow_run_from_deployment(
                dep.id,
                parameters={"run_id": "zombie"},
            )
            marker = tiny_assets / "runs" / "zombie" / "step_000001" / "generate_g0.manifest.json"
            hung = tiny_assets / "runs" / "zombie" / "faults" / "hang@generate_g0#0:2.done"
            wait_for(hung.exists, "the run to be held in step 2's generation", 300, alive=serve)
            assert client.read_flow_run(fr.id).state.type == StateType.RUNNING
            wait_for(
                lambda: _heartbeats(server.api, fr.id),
                f"the server to record a heartbeat event of flow run {fr.id}",
                120,  # the first beat goes out when the flow run starts; the server stores events in batches
                0.5,
                alive=serve,
            )
            victims = _descendants(serve.pid)  # the flow-run process (and anything it started)
            assert victims, "the flow run should run in a child process of the runner"
            os.killpg(serve.pid, signal.SIGKILL)  # the host is gone: runner and flow run die together
            for pid in victims:
                with suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            serve.wait()
            killed = time.time()
            committed = marker.read_text()
            serve = _serve(
                server, tiny_assets, "zombie", HOST_LOSS_RUN, **held
            )  # the hang acted once: it passes
            state = _final_state(client, fr.id, ZOMBIE_WITHIN_S + 120, serve)
            took = time.time() - killed
            assert state.type == StateType.CRASHED, state
            assert "heartbeat" in (state.message or "")
            print(f"marked Crashed {took:.0f} s after the kill")

            result = client.set_flow_run_state(fr.id, AwaitingRetry(message="Retry from the UI"), force=False)
            assert result.status.value == "ACCEPT", result
            state = _final_state(client, fr.id, 900, serve)
            assert state.type == StateType.COMPLETED, state
            assert marker.read_text() == committed  # step 1's generation was replayed, not recomputed
            left = _settled_task_runs(client, fr.id)  # none runs forever
            crashed = [t for t in left if t.state_type == StateType.CRASHED]
            assert all("attempt 2" in (t.state.message or "") for t in crashed), crashed
            assert (tiny_assets / "runs" / "zombie" / "ckpt" / "step_2" / "actor").is_dir()
    finally:
        stop(serve, signal.SIGKILL)


def test_deployment_overrides_survive_the_prefect_cli_printing_them():
    """`prefect deployment run` prints parameters as rich markup; list values must not read as tags."""
    from rich.console import Console
    from rich.errors import MarkupError

    from flows.deploy import markup_safe

    items = ["data.train_files=[/tmp/a.parquet, /tmp/b.parquet]", "trainer.logger=[jsonl]", "data.seed=3"]
    with pytest.raises(MarkupError):
        Console(file=open(os.devnull, "w")).print(str(items))  # noqa: SIM115
    safe = [markup_safe(i) for i in items]
    Console(file=open(os.devnull, "w")).print(str(safe))  # noqa: SIM115
    assert load_config(CONFIG, safe) == load_config(CONFIG, items)
