"""Opening, resuming and closing a training run: the lease, the run store, the workers and the driver's state
restored from the latest checkpoint (`open_run`, `restore`, `close_run`), and new workers in place of the
run's dead or hung ones (`restart_workers`, before a `restore`; `flows.restarts` decides when).

Plumbing kept out of `flows/dapo_train.py` so that file reads like the algorithm; the workers are built in
`flows.roles`, the inputs read in `flows.run_inputs`.
"""

from __future__ import annotations

import copy
import json
import re
import sys
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from dapo_core.algo.dynamic_sampling import KeepRateEstimator
from dapo_core.algo.kl import get_kl_controller
from dapo_core.compute.cluster import Cluster, start_when_placed
from dapo_core.compute.host import worker_threads
from dapo_core.compute.placement import check_feasible, checked_resources
from dapo_core.compute.storage_probe import probe_storage
from dapo_core.compute.tokenizer import load_tokenizer
from dapo_core.config import (
    DapoConfig,
    gen_batch_size,
    need_ref_worker,
    need_reference_policy,
    resolve_device,
    runs_ahead,
    use_critic,
)
from dapo_core.metrics.tracking import Tracker
from dapo_core.store import RunStore, StoreCorruption
from dapo_core.store.checkpoint import MANIFEST_NAME, CheckpointDir, CheckpointError, verify_folder
from dapo_core.store.files import atomic_write_bytes
from dapo_core.store.lease import Lease
from dapo_core.store.lease import acquire as acquire_lease
from flows.progress import StepProgress
from flows.roles import (
    actor_worker,
    check_gpu_count,
    colocated,
    critic_worker,
    device_pool,
    local_ray_cpus,
    ref_worker,
    reward_worker,
    rollout_replicas,
)
from flows.run_inputs import (
    INPUTS_FILE,
    check_inputs,
    config_record,
    default_model_path,
    input_fingerprints,
    read_table,
    train_sampler,
    val_prompts,
)
from tasks import runtime
from tasks.runtime import ChunkSampler
from tasks.update import push_weights

# Stages of a step that depend only on the weights the step started from: kept on resume and replayed.
ROLLOUT_STAGES = ("prompts_g", "generate_g", "reward_g", "kept_g", "batch", "replay_add_")


@dataclass(kw_only=True)
class TrainRun(runtime.Runtime):
    """The flow's view of a run: the tasks' `Runtime` plus what only the driver uses."""

    tracker: Tracker
    """Metric sinks (console, jsonl, tensorboard)."""
    progress: StepProgress
    """The live console display."""
    keep_rate: KeepRateEstimator = field(default_factory=KeepRateEstimator)
    """Observed share of kept groups, which sizes adaptive refills (checkpointed)."""
    inputs: dict = field(default_factory=dict)
    """Fingerprints of this attempt's data, base model and training config (recorded as inputs.json)."""
    changed_inputs: list[str] = field(default_factory=list)
    """What differs from the run's recorded inputs (non-empty only with trainer.allow_changed_inputs)."""
    model_path: str = ""
    """The base model the workers load (`restart_workers` builds new ones from it)."""
    tokenizer_path: str = ""
    """The tokenizer the reward worker loads."""
    initial_sampler_state: dict = field(default_factory=dict)
    """The sampler's position before anything was drawn (a restart without a checkpoint starts there)."""
    lease: Lease | None = None
    """This process's hold on the run (one writer per run), released by `close_run`."""
    announced: bool = False
    """Whether the old_log_prob decision was printed (once per run and process; `flows.learn`)."""


def record_attempt(rt: TrainRun) -> Path:
    """Write this attempt's records once its setup and restore succeeded: `config.<n>.yaml` (n = attempt
    number; earlier attempts' files are never overwritten), `config.yaml` (the config in force) and
    `inputs.json` (a replaced record is kept as `inputs.<n>.replaced.json`). Returns config.<n>.yaml."""
    root = rt.store.root
    attempts = [
        int(m.group(1)) for p in root.iterdir() if (m := re.fullmatch(r"config\.(\d+)\.yaml", p.name))
    ]
    if not attempts and (root / "config.yaml").exists():  # a run of an older version: keep its record
        atomic_write_bytes(root / "config.0.yaml", (root / "config.yaml").read_bytes())
    n = max(attempts, default=0) + 1
    text = config_record(rt.cfg).encode()
    path = root / f"config.{n}.yaml"
    atomic_write_bytes(path, text)
    atomic_write_bytes(root / "config.yaml", text)
    if rt.changed_inputs and (root / INPUTS_FILE).exists():
        atomic_write_bytes(root / f"inputs.{n}.replaced.json", (root / INPUTS_FILE).read_bytes())
    rt.store.write_json(INPUTS_FILE, rt.inputs)
    record_workers(rt)
    return path


