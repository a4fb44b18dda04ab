"""Structured configuration for dapo: schema, loading, overrides and validation.

The schema is a tree of dataclasses turned into an OmegaConf structured config. Key paths follow verl
(`actor_rollout_ref.actor.clip_ratio_high`, `algorithm.filter_groups.enable`, ...) so that the overrides
of a verl DAPO script work here unchanged, as long as the key exists in our schema.

Defaults follow the reference (verl NEWEST `ppo_trainer.yaml` + the DAPO recipe's `dapo_trainer.yaml`), so
the base config is *not* DAPO: dynamic sampling and overlong shaping are off, clipping is symmetric. The
DAPO configs (`configs/tiny_cpu.yaml`, `configs/dapo_*_qwen2.5_32b.yaml`) switch them on. Where we differ
from verl's defaults on purpose, the field docstring says so (engines default to the CPU-runnable `hf` /
`torch`, `adv_estimator` defaults to `grpo`, `filter_groups.metric` to `acc`).

Loading (`load_config`): schema defaults <- YAML file (and the chain of files named by its top-level
`base:` key, resolved relative to the including file) <- dotted overrides (`a.b.c=1`, verl-style
`+a.b.c=1`). Every unknown key or wrong type is reported with its full dotted path and the closest valid
key; then `validate_config` runs the cross-field checks and reports all problems at once.
"""

from __future__ import annotations

import ast
import copy
import difflib
import functools
import hashlib
import inspect
import itertools
import re
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

__all__ = [
    "ConfigError",
    "ConfigWarning",
    "DapoConfig",
    "all_keys",
    "config_hash",
    "field_docs",
    "gen_batch_size",
    "load_config",
    "load_config_text",
    "need_reference_policy",
    "resolve_device",
    "to_yaml",
    "use_critic",
    "validate_config",
]


class ConfigError(ValueError):
    """A configuration problem: unknown key, wrong type, or inconsistent values (the message lists each)."""


class ConfigWarning(UserWarning):
    """A configuration that is legal but probably not what the user meant."""


# --------------------------------------------------------------------------------------------- data
@dataclass
class SyntheticDataConfig:
    """Generated arithmetic word problems: the CPU default's training and validation data."""

    enable: bool = False
    """Generate the dataset instead of reading `train_files`/`val_files` from disk."""
    num_train: int = 4000
    """Number of generated training problems."""
    num_val: int = 200
    """Number of generated validation problems."""
    min_value: int = 0
    """Smallest operand value."""
    max_value: int = 99
    """Largest operand value."""
    num_operands: int = 2
    """Operands per problem."""
    ops: list[str] = field(default_factory=lambda: ["+", "-"])
    """Operators to draw from (any of "+", "-", "*")."""
    seed: int = 0
    """Seed of the generator (the data are a pure function of this section)."""
    out_dir: str = "data"
    """Folder the generated parquet files are written to."""


@dataclass
class SourceFilesConfig:
    """Where `dapo prepare` fetches the real DAPO data from (URLs or local paths)."""

    train: str | None = (
        "https://huggingface.co/datasets/BytedTsinghua-SIA/DAPO-Math-17k/resolve/main/data/"
        "dapo-math-17k.parquet?download=true"
    )
    """DAPO-Math-17k training parquet (URL or path); null = do not fetch."""
    val: str | None = (
        "https://huggingface.co/datasets/BytedTsinghua-SIA/AIME-2024/resolve/main/data/"
        "aime-2024.parquet?download=true"
    )
    """AIME-2024 validation parquet (URL or path); null = do not fetch."""


@dataclass
class DataConfig:
    """Datasets, prompt/response lengths and batch sizes (counted in prompts)."""

    train_files: list[str] = field(default_factory=list)
    """Training parquet files (verl schema); a single string is accepted."""
    val_files: list[str] = field(default_factory=list)
    """Validation parquet files (verl schema); a single string is accepted."""
    prompt_key: str = "prompt"
    """Column holding the chat messages of a prompt."""
    reward_fn_key: str = "data_source"
    """Column that routes a row to its scoring function."""
    max_prompt_length: int = 512
    """Longest prompt in tokens (longer prompts are truncated per `truncation`)."""
    max_response_length: int = 512
    """Most tokens generated per response."""
    train_batch_size: int = 1024
    """Prompts per training step (after dynamic sampling)."""
    gen_batch_size: int | None = None
    """Prompts per generation batch; null = train_batch_size (DAPO full uses 3x)."""
    val_batch_size: int | None = None
    """Prompts per validation generation batch; null = the whole validation set."""
    truncation: str = "left"
    """How an over-long prompt is cut: left | right | error (DAPO recipe: left)."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch."""
    seed: int = 1
    """Seed of the training sampler."""
    dedup: bool = False
    """Drop duplicated problems (DAPO-Math-17k holds ~100 copies of each); reference keeps them."""
    synthetic: SyntheticDataConfig = field(default_factory=SyntheticDataConfig)
    """Generated arithmetic data for the CPU default."""
    source_files: SourceFilesConfig = field(default_factory=SourceFilesConfig)
    """Where to fetch the real DAPO data from."""


# -------------------------------------------------------------------------------------------- model
@dataclass
class TinyModelConfig:
    """The embedded tiny Qwen2-architecture model built when `model.path` is empty."""

    hidden_size: int = 128
    """Width of the residual stream."""
    intermediate_size: int = 384
    """Width of the MLP."""
    num_hidden_layers: int = 2
    """Number of transformer blocks."""
    num_attention_heads: int = 4
    """Query heads per layer."""
    num_key_value_heads: int = 2
    """Key/value heads per layer (grouped-query attention)."""
    head_dim: int = 32
    """Width of one attention head."""
    max_position_embeddings: int = 256
    """Longest sequence (prompt + response) the model accepts."""
    tie_word_embeddings: bool = True
    """Share the input embedding and the output head."""
    seed: int = 0
    """Seed of the random initialisation."""


@dataclass
class SftConfig:
    """Supervised warm-up of the tiny base model before RL."""

    enable: bool = False
    """Run the warm-up (only for the tiny model)."""
    steps: int = 300
    """Optimizer steps of the warm-up."""
    lr: float = 3e-3
    """Learning rate of the warm-up."""
    batch_size: int = 64
    """Examples per warm-up step."""
    seed: int = 0
    """Seed of the warm-up data order."""
    answer_line_prob: float = 1.0
    """Share of warm-up solutions that end with the `Answer: <n>` line the verifier needs (the rest stop after
    the worked line): below 1 the base model often forgets the answer line, which RL can learn to fix."""


