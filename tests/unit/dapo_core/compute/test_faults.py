"""The DAPO_FAULT grammar: items, actions, ranks, run patterns, once-only markers, refused spellings; and the
worker hook outside a Ray worker (a kill is inert, a hang holds the caller)."""

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


def test_outside_a_ray_worker_a_kill_does_nothing_and_a_hang_holds_the_caller_once(tmp_path, monkeypatch):
    import dapo_core.compute.faults as faults

    class Held(Exception):
        """Raised by the patched sleep: the hook started to hang."""

    def held(_seconds: float) -> None:
        raise Held

    monkeypatch.setattr(faults.time, "sleep", held)
    monkeypatch.setenv("DAPO_FAULT", "kill-always@generate_g0:1,hang@reward_g0:1")
    fault_point(str(tmp_path), "generate_g0", 1)  # this process is no Ray actor: a kill would end it
    with pytest.raises(Held):
        fault_point(str(tmp_path), "reward_g0_r0of2", 1)  # replica 0's share of reward_g0
    assert (tmp_path / "faults" / "hang@reward_g0#0:1.done").exists()
    fault_point(str(tmp_path), "reward_g0", 1)  # once: the marker lets the next attempt pass