def record_workers(rt: TrainRun) -> None:
    """Write `workers.json`: the workers of this attempt (or of its latest restart), every rank of every role
    with its Ray node ("in-process" without Ray); the rollout replicas report themselves as role `rollout`,
    rank = replica."""
    replicas = {w["name"] for w in rt.rollout.workers_info()}
    trainers = [w for w in rt.cluster.workers if w["role"] not in replicas]
    rt.store.write_json("workers.json", {"workers": trainers + rt.rollout.workers_info()})


def open_run(cfg: DapoConfig, run_id: str) -> TrainRun:
    """Open (or create) `runs/<run_id>/`, check the inputs against the run's record, start the workers, build
    the samplers. Nothing is written to the run's records here (`record_attempt`
    does, once `restore` succeeded)."""
    root = Path(cfg.trainer.runs_dir) / run_id
    lease = take_lease(cfg, root)  # one writer per run: refused here while another process holds it
    store = RunStore(root)
    if cfg.trainer.resume_mode == "disable" and (
        store.checkpoints.latest_step() is not None or store.steps()
    ):
        store.close()
        lease.release()
        raise RuntimeError(
            f"run {run_id} already has outputs in {root} and trainer.resume_mode=disable: "
            f"choose a new trainer.experiment_name, delete the folder, or set trainer.resume_mode=auto"
        )
    model_path = default_model_path(cfg)
    tokenizer_path = cfg.actor_rollout_ref.model.tokenizer_path or model_path
    device = resolve_device(cfg)
    cluster = tracker = None
    try:
        tokenizer = load_tokenizer(tokenizer_path)
        pad = int(tokenizer.pad_token_id)
        # Data first (cheap, and a wrong path should fail before workers spend minutes loading models).
        train_table = read_table(cfg.data.train_files)
        sampler = ChunkSampler(train_sampler(cfg, train_table, tokenizer))
        val_table = val_prompts(cfg.data, tokenizer)
        inputs = input_fingerprints(
            cfg,
            model_path,
            tokenizer_path,
            train_table,
            val_table,
            store.read_json(INPUTS_FILE, default=None),
        )
        changed = check_inputs(store, cfg, inputs)
        kl = cfg.algorithm.kl_ctrl
        kl_ctrl = get_kl_controller(kl.type, kl.kl_coef, kl.horizon, kl.target_kl)
        tracker = Tracker(root, cfg.trainer.logger)
        cluster = Cluster(
            run_id,
            use_ray=cfg.trainer.use_ray,
            address=cfg.trainer.ray_address,
            device=device,
            num_cpus=local_ray_cpus(cfg, device),
            # sync order: one stage at a time; replay order: generation overlaps the update
            num_threads=worker_threads(cfg.trainer.num_threads, 2 if runs_ahead(cfg) else 1, device),
            deterministic=cfg.trainer.deterministic,
            stage_timeout_s=cfg.trainer.stage_timeout_s,
        )
        if cfg.trainer.use_ray:  # every node sees the run folder, the model and the data before any loads
            probe_storage(root, [model_path, tokenizer_path, *cfg.data.train_files, *cfg.data.val_files])
        if device == "cuda" and cfg.trainer.use_ray:
            import ray

            check_gpu_count(cfg, float(ray.cluster_resources().get("GPU", 0.0)))
        rt = TrainRun(
            run_id=run_id,
            cfg=cfg,
            store=store,
            cluster=cluster,
            pad_token_id=pad,
            vocab_size=len(tokenizer),
            **start_workers(cfg, cluster, model_path, tokenizer_path, pad),
            sampler=sampler,
            val_prompts=val_table,
            kl_ctrl=kl_ctrl,
            tracker=tracker,
            progress=StepProgress(run_id, enabled=sys.stdout.isatty() or "console" in cfg.trainer.logger),
            inputs=inputs,
            changed_inputs=changed,
            model_path=model_path,
            tokenizer_path=tokenizer_path,
            initial_sampler_state=copy.deepcopy(sampler.state_dict()),
            lease=lease,
        )
        push_weights(rt, 0)  # the replicas start with unset weights: the actor's initial ones, version 0
    except (
        BaseException
    ):  # nothing of a half-opened run may outlive it (Ray actors, a Ray we started, the store)
        if cluster is not None:
            cluster.shutdown()
        if tracker is not None:
            tracker.close()
        store.close()
        lease.release()
        raise
    lease.start_heartbeat()
    return rt