@dataclass
class ModelConfig:
    """The policy model: a HF folder, or the tiny model built locally."""

    path: str = ""
    """HF model folder or hub name; "" builds the tiny model (`tiny.*`)."""
    tokenizer_path: str | None = None
    """Tokenizer folder; null = `path`."""
    enable_gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Shape of the embedded tiny model."""
    sft: SftConfig = field(default_factory=SftConfig)
    """Warm-up of the tiny base model."""


# -------------------------------------------------------------------------------------------- actor
@dataclass
class OptimConfig:
    """AdamW with linear warm-up then constant (or cosine) learning rate."""

    lr: float = 1e-6
    """Peak learning rate."""
    lr_warmup_steps: int = -1
    """Warm-up steps; negative = use `lr_warmup_steps_ratio`."""
    lr_warmup_steps_ratio: float = 0.0
    """Warm-up length as a fraction of the total training steps."""
    warmup_style: str = "constant"
    """Schedule after warm-up: constant | cosine."""
    min_lr_ratio: float = 0.0
    """Cosine schedule floor as a fraction of `lr`."""
    weight_decay: float = 0.01
    """AdamW decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW (beta1, beta2)."""


@dataclass
class PolicyLossConfig:
    """Which registered policy loss to use, and the parameters of the non-vanilla ones."""

    loss_mode: str = "vanilla"
    """Registered policy loss (vanilla = PPO clip with dual clip, the DAPO loss)."""
    clip_cov_ratio: float = 0.0002
    """clip_cov: fraction of tokens whose loss is zeroed."""
    clip_cov_lb: float = 1.0
    """clip_cov: lower bound of the covariance window."""
    clip_cov_ub: float = 5.0
    """clip_cov: upper bound of the covariance window."""
    kl_cov_ratio: float = 0.0002
    """kl_cov: fraction of tokens that get the KL term."""
    ppo_kl_coef: float = 0.1
    """kl_cov: coefficient of the |log ratio| term."""
    tau_pos: float = 1.0
    """sapo: gate temperature for positive advantages."""
    tau_neg: float = 1.05
    """sapo: gate temperature for negative advantages."""
    dro_beta: float = 0.0
    """dro: coefficient of the squared log-ratio term (must be > 0 for loss_mode=dro)."""


@dataclass
class DeepSpeedConfig:
    """DeepSpeed settings for `actor.strategy: deepspeed`."""

    zero_stage: int = 1
    """ZeRO stage 0-3."""
    offload_optimizer: bool = False
    """Keep optimizer state on the CPU."""
    offload_param: bool = False
    """Keep parameters on the CPU (ZeRO-3 only)."""
    bf16: bool = False
    """Train in bfloat16 mixed precision."""


@dataclass
class CheckpointConfig:
    """What an actor checkpoint holds."""

    save_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra", "hf_model"])
    """Parts written per checkpoint: model, optimizer, extra (lr schedule, RNG), hf_model."""
    load_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    """Parts restored on resume."""


@dataclass
class ActorConfig:
    """The trained policy: PPO/DAPO loss, mini-batching and optimizer."""

    strategy: str = "torch"
    """Training engine: torch | deepspeed (verl's fsdp/megatron are not available here)."""
    ppo_mini_batch_size: int = 256
    """Prompts per optimizer step (x rollout.n trajectories)."""
    ppo_micro_batch_size_per_gpu: int | None = None
    """Trajectories per forward/backward; null = the whole mini-batch."""
    use_dynamic_bsz: bool = False
    """Form micro-batches by a token budget instead of a trajectory count."""
    ppo_max_token_len_per_gpu: int = 16384
    """Token budget of a micro-batch when `use_dynamic_bsz`."""
    ppo_epochs: int = 1
    """Passes over each training batch."""
    shuffle: bool = False
    """Shuffle trajectories between PPO epochs."""
    clip_ratio: float = 0.2
    """Symmetric clip epsilon, used where low/high are null."""
    clip_ratio_low: float | None = 0.2
    """eps_low: ratio lower clip is 1 - eps_low."""
    clip_ratio_high: float | None = 0.2
    """eps_high: ratio upper clip is 1 + eps_high (DAPO clip-higher: 0.28)."""
    clip_ratio_c: float = 3.0
    """Dual-clip bound for negative advantages (must be > 1; DAPO: 10)."""
    loss_agg_mode: str = "token-mean"
    """Loss aggregation: token-mean | token-sum | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm."""
    loss_scale_factor: float | None = None
    """Divisor of seq-mean-token-sum-norm; null = padded response length."""
    entropy_coeff: float = 0.0
    """Weight of the entropy bonus."""
    use_kl_loss: bool = False
    """Add a KL-to-reference term to the actor loss."""
    kl_loss_type: str = "low_var_kl"
    """KL estimator of the KL loss (kl|k1|abs|mse|k2|low_var_kl|k3, optional '+' suffix)."""
    kl_loss_coef: float = 0.001
    """Weight of the KL loss."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Actor optimizer."""
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    """Policy-loss selection and parameters."""
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    """DeepSpeed engine settings."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint contents."""


# ------------------------------------------------------------------------------------------ rollout
@dataclass
class ValKwargsConfig:
    """Sampling for validation generations."""

    n: int = 1
    """Samples per validation prompt."""
    temperature: float = 0.0
    """Validation sampling temperature."""
    top_p: float = 1.0
    """Validation nucleus threshold."""
    top_k: int = -1
    """Validation top-k (-1 = off)."""
    do_sample: bool = False
    """Sample (true) or decode greedily (false)."""


@dataclass
class RolloutConfig:
    """The generation engine and its sampling parameters."""

    name: str = "hf"
    """Rollout engine: hf | vllm (verl default vllm; ours hf so that the CPU path works)."""
    n: int = 16
    """Responses sampled per prompt, the GRPO group size (verl default 1; ours DAPO's 16)."""
    temperature: float = 1.0
    """Training sampling temperature."""
    top_p: float = 1.0
    """Training nucleus threshold."""
    top_k: int = -1
    """Training top-k (-1 = off)."""
    do_sample: bool = True
    """Sample (true) or decode greedily (false)."""
    calculate_log_probs: bool = True
    """Return the engine's log-probs of the sampled tokens (needed by rollout correction)."""
    log_prob_micro_batch_size_per_gpu: int | None = None
    """Trajectories per forward when recomputing old log-probs; null = whole batch."""
    log_prob_use_dynamic_bsz: bool = False
    """Form log-prob micro-batches by a token budget."""
    log_prob_max_token_len_per_gpu: int = 16384
    """Token budget of a log-prob micro-batch when dynamic."""
    gpu_memory_utilization: float = 0.5
    """vLLM: fraction of GPU memory for weights and KV cache."""
    tensor_model_parallel_size: int = 1
    """vLLM: tensor-parallel degree."""
    enforce_eager: bool = True
    """vLLM: disable CUDA graphs."""
    free_cache_engine: bool = True
    """vLLM: release the KV cache between rollouts."""
    enable_chunked_prefill: bool = True
    """vLLM: chunked prefill."""
    max_num_batched_tokens: int = 8192
    """vLLM: tokens per engine step."""
    max_num_seqs: int = 1024
    """vLLM: concurrent sequences."""
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    """Sampling for validation."""


@dataclass
class RefConfig:
    """The frozen reference policy (only built when a KL term needs it)."""

    log_prob_micro_batch_size_per_gpu: int | None = None
    """Trajectories per reference forward; null = whole batch."""
    log_prob_use_dynamic_bsz: bool = False
    """Form reference micro-batches by a token budget."""
    log_prob_max_token_len_per_gpu: int = 16384
    """Token budget of a reference micro-batch when dynamic."""


@dataclass
class ActorRolloutRefConfig:
    """Model, actor, rollout and reference: verl's `actor_rollout_ref` section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy model."""
    actor: ActorConfig = field(default_factory=ActorConfig)
    """The trained policy."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """The generation engine."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The reference policy."""


# ------------------------------------------------------------------------------------------- critic
@dataclass
class CriticConfig:
    """The value model (used by GAE only)."""

    enable: bool | None = None
    """Build a critic; null = only when `algorithm.adv_estimator` is gae."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Critic optimizer."""
    ppo_mini_batch_size: int | None = None
    """Prompts per critic step; null = actor's."""
    ppo_micro_batch_size_per_gpu: int | None = None
    """Trajectories per critic forward/backward; null = whole mini-batch."""
    ppo_epochs: int | None = None
    """Passes per batch; null = actor's."""
    cliprange_value: float = 0.5
    """Value clip range."""
    loss_agg_mode: str = "token-mean"
    """Value-loss aggregation (same five modes as the actor)."""
    grad_clip: float = 1.0
    """Global gradient-norm clip."""


# ---------------------------------------------------------------------------------------- algorithm
@dataclass
class KLCtrlConfig:
    """Controller of the in-reward KL coefficient."""

    type: str = "fixed"
    """fixed | adaptive."""
    kl_coef: float = 0.001
    """(Initial) KL coefficient beta."""
    horizon: int = 10000
    """Adaptive controller horizon (> 0)."""
    target_kl: float = 0.1
    """Adaptive controller target KL."""


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop groups whose metric has zero spread."""

    enable: bool = False
    """Turn dynamic sampling on."""
    metric: str | None = "acc"
    """Per-trajectory value that must vary within a group: acc | score | seq_reward | seq_final_reward (verl default null)."""
    max_num_gen_batches: int = 0
    """Most generation batches per step before giving up (0 = unlimited)."""
    refill: str = "fixed"
    """Refill sizing: fixed = gen_batch_size (reference) | adaptive = sized to the deficit (ours)."""


@dataclass
class RolloutCorrectionConfig:
    """Importance sampling / rejection sampling against the rollout policy (verl YAML defaults)."""

    rollout_is: str | None = None
    """IS level: null | token | sequence."""
    rollout_is_threshold: Any = 2.0
    """IS cap: a number (TIS upper) or a quoted "lower_upper" string (IcePop)."""
    rollout_is_batch_normalize: bool = False
    """Rescale IS weights to mean 1."""
    rollout_rs: str | None = None
    """Comma-separated rejection options (token_k1, seq_mean_k3, ...)."""
    rollout_rs_threshold: Any = None
    """Threshold per RS option (one shared or one per option, comma-separated)."""
    bypass_mode: bool = False
    """Use rollout log-probs as old log-probs (2 policies) instead of recomputing."""
    loss_type: str = "ppo_clip"
    """Bypass-mode loss: ppo_clip | reinforce."""


@dataclass
class AlgorithmConfig:
    """Advantage estimation, KL in reward, dynamic sampling and rollout correction."""

    adv_estimator: str = "grpo"
    """Advantage estimator (verl default gae; ours grpo)."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 1.0
    """GAE lambda."""
    norm_adv_by_std_in_grpo: bool = True
    """Divide GRPO advantages by the group std (false = Dr.GRPO)."""
    use_kl_in_reward: bool = False
    """Subtract beta * KL from the token rewards."""
    kl_penalty: str = "kl"
    """KL estimator for the in-reward penalty."""
    kl_ctrl: KLCtrlConfig = field(default_factory=KLCtrlConfig)
    """In-reward KL coefficient controller."""
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    """DAPO dynamic sampling."""
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    """Training/inference mismatch correction."""


# ------------------------------------------------------------------------------------------- reward
@dataclass
class OverlongBufferConfig:
    """DAPO overlong reward shaping over the last `len` tokens before max_response_length."""

    enable: bool = False
    """Turn the soft overlong penalty on."""
    len: int = 0
    """Buffer length L_cache in tokens (0 < len < max_response_length)."""
    penalty_factor: float = 0.0
    """Penalty at max_response_length."""
    log: bool = False
    """Log `overlong_reward` and `overlong` per trajectory."""


@dataclass
class RewardModelConfig:
    """Rule-based reward: the manager, its worker pool and overlong shaping."""

    reward_manager: str = "dapo"
    """Reward manager name."""
    num_workers: int = 1
    """Processes scoring responses in parallel (1 = in-process)."""
    timeout_s: float = 10.0
    """Seconds before one scoring call is abandoned (scored as a failure)."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """Overlong reward shaping."""


# ------------------------------------------------------------------------------------------ trainer
@dataclass
class TrainerConfig:
    """The step loop, checkpoints, resume, logging and where it runs."""

    project_name: str = "dapo"
    """Project name in logs."""
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
    resume_mode: str = "auto"
    """auto (latest checkpoint if any) | disable | resume_path."""
    resume_from_path: str | None = None
    """Checkpoint folder for resume_mode=resume_path."""
    max_actor_ckpt_to_keep: int | None = None
    """Keep at most this many actor checkpoints; null = all."""
    max_critic_ckpt_to_keep: int | None = None
    """Keep at most this many critic checkpoints; null = all."""
    step_order: str = "sync"
    """sync (one weight version per step) | replay_buffer (rollouts run ahead)."""
    parameter_sync_step: int = 1
    """replay_buffer: local updates per global step before syncing rollout weights."""
    max_off_policy_threshold: int = 8
    """replay_buffer: largest allowed staleness in steps."""
    max_off_policy_strategy: str = "drop"
    """replay_buffer: drop stale prompts | wait for fresh ones."""
    balance_batch: bool = True
    """Reorder trajectories so data-parallel ranks get equal token loads."""
    critic_warmup: int = 0
    """Steps that update only the critic."""
    device: str = "auto"
    """cpu | cuda | auto (cuda when available)."""
    use_ray: bool = True
    """Run workers as Ray actors (false = in-process)."""
    ray_address: str | None = None
    """Ray cluster to join; null = RAY_ADDRESS or start a local one."""
    nnodes: int = 1
    """Nodes in the cluster."""
    n_gpus_per_node: int = 8
    """GPUs per node (ignored on CPU)."""
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    """Metric sinks: console | jsonl | tensorboard."""
    seed: int = 1
    """Seed of all sampling and initialisation randomness."""


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
    """Sampling temperature."""
    top_p: float = 0.7
    """Nucleus threshold."""
    top_k: int = -1
    """Top-k (-1 = off)."""
    output: str = "metrics/eval.json"
    """Where the metrics JSON is written."""


@dataclass
class DapoConfig:
    """The whole configuration (verl key paths)."""

    data: DataConfig = field(default_factory=DataConfig)
    """Datasets and batch sizes."""
    actor_rollout_ref: ActorRolloutRefConfig = field(default_factory=ActorRolloutRefConfig)
    """Model, actor, rollout and reference."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """Value model."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """Advantage, KL, dynamic sampling, rollout correction."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)
    """Reward scoring."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Step loop and infrastructure."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Offline evaluation."""


# ------------------------------------------------------------------------------------ introspection
@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Return {field name: its one-line docstring} for a config dataclass (read from the source)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in itertools.pairwise(body):
        is_field = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        is_doc = isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
        if is_field and is_doc and isinstance(nxt.value.value, str):
            docs[node.target.id] = nxt.value.value.strip()
    return docs


def _walk_schema(cls: type = DapoConfig, prefix: str = "") -> Iterator[tuple[str, type, str]]:
    """Yield (dotted key, owning dataclass, field name) for every leaf and section of the schema."""
    for f in fields(cls):
        key = f"{prefix}{f.name}"
        yield key, cls, f.name
        sub = f.default_factory() if f.default_factory is not MISSING else None
        if is_dataclass(sub):
            yield from _walk_schema(type(sub), key + ".")


def all_keys() -> list[str]:
    """Every dotted key of the schema, sections included (e.g. `algorithm.filter_groups.enable`)."""
    return [k for k, _, _ in _walk_schema()]


_STR_OR_LIST = {"data.train_files", "data.val_files", "eval.files", "trainer.logger"}
"""List-typed keys that also accept a single string (as verl scripts pass them)."""


# -------------------------------------------------------------------------------------- key checks
def _suggest(key: str, parent: Any) -> str:
    """A ' — did you mean X?' hint for an unknown dotted key (siblings first, then any leaf)."""
    leaf = key.rsplit(".", 1)[-1]
    siblings = list(parent.keys()) if isinstance(parent, DictConfig) else []
    close = difflib.get_close_matches(leaf, siblings, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]}?"
    everywhere = all_keys()
    by_leaf = {k.rsplit(".", 1)[-1]: k for k in everywhere}
    close = difflib.get_close_matches(leaf, list(by_leaf), n=1, cutoff=0.75)
    if close:
        return f"did you mean {by_leaf[close[0]]}?"
    close = difflib.get_close_matches(key, everywhere, n=1, cutoff=0.5)
    if close:
        return f"did you mean {close[0]}?"
    return "see `dapo config` for the valid keys."


