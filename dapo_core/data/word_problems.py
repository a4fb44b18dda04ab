"""Generated math word problems with integer answers (one to three operations), in verl's DAPO row schema.

A problem is a start quantity ("Mia has 23 stickers.") followed by one to three events, each one operation on
the running count: gains (+), losses (−), "k times as many" (×), and sharing equally into k groups and
keeping one (÷, only when it divides exactly). The question asks for the final count; every intermediate
count is a non-negative integer.

The prompt is a short chat: the worked examples of :data:`WORD_EXAMPLES` as earlier user / assistant turns
(the first user turn opens with :data:`WORD_INSTRUCTION`, which asks for the final line the DAPO verifier
reads, `Answer: <n>`), then the question as the last user turn. A 135 M instruction model answers in the
assistants' short format (one equation per step, then the `Answer:` line), so its answers parse and stay
short.
`reward_model.ground_truth` is the integer as a string; `extra_info` keeps the `expression` (e.g.
`((23+5)*2)`) and the number of operations.

:func:`make_word_problem_splits` draws the held-out split first (seed + 1) and excludes its questions from the
training split, so the two are disjoint by problem text.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from dapo_core.data.datasets import DataError

__all__ = [
    "WORD_DATA_SOURCE",
    "WORD_EXAMPLES",
    "WORD_INSTRUCTION",
    "make_word_problem_splits",
    "make_word_problems",
    "word_prompt",
]

WORD_DATA_SOURCE = "synthetic_word"
"""`data_source` of generated word problems (scored by `math_dapo`)."""

WORD_INSTRUCTION = 'Solve the problem. Show the calculation, then write the final line "Answer: N".'
"""Opens the first user turn: the verifier reads the last `Answer:` line."""

WORD_EXAMPLES: tuple[tuple[str, str], ...] = (
    (
        "Anna has 3 shirts. She buys 4 more shirts. How many shirts does Anna have now?",
        "3 + 4 = 7.\nAnswer: 7",
    ),
    (
        "Tom has 12 pens. He gives 5 pens to a friend. He finds 3 more pens. "
        "How many pens does Tom have now?",
        "12 - 5 = 7. 7 + 3 = 10.\nAnswer: 10",
    ),
)
"""Worked examples (question, answer) shown as earlier chat turns; their names and items never occur in
generated problems."""


def word_prompt(question: str) -> list[dict[str, str]]:
    """The chat messages of one problem: the worked examples as earlier turns, then `question`."""
    messages: list[dict[str, str]] = []
    for i, (q, a) in enumerate(WORD_EXAMPLES):
        opening = f"{WORD_INSTRUCTION}\n\n" if i == 0 else ""
        messages += [
            {"role": "user", "content": f"{opening}Question: {q}"},
            {"role": "assistant", "content": a},
        ]
    return [*messages, {"role": "user", "content": f"Question: {question}"}]


_NAMES = ("Mia", "Leo", "Ava", "Sam", "Zoe", "Max", "Ella", "Ben", "Lily", "Noah", "Ruby", "Omar")
_ITEMS = (
    "apples",
    "stickers",
    "marbles",
    "books",
    "coins",
    "cards",
    "shells",
    "pencils",
    "stamps",
    "cookies",
)
_FRIENDS = ("a friend", "her brother", "his sister", "a classmate", "a neighbour")
_GAIN = (
    "{who} buys {n} more {item}.",
    "{who} finds {n} more {item}.",
    "{who} gets {n} more {item} as a gift.",
)
_LOSS = ("{who} gives {n} {item} to {friend}.", "{who} loses {n} {item}.", "{who} sells {n} {item}.")
_TIMES = ("Then {who} ends up with {n} times as many {item} as before.",)
_SHARE = ("{who} splits the {item} equally into {n} bags and keeps one bag.",)


def _event(rng: random.Random, op: str, total: int, lo: int, hi: int) -> tuple[str, int, int] | None:
    """One event applied to `total`: (template, operand, new total), or None when `op` cannot apply."""
    if op == "+":
        n = rng.randint(max(lo, 1), hi)
        return rng.choice(_GAIN), n, total + n
    if op == "-":
        if total < 1:
            return None
        n = rng.randint(1, min(total, hi))
        return rng.choice(_LOSS), n, total - n
    if op == "*":
        if total > 200:
            return None
        n = rng.randint(2, 4)
        return _TIMES[0], n, total * n
    divisors = [k for k in range(2, 7) if total % k == 0 and total > 0]
    if not divisors:
        return None
    n = rng.choice(divisors)
    return _SHARE[0], n, total // n


def _problem(rng: random.Random, lo: int, hi: int, max_ops: int, ops: Sequence[str]) -> dict[str, Any]:
    """One problem: text, answer, expression, number of operations."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    total = rng.randint(max(lo, 1), hi)
    sentences = [f"{name} has {total} {item}."]
    expr = str(total)
    k = rng.randint(1, max_ops)
    done = 0
    while done < k:
        op = rng.choice(ops)
        ev = _event(rng, op, total, lo, hi)
        if ev is None:
            op = "+"
            ev = _event(rng, op, total, lo, hi)
            assert ev is not None
        template, n, total = ev
        who = "She" if name in ("Mia", "Ava", "Zoe", "Ella", "Lily", "Ruby") else "He"
        sentences.append(template.format(who=who, n=n, item=item, friend=rng.choice(_FRIENDS)))
        expr = f"({expr}{'/' if op == '/' else op}{n})"
        done += 1
    sentences.append(f"How many {item} does {name} have now?")
    return {"text": " ".join(sentences), "answer": total, "expression": expr, "num_ops": k}


