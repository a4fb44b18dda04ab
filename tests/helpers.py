"""Small shared test helpers: the tiny model shapes the tests build (fast on one CPU thread), their inputs,
and `wait_for`, the one way a test waits for something to happen."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


def wait_for(
    predicate: Callable[[], T],
    what: str,
    timeout_s: float,
    poll_s: float = 0.05,
    *,
    alive: subprocess.Popen | None = None,
) -> T:
    """Call `predicate` every `poll_s` seconds until it returns something truthy, and return that. Fail with
    an AssertionError naming `what` when `timeout_s` passes first, or, with `alive`, as soon as that process
    exits (with its exit code). The deadline is generous on purpose: a busy machine only makes it slower."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = predicate()
        if got:
            return got
        if alive is not None and alive.poll() is not None:
            raise AssertionError(f"waiting for {what}: the process {alive.pid} exited ({alive.returncode})")
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(poll_s)


def unchanged_for(paths: list[Path], after_s: float) -> bool:
    """Whether every file of `paths` has been unchanged (mtime and ctime) for `after_s` seconds now: settled
    in the sense of the run store's trust records (`dapo_core.store.trust.settled`)."""
    now = time.time_ns()
    return all(now - max(st.st_mtime_ns, st.st_ctime_ns) >= after_s * 1e9 for st in (p.stat() for p in paths))


def run_tmp(tmp_path_factory: Any) -> Path:
    """The test run's temporary directory, which every pytest-xdist worker shares: the parent of a worker's
    own base directory, or the base directory itself in the process that runs the session (the xdist
    controller, or pytest without xdist)."""
    import os

    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_once(tmp_path_factory: Any, name: str, build: Callable[[Path], None]) -> Path:
    """The folder `name`, built by `build(folder)` once per test run and read-only afterwards. Under
    pytest-xdist the workers share it: the first worker to ask builds it while the others wait on a file lock,
    then all read the same folder (in the run's temporary directory, the parent of each worker's own). A build
    that raised is not retried by the next worker: it fails with the first worker's error."""
    import shutil

    from filelock import FileLock

    folder = run_tmp(tmp_path_factory) / f"once-{name}"
    failed = folder.with_name(folder.name + ".failed")
    with FileLock(str(folder) + ".lock"):
        if failed.exists():
            raise AssertionError(f"building {name} failed in another worker:\n{failed.read_text()}")
        if not (folder / ".built").exists():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            try:
                build(folder)
            except BaseException as e:
                failed.write_text(f"{type(e).__name__}: {e}"[-4000:])
                raise
            (folder / ".built").touch()
    return folder


SMALL_MODEL: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,  # vLLM's CPU attention needs head_dim >= 32
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
}
"""`actor_rollout_ref.model.tiny` keys of a two-layer model with 64 hidden units."""