def _unknown_keys(schema: DictConfig, data: Any, prefix: str, where: str) -> list[str]:
    """List a problem line for every key of `data` (a plain dict) that the schema does not have."""
    problems = []
    if not isinstance(data, dict):
        return problems
    for k, v in data.items():
        key = f"{prefix}{k}"
        if not isinstance(schema, DictConfig) or k not in schema:
            problems.append(f"{key}: unknown key ({where}) — {_suggest(key, schema)}")
            continue
        child = schema._get_node(k)
        if isinstance(child, DictConfig) and isinstance(v, dict):
            problems.extend(_unknown_keys(child, v, key + ".", where))
    return problems


def _lift_str_lists(data: Any, prefix: str = "") -> Any:
    """Wrap a string given for a list-typed key in `_STR_OR_LIST` into a one-element list."""
    if isinstance(data, dict):
        return {k: _lift_str_lists(v, f"{prefix}{k}.") for k, v in data.items()}
    if prefix[:-1] in _STR_OR_LIST and isinstance(data, str) and not data.startswith("${"):
        return [data] if data else []
    return data


def _merge(cfg: DictConfig, data: dict, where: str, problems: list[str]) -> DictConfig:
    """Merge a plain dict into the structured config; on unknown keys or wrong types append problem
    lines to `problems` and return `cfg` unchanged."""
    unknown = _unknown_keys(cfg, data, "", where)
    if unknown:
        problems.extend(unknown)
        return cfg
    try:
        return OmegaConf.merge(cfg, _lift_str_lists(data))  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        msg = str(e).splitlines()[0]
        problems.append(
            f"{key}: wrong type ({where}): {msg} — give a value of the type documented in configs/dapo.yaml."
        )
        return cfg