def start_workers(
    cfg: DapoConfig, cluster: Cluster, model_path: str, tokenizer_path: str, pad: int
) -> dict[str, Any]:
    """Start the run's workers on `cluster`: [the colocated GPU pool], rollout replicas, actor, reward, [ref],
    [critic]; returns them by their `TrainRun` field names. With LoRA the actor is the reference (its
    adapters off): no second model. On a local CPU Ray this run started, the roles start all at once, so
    their processes' imports and model loads overlap; elsewhere one after another, in that order: on a
    cluster, placement follows the order (a role started early could take the room a later, more particular
    one needs), and on a GPU vLLM sizes its cache from the memory free as it starts."""
    device = resolve_device(cfg)
    if device == "cuda" and cfg.trainer.use_ray and colocated(cfg, device):
        cluster.pool = device_pool(cfg, cluster)
    roles: dict[str, Callable[[], Any]] = {
        "rollout": lambda: rollout_replicas(cfg, cluster, model_path, device),
        "actor": lambda: actor_worker(cfg, cluster, model_path, pad, device),
        "reward": lambda: reward_worker(cfg, cluster, tokenizer_path),
    }
    if need_ref_worker(cfg):
        roles["ref"] = lambda: ref_worker(cfg, cluster, model_path, pad, device)
    if use_critic(cfg):
        roles["critic"] = lambda: critic_worker(cfg, cluster, model_path, pad, device)
    if cluster.started_ray and device == "cpu":
        with ThreadPoolExecutor(len(roles), thread_name_prefix="dapo-start") as pool:
            started = {name: pool.submit(make) for name, make in roles.items()}
            workers = {name: f.result() for name, f in started.items()}
    else:
        workers = {name: make() for name, make in roles.items()}
    if "ref" not in workers:
        workers["ref"] = workers["actor"] if need_reference_policy(cfg) else None
    workers.setdefault("critic", None)
    return workers


def restart_workers(rt: TrainRun) -> None:
    """Kill the run's workers (dead, hung or well) and start new ones in their place on the live nodes,
    waiting up to `trainer.restart_wait_s` for room and their start (`start_when_placed`: a node that offers
    what a worker asks for, when its own is gone; a `PlacementError` after it); put the driver's state back
    where the run started (sampler position, keep rate, KL coefficient, replay buffer, launches), give the
    replicas the actor's initial weights and list the new workers in `workers.json`. `restore` then resumes
    from the latest checkpoint and the committed stages, as a new attempt of the run would."""
    import ray

    cfg, cluster = rt.cfg, rt.cluster
    cluster.kill_workers()
    wait = cluster.start_timeout_s

    def start(left_s: float) -> dict[str, Any]:
        cluster.start_timeout_s = left_s
        if cluster.use_ray:
            check_custom_resources(cfg, ray.nodes())  # before any worker starts (model loads) in vain
        return start_workers(cfg, cluster, rt.model_path, rt.tokenizer_path, rt.pad_token_id)

    def nodes() -> list[Mapping[str, Any]]:
        return ray.nodes() if cluster.use_ray else []

    try:
        workers = start_when_placed(
            start,
            cfg.trainer.restart_wait_s,
            what=f"the restart of run {rt.run_id}",
            nodes=nodes,
            clean_up=cluster.kill_workers,
        )
    finally:
        cluster.start_timeout_s = wait
    for name, worker in workers.items():
        setattr(rt, name, worker)
    rt.sampler.load_state_dict(copy.deepcopy(rt.initial_sampler_state))
    rt.keep_rate = KeepRateEstimator()
    kl = cfg.algorithm.kl_ctrl
    rt.kl_ctrl = get_kl_controller(kl.type, kl.kl_coef, kl.horizon, kl.target_kl)
    rt.replay_buffer = None
    rt.launches.clear()
    push_weights(rt, 0)
    record_workers(rt)


