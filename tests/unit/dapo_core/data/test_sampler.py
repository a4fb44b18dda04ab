"""The history-aware prompt sampler (`dapo_core.data.sampler`): what it passes over, that it is verl's sampler
until it has seen something, and that its state resumes the same draws after a JSON round trip."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from dapo_core.config import load_config, typed
from dapo_core.data.datasets import DataError, PromptSampler, make_synthetic_math
from dapo_core.data.sampler import ALL_CORRECT, ALL_WRONG, MIXED, HistorySampler, group_outcomes
from flows.run_inputs import train_sampler

ROWS = 40


@pytest.fixture(scope="module")
def tokenizer():
    from dapo_core.compute.models import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture(scope="module")
def table():
    return pa.Table.from_pylist(make_synthetic_math(ROWS, seed=3))


def _hist(table, tokenizer, **kw):
    kw = {"window": 1, "explore_prob": 0.0, "seed": 5, "max_prompt_length": 128, **kw}
    return HistorySampler(table, tokenizer, batch_size=1, **kw)


def _draw(sampler, k: int) -> list[int]:
    return [int(sampler.next_batch().column("prompt_id")[0].as_py()) for _ in range(k)]


def test_group_outcomes():
    pids = [4, 4, 4, 9, 9, 7, 7]
    accs = [True, True, True, False, True, False, False]
    assert group_outcomes(pids, accs) == {4: [ALL_CORRECT], 9: [MIXED], 7: [ALL_WRONG]}


def test_without_history_it_draws_what_prompt_sampler_draws(table, tokenizer):
    plain = PromptSampler(table, tokenizer, batch_size=1, seed=5, max_prompt_length=128)
    hist = _hist(table, tokenizer)
    assert _draw(hist, 2 * ROWS + 3) == _draw(plain, 2 * ROWS + 3)
    assert hist.passed_over == 0


def test_prompts_without_spread_are_passed_over_until_they_explore(table, tokenizer):
    s = _hist(table, tokenizer, window=2)
    first = _draw(s, ROWS)  # one epoch
    solved, hopeless, mixed = set(first[:10]), set(first[10:20]), set(first[20:])
    for pid in first:  # two observations each: window 2
        for _ in range(2):
            acc = [True] * 4 if pid in solved else [False] * 4 if pid in hopeless else [True, False] * 2
            s.observe([pid] * 4, acc)
    second = _draw(s, len(mixed))
    assert set(second) == mixed and 0 < s.passed_over <= 20  # the next epoch offers only these
    s.observe([second[0]] * 4, [True] * 4)  # one all-correct group is not `window` of them
    assert not s.skips(second[0]) and s.skips(first[0])
    # explore_prob 1: nothing is passed over; 0.3: about that share of the no-spread prompts comes back
    always = _hist(table, tokenizer, explore_prob=1.0)
    always.load_state_dict({**s.state_dict(), "epoch": 4, "position": 0})
    assert sorted(_draw(always, ROWS)) == list(range(ROWS))
    some = _hist(table, tokenizer, window=2, explore_prob=0.3)
    some.load_state_dict({**s.state_dict(), "epoch": 5, "position": 0})
    explored = [p for p in _draw(some, len(mixed)) if p not in mixed]
    assert 0 < len(explored) < 20


def test_state_resumes_the_same_draws_after_a_json_round_trip(table, tokenizer):
    def run(sampler, draws, observe_from=0):
        out = []
        for i in range(draws):
            pid = _draw(sampler, 1)[0]
            out.append(pid)
            if i >= observe_from:
                sampler.observe([pid] * 2, [pid % 3 == 0, pid % 3 == 0 or pid % 2 == 0])
        return out

    a = _hist(table, tokenizer, explore_prob=0.25)
    run(a, 50)
    saved = json.dumps(a.state_dict())
    after_a = run(a, 70)
    b = _hist(table, tokenizer, explore_prob=0.25)
    b.load_state_dict(json.loads(saved))
    assert b.state_dict() == json.loads(saved)
    assert run(b, 70) == after_a
    assert a.passed_over > 0 and a.state_dict() == b.state_dict()


def test_history_state_is_one_string_per_row_and_reads_the_first_versions_dict(table, tokenizer):
    """The state carries the history as `window` characters per row (it is written into every prompt stage's
    manifest, so its size is paid each step); a state saved by the first version, a dict of code lists per
    prompt, resumes the same draws; a history that does not fit the table is refused, naming what to fix."""
    s = _hist(table, tokenizer, window=2)
    s.observe([3] * 4 + [7] * 4, [True] * 4 + [True, False] * 2)
    s.observe([3] * 4, [True] * 4)
    s.observe([5] * 4, [False] * 4)
    state = s.state_dict()
    assert isinstance(state["history"], str) and len(state["history"]) == 2 * ROWS
    hist = state["history"]
    assert hist[6:8] == "22" and hist[14:16] == "-1" and hist[10:12] == "-0"
    assert s.skips(3) and not s.skips(5) and not s.skips(7)
    old = {**state, "history": {"3": [ALL_CORRECT, ALL_CORRECT, ALL_CORRECT], "5": [ALL_WRONG], "7": [MIXED]}}
    a, b = _hist(table, tokenizer, window=2), _hist(table, tokenizer, window=2)
    a.load_state_dict(json.loads(json.dumps(old)))
    b.load_state_dict(json.loads(json.dumps(state)))
    assert a.state_dict() == b.state_dict() == state
    assert _draw(a, ROWS) == _draw(b, ROWS)
    wider, narrower = _hist(table, tokenizer, window=3), _hist(table, tokenizer, window=1)
    wider.load_state_dict(state)
    narrower.load_state_dict(state)
    assert wider.state_dict()["history"][9:12] == "-22" and narrower.state_dict()["history"][7] == "1"
    with pytest.raises(DataError, match=r"data\.train_files"):
        _hist(table, tokenizer, window=2).load_state_dict({**state, "history": state["history"][:-1]})
    with pytest.raises(DataError, match="prompt_id 40 is not a row"):
        s.observe([ROWS] * 2, [True, False])


def _cfg(*overrides: str):
    return typed(load_config("configs/tiny_cpu.yaml", list(overrides)))


def test_the_config_picks_the_sampler(table, tokenizer, capsys):
    s = train_sampler(_cfg(), table, tokenizer)  # the CPU default draws with it (bench/README.md)
    assert isinstance(s, HistorySampler) and s.window == 1 and s.explore_prob == 0.1
    s = train_sampler(_cfg("data.history_sampler.window=3"), table, tokenizer)
    assert isinstance(s, HistorySampler) and s.window == 3
    off = "data.history_sampler.enable=false"
    assert type(train_sampler(_cfg(off), table, tokenizer)) is PromptSampler
    replay = train_sampler(_cfg("trainer.step_order=replay_buffer"), table, tokenizer)
    assert type(replay) is PromptSampler  # sync order only: the replay order falls back, and says so
    assert "data.history_sampler: not used with trainer.step_order=replay_buffer" in capsys.readouterr().out
    dapo = typed(load_config("configs/dapo.yaml"))
    assert dapo.data.history_sampler.enable is False  # the reproduction keeps verl's sampler