# ----------------------------------------------------------------------------------------- loading
@functools.lru_cache(maxsize=32)
def _read_yaml_dict(path: Path, mtime_ns: int) -> dict:
    """Parse a YAML config file into a plain dict (cached per file version; interpolations kept)."""
    del mtime_ns  # part of the cache key only
    raw = OmegaConf.load(path)
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"{path}: the top level must be a mapping of sections.")
    data = OmegaConf.to_container(raw, resolve=False)
    assert isinstance(data, dict)
    return data


def _read_yaml_chain(path: Path, seen: tuple[Path, ...] = ()) -> list[tuple[Path, dict]]:
    """Read a YAML file and, first, the files named by its `base:` key (relative to it)."""
    path = path.resolve()
    if path in seen:
        raise ConfigError(f"base: cycle of config files: {' -> '.join(str(p) for p in (*seen, path))}")
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist — pass an existing --config path.")
    data = copy.deepcopy(_read_yaml_dict(path, path.stat().st_mtime_ns))
    base = data.pop("base", None)
    chain: list[tuple[Path, dict]] = []
    if base is not None:
        if not isinstance(base, str):
            raise ConfigError(f"{path}: base must be a file name such as 'dapo.yaml', got {base!r}.")
        chain = _read_yaml_chain(path.parent / base, (*seen, path))
    return chain + [(path, data)]