def check_custom_resources(cfg: DapoConfig, nodes: list[Mapping[str, Any]]) -> None:
    """A `PlacementError` naming the role when no live node of `nodes` (`ray.nodes()`) offers the custom
    resources `trainer.ray_resources` gives one of the run's roles."""
    res = cfg.trainer.ray_resources
    roles = ["rollout", "actor", "reward"]
    roles += ["ref"] * need_ref_worker(cfg) + ["critic"] * use_critic(cfg)
    for role in roles:
        custom = checked_resources(role, getattr(res, role))
        if custom:
            check_feasible(role, custom, nodes)


def take_lease(cfg: DapoConfig, root: Path) -> Lease:
    """Take the run's lease (`dapo_core.store.lease`), naming this Prefect flow run as the holder; a lease
    taken over from a stale holder is logged once (a WARNING of `dapo_core.store.lease`). Losing it later
    interrupts the main thread (stop writing)."""
    import _thread

    from prefect.runtime import flow_run

    lease = acquire_lease(
        root,
        timeout_s=cfg.trainer.lease_timeout_s,
        wait_s=cfg.trainer.lease_wait_s,
        flow_run_id=str(flow_run.id or ""),
        on_lost=_thread.interrupt_main,
    )
    return lease


@dataclass
class DriverState:
    """What the driver must remember across a restart (stored in each checkpoint as driver_state.json)."""

    train_step: int = 0
    gen_step: int = 0
    weight_version: int = 0
    total_steps: int = 0
    kl_coef: float = 0.0

    def to_json(self, run: TrainRun) -> dict:
        """The state to checkpoint, with the run's KL coefficient, sampler position and keep-rate counts."""
        d = asdict(self)
        d["kl_coef"] = float(run.kl_ctrl.value)
        d["sampler_state"] = run.sampler.state_dict()
        d["keep_rate_state"] = run.keep_rate.state_dict()
        return d


