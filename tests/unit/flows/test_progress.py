"""Progress everywhere a person waits (flows/progress.py, flows/evaluate.eval_chunks): bars on a terminal,
rate-limited lines elsewhere, evaluation chunks that leave every sample unchanged, no duplicate TensorBoard
points after a resume, and no Prefect usage-data notice when analytics are off."""

from __future__ import annotations

import io
import itertools
import json
import os
import pty
import select
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from rich.console import Console

from flows.evaluate import eval_chunks
from flows.progress import StepProgress, Ticker, line_interval_s
from tests.helpers import tiny_model_cfg

ROOT = Path(__file__).resolve().parents[3]


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_ticker_off_a_terminal_prints_first_last_and_at_most_one_line_per_interval():
    clock, lines = Clock(), []
    with Ticker(
        "SFT warm-up", 600, "steps", live=False, interval_s=15, printer=lines.append, clock=clock
    ) as t:
        for step in range(1, 601):
            clock.t = step * 0.5  # a step every 0.5 s: 300 s in all
            t.update(step, f"loss {1 / step:.3f}")
    # first update, one per 15 s over 300 s, the last: ~21 lines for 600 steps, never one per step
    assert 15 <= len(lines) <= 22, lines
    assert lines[0].startswith("SFT warm-up: 1/600 steps (0%, 0s) loss 1.000")
    assert lines[-1].startswith("SFT warm-up: 600/600 steps (100%, 300s)")


def test_ticker_close_prints_the_held_back_last_state():
    clock, lines = Clock(), []
    t = Ticker(
        "evaluate: generate", 1000, "responses", live=False, interval_s=60, printer=lines.append, clock=clock
    )
    t.update(64)
    clock.t = 5
    t.update(640)  # held back: within the interval and not the last
    assert len(lines) == 1
    t.close()
    assert lines[-1].startswith("evaluate: generate: 640/1000 responses (64%, 5s)")


def test_ticker_on_a_terminal_draws_a_bar_and_prints_no_lines():
    buf, lines = io.StringIO(), []
    console = Console(file=buf, force_terminal=True, width=100)
    with Ticker("evaluate: generate", 10, "responses", console=console, printer=lines.append) as t:
        t.update(10)
    assert t.live and not lines
    assert "evaluate: generate" in buf.getvalue() and "10/10" in buf.getvalue()


def test_interval_env(monkeypatch):
    monkeypatch.setenv("DAPO_PROGRESS_INTERVAL_S", "2.5")
    assert line_interval_s() == 2.5
    monkeypatch.setenv("DAPO_PROGRESS_INTERVAL_S", "soon")
    assert line_interval_s() == 15.0


def test_step_progress_lines_per_generation_batch_with_kept_groups_rate_limited():
    clock, lines = Clock(), []
    console = Console(file=io.StringIO(), force_terminal=False)
    p = StepProgress("r", enabled=True, console=console, printer=lines.append, interval_s=10, clock=clock)
    assert not p.enabled  # not a terminal: lines, no live display
    p.begin_step(3, 100)
    p.gen_batch(0, 32, 9, 16)
    clock.t = 12
    p.gen_batch(1, 14, 17, 16)
    assert lines == [
        "step 3/100 gen batch 1: 32 prompts, kept 9/16 groups; generating more",
        "step 3/100 gen batch 2: 14 prompts, kept 17/16 groups",
    ]
    clock.t = 13
    p.begin_step(4, 100)
    p.gen_batch(0, 32, None, 16)  # 1 s after the last line: held back
    assert len(lines) == 2
    p.close()


def test_step_progress_on_a_terminal_shows_a_generation_batch_bar():
    buf, lines = io.StringIO(), []
    console = Console(file=buf, force_terminal=True, width=140)
    p = StepProgress("r", enabled=True, console=console, printer=lines.append)
    p.begin_step(1, 5)
    p.gen_batch(0, 32, 12, 16)
    p.close()
    assert p.enabled and not lines
    out = buf.getvalue()
    assert "gen batch 1" in out and "kept 12/16 groups" in out and "12/16" in out


@pytest.mark.parametrize(("rows", "mb"), [(1600, 64), (1000, 64), (100, 16), (63, 64), (5, None)])
def test_eval_chunks_cover_the_rows_in_whole_micro_batches(rows, mb):
    chunks = eval_chunks(rows, mb)
    assert chunks[0][0] == 0 and chunks[-1][1] == rows
    assert all(a == b for (_, a), (b, _) in itertools.pairwise(chunks))
    assert all((stop - start) % mb == 0 for start, stop in chunks[:-1]) if mb else len(chunks) == 1
    assert len(chunks) <= 20


