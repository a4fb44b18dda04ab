"""Rule-based math scoring used by DAPO (docs/REFERENCE.md §6.3, NEWEST incl. the ``\\boxed`` fallback).

The answer is read from the *last* ``Answer: ...`` line in the last 300 characters of the response, normalised
with the Minerva rules (:func:`normalize_final_answer`), and compared to the normalised ground truth by exact
string equality. If no ``Answer:`` line exists, the last ``\\boxed{...}`` in the final 100 characters is
compared to the raw ground truth. Score is +1 / −1 (not 1 / 0). Pure Python, standard library only, so it can
run in a spawned scoring process without importing torch.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = [
    "INVALID",
    "compute_score",
    "is_correct_minerva",
    "is_correct_strict_box",
    "last_boxed_only_string",
    "normalize_final_answer",
    "remove_boxed",
]

INVALID = "[INVALID]"
"""The prediction recorded when the response has no ``Answer:`` line."""

_TAIL_CHARS = 300
_BOX_TAIL_CHARS = 100
_ANSWER_RE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# step b: plain substring replacements, applied in this order
_SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)

# step c: substrings deleted, in this order (``\n`` below is a real newline character)
_REMOVED: tuple[str, ...] = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)

# step d: regex rewrites, in this order
_REGEXES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), r"$\3$"),
    (re.compile(r"(\\text\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), r"\2"),
    (re.compile(r"(frac)([^{])(.)"), r"frac{\2}{\3}"),
    (re.compile(r"(sqrt)([^{])"), r"sqrt{\2}"),
)


def normalize_final_answer(final_answer: str) -> str:
    """Minerva-style normalisation of a final answer string (§6.3 a–e; order matters).

    Keeps the text after the last ``=``, applies the fixed replacements and deletions, unwraps ``\\text``,
    ``\\textbf``, ``\\overline`` and ``\\boxed``, expands ``frac12``/``sqrt2`` shorthands, drops ``$``,
    removes thousands separators from pure numbers and strips whitespace. Examples: ``"x = 5"`` → ``"5"``,
    ``"1,000"`` → ``"1000"``, ``"34."`` stays ``"34."``.
    """
    s = final_answer.split("=")[-1]
    for before, after in _SUBSTITUTIONS:
        s = s.replace(before, after)
    for token in _REMOVED:
        s = s.replace(token, "")
    for pattern, repl in _REGEXES:
        s = pattern.sub(repl, s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def last_boxed_only_string(string: str) -> str | None:
    """The last ``\\boxed{...}`` in ``string`` including the wrapper, with brace matching; None if
    absent/unclosed."""
    start = string.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(string)):
        ch = string[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return string[start : i + 1]
    return None


def remove_boxed(s: str) -> str:
    """Strip the ``\\boxed{`` … ``}`` wrapper from a string returned by :func:`last_boxed_only_string`."""
    left = "\\boxed{"
    if not s.startswith(left) or not s.endswith("}"):
        raise ValueError(f"remove_boxed expects a string of the form '\\\\boxed{{...}}', got {s[:40]!r}")
    return s[len(left) : -1]


def is_correct_minerva(solution_str: str, gt: str) -> tuple[bool, str]:
    """Minerva check: the last ``Answer:`` line (or ``"[INVALID]"``) normalised vs the normalised ground
    truth."""
    matches = _ANSWER_RE.findall(solution_str)
    extracted = matches[-1] if matches else INVALID
    pred = normalize_final_answer(extracted)
    return pred == normalize_final_answer(gt), pred


def is_correct_strict_box(
    solution_str: str, gt: str, pause_tokens_index: Sequence[int] | None = None
) -> tuple[int, str | None]:
    """Strict box check: +1 if the last ``\\boxed{}`` in the final 100 characters equals the *raw* ``gt``,
    else −1.

    With ``pause_tokens_index`` (exactly 4 indices) the window starts 100 characters before the last index and
    runs to the end of the string (as the reference). Deliberate difference: the start is clamped at 0,
    whereas the reference slices ``[idx − 100:]`` and so, for ``idx < 100``, wraps to the last ``100 − idx``
    characters. Returns ``(±1, extracted or None)``.
    """
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise ValueError(
                f"pause_tokens_index must hold exactly 4 indices, got {len(pause_tokens_index)}; pass None "
                "to look at the last 100 characters"
            )
        tail = solution_str[max(pause_tokens_index[-1] - _BOX_TAIL_CHARS, 0) :]
    else:
        tail = solution_str[-_BOX_TAIL_CHARS:]
    boxed = last_boxed_only_string(tail)
    extracted = remove_boxed(boxed) if boxed is not None else None
    return (1 if extracted == gt else -1), extracted


def compute_score(
    solution_str: str,
    ground_truth: str,
    strict_box_verify: bool = False,
    pause_tokens_index: Sequence[int] | None = None,
) -> dict[str, float | bool | str | None]:
    """Score one response: ``{"score": 1.0 | −1.0, "acc": bool, "pred": str | None}`` (§6.3, NEWEST).

    Only the last 300 characters are examined. ``strict_box_verify=True`` uses only the strict box check;
    otherwise the Minerva ``Answer:`` check is used and, if it found no ``Answer:`` line, the strict box check
    is used instead when a box exists (NEWEST fallback, added upstream 2026-08).
    """
    tail = solution_str[-_TAIL_CHARS:]
    if strict_box_verify:
        verdict, pred = is_correct_strict_box(tail, ground_truth, pause_tokens_index)
        correct = verdict == 1
    else:
        correct, pred = is_correct_minerva(tail, ground_truth)
        if pred == INVALID:
            verdict, box_pred = is_correct_strict_box(tail, ground_truth, pause_tokens_index)
            if box_pred is not None:
                correct, pred = verdict == 1, box_pred
    return {"score": 1.0 if correct else -1.0, "acc": bool(correct), "pred": pred}