_LOWER_UPPER = re.compile(r"^[0-9.eE+-]+_[0-9.eE+-]+$")
"""A 'lower_upper' threshold pair, kept as a string (quote such values in YAML files)."""


def _parse_override(item: str) -> tuple[str, Any]:
    """Split 'a.b=value' (or verl-style '+a.b=value') into the key and a YAML-parsed value."""
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key=value (e.g. data.train_batch_size=16).")
    key, value = item.split("=", 1)
    key = key.strip().lstrip("+")
    if key.startswith("~"):
        raise ConfigError(f"override {item!r}: deleting keys is not supported — set the key to null instead.")
    if value == "":
        return key, ""
    if _LOWER_UPPER.match(value):  # YAML 1.1 would read "5_0.5" as the number 50.5
        return key, value
    parsed = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={value}"]), resolve=False)["v"]
    return key, parsed


def _nest(key: str, value: Any) -> dict:
    """Turn 'a.b.c', v into {'a': {'b': {'c': v}}}."""
    out: Any = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> DictConfig:
    """Load, override and validate a config.

    `path` is a YAML file (None = schema defaults only); a top-level `base: other.yaml` key makes it
    inherit that file (resolved relative to it, chains allowed). `overrides` are `a.b.c=value` strings
    (a leading `+` as in verl/Hydra is accepted when the key exists). Returns a struct-mode DictConfig
    typed by `DapoConfig`. Raises `ConfigError` naming the full key (and the closest valid key) for an
    unknown key or a wrong type, and listing all cross-field problems (see `validate_config`).
    """
    sources = [] if path is None else [(f.name, d) for f, d in _read_yaml_chain(Path(path))]
    return _build(sources, overrides)


def load_config_text(text: str, overrides: Sequence[str] = ()) -> DictConfig:
    """Like `load_config`, from YAML text (e.g. `to_yaml` output passed between flows and tasks).

    A `base:` key is not allowed in text (there is no file to resolve it against).
    """
    try:
        raw = OmegaConf.create(text)
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        raise ConfigError(f"config text is not valid YAML: {e}") from None
    if not isinstance(raw, DictConfig):
        raise ConfigError("config text: the top level must be a mapping of sections.")
    data = OmegaConf.to_container(raw, resolve=False)
    assert isinstance(data, dict)
    if "base" in data:
        raise ConfigError("config text: `base:` needs a file — use load_config(path) instead.")
    return _build([("config text", data)], overrides)


_SCHEMA_CACHE: list[DictConfig] = []
"""The structured default config, built once (OmegaConf.structured is slow); callers get deep copies."""


def _schema() -> DictConfig:
    """A fresh copy of the structured default config."""
    if not _SCHEMA_CACHE:
        _SCHEMA_CACHE.append(OmegaConf.structured(DapoConfig))
    return copy.deepcopy(_SCHEMA_CACHE[0])


def _deep_update(dst: dict, src: dict) -> dict:
    """Recursively merge plain dict `src` into `dst` (dicts merge, everything else replaces)."""
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_update(dst[k], v)
        else:
            dst[k] = copy.deepcopy(v)
    return dst


def _build(sources: list[tuple[str, dict]], overrides: Sequence[str]) -> DictConfig:
    """Merge (name, dict) sources then overrides into the schema, collecting all problems; validate."""
    cfg = _schema()
    problems: list[str] = []
    named = list(sources)
    for item in overrides:
        try:
            key, value = _parse_override(item)
        except ConfigError as e:
            problems.append(str(e))
            continue
        named.append((f"override {item!r}", _nest(key, value)))
    for where, data in named:
        problems.extend(
            _unknown_keys(cfg, data, "", where if where.startswith("override") else f"in {where}")
        )
    if problems:
        raise ConfigError("Invalid configuration:\n  " + "\n  ".join(problems))
    combined: dict = {}
    for _, data in named:
        _deep_update(combined, _lift_str_lists(data))
    try:
        cfg = OmegaConf.merge(cfg, combined)  # type: ignore[assignment]
    except OmegaConfBaseException:
        # Slow path, only to say which file or override holds the bad value.
        cfg = _schema()
        for where, data in named:
            cfg = _merge(cfg, data, where if where.startswith("override") else f"in {where}", problems)
        raise ConfigError("Invalid configuration:\n  " + "\n  ".join(problems)) from None
    OmegaConf.set_struct(cfg, True)
    validate_config(cfg)
    return cfg


def validate_config(cfg: DictConfig) -> None:
    """Run every cross-field check; raise one `ConfigError` listing all problems (key: problem — fix).

    Questionable-but-legal settings are reported as `ConfigWarning`s instead.
    """
    try:
        resolved = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise ConfigError(
            f"Invalid configuration:\n  {getattr(e, 'full_key', '?')}: cannot resolve: {e} — "
            "set the environment variable or give the value directly."
        ) from None
    errors, warns = _collect_problems(resolved)  # type: ignore[arg-type]
    for w in warns:
        warnings.warn(w, ConfigWarning, stacklevel=2)
    if errors:
        raise ConfigError("Invalid configuration:\n  " + "\n  ".join(errors))


def to_yaml(cfg: DictConfig) -> str:
    """The fully resolved config as YAML with sorted keys (what `dapo config` prints and runs store)."""
    return OmegaConf.to_yaml(cfg, resolve=True, sort_keys=True)


def config_hash(cfg: DictConfig) -> str:
    """Stable sha256 hex digest of the resolved config (`to_yaml`); equal configs hash equal."""
    return hashlib.sha256(to_yaml(cfg).encode()).hexdigest()


# ----------------------------------------------------------------------------------------- helpers
def gen_batch_size(cfg: DictConfig) -> int:
    """Prompts per generation batch: `data.gen_batch_size`, or `data.train_batch_size` when null."""
    g = cfg.data.gen_batch_size
    return int(cfg.data.train_batch_size if g is None else g)


