"""The configuration schema: a tree of dataclasses, one per section, turned into an OmegaConf structured
config. Loading, overrides and validation live in `dapo_core.config.loading` (which re-exports these).

Key paths follow verl (`actor_rollout_ref.actor.clip_ratio_high`, `algorithm.filter_groups.enable`, ...), so
a verl DAPO script's overrides work here unchanged where the key exists. Every field carries a one-line
docstring (read by `dapo_core.config.loading.field_docs`; `configs/dapo.yaml` mirrors the defaults).
Defaults follow the reference (verl NEWEST `ppo_trainer.yaml` + the DAPO recipe's `dapo_trainer.yaml`), so
the base config is *not* DAPO; the DAPO configs (`configs/tiny_cpu.yaml`, `configs/dapo_*_qwen2.5_32b.yaml`)
switch it on. A field whose default differs from verl's on purpose says so in its docstring.

`reward_model.overlong_buffer` is the reward manager's own `OverlongBufferConfig`;
`algorithm.rollout_correction` is validated by the algo layer into
`dapo_core.algo.rollout_correction.RolloutCorrection`. Keys that no code reads are listed, with their
reasons, in `dapo_core.config.unused`. More in docs/ARCHITECTURE.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dapo_core.rewards.manager import OverlongBufferConfig

__all__ = [
    "ActorConfig",
    "ActorRolloutRefConfig",
    "AlgorithmConfig",
    "CheckpointConfig",
    "CriticConfig",
    "CriticModelConfig",
    "DapoConfig",
    "DataConfig",
    "DeepSpeedConfig",
    "EvalConfig",
    "FSDPConfig",
    "FilterGroupsConfig",
    "KLCtrlConfig",
    "MixedPrecisionConfig",
    "ModelConfig",
    "OptimConfig",
    "OverlongBufferConfig",
    "PolicyLossConfig",
    "RefConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "RolloutCorrectionConfig",
    "SftConfig",
    "SourceFilesConfig",
    "SyntheticDataConfig",
    "TinyModelConfig",
    "TrainerConfig",
    "ValKwargsConfig",
]


# --------------------------------------------------------------------------------------------- data
@dataclass
class SyntheticDataConfig:
    """Generated arithmetic word problems: the CPU default's training and validation data."""

    enable: bool = False
    """Generate the dataset instead of reading `train_files`/`val_files` from disk."""
    kind: str = "arith"
    """"arith" (expressions) or "word" (word problems of 1..num_operands−1 steps; ops may add "/")."""
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
class HistorySamplerConfig:
    """History-aware prompt sampling (ours; off = verl's sampler): pass over prompts whose recent groups all
    had no reward spread (all correct or all wrong), except with a small exploration probability."""

    enable: bool = False
    """Turn the history-aware sampler on (sync step order; the replay order ignores it)."""
    window: int = 1
    """How many of a prompt's latest groups must all lack spread for it to be passed over."""
    explore_prob: float = 0.1
    """Chance a prompt that would be passed over is drawn anyway."""


@dataclass
class DataConfig:
    """Datasets, prompt/response lengths and batch sizes (counted in prompts)."""

    train_files: list[str] = field(default_factory=list)
    """Training parquet files (verl schema); a single string is accepted."""
    val_files: list[str] = field(default_factory=list)
    """Validation parquet files (verl schema); a single string is accepted."""
    prompt_key: str = "prompt"
    """Column holding the chat messages of a prompt. Not implemented yet (default only)."""
    reward_fn_key: str = "data_source"
    """Column that routes a row to its scoring function. Not implemented yet (default only)."""
    max_prompt_length: int = 512
    """Longest prompt in tokens (longer prompts are truncated per `truncation`)."""
    max_response_length: int = 512
    """Most tokens generated per response."""
    train_batch_size: int = 1024
    """Prompts per training step (after dynamic sampling)."""
    gen_batch_size: int | None = None
    """Prompts per generation batch; null = train_batch_size (DAPO full uses 3x)."""
    val_batch_size: int | None = None
    """Prompts per validation generation batch; null = the whole validation set. No-op here."""
    truncation: str = "left"
    """How an over-long prompt is cut: left | right | error (DAPO recipe: left)."""
    shuffle: bool = True
    """Shuffle the training prompts each epoch."""
    seed: int = 1
    """Seed of the training sampler."""
    dedup: bool = False
    """Drop duplicated problems (DAPO-Math-17k holds ~100 copies of each); reference keeps them."""
    history_sampler: HistorySamplerConfig = field(default_factory=HistorySamplerConfig)
    """History-aware prompt sampling (off by default)."""
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
    """Share of warm-up solutions ending with the `Answer: <n>` line (below 1: RL must learn it)."""


