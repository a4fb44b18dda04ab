"""The `trainer` section (step loop, checkpoints, resume, restarts, logging, where the workers run) and
the `eval` section (`dapo eval`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dapo_core.config.choices import Device, LoggerName, OffPolicyStrategy, ResumeMode, StepOrder


@dataclass
class RayResourcesConfig:
    """Placement on a multi-node Ray cluster: the custom resources each role's worker asks for, e.g.
    `rollout: {gen_node: 1}` puts the rollout worker on a node started with
    `ray start --resources '{"gen_node": 1}'` (infra/ray_cluster.sh). Empty = any node with a free CPU/GPU.
    A resource no live node offers is refused when the worker is created. Not part of the resume check:
    a resumed run may be placed differently."""

    rollout: dict[str, float] = field(default_factory=dict)
    """Resources of the rollout (generation) worker, {name: amount}."""
    actor: dict[str, float] = field(default_factory=dict)
    """Resources of the actor (policy update) worker."""
    ref: dict[str, float] = field(default_factory=dict)
    """Resources of the reference-policy worker (when KL needs one)."""
    critic: dict[str, float] = field(default_factory=dict)
    """Resources of the critic worker (GAE)."""
    reward: dict[str, float] = field(default_factory=dict)
    """Resources of the reward worker (CPU scoring)."""


@dataclass
class TrainerConfig:
    """The step loop, checkpoints, resume, logging and where it runs."""

    project_name: str = "dapo"
    """Project name in logs. No-op here."""
    experiment_name: str | None = None
    """Run id (runs/<id>/); null = generated YYYYmmdd-HHMMSS-xxxx."""
    runs_dir: str = "runs"
    """Root of the run store."""
    models_dir: str = "models"
    """Folder for locally built base models (the tiny model is built in models_dir/tiny_base)."""
    total_epochs: int = 1
    """Passes over the training prompts."""
    total_training_steps: int | None = None
    """Training steps; null = epochs x batches per epoch."""
    save_freq: int = -1
    """Checkpoint every this many steps (<= 0: only at the end)."""
    test_freq: int = -1
    """Validate every this many steps (<= 0: never during training)."""
    val_before_train: bool = True
    """Validate once before the first step."""
    resume_mode: ResumeMode = "auto"
    """auto (latest checkpoint if any) | disable | resume_path."""
    resume_from_path: str | None = None
    """Checkpoint folder for resume_mode=resume_path."""
    allow_changed_inputs: bool = False
    """Resume even if data, base model or training config changed (inputs.json); drops stored rollouts."""
    max_actor_ckpt_to_keep: int | None = None
    """Keep at most this many actor checkpoints; null = all."""
    keep_rollouts_every: int = 0
    """Keep every this-many-th step's data past checkpoints (0: only steps a resume replays)."""
    max_critic_ckpt_to_keep: int | None = None
    """Keep at most this many critic checkpoints; null = all. Not implemented yet (default only)."""
    step_order: StepOrder = "sync"
    """sync (one weight version per step) | async (next batch generated during the update) | replay_buffer."""
    max_staleness: int = 1
    """async: largest weight-version lag of a trained sample; older groups are dropped (0: none ahead)."""
    parameter_sync_step: int = 1
    """replay_buffer: local updates per global step before syncing rollout weights."""
    max_off_policy_threshold: int = 8
    """replay_buffer: largest allowed staleness in steps."""
    max_off_policy_strategy: OffPolicyStrategy = "drop"
    """replay_buffer: drop stale prompts | wait for fresh ones."""
    balance_batch: bool = True
    """Reorder trajectories so data-parallel ranks get equal token loads."""
    critic_warmup: int = 0
    """Steps that update only the critic."""
    device: Device = "auto"
    """cpu | cuda | auto (cuda when available)."""
    use_ray: bool = True
    """Run workers as Ray actors (false = in-process)."""
    ray_address: str | None = None
    """Ray cluster to join; null = RAY_ADDRESS or start a local one."""
    ray_resources: RayResourcesConfig = field(default_factory=RayResourcesConfig)
    """Which nodes each worker runs on (Ray custom resources per role; docs/SCALE.md "Several machines")."""
    nnodes: int = 1
    """Nodes the actor and reference ranks span (more than 1 needs actor.strategy fsdp2)."""
    n_gpus_per_node: int = 8
    """Ranks per node (GPUs; on CPU one-core processes): fsdp2 actor/ref ranks, and rollout replicas × TP."""
    logger: list[LoggerName] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    """Metric sinks: console | jsonl | tensorboard."""
    seed: int = 1
    """Seed of all sampling and initialisation randomness."""
    lease_timeout_s: float = 120.0
    """A run's lease (one writer per run) whose heartbeat is older than this may be taken over."""
    lease_wait_s: float = 0.0
    """How long a second writer of a run waits for the lease before it is refused (0: refuse at once)."""
    max_restarts: int = 0
    """Restarts from the last checkpoint after a worker died or hung, per restart_window_s (0: none)."""
    restart_window_s: float = 3600.0
    """The sliding window (seconds) in which max_restarts counts restarts."""
    restart_wait_s: float = 600.0
    """How long a restart waits for the new workers to be placed and built before the run ends."""
    stage_timeout_s: float = 0.0
    """A Ray worker call silent this long is a hang, handled as a death (0: off; not in-process)."""
    num_threads: int = 1
    """Torch threads per process on CPU (SFT, workers, eval); 0 = share the cores (numbers vary by host)."""
    deterministic: bool = False
    """torch.use_deterministic_algorithms in every computing process: SFT warm-up, workers, eval."""


@dataclass
class EvalConfig:
    """`dapo eval`: avg@k / pass@k / maj@k of a checkpoint."""

    checkpoint: str = ""
    """Checkpoint or HF folder to evaluate; "" = the run's latest."""
    files: list[str] = field(default_factory=list)
    """Evaluation parquet files; empty = data.val_files."""
    n: int = 8
    """Samples per problem (k)."""
    temperature: float = 1.0
    """Sampling temperature; 0 = greedy decoding (then eval.n = 1 is enough)."""
    top_p: float = 0.7
    """Nucleus threshold."""
    top_k: int = -1
    """Top-k (-1 = off)."""
    output: str = "metrics/eval.json"
    """Where the metrics JSON is written."""
    greedy: bool = False
    """`dapo train` also evaluates greedily (one sample) before and after DAPO."""