def spawn_ranks(target: Callable[..., None], *args: Any, world: int = 2, timeout_s: float = 500) -> Any:
    """Run `target(rank, port, *args, queue)` in `world` spawned processes (a gloo group on a free loopback
    port) and return the first thing one of them puts on `queue`, after the processes have ended."""
    import multiprocessing as mp

    from dapo_core.compute.dist import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=target, args=(r, port, *args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    result = queue.get(timeout=timeout_s)
    for p in procs:
        p.join(timeout=60)
    return result


def tiny_model_cfg(**overrides: Any) -> dict[str, Any]:
    """`SMALL_MODEL` with some keys replaced (e.g. `hidden_size=32` for the fastest tests)."""
    unknown = set(overrides) - set(SMALL_MODEL)
    if unknown:
        raise KeyError(f"not a tiny-model key: {sorted(unknown)}")
    return {**SMALL_MODEL, **overrides}


def in_process_run_overrides(tmp_path: Path, num_train: int = 32, num_val: int = 4) -> list[str]:
    """Write `num_train` / `num_val` synthetic problems and build a one-layer random tiny model under
    `tmp_path`; returns the overrides that point the CPU default at them with in-process workers (a run opened
    with `flows.run_setup.open_run` in the test's process; add `trainer.runs_dir`)."""
    from dapo_core.compute.models import build_tiny_model
    from dapo_core.data.datasets import make_synthetic_splits, write_parquet

    train, val = make_synthetic_splits(
        num_train, num_val, seed=0, min_value=0, max_value=99, num_operands=2, ops=["+"]
    )
    write_parquet(train, tmp_path / "train.parquet")
    write_parquet(val, tmp_path / "val.parquet")
    model = build_tiny_model(tmp_path / "model", tiny_model_cfg(num_hidden_layers=1), seed=0)
    return [
        f"actor_rollout_ref.model.path={model}",
        f"data.train_files=[{tmp_path / 'train.parquet'}]",
        f"data.val_files=[{tmp_path / 'val.parquet'}]",
        "trainer.use_ray=false",
        "trainer.logger=[jsonl]",
        "reward_model.num_workers=1",
    ]


def write_good_inputs(root: Path) -> Path:
    """Good inputs in `root`: train.parquet and val.parquet (24 and 8 synthetic problems) and a tiny model
    folder `model/` with the schema's default shape; returns `root`."""
    from dataclasses import asdict

    from dapo_core.compute.models import build_tiny_model
    from dapo_core.config.schema import TinyModelConfig
    from dapo_core.data.datasets import make_synthetic_splits, write_parquet

    train, val = make_synthetic_splits(24, 8, seed=0)
    write_parquet(train, root / "train.parquet")
    write_parquet(val, root / "val.parquet")
    build_tiny_model(root / "model", asdict(TinyModelConfig()), 0)
    return root


# Measurement helpers shared by tests and bench scripts (bench/bench_scale.py and
# bench/bench_step_anatomy.py import them from here).


def _cell_bytes(arrow_type: Any, value: Any) -> float:
    """The data bytes of one cell: list and string values plus their 4-byte offset, fixed widths by width."""
    import pyarrow as pa

    if value is None:
        return 0.125
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        return 4 + sum(_cell_bytes(arrow_type.value_type, v) for v in value)
    if pa.types.is_string(arrow_type) or pa.types.is_binary(arrow_type):
        return 4 + len(value.encode() if isinstance(value, str) else value)
    if pa.types.is_boolean(arrow_type):
        return 0.125
    if pa.types.is_struct(arrow_type):
        return sum(_cell_bytes(f.type, value.get(f.name)) for f in arrow_type)
    try:
        return arrow_type.bit_width / 8
    except ValueError:  # another variable-width type (map, union, ...): its values as text
        return 4 + len(repr(value).encode())


def store_accounting(root: str | Path) -> dict:
    """Data bytes written per step vs unique bytes per step of the committed stage files (those with a
    manifest) under the run folder `root`: `{"per_step": {step: {"written", "unique", "token_cells_again"}},
    "written", "unique", "written_over_unique", "token_cells_again"}`.

    Written bytes are each cell's values plus the row ids `_key`/`_src` (8 bytes each; Arrow IPC framing
    left out, so tiny files compare fairly); unique bytes count each distinct row/column/value once, in the
    step that first wrote it; `token_cells_again` counts the token-level cells (lists, or the store's compact
    struct form of them) written with a value an earlier file already holds. Reads every file whole (for
    tests and benchmarks, not for large runs)."""
    import hashlib

    import pyarrow as pa
    from pyarrow import ipc

    seen: set[tuple] = set()
    per_step: dict[int, dict[str, float]] = {}
    for step_dir in sorted(Path(root).glob("step_*")):
        step = int(step_dir.name.split("_")[1])
        acc = {"written": 0.0, "unique": 0.0, "token_cells_again": 0}
        for path in sorted(step_dir.glob("*.arrow")):
            if path.name.startswith(".") or not path.with_name(path.stem + ".manifest.json").exists():
                continue
            with pa.memory_map(str(path)) as f:
                table = ipc.open_file(f).read_all()
            ids = ["_key", "_src"]
            keys = (
                table.column("_key").to_pylist()
                if "_key" in table.column_names
                else [(path.name, i) for i in range(table.num_rows)]
            )
            acc["written"] += 8 * table.num_rows * sum(c in table.column_names for c in ids)
            for field in table.schema:
                if field.name in ids:
                    continue
                # token-level: a list per row, or the store's compact struct form of one
                nested = pa.types.is_nested(field.type)
                for key, value in zip(keys, table.column(field.name).to_pylist(), strict=True):
                    size = _cell_bytes(field.type, value)
                    acc["written"] += size
                    ident = (key, field.name, hashlib.blake2b(repr(value).encode(), digest_size=16).digest())
                    if ident in seen:
                        acc["token_cells_again"] += int(nested)
                    else:
                        seen.add(ident)
                        acc["unique"] += size
        per_step[step] = acc
    written = sum(a["written"] for a in per_step.values())
    unique = sum(a["unique"] for a in per_step.values())
    return {
        "per_step": per_step,
        "written": written,
        "unique": unique,
        "written_over_unique": round(written / unique, 3) if unique else None,
        "token_cells_again": sum(a["token_cells_again"] for a in per_step.values()),
    }


RefillSizeFn = Callable[[int, float | None], int]
"""(deficit in groups, estimated keep rate or None) -> prompts to generate next."""


def simulate_refill_steps(
    size_fn: RefillSizeFn, rates: list[float], *, tbs: int, seed: int
) -> dict[str, float]:
    """Dynamic-sampling refill without a model: one step per entry of `rates` (each prompt kept independently,
    Binomial, at that keep rate), generating `size_fn(deficit, estimated rate)` prompts per round until `tbs`
    groups are kept, with the run-wide `KeepRateEstimator` (decay 0.9). Returns per-step means of surplus
    groups, rounds and prompts, and the surplus as a share of the kept groups used."""
    import numpy as np

    from dapo_core.algo.dynamic_sampling import KeepRateEstimator

    rng = np.random.default_rng(seed)
    est = KeepRateEstimator(decay=0.9)
    surplus, rounds, prompts = [], [], []
    for p in rates:
        kept = r = n = 0
        while kept < tbs:
            size = size_fn(tbs - kept, est.rate)
            k = int(rng.binomial(size, p))
            est.update(k, size)
            kept, r, n = kept + k, r + 1, n + size
        surplus.append(kept - tbs)
        rounds.append(r)
        prompts.append(n)
    return {
        "surplus_groups": float(np.mean(surplus)),
        "surplus_share": float(np.sum(surplus) / (tbs * len(rates))),
        "gen_batches_per_step": float(np.mean(rounds)),
        "prompts_per_step": float(np.mean(prompts)),
    }


def refill_policy_size_fn(policy: str, *, tbs: int, gbs: int, min_size: int = 1) -> RefillSizeFn:
    """The refill batch-size rule named `policy`: `fixed` (always `gbs`), `budget<x>`
    (`surplus_bounded_size` with a surplus budget of x · `tbs` groups) or `safety<s>` (`next_gen_batch_size`
    with safety factor s)."""
    from dapo_core.algo.dynamic_sampling import next_gen_batch_size, surplus_bounded_size

    if policy == "fixed":
        return lambda deficit, rate: gbs
    if policy.startswith("safety"):
        s = float(policy[len("safety") :])
        return lambda deficit, rate: next_gen_batch_size(deficit, rate, base=gbs, min_size=min_size, safety=s)
    if policy.startswith("budget"):
        budget = float(policy[len("budget") :]) * tbs
        return lambda deficit, rate: surplus_bounded_size(deficit, rate, surplus_budget=budget, base=gbs)
    raise SystemExit(f"unknown policy {policy!r}: use fixed, budget<x> or safety<s>")


def simulate_refill(
    p: float,
    adaptive: bool,
    *,
    steps: int,
    train_batch_size: int,
    gen_batch_size: int,
    min_size: int,
    safety: float,
    seed: int,
) -> dict[str, float]:
    """`simulate_refill_steps` for `steps` steps at constant keep rate `p`: fixed batches, or
    `next_gen_batch_size` (`safety<safety>`) when `adaptive`."""
    policy = f"safety{safety}" if adaptive else "fixed"
    size_fn = refill_policy_size_fn(policy, tbs=train_batch_size, gbs=gen_batch_size, min_size=min_size)
    return simulate_refill_steps(size_fn, [p] * steps, tbs=train_batch_size, seed=seed)


STAGE_TIMING_ALIASES = {"timing_s/step", "timing_s/gen", "timing_s/adv"}
"""Timing keys that are not stages of their own (the step, and the reference's names for ours)."""


def stage_times(row: dict) -> dict[str, float]:
    """The step's per-stage seconds of a metrics.jsonl step row (`timing_s/<stage>` minus the aliases)."""
    return {
        k.split("/", 1)[1]: float(v)
        for k, v in row.items()
        if k.startswith("timing_s/") and k not in STAGE_TIMING_ALIASES
    }


def step_anatomy(rows: list[dict]) -> dict[str, float]:
    """Medians over `rows` (metrics.jsonl step rows): step, each stage, orchestration (step − Σ stages), and
    `loop` / `tail` (loop − step) where the rows carry `_loop_s` (the driver's wall time from this step's
    start to the next one's), `driver_cpu` where they carry `_driver_cpu_s`."""
    import statistics

    stages = sorted({k for r in rows for k in stage_times(r)})
    out = {"step": statistics.median(r["timing_s/step"] for r in rows)}
    for s in stages:
        out[s] = statistics.median(stage_times(r).get(s, 0.0) for r in rows)
    out["orchestration"] = statistics.median(r["timing_s/step"] - sum(stage_times(r).values()) for r in rows)
    looped = [r for r in rows if "_loop_s" in r]
    if looped:
        out["loop"] = statistics.median(r["_loop_s"] for r in looped)
        out["tail"] = statistics.median(r["_loop_s"] - r["timing_s/step"] for r in looped)
    timed = [r["_driver_cpu_s"] for r in rows if "_driver_cpu_s" in r]
    if timed:
        out["driver_cpu"] = statistics.median(timed)
    return out


# Peak-memory measurements next to `dapo plan`'s estimates (tests/unit/dapo_core/compute/test_plan.py,
# bench/bench_plan.py and bench/gpu_memory_check.sh); dapo_core is imported inside them.


def measure_actor_update(
    cfg: Any, model_path: str, *, device: str = "cpu", seed: int = 0, steps: int = 1
) -> dict[str, int]:
    """Measure the peak memory of actor updates above the loaded weights, next to the plan's estimate.

    Builds the `ActorWorker` as flows/roles.py does and runs `update_actor` `steps` times on one
    mini-batch of rows at full width (max_prompt_length + max_response_length, the plan's worst case); with
    `use_shared_prompt` the n rows of each group share their prompt, as generated rows do.
    On CPU the peak is the process's resident high-water mark (VmHWM, reset through
    /proc/self/clear_refs after the weights are loaded) minus the resident size then; on CUDA it is
    `torch.cuda.max_memory_allocated` minus the allocation after loading. Returns `measured` and
    `estimated` bytes (the plan's actor rows except the weights, with the update pass) and `weights`
    (the plan's weight row).
    """

    import dataclasses

    import pyarrow as pa
    import torch

    from dapo_core.compute.lora import LoraSpec
    from dapo_core.compute.peak_memory import rss_bytes
    from dapo_core.compute.plan import make_plan
    from dapo_core.compute.workers.actor import ActorWorker

    arr = cfg.actor_rollout_ref
    rows = int(arr.actor.ppo_mini_batch_size) * int(arr.rollout.n)
    P, R = int(cfg.data.max_prompt_length), int(cfg.data.max_response_length)
    worker = ActorWorker(
        model_path,
        dataclasses.asdict(arr.actor),
        pad_token_id=0,
        temperature=1.0,
        rollout_n=int(arr.rollout.n),
        total_steps=10,
        device=device,
        seed=seed,
        gradient_checkpointing=bool(arr.model.enable_gradient_checkpointing),
        use_remove_padding=bool(arr.model.use_remove_padding),
        use_shared_prompt=bool(arr.model.use_shared_prompt),
        lora=LoraSpec.from_model_config(arr.model),
    )
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, 99, (rows, P + R), generator=g)
    if arr.model.use_shared_prompt:  # as generated: the n rows of a group share their prompt
        n = int(arr.rollout.n)
        ids[:, :P] = ids[::n, :P].repeat_interleave(n, dim=0)[:rows]
    table = pa.table(
        {
            "prompt_ids": pa.array(ids[:, :P].tolist(), type=pa.list_(pa.int32())),
            "response_ids": pa.array(ids[:, P:].tolist(), type=pa.list_(pa.int32())),
            "old_log_probs": pa.array((-4.6 * torch.ones(rows, R)).tolist(), type=pa.list_(pa.float32())),
            "advantages": pa.array(torch.randn(rows, R, generator=g).tolist(), type=pa.list_(pa.float32())),
        }
    )
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for step in range(steps):
            worker.update_actor(table, step)
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - base
    else:
        base = rss_bytes("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        for step in range(steps):
            worker.update_actor(table, step)
        measured = rss_bytes("VmHWM") - base
    plan = make_plan(cfg, device=device)
    actor = next(r for r in plan.roles if r.role == "actor")
    weights = sum(r.bytes for r in actor.rows if r.name == "weights")
    estimated = sum(
        r.bytes for r in actor.rows if r.phase in ("", "update") and r.name not in ("weights", "process")
    )
    return {"measured": int(measured), "estimated": int(estimated), "weights": int(weights)}


def measure_rollout(cfg: Any, model_path: str, *, device: str = "cpu", seed: int = 0) -> dict[str, int]:
    """Measure the peak memory of one HF-engine generation above the loaded weights, next to the plan's.

    One batch of `min(gen batch × n, max_num_seqs)` rows: `n` samples of each of `rows / n` random prompts of
    `max_prompt_length` tokens, `max_response_length` new tokens (EOS is an id the model almost never draws,
    so rows run to full length: the plan's worst case). Measured as in `measure_actor_update`; `estimated` is
    the plan's rollout rows except the weights, the process and the push's pass, `weights` its weight row.
    """
    import torch

    from dapo_core.compute.engines.hf_rollout import HFRolloutEngine
    from dapo_core.compute.engines.rollout import SamplingParams
    from dapo_core.compute.peak_memory import rss_bytes
    from dapo_core.compute.plan import make_plan, resolve_shape
    from dapo_core.compute.plan.tables import _peak

    ro = cfg.actor_rollout_ref.rollout
    n, P, R = int(ro.n), int(cfg.data.max_prompt_length), int(cfg.data.max_response_length)
    rows = min(int(cfg.data.gen_batch_size or cfg.data.train_batch_size) * n, int(ro.max_num_seqs))
    dtype = "float32" if str(ro.dtype) == "auto" else str(ro.dtype)
    vocab = resolve_shape(cfg).vocab_size
    if device == "cuda":
        torch.cuda.synchronize()
    engine = HFRolloutEngine(
        model_path, device=device, seed=seed, dtype=dtype, max_batch_size=rows, eos_token_id=vocab - 1
    )
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, vocab - 1, (P,), generator=g).tolist() for _ in range(-(-rows // n))]
    batch = [prompts[i // n] for i in range(rows)]
    params = SamplingParams(temperature=1.0, max_new_tokens=R)
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        engine.generate(batch, params, list(range(rows)))
        torch.cuda.synchronize()
        measured = torch.cuda.max_memory_allocated() - base
    else:
        base = rss_bytes("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        engine.generate(batch, params, list(range(rows)))
        measured = rss_bytes("VmHWM") - base
    rollout = next(r for r in make_plan(cfg, device=device).roles if r.role == "rollout")
    estimated = _peak([r for r in rollout.rows if r.name not in ("weights", "process") and r.phase != "sync"])
    weights = sum(r.bytes for r in rollout.rows if r.name == "weights")
    return {"measured": int(measured), "estimated": int(estimated), "weights": int(weights), "rows": rows}
