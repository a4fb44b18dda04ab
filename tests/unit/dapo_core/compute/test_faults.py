"""The DAPO_FAULT grammar: items, actions, ranks, run patterns, once-only markers, refused spellings; and the
worker hook is inert outside a Ray worker."""

from __future__ import annotations

import pytest

from dapo_core.compute.faults import FaultSpec, fault_point, parse_faults


def test_items_actions_ranks_and_run_patterns():
    faults = parse_faults(
        "update_actor:2, kill@generate_g0:2,kill-always@update_actor#1:1,hang@reward_g0:3:n-*"
    )
    assert faults == [
        FaultSpec("fail", "update_actor", 2),
        FaultSpec("kill", "generate_g0", 2),
        FaultSpec("kill-always", "update_actor", 1, rank=1),
        FaultSpec("hang", "reward_g0", 3, run_pattern="n-*"),
    ]
    fail, kill, always, hang = faults
    assert not fail.in_worker and kill.in_worker and kill.once and not always.once and hang.once
    assert kill.matches("generate_g0", 2, "r") and not kill.matches("generate_g0", 1, "r")
    assert not kill.matches("generate_g0", 2, "r", rank=1)
    assert always.matches("update_actor", 1, "r", rank=1) and not always.matches("update_actor", 1, "r")
    assert hang.matches("reward_g0", 3, "n-7") and not hang.matches("reward_g0", 3, "d-7")
    assert fail.matches("update_actor", 2, "r", rank=5)  # the driver's fault has no rank
    assert str(always) == "kill-always@update_actor#1:1" and str(hang) == "hang@reward_g0:3:n-*"
    assert parse_faults("") == [] and parse_faults(" , ") == []


def test_once_markers_live_in_the_run_folder(tmp_path):
    fault = FaultSpec("kill", "generate_g0", 2)
    assert (
        fault.marker(tmp_path / "runs" / "r1")
        == tmp_path / "runs" / "r1" / "faults" / "kill@generate_g0#0:2.done"
    )


@pytest.mark.parametrize(
    "spec",
    ["nonsense", "explode@update_actor:2", "update_actor:two", "update_actor#1:2", "kill@:2", "a:1:b:c"],
)
def test_bad_spellings_are_refused_naming_the_variable(spec):
    with pytest.raises(ValueError, match="DAPO_FAULT"):
        parse_faults(spec)


def test_the_worker_hook_does_nothing_outside_a_ray_worker(tmp_path, monkeypatch):
    monkeypatch.setenv("DAPO_FAULT", "kill-always@generate_g0:1,hang-always@reward_g0:1")
    fault_point(str(tmp_path), "generate_g0", 1)  # this process is no Ray actor: it must survive
    fault_point(str(tmp_path), "reward_g0_r0of2", 1)
    assert not (tmp_path / "faults").exists()