def need_reference_policy(cfg: DictConfig) -> bool:
    """True when a KL term needs the frozen reference model (KL in reward or KL loss)."""
    return bool(cfg.algorithm.use_kl_in_reward or cfg.actor_rollout_ref.actor.use_kl_loss)


def use_critic(cfg: DictConfig) -> bool:
    """True when a critic is built: `critic.enable` if set, else `adv_estimator == "gae"`."""
    if cfg.critic.enable is not None:
        return bool(cfg.critic.enable)
    return cfg.algorithm.adv_estimator == "gae"


def resolve_device(cfg: DictConfig) -> str:
    """`trainer.device` made concrete: "auto" → "cuda" if available else "cpu"; "cuda" must exist."""
    import torch

    device = cfg.trainer.device
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("trainer.device: cuda requested but no CUDA device is visible — use cpu or auto.")
    return str(device)


# ----------------------------------------------------------------------------------- cross checks
LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
"""The five aggregation modes of the reference `agg_loss` (§2)."""

ADV_ESTIMATORS = (
    "gae", "grpo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax", "rloo", "opo",
    "grpo_passk", "gpg", "rloo_vectorized", "grpo_vectorized", "optimal_token_baseline",
    "tir_optimal_token_baseline", "gdpo",
)  # fmt: skip
"""The advantage estimator names of the reference (§3)."""

GROUP_ESTIMATORS = (
    "grpo", "grpo_vectorized", "grpo_passk", "rloo", "rloo_vectorized", "opo", "gpg",
    "reinforce_plus_plus_baseline", "optimal_token_baseline", "tir_optimal_token_baseline", "gdpo",
)  # fmt: skip
"""Estimators whose baseline comes from the other samples of a group (need rollout.n >= 2)."""

KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
"""KL estimators of the reference (§4); each may carry a '+' (straight-through) suffix."""

POLICY_LOSSES = (
    "vanilla", "dppo_tv", "dppo_kl", "gspo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dro",
    "cispo", "bypass_mode",
)  # fmt: skip
"""Policy losses registered by the reference (§1.3); others may be registered by users."""

FILTER_METRICS = ("acc", "score", "seq_reward", "seq_final_reward")
"""Dynamic-sampling metrics that always exist (others must be reward extra-info names)."""

RS_OPTIONS = tuple(
    [f"token_k{i}" for i in (1, 2, 3)]
    + [f"seq_sum_k{i}" for i in (1, 2, 3)]
    + [f"seq_mean_k{i}" for i in (1, 2, 3)]
    + ["seq_max_k2", "seq_max_k3"]
)
"""Rejection-sampling options of the reference (§5.3)."""

_ENUMS: dict[str, tuple[tuple[str, ...], str]] = {
    "actor_rollout_ref.rollout.name": (("hf", "vllm"), "use hf on CPU, vllm on GPUs"),
    "actor_rollout_ref.actor.optim.warmup_style": (("constant", "cosine"), ""),
    "critic.optim.warmup_style": (("constant", "cosine"), ""),
    "algorithm.kl_ctrl.type": (("fixed", "adaptive"), ""),
    "algorithm.filter_groups.refill": (("fixed", "adaptive"), "fixed matches the reference"),
    "algorithm.rollout_correction.loss_type": (("ppo_clip", "reinforce"), ""),
    "reward_model.reward_manager": (("dapo", "naive"), ""),
    "data.truncation": (("left", "right", "error"), ""),
    "trainer.resume_mode": (("auto", "disable", "resume_path"), ""),
    "trainer.step_order": (("sync", "replay_buffer"), ""),
    "trainer.max_off_policy_strategy": (("drop", "wait"), ""),
    "trainer.device": (("cpu", "cuda", "auto"), ""),
}
"""Keys whose value must be one of a fixed set (key -> (allowed, hint))."""

_POSITIVE_INTS = (
    "data.max_prompt_length", "data.max_response_length", "data.train_batch_size",
    "data.synthetic.num_train", "data.synthetic.num_val", "data.synthetic.num_operands",
    "actor_rollout_ref.actor.ppo_mini_batch_size", "actor_rollout_ref.actor.ppo_epochs",
    "actor_rollout_ref.actor.ppo_max_token_len_per_gpu", "actor_rollout_ref.rollout.n",
    "actor_rollout_ref.rollout.val_kwargs.n", "actor_rollout_ref.rollout.tensor_model_parallel_size",
    "actor_rollout_ref.model.sft.batch_size", "trainer.parameter_sync_step",
    "trainer.max_off_policy_threshold", "trainer.total_epochs", "trainer.nnodes", "reward_model.num_workers",
    "eval.n", "actor_rollout_ref.model.tiny.hidden_size", "actor_rollout_ref.model.tiny.num_hidden_layers",
    "actor_rollout_ref.model.tiny.num_attention_heads", "actor_rollout_ref.model.tiny.num_key_value_heads",
    "actor_rollout_ref.model.tiny.head_dim", "actor_rollout_ref.model.tiny.intermediate_size",
    "actor_rollout_ref.model.tiny.max_position_embeddings",
)  # fmt: skip
"""Integer keys that must be >= 1."""

_OPTIONAL_POSITIVE_INTS = (
    "data.gen_batch_size", "data.val_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "critic.ppo_mini_batch_size",
    "critic.ppo_micro_batch_size_per_gpu", "critic.ppo_epochs", "trainer.total_training_steps",
    "trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep",
)  # fmt: skip
"""Integer keys that are null or >= 1."""


def _get(c: dict, key: str) -> Any:
    """Value at a dotted key of a plain nested dict."""
    for part in key.split("."):
        c = c[part]
    return c


def _parse_is_threshold(t: Any) -> str | None:
    """Problem with an IS threshold (number, number string or 'lower_upper'), or None if fine."""
    if isinstance(t, bool):
        return "must be a number or a 'lower_upper' string, not a boolean"
    if isinstance(t, (int, float)):
        return None if t > 0 else "must be > 0"
    if isinstance(t, str):
        parts = t.split("_")
        try:
            nums = [float(x) for x in parts]
        except ValueError:
            return f"{t!r} is not a number or 'lower_upper' pair (e.g. 2.0 or '0.5_5.0')"
        if len(nums) > 2 or any(x <= 0 for x in nums):
            return f"{t!r}: give one upper bound or 'lower_upper', all > 0"
        if len(nums) == 2 and nums[0] > nums[1]:
            return f"{t!r}: lower must be <= upper"
        return None
    return f"{t!r} must be a number or a 'lower_upper' string"