@dataclass
class ModelConfig:
    """The policy model: a HF folder, or the tiny model built locally."""

    path: str = ""
    """HF model folder or hub name; "" builds the tiny model (`tiny.*`)."""
    tokenizer_path: str | None = None
    """Tokenizer folder; null = `path`."""
    enable_gradient_checkpointing: bool = False
    """Recompute activations in the backward pass to save memory (actor and critic; same gradients)."""
    use_remove_padding: bool = False
    """Packed, padding-free forwards for log-probs and updates (same values as padded within float error)."""
    use_shared_prompt: bool = False
    """Ours: actor/ref forwards run each distinct prompt once, with its n responses (exact to float error)."""
    lora_rank: int = 0
    """LoRA adapter rank (peft); 0 = full fine-tuning. With LoRA the reference is the actor, adapters off."""
    lora_alpha: int = 16
    """LoRA scaling numerator: the adapter's update is B·A·lora_alpha/lora_rank."""
    target_modules: Any = "all-linear"
    """Modules that get adapters: all-linear (every linear layer but the LM head) or a list of names."""
    exclude_modules: Any = None
    """Module names (a list, or a regex string) kept without adapters; null = none."""
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
class MixedPrecisionConfig:
    """Compute precision of the actor's training engine (verl's `fsdp_config.mixed_precision`).

    With `param_dtype: bfloat16` the torch engine runs the model under `torch.autocast` and fsdp2 gathers
    bfloat16 copies of its float32 shards (`MixedPrecisionPolicy`); the weights, gradients and AdamW state
    stay float32 either way. verl's default is bf16; ours is float32, so that CPU runs and tests compare
    exactly with the reference."""

    param_dtype: str = "float32"
    """Forward/backward precision, float32 | bfloat16 (or fp32 | bf16); weights, grads, AdamW stay float32."""
    reduce_dtype: str = "float32"
    """fsdp2: precision of the gradient reduce-scatter over the ranks: float32 | bfloat16."""


@dataclass
class FSDPConfig:
    """verl's `actor.fsdp_config`: the precision of the torch and fsdp2 training engines."""

    mixed_precision: MixedPrecisionConfig = field(default_factory=MixedPrecisionConfig)
    """Compute and gradient-reduce precision."""


@dataclass
class CheckpointConfig:
    """What an actor checkpoint holds."""

    save_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra", "hf_model"])
    """Parts saved per checkpoint: model, optimizer, extra, hf_model. Not implemented yet (default only)."""
    load_contents: list[str] = field(default_factory=lambda: ["model", "optimizer", "extra"])
    """Parts restored on resume. Not implemented yet (default only)."""


@dataclass
class ActorConfig:
    """The trained policy: PPO/DAPO loss, mini-batching and optimizer."""

    strategy: str = "torch"
    """Training engine: torch (one process) | deepspeed (one device) | fsdp2 (sharded over the ranks)."""
    ppo_mini_batch_size: int = 256
    """Prompts per optimizer step (x rollout.n trajectories)."""
    ppo_micro_batch_size_per_gpu: int | None = None
    """Trajectories per forward/backward; null = the whole mini-batch."""
    use_dynamic_bsz: bool = False
    """Form micro-batches by a token budget, not a trajectory count (loss normalisation unchanged)."""
    ppo_max_token_len_per_gpu: int = 16384
    """Token budget of a micro-batch when `use_dynamic_bsz` (a longer row goes alone)."""
    ppo_epochs: int = 1
    """Passes over each training batch."""
    skip_old_log_prob_when_on_policy: bool = True
    """Skip the old_log_prob forward when the update is exactly on-policy (π_old = the policy, ratio 1)."""
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
    """Aggregation: token-mean|token-sum|seq-mean-token-sum|seq-mean-token-mean|seq-mean-token-sum-norm."""
    loss_scale_factor: float | None = None
    """Divisor of seq-mean-token-sum-norm; null = padded response length."""
    mask_truncated_responses: bool = False
    """DAPO overlong filtering: rows cut at max_response_length (finish_reason length) get no loss tokens."""
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
    fsdp_config: FSDPConfig = field(default_factory=FSDPConfig)
    """Mixed precision of the torch and fsdp2 engines (deepspeed: `deepspeed.bf16`)."""
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
    """Return the engine's log-probs of the sampled tokens (needed by rollout correction). No-op here."""
    log_prob_micro_batch_size_per_gpu: int | None = None
    """Trajectories per forward when recomputing old log-probs; null = whole batch."""
    log_prob_use_dynamic_bsz: bool = False
    """Form log-prob micro-batches by a token budget instead of a trajectory count."""
    log_prob_max_token_len_per_gpu: int = 16384
    """Token budget of a log-prob micro-batch when `log_prob_use_dynamic_bsz`."""
    gpu_memory_utilization: float = 0.5
    """vLLM: fraction of GPU memory for weights and KV cache."""
    tensor_model_parallel_size: int = 1
    """vLLM: tensor-parallel degree."""
    enforce_eager: bool = True
    """vLLM: disable CUDA graphs."""
    free_cache_engine: bool = True
    """Colocated GPUs: the engine frees its memory while training (vLLM sleep mode, HF cached blocks)."""
    enable_chunked_prefill: bool = True
    """vLLM on GPU: chunked prefill (on CPU it stays off: seeded sampling cannot rewind a CPU generator)."""
    max_num_batched_tokens: int = 8192
    """vLLM: tokens per engine step."""
    max_model_len: int | None = None
    """vLLM: longest prompt + response to hold (null: max_prompt_length + max_response_length)."""
    max_num_seqs: int = 1024
    """Most sequences decoded at once: vLLM's max_num_seqs, the hf engine's rows per forward (lower: OOM)."""
    dtype: str = "auto"
    """Rollout model precision: auto (hf float32; vLLM float32 on CPU, bf16 on GPU) | float32 | bfloat16."""
    update_weights_bucket_megabytes: int = 512
    """Weight sync: the bucket the actor's tensors travel in, MiB (verl's key); no message is larger."""
    weight_transport: str = "auto"
    """Weight sync links: auto | same_device (rank i to replica i, shared memory / CUDA IPC) | broadcast."""
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    """Sampling for validation."""


