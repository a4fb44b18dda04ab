"""`dapo_core.store.fingerprints.changes` on config records: what a resume calls a changed input."""

from __future__ import annotations

from dapo_core.store.fingerprints import changes, config_fingerprint

DEFAULTS = config_fingerprint({"trainer": {"max_restarts": 0}, "algorithm": {"gamma": 1.0}})


def _record(config: dict) -> dict:
    return {"config": config_fingerprint(config)}


def test_a_key_the_record_lacks_is_no_change_at_its_default_and_a_change_otherwise():
    old = _record({"algorithm": {"gamma": 1.0}})  # a run recorded before trainer.max_restarts existed
    same = _record({"algorithm": {"gamma": 1.0}, "trainer": {"max_restarts": 0}})
    assert changes(old, same, defaults=DEFAULTS) == []
    assert changes(old, same) == ["config: trainer.max_restarts"]  # without the defaults: every new key
    moved = _record({"algorithm": {"gamma": 1.0}, "trainer": {"max_restarts": 3}})
    assert changes(old, moved, defaults=DEFAULTS) == ["config: trainer.max_restarts"]


def test_a_changed_or_removed_key_is_a_change_even_at_its_default():
    old = _record({"algorithm": {"gamma": 0.9}, "trainer": {"max_restarts": 0}})
    new = _record({"algorithm": {"gamma": 1.0}})
    assert changes(old, new, defaults=DEFAULTS) == ["config: algorithm.gamma, trainer.max_restarts"]
