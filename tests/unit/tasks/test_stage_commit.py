"""Stage tasks retry transient failures but not user errors (which the same attempt would only hit again)."""

from __future__ import annotations

import importlib

import pytest
from prefect import Task
from prefect.states import Failed

from dapo_core.errors import DapoUserError
from dapo_core.stages import DynamicSamplingExhausted
from tasks.stage_commit import retry_unless_user_error

TASK_MODULES = ["tasks.rollout", "tasks.compute", "tasks.update", "tasks.replay", "tasks.validate"]


def _wrapped_user_error() -> BaseException:
    try:
        try:
            raise DapoUserError("the prompt is empty", where="data/x.parquet row 3", fix="drop the row")
        except DapoUserError as inner:
            raise RuntimeError("task failed") from inner
    except RuntimeError as outer:
        return outer


@pytest.mark.parametrize(
    ("exc", "retry"),
    [
        (OSError("disk hiccup"), True),
        (RuntimeError("worker busy"), True),
        (DapoUserError("bad data", where="data/x.parquet", fix="fix it"), False),
        (DynamicSamplingExhausted("no group kept after 3 generation batches"), False),
        (_wrapped_user_error(), False),
    ],
)
def test_retry_condition(exc, retry):
    assert retry_unless_user_error(None, None, Failed(data=exc)) is retry


def test_a_failed_state_without_an_exception_is_retried():
    assert retry_unless_user_error(None, None, Failed(message="crashed")) is True


def test_every_retried_task_uses_the_condition():
    seen = 0
    for name in TASK_MODULES:
        module = importlib.import_module(name)
        for obj in vars(module).values():
            if isinstance(obj, Task) and obj.retries:
                seen += 1
                assert obj.retry_condition_fn is retry_unless_user_error, obj.name
    assert seen >= 10