def test_chunked_evaluation_generates_the_same_samples_as_one_call(tmp_path):
    """What evaluate_model does with eval_chunks equals one generate call, bitwise."""
    from dapo_core.compute.models import build_tiny_model, load_tokenizer
    from dapo_core.compute.workers.rollout import RolloutWorker

    torch.set_num_threads(1)
    model = build_tiny_model(tmp_path / "m", tiny_model_cfg(hidden_size=32, intermediate_size=64), seed=0)
    tok = load_tokenizer(model)
    n = 40
    prompts = [tok.encode(f"{i}+{i % 7}=") for i in range(n)]
    table = pa.table(
        {
            "uid": [f"u{i // 4}" for i in range(n)],
            "sample_idx": [i % 4 for i in range(n)],
            "prompt_ids": pa.array(prompts, type=pa.list_(pa.int32())),
        }
    )
    sampling = {"temperature": 1.0, "top_p": 0.7, "top_k": -1, "max_new_tokens": 8, "do_sample": True}
    w = RolloutWorker(
        str(model),
        engine="hf",
        device="cpu",
        seed=3,
        train_sampling=sampling,
        val_sampling=sampling,
        engine_opts={"max_batch_size": 8, "progress": False},
    )
    whole = w.generate(table, gen_step=0, validate=True)
    chunks = eval_chunks(n, w.engine.max_batch_size, parts=3)
    assert len(chunks) > 1
    parts = pa.concat_tables([w.generate(table.slice(a, b - a), 0, validate=True) for a, b in chunks])
    for col in ("response_ids", "rollout_log_probs", "finish_reason"):
        assert parts.column(col).to_pylist() == whole.column(col).to_pylist(), col


def test_no_duplicate_tensorboard_points_after_a_resume(tmp_path):
    """A run killed after step 5 and resumed from the step-3 checkpoint logs 4 and 5 again; TensorBoard then
    shows one point per step (purge_step), as metrics.jsonl has one row per step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dapo_core.metrics.tracking import Tracker

    first = Tracker(tmp_path, ["jsonl", "tensorboard"])
    for step in range(1, 6):
        first.log(step, {"critic/score/mean": float(step)})
    first.close()
    again = Tracker(tmp_path, ["jsonl", "tensorboard"])
    assert again.rewind(3) == 2  # metrics.jsonl rows of steps 4 and 5
    for step in (4, 5, 6):
        again.log(step, {"critic/score/mean": 10.0 * step})
    again.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    points = [(e.step, e.value) for e in acc.Scalars("critic/score/mean")]
    assert points == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]


def _import_prefect_on_a_terminal(env: dict[str, str], setup: str) -> str:
    """Import prefect in a child whose stdout/stderr are a pseudo-terminal (Prefect shows its notice only
    there) and return what it printed."""
    master, slave = pty.openpty()
    code = f"{setup}\nimport prefect\nprint('IMPORTED', flush=True)"
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.DEVNULL, stdout=slave, stderr=slave, env=env, cwd=ROOT
    )
    os.close(slave)
    out = b""
    while True:
        ready, _, _ = select.select([master], [], [], 120)
        if not ready:
            break
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    proc.wait(timeout=60)
    os.close(master)
    return out.decode(errors="replace")


def test_prefect_usage_notice_hidden_when_analytics_are_off(tmp_path):
    from prefect._internal.analytics.ci_detection import CI_ENV_VARS  # Prefect is silent on CI machines

    drop = {"DO_NOT_TRACK", "PREFECT_SERVER_ANALYTICS_ENABLED", *CI_ENV_VARS}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    notice = "anonymous usage data"
    # a first-time user on a terminal with analytics disabled the documented way: Prefect alone still shows it
    shown = _import_prefect_on_a_terminal(
        {**env, "PREFECT_HOME": str(tmp_path / "a"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}, ""
    )
    assert "IMPORTED" in shown and notice in shown
    # the dapo CLI's set-up (what `dapo <command>` runs before importing prefect): analytics off by default
    hidden = _import_prefect_on_a_terminal(
        {**env, "PREFECT_HOME": str(tmp_path / "b")},
        "from flows.progress import prefect_console_env; prefect_console_env()",
    )
    assert "IMPORTED" in hidden and notice not in hidden


def test_temporary_server_batches_its_task_run_recorder_unless_the_user_set_it(tmp_path):
    """`start_local_prefect` starts Prefect's temporary server with the task-run recorder and the event
    persister batched (`TEMPORARY_SERVER_ENV`), read back from the running server's own settings; a value the
    user set wins."""
    script = (
        "import json, httpx\n"
        "from flows.progress import prefect_console_env; prefect_console_env()\n"
        "from flows.progress import start_local_prefect\n"
        "url = start_local_prefect('test', printer=lambda s: None)\n"
        "services = httpx.get(url + '/admin/settings').json()['server']['services']\n"
        "print(json.dumps([services['task_run_recorder'], services['event_persister']]))\n"
    )
    recorder = "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER"
    env = {k: v for k, v in os.environ.items() if not k.startswith(recorder)}
    env = {**env, "PREFECT_HOME": str(tmp_path / "home"), "PYTHONPATH": str(ROOT)}
    env.pop("PREFECT_API_URL", None)
    env[f"{recorder}_FLUSH_INTERVAL"] = "3"
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert out.returncode == 0, out.stderr[-2000:]
    settings, persister = json.loads(out.stdout.strip().splitlines()[-1])
    assert settings["batch_size"] == 200 and settings["read_batch_size"] == 50
    assert settings["flush_interval"] == 3.0  # the user's
    assert persister["batch_size"] == 200 and persister["read_batch_size"] == 50
    assert persister["flush_interval"] == 2.0