@dataclass
class RefConfig:
    """The frozen reference policy (only built when a KL term needs it)."""

    log_prob_micro_batch_size_per_gpu: int | None = None
    """Trajectories per reference forward; null = whole batch."""
    log_prob_use_dynamic_bsz: bool = False
    """Form reference micro-batches by a token budget instead of a trajectory count."""
    log_prob_max_token_len_per_gpu: int = 16384
    """Token budget of a reference micro-batch when `log_prob_use_dynamic_bsz`."""
    dtype: str = "float32"
    """Reference weights' precision: float32 | bfloat16 (halves its memory; verl's FSDP reference is bf16)."""


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
class CriticModelConfig:
    """Memory switches of the value model (the backbone of `actor_rollout_ref.model` plus a value head)."""

    enable_gradient_checkpointing: bool | None = None
    """Recompute activations in backward (same gradients); null = the policy model's switch (verl: true)."""
    use_remove_padding: bool = False
    """Packed, padding-free value forwards and updates (same values as padded within float error)."""


@dataclass
class CriticConfig:
    """The value model (used by GAE only)."""

    enable: bool | None = None
    """Build a critic; null = only when `algorithm.adv_estimator` is gae."""
    model: CriticModelConfig = field(default_factory=CriticModelConfig)
    """Gradient checkpointing and packed forwards of the value model."""
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    """Critic optimizer: AdamW, the actor's warm-up then constant or cosine schedule (a step per update)."""
    ppo_mini_batch_size: int | None = None
    """Prompts per critic step; null = actor's."""
    ppo_micro_batch_size_per_gpu: int | None = None
    """Trajectories per critic forward/backward; null = whole mini-batch."""
    use_dynamic_bsz: bool | None = None
    """Form critic micro-batches by a token budget (loss normalisation unchanged); null = the actor's."""
    ppo_max_token_len_per_gpu: int = 32768
    """Token budget of a critic update micro-batch when `use_dynamic_bsz` (verl: 32768, twice the actor's)."""
    forward_max_token_len_per_gpu: int | None = None
    """Token budget of a value forward when `use_dynamic_bsz`; null = `ppo_max_token_len_per_gpu`."""
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
    """Value that must vary within a group: acc | score | seq_reward | seq_final_reward (verl: null)."""
    max_num_gen_batches: int = 0
    """Most generation batches per step before giving up (0 = unlimited)."""
    refill: str = "fixed"
    """Refill sizing: fixed = gen_batch_size (reference) | adaptive = sized to the deficit (ours)."""
    surplus_budget: float = 0.005
    """refill=adaptive: expected kept groups thrown away per batch, as a share of train_batch_size."""


@dataclass
class RolloutCorrectionConfig:
    """Importance sampling / rejection sampling against the rollout policy (verl YAML defaults)."""

    preset: str | None = None
    """Named preset (rollout_correction.PRESETS) setting this section's keys at load; null = as given."""
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
class RewardModelConfig:
    """Rule-based reward: the manager, its worker pool and overlong shaping."""

    reward_manager: str = "dapo"
    """Reward manager name. Not implemented yet (default only)."""
    num_workers: int = 1
    """Worker processes scoring responses in parallel (each sample under its own timeout; >= 1)."""
    timeout_s: float = 10.0
    """Seconds before one scoring call is abandoned (scored as a failure); > 0."""
    max_failure_rate: float = 0.5
    """Largest failed share (timeout, error, NaN) of a batch's rewards before the step stops; 1.0 = never."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """Overlong reward shaping."""


# ------------------------------------------------------------------------------------------ trainer
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
    resume_mode: str = "auto"
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
    step_order: str = "sync"
    """sync (one weight version per step) | async (next batch generated during the update) | replay_buffer."""
    max_staleness: int = 1
    """async: largest weight-version lag of a trained sample; older groups are dropped (0: none ahead)."""
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
    ray_resources: RayResourcesConfig = field(default_factory=RayResourcesConfig)
    """Which nodes each worker runs on (Ray custom resources per role; docs/SCALE.md "Several machines")."""
    nnodes: int = 1
    """Nodes the actor and reference ranks span (more than 1 needs actor.strategy fsdp2)."""
    n_gpus_per_node: int = 8
    """Ranks per node (GPUs; on CPU one-core processes): fsdp2 actor/ref ranks, and rollout replicas × TP."""
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
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