def make_word_problems(
    num: int,
    *,
    min_value: int = 1,
    max_value: int = 50,
    max_ops: int = 3,
    ops: Sequence[str] = ("+", "-", "*", "/"),
    seed: int = 0,
    exclude: set[str] | None = None,
    split: str = "train",
) -> list[dict[str, Any]]:
    """`num` distinct word problems (numbers in [min_value, max_value], 1..max_ops operations) as verl rows;
    problems whose text is in `exclude` are skipped."""
    if num < 0 or not 1 <= max_ops <= 3:
        raise DataError(
            f"num={num} must be >= 0 and max_ops={max_ops} in 1..3 (data.synthetic.num_operands - 1)"
        )
    bad = [o for o in ops if o not in ("+", "-", "*", "/")]
    if not ops or bad:
        raise DataError(
            f"ops={list(ops)} must be a non-empty subset of ['+', '-', '*', '/'] (data.synthetic.ops)"
        )
    if max_value < max(min_value, 1):
        raise DataError(f"max_value={max_value} must be >= max(min_value, 1) (data.synthetic)")
    rng = random.Random(seed)
    excluded = exclude or set()
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    tries = 0
    while len(rows) < num:
        tries += 1
        if tries > 50 * num + 1000:
            raise DataError(f"could only draw {len(rows)} of {num} distinct word problems; widen max_value")
        p = _problem(rng, min_value, max_value, max_ops, ops)
        text = p["text"]
        if text in seen or text in excluded:
            continue
        seen.add(text)
        rows.append(
            {
                "data_source": WORD_DATA_SOURCE,
                "prompt": word_prompt(text),
                "ability": "MATH",
                "reward_model": {"ground_truth": str(p["answer"]), "style": "rule"},
                "extra_info": {
                    "index": len(rows),
                    "split": split,
                    "expression": p["expression"],
                    "num_ops": p["num_ops"],
                },
            }
        )
    return rows


def make_word_problem_splits(
    num_train: int, num_val: int, *, seed: int = 0, **kwargs: Any
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Training and held-out word problems, disjoint by text (the held-out split is drawn first).

    `kwargs` are :func:`make_word_problems`'s options; `num_operands` (the `data.synthetic` key) gives
    `max_ops = num_operands − 1`."""
    if "num_operands" in kwargs:
        kwargs["max_ops"] = int(kwargs.pop("num_operands")) - 1
    val = make_word_problems(num_val, seed=seed + 1, split="test", **kwargs)
    keys = {r["prompt"][-1]["content"].removeprefix("Question: ") for r in val}  # the problem texts
    train = make_word_problems(num_train, seed=seed, split="train", exclude=keys, **kwargs)
    return train, val