def total_training_steps(run: TrainRun) -> int:
    """trainer.total_training_steps, or epochs × (train prompts ÷ gen_batch_size) as in the reference."""
    cfg = run.cfg
    if cfg.trainer.total_training_steps:
        return cfg.trainer.total_training_steps
    per_epoch = max(len(run.sampler.sampler) // gen_batch_size(cfg), 1)
    return per_epoch * cfg.trainer.total_epochs


def _resume_path_dir(given: Path, ckpts: CheckpointDir, step: int) -> Path:
    """The checkpoint folder `trainer.resume_from_path` names: this run's `ckpt/step_<n>` or another run's,
    which must be a complete checkpoint (manifest and driver state present); verified against its manifest
    either way."""
    if given.absolute().resolve() == ckpts.path(step).resolve():
        return ckpts.load(step)
    for name in (MANIFEST_NAME, "driver_state.json", "actor"):
        if not (given / name).exists():
            raise CheckpointError(
                f"trainer.resume_from_path={str(given)!r} is not a complete checkpoint ({name} is missing)",
                fix="point it at a ckpt/step_<n> folder written by dapo-train",
            )
    verify_folder(given)
    return given


def restore(rt: TrainRun) -> DriverState:
    """Load the latest checkpoint (resume_mode auto / resume_path), push its weights to the rollout replicas
    and prepare later steps for replay."""
    cfg = rt.cfg
    state = DriverState(total_steps=total_training_steps(rt))
    ckpts = rt.store.checkpoints
    mode, given = cfg.trainer.resume_mode, cfg.trainer.resume_from_path or ""
    step = None
    if mode == "auto":
        step = ckpts.resume_step(warn=print)  # a lost `latest` pointer: the newest verifying checkpoint
    elif mode == "resume_path":
        if "step_" not in given:
            raise ValueError(f"trainer.resume_from_path={given!r} must point at a ckpt/step_<n> folder")
        step = int(given.rstrip("/").rsplit("step_", 1)[1])
    if step is not None:
        if mode == "resume_path":  # the folder named, which may belong to another run
            path = _resume_path_dir(Path(given), ckpts, step)
            moved = ckpts.rewind(step)  # later checkpoints of this run belong to the branch we leave
            if moved:
                print(f"resuming from step {step}: later checkpoints {moved} moved under ckpt/abandoned-*")
        else:
            path = ckpts.load(step)
        rt.actor.load_checkpoint(str(path / "actor"))
        if rt.critic is not None:
            rt.critic.load_checkpoint(str(path / "critic"))
        saved = json.loads((path / "driver_state.json").read_text())
        state.train_step, state.gen_step = int(saved["train_step"]), int(saved["gen_step"])
        state.weight_version = int(saved["weight_version"])
        rt.sampler.load_state_dict(saved["sampler_state"])
        if "keep_rate_state" in saved:
            rt.keep_rate.load_state_dict(saved["keep_rate_state"])
        rt.kl_ctrl.value = float(saved["kl_coef"])
        push_weights(rt, state.weight_version)
    dropped = rt.tracker.rewind(state.train_step)
    if dropped:
        print(
            f"metrics: dropped {dropped} rows of steps after {state.train_step} (this attempt logs them anew)"
        )
    # Later steps: keep committed rollouts (replayed), drop everything computed from the lost weights — and
    # the rollouts too when the inputs changed (they came from the old data or model).
    for s in rt.store.steps():
        if s > state.train_step:
            for stage in rt.store.committed_stages(s):
                if rt.changed_inputs or not stage.startswith(ROLLOUT_STAGES):
                    rt.store.delete_stage(s, stage)
                else:
                    _verify_replayed(rt.store, s, stage)
    if rt.changed_inputs:
        n = rt.store.drop_prompts_after("train", state.train_step)
        if n:
            print(f"dropped {n} prompts drawn from the old inputs after step {state.train_step}")
    reissued = rt.store.reissue_inflight("train", state.train_step + 1)
    if reissued:
        print(f"re-issued {reissued} prompts that were in flight when the run stopped")
    record_attempt(rt)
    return state


def _verify_replayed(store: RunStore, step: int, stage: str) -> None:
    """Checksum a stage that a resumed run will replay; a corrupted one (possibly shadowed by a later stage,
    so never read again) is reported and un-committed, so it is recomputed if anything needs it."""
    if not store.is_committed(step, stage):
        return  # deleted with a corrupted stage it was built on (a column delta): recomputed if needed
    try:
        store.verify_stage(step, stage)
    except StoreCorruption as e:
        print(f"warning: {e} — un-committing stage {stage!r} of step {step}; it is recomputed if needed")
        store.delete_stage(step, stage)


def close_run(rt: TrainRun) -> None:
    """Stop workers this run started, close the store and the logger, and make the end-of-run plot."""
    from dapo_core.metrics.tracking import plot_run

    try:
        write_memory_report(rt)
        rt.tracker.close()
        jsonl = rt.store.root / "metrics.jsonl"
        if jsonl.exists():
            try:
                plot_run(jsonl, rt.store.root / "curves.png")
            except Exception as exc:
                print(f"could not draw {rt.store.root / 'curves.png'}: {exc!r}")
    finally:
        rt.progress.close()
        rt.cluster.shutdown()
        rt.store.close()
        if rt.lease is not None:
            rt.lease.release()
            rt.lease = None


def write_memory_report(rt: TrainRun) -> dict[str, Any] | None:
    """Write `memory.json` (each worker process's peak resident memory next to `dapo plan`'s estimate of
    its role, `dapo_core.compute.peak_memory`) and print one line of it. Without Ray there is nothing to
    measure (the workers are this process) and nothing is written; a plan that cannot be made leaves the
    plan columns empty. Never raises: the end of a run must not fail on a report."""
    from dapo_core.compute.peak_memory import compare_to_plan
    from dapo_core.compute.plan import make_plan

    try:
        measured = rt.cluster.memory_report()
        if not measured:
            return None
        names = list(getattr(rt.rollout, "names", []))
        for m in measured:
            if m["role"] in names:
                m.update(role="rollout", rank=names.index(m["role"]))
        device = str(rt.cfg.trainer.device)
        try:
            plan: Any = make_plan(rt.cfg, device=device)
        except Exception as exc:
            print(f"memory report without the plan ({exc})")
            plan = SimpleNamespace(roles=[])
        report = compare_to_plan(measured, plan, device)
        rt.store.write_json("memory.json", report)
        parts = []
        for role, r in report["roles"].items():
            want = r["plan_bytes"]
            tail = f" (plan {want / 2**30:.2f} GiB, {r['measured_over_plan']:.2f}x)" if want else ""
            parts.append(f"{role} {r['peak_rss_bytes'] / 2**30:.2f} GiB{tail}")
        print("peak resident memory per process: " + " · ".join(parts))
        return report
    except Exception as exc:
        print(f"could not write the memory report: {exc!r}")
        return None
