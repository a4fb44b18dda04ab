"""Per-step metric logging: JSONL and TensorBoard under the run folder, and a console line per step.

A `Tracker` fans out to the configured backends (`trainer.logger`: console | jsonl | tensorboard); with none
configured it is a null logger, so the training loop never branches on "is logging on".
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any


def _clean(metrics: Mapping[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        try:
            f = float(v)
        except (TypeError, ValueError):
            continue
        out[k] = f if math.isfinite(f) else float("nan")
    return out


class JsonlBackend:
    """Appends one JSON object per step to `<run>/metrics.jsonl` (flushed each step, so a crash loses
    nothing)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}, allow_nan=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def rewind(self, step: int) -> int:
        """Drop the rows of steps after `step` (all rows when `step` is 0), which a resumed run logs again;
        returns how many were dropped. The file is rewritten atomically."""
        from dapo_core.store.files import atomic_write_bytes

        if not self.path.exists():
            return 0
        kept, dropped = [], 0
        for line in self.path.read_text().splitlines():
            try:
                row_step = int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                row_step = None  # a torn last line of a killed run
            if row_step is None or step == 0 or row_step > step:
                dropped += bool(line.strip())
            else:
                kept.append(line + "\n")
        if dropped:
            atomic_write_bytes(self.path, "".join(kept).encode())
        return dropped

    def close(self) -> None:
        pass


class TensorBoardBackend:
    """Scalars to `<run>/tensorboard/`."""

    def __init__(self, logdir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = logdir
        self.writer = SummaryWriter(log_dir=str(logdir))

    def rewind(self, step: int) -> int:
        """Hide the points of steps after `step` that an earlier attempt wrote (TensorBoard's purge_step)."""
        from torch.utils.tensorboard import SummaryWriter

        self.writer.close()
        self.writer = SummaryWriter(log_dir=str(self.logdir), purge_step=step + 1 if step else 0)
        return 0

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


CONSOLE_KEYS = (
    "critic/score/mean",
    "val-core",
    "actor/entropy",
    "response_length/mean",
    "actor/pg_clipfrac",
    "train/num_gen_batches",
    "timing_s/step",
)


class ConsoleBackend:
    """One compact line per step with the headline metrics (the rich live display is the flow's job)."""

    def __init__(self, printer: Callable[[str], None] = print) -> None:
        self.printer = printer

    def log(self, step: int, metrics: dict[str, float]) -> None:
        shown = [f"{k}={v:.4g}" for k, v in metrics.items() if k.startswith(CONSOLE_KEYS) and "/std" not in k]
        self.printer(f"[step {step}] " + " ".join(shown[:10]))

    def close(self) -> None:
        pass


class Tracker:
    """Log metrics to every backend named in `backends` (subset of console, jsonl, tensorboard)."""

    def __init__(
        self,
        run_dir: str | Path,
        backends: Sequence[str] = ("jsonl",),
        printer: Callable[[str], None] = print,
    ) -> None:
        run_dir = Path(run_dir)
        self.backends: list[Any] = []
        for name in backends:
            if name == "jsonl":
                self.backends.append(JsonlBackend(run_dir / "metrics.jsonl"))
            elif name == "tensorboard":
                self.backends.append(TensorBoardBackend(run_dir / "tensorboard"))
            elif name == "console":
                self.backends.append(ConsoleBackend(printer))
            else:
                raise ValueError(
                    f"trainer.logger: unknown backend {name!r}; use console, jsonl or tensorboard"
                )

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Log the numeric entries of `metrics` at `step`."""
        clean = _clean(metrics)
        for b in self.backends:
            b.log(step, clean)

    def rewind(self, step: int) -> int:
        """A run resumed at `step` logs the later steps again: drop what an earlier attempt logged for them
        (metrics.jsonl rows; TensorBoard points are purged), so no step has two rows. Returns the rows
        dropped."""
        return sum(b.rewind(step) for b in self.backends if hasattr(b, "rewind"))

    def close(self) -> None:
        """Flush and close every backend."""
        for b in self.backends:
            b.close()


def read_jsonl(path: str | Path) -> list[dict[str, float]]:
    """All rows of a metrics.jsonl; a later row for the same step (after a resume) replaces the earlier
    one."""
    rows: dict[int, dict[str, float]] = {}
    if not Path(path).exists():
        return []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                row = json.loads(line)
                rows[int(row["step"])] = {**rows.get(int(row["step"]), {}), **row}
    return [rows[k] for k in sorted(rows)]


def plot_run(jsonl_path: str | Path, out_png: str | Path) -> Path:
    """Reward, accuracy, entropy and response length over steps, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_jsonl(jsonl_path)
    panels = [
        ("critic/score/mean", "train score (±1)"),
        ("val_acc", "held-out accuracy"),
        ("actor/entropy", "entropy"),
        ("response_length/mean", "response length"),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, title) in zip(axes.flat, panels, strict=False):
        if key == "val_acc":
            pts = [
                (r["step"], v)
                for r in rows
                for k, v in r.items()
                if k.startswith("val-core/") and "/acc/mean@" in k
            ]
        else:
            pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            xs, ys = zip(*pts, strict=True)
            ax.plot(xs, ys, marker="o", ms=3)
        ax.set_title(title)
        ax.set_xlabel("train step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out_png = Path(out_png)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    return out_png