def _collect_problems(c: dict) -> tuple[list[str], list[str]]:
    """All cross-field problems of a resolved config dict: (errors, warnings), each 'key: problem — fix'."""
    errs: list[str] = []
    warns: list[str] = []
    arr, alg = c["actor_rollout_ref"], c["algorithm"]
    actor, rollout = arr["actor"], arr["rollout"]
    data = c["data"]

    for key, (allowed, hint) in _ENUMS.items():
        v = _get(c, key)
        if v not in allowed:
            errs.append(f"{key}: {v!r} is not one of {list(allowed)}" + (f" — {hint}" if hint else ""))
    strategy = actor["strategy"]
    if strategy in ("fsdp", "fsdp2", "megatron"):
        errs.append(
            f"actor_rollout_ref.actor.strategy: {strategy!r} (a verl engine) is not available here — use "
            "'deepspeed' for sharded GPU training (ZeRO-3 ~ FSDP) or 'torch' for one device."
        )
    elif strategy not in ("torch", "deepspeed"):
        errs.append(f"actor_rollout_ref.actor.strategy: {strategy!r} is not one of ['torch', 'deepspeed'].")
    if actor["deepspeed"]["zero_stage"] not in (0, 1, 2, 3):
        errs.append("actor_rollout_ref.actor.deepspeed.zero_stage: must be 0, 1, 2 or 3.")
    if actor["deepspeed"]["offload_param"] and actor["deepspeed"]["zero_stage"] != 3:
        errs.append("actor_rollout_ref.actor.deepspeed.offload_param: needs zero_stage 3 — set zero_stage=3.")
    for key in _POSITIVE_INTS:
        if _get(c, key) < 1:
            errs.append(f"{key}: {_get(c, key)} must be >= 1.")
    for key in _OPTIONAL_POSITIVE_INTS:
        v = _get(c, key)
        if v is not None and v < 1:
            errs.append(f"{key}: {v} must be >= 1 or null.")

    # --- batch arithmetic
    n = rollout["n"]
    tbs, mini = data["train_batch_size"], actor["ppo_mini_batch_size"]
    gbs = data["gen_batch_size"] if data["gen_batch_size"] is not None else tbs
    if mini >= 1 and tbs % mini:
        errs.append(
            f"actor_rollout_ref.actor.ppo_mini_batch_size: {mini} does not divide data.train_batch_size {tbs}"
            " — choose a divisor."
        )
    micro = actor["ppo_micro_batch_size_per_gpu"]
    if micro and n >= 1 and (mini * n) % micro:
        errs.append(
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu: {micro} does not divide "
            f"ppo_mini_batch_size x rollout.n = {mini * n} trajectories — choose a divisor."
        )
    cmini = c["critic"]["ppo_mini_batch_size"] or mini
    cmicro = c["critic"]["ppo_micro_batch_size_per_gpu"]
    if tbs % cmini:
        errs.append(f"critic.ppo_mini_batch_size: {cmini} does not divide data.train_batch_size {tbs}.")
    if cmicro and (cmini * n) % cmicro:
        errs.append(
            f"critic.ppo_micro_batch_size_per_gpu: {cmicro} does not divide critic mini-batch x rollout.n"
            f" = {cmini * n} trajectories."
        )
    fg = alg["filter_groups"]
    if fg["enable"]:
        if gbs < tbs:
            errs.append(
                f"data.gen_batch_size: {gbs} < data.train_batch_size {tbs} with dynamic sampling — "
                "set gen_batch_size >= train_batch_size (DAPO: 3x)."
            )
        if fg["max_num_gen_batches"] < 0:
            errs.append("algorithm.filter_groups.max_num_gen_batches: must be >= 0 (0 = unlimited).")
        if not fg["metric"]:
            errs.append("algorithm.filter_groups.metric: required when enabled — use acc (as the 32B runs).")
        elif fg["metric"] not in FILTER_METRICS:
            warns.append(
                f"algorithm.filter_groups.metric: {fg['metric']!r} is not one of {list(FILTER_METRICS)}; it "
                "must be a key the reward function returns in its extra info."
            )

    # --- loss
    for key in ("actor_rollout_ref.actor.loss_agg_mode", "critic.loss_agg_mode"):
        if _get(c, key) not in LOSS_AGG_MODES:
            errs.append(f"{key}: {_get(c, key)!r} is not one of {list(LOSS_AGG_MODES)}.")
    if actor["clip_ratio_c"] <= 1.0:
        errs.append(
            f"actor_rollout_ref.actor.clip_ratio_c: {actor['clip_ratio_c']} must be > 1 (dual-clip lower "
            "bound) — DAPO uses 10.0."
        )
    for k in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
        v = actor[k]
        if v is not None and v < 0:
            errs.append(f"actor_rollout_ref.actor.{k}: {v} must be >= 0.")
    low = actor["clip_ratio_low"] if actor["clip_ratio_low"] is not None else actor["clip_ratio"]
    if low >= 1.0:
        errs.append(
            f"actor_rollout_ref.actor.clip_ratio_low: {low} must be < 1 (the lower clip is 1 - eps_low)."
        )
    pl = actor["policy_loss"]
    if pl["loss_mode"] not in POLICY_LOSSES:
        warns.append(
            f"actor_rollout_ref.actor.policy_loss.loss_mode: {pl['loss_mode']!r} is not a built-in loss "
            f"{list(POLICY_LOSSES)}; it must be registered with register_policy_loss before training."
        )
    if pl["loss_mode"] == "dro" and pl["dro_beta"] <= 0:
        errs.append("actor_rollout_ref.actor.policy_loss.dro_beta: must be > 0 for loss_mode=dro.")

    # --- advantage and KL
    est = alg["adv_estimator"]
    if est not in ADV_ESTIMATORS:
        errs.append(f"algorithm.adv_estimator: {est!r} is not one of {list(ADV_ESTIMATORS)}.")
    elif est in GROUP_ESTIMATORS and n < 2:
        warns.append(
            f"actor_rollout_ref.rollout.n: {n} with group estimator {est!r} gives singleton groups (no "
            "baseline) — use n >= 2 (DAPO: 16)."
        )
    for key in ("algorithm.kl_penalty", "actor_rollout_ref.actor.kl_loss_type"):
        v = _get(c, key)
        if v.removesuffix("+") not in KL_TYPES:
            fix = (
                "'full' is not implemented by the reference"
                if v == "full"
                else f"use one of {list(KL_TYPES)}"
            )
            errs.append(f"{key}: {v!r} is not a KL estimator — {fix} (optionally with a '+' suffix).")
    if alg["kl_ctrl"]["type"] == "adaptive" and alg["kl_ctrl"]["horizon"] <= 0:
        errs.append("algorithm.kl_ctrl.horizon: must be > 0 for the adaptive controller.")

    # --- rollout correction
    rc = alg["rollout_correction"]
    if rc["rollout_is"] not in (None, "token", "sequence"):
        errs.append(
            f"algorithm.rollout_correction.rollout_is: {rc['rollout_is']!r} must be null, token or sequence."
        )
    if rc["rollout_is"] is not None:
        problem = _parse_is_threshold(rc["rollout_is_threshold"])
        if problem:
            errs.append(f"algorithm.rollout_correction.rollout_is_threshold: {problem}.")
    if rc["rollout_rs"]:
        opts = [o.strip() for o in str(rc["rollout_rs"]).split(",") if o.strip()]
        bad = [o for o in opts if o not in RS_OPTIONS]
        if bad:
            errs.append(
                f"algorithm.rollout_correction.rollout_rs: unknown option(s) {bad} — use {list(RS_OPTIONS)}."
            )
        thr = rc["rollout_rs_threshold"]
        if thr is None:
            errs.append("algorithm.rollout_correction.rollout_rs_threshold: required when rollout_rs is set.")
        else:
            specs = [s.strip() for s in str(thr).split(",")]
            if len(specs) not in (1, len(opts)):
                errs.append(
                    f"algorithm.rollout_correction.rollout_rs_threshold: {len(specs)} values for {len(opts)} "
                    "options — give one shared value or one per option."
                )
            else:
                for opt, spec in zip(opts, specs * len(opts) if len(specs) == 1 else specs):
                    if opt.endswith(("k2", "k3")) and "_" in spec:
                        errs.append(
                            f"algorithm.rollout_correction.rollout_rs_threshold: {opt} takes one upper bound, "
                            f"not {spec!r}."
                        )
                    elif (p := _parse_is_threshold(spec)) is not None:
                        errs.append(f"algorithm.rollout_correction.rollout_rs_threshold: {opt}: {p}.")
    if (rc["rollout_is"] or rc["rollout_rs"] or rc["bypass_mode"]) and not rollout["calculate_log_probs"]:
        errs.append(
            "actor_rollout_ref.rollout.calculate_log_probs: rollout correction needs the engine's log-probs "
            "— set it to true."
        )

    # --- overlong shaping
    ob = c["reward_model"]["overlong_buffer"]
    if ob["enable"]:
        L = data["max_response_length"]
        if not 0 < ob["len"] < L:
            errs.append(
                f"reward_model.overlong_buffer.len: {ob['len']} must be > 0 and < data.max_response_length "
                f"{L} — DAPO uses 4096 of 20480."
            )
        if ob["penalty_factor"] < 0:
            errs.append("reward_model.overlong_buffer.penalty_factor: must be >= 0 (DAPO: 1.0).")

    # --- sampling parameters
    for prefix, sec in (
        ("actor_rollout_ref.rollout", rollout),
        ("actor_rollout_ref.rollout.val_kwargs", rollout["val_kwargs"]),
        ("eval", c["eval"]),
    ):
        if not 0 < sec["top_p"] <= 1:
            errs.append(f"{prefix}.top_p: {sec['top_p']} must be in (0, 1].")
        if sec["top_k"] == 0 or sec["top_k"] < -1:
            errs.append(f"{prefix}.top_k: {sec['top_k']} must be -1 (off) or >= 1.")
        if sec["temperature"] < 0 or (sec["temperature"] == 0 and sec.get("do_sample", True)):
            errs.append(f"{prefix}.temperature: {sec['temperature']} must be > 0 when sampling.")

    # --- step order
    tr = c["trainer"]
    if tr["step_order"] == "replay_buffer" and tbs % max(tr["parameter_sync_step"], 1):
        errs.append(
            f"trainer.parameter_sync_step: {tr['parameter_sync_step']} does not divide data.train_batch_size "
            f"{tbs} (replay_buffer order) — choose a divisor."
        )
    if tr["resume_mode"] == "resume_path" and not tr["resume_from_path"]:
        errs.append(
            "trainer.resume_from_path: required for resume_mode=resume_path — give a checkpoint folder."
        )
    bad_loggers = [x for x in tr["logger"] if x not in ("console", "jsonl", "tensorboard")]
    if bad_loggers:
        errs.append(f"trainer.logger: {bad_loggers} not available — use console, jsonl, tensorboard.")

    # --- optimizers and small models
    for prefix in ("actor_rollout_ref.actor.optim", "critic.optim"):
        o = _get(c, prefix)
        if o["lr"] <= 0:
            errs.append(f"{prefix}.lr: {o['lr']} must be > 0.")
        if not 0 <= o["lr_warmup_steps_ratio"] <= 1:
            errs.append(f"{prefix}.lr_warmup_steps_ratio: must be in [0, 1].")
        if not 0 <= o["min_lr_ratio"] <= 1:
            errs.append(f"{prefix}.min_lr_ratio: must be in [0, 1].")
        if len(o["betas"]) != 2 or not all(0 <= b < 1 for b in o["betas"]):
            errs.append(f"{prefix}.betas: {o['betas']} must be two numbers in [0, 1).")
    syn = data["synthetic"]
    if syn["min_value"] > syn["max_value"]:
        errs.append("data.synthetic.min_value: must be <= max_value.")
    bad_ops = [op for op in syn["ops"] if op not in ("+", "-", "*")]
    if bad_ops or not syn["ops"]:
        errs.append(f"data.synthetic.ops: {syn['ops']} — use a non-empty subset of ['+', '-', '*'].")
    tiny = arr["model"]["tiny"]
    if tiny["num_key_value_heads"] >= 1 and tiny["num_attention_heads"] % tiny["num_key_value_heads"]:
        errs.append("actor_rollout_ref.model.tiny.num_key_value_heads: must divide num_attention_heads.")
    if not arr["model"]["path"]:
        total = data["max_prompt_length"] + data["max_response_length"]
        if total > tiny["max_position_embeddings"]:
            warns.append(
                f"actor_rollout_ref.model.tiny.max_position_embeddings: {tiny['max_position_embeddings']} < "
                f"max_prompt_length + max_response_length = {total} — raise it or shorten the lengths."
            )
    sft = arr["model"]["sft"]
    if sft["steps"] < 0 or sft["lr"] <= 0:
        errs.append("actor_rollout_ref.model.sft: steps must be >= 0 and lr > 0.")
    return errs, warns
