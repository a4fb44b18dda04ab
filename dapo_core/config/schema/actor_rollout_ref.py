"""The `actor_rollout_ref` section (verl's name): the policy model, the trained actor with its loss,
optimizer and engine, the generation engine, and the frozen reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dapo_core.config.choices import (
    LossAggMode,
    RefDtype,
    RolloutDtype,
    RolloutName,
    Strategy,
    TargetModules,
    TrainDtype,
    WarmupStyle,
    WeightTransport,
    ZeroStage,
)


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
    target_modules: TargetModules = "all-linear"
    """Modules that get adapters: all-linear (every linear layer but the LM head) or a list of names."""
    exclude_modules: Any = None
    """Module names (a list, or a regex string) kept without adapters; null = none."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    """Shape of the embedded tiny model."""
    sft: SftConfig = field(default_factory=SftConfig)
    """Warm-up of the tiny base model."""


@dataclass
class OptimConfig:
    """AdamW with linear warm-up then constant (or cosine) learning rate."""

    lr: float = 1e-6
    """Peak learning rate."""
    lr_warmup_steps: int = -1
    """Warm-up steps; negative = use `lr_warmup_steps_ratio`."""
    lr_warmup_steps_ratio: float = 0.0
    """Warm-up length as a fraction of the total training steps."""
    warmup_style: WarmupStyle = "constant"
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

    zero_stage: ZeroStage = 1
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

    param_dtype: TrainDtype = "float32"
    """Forward/backward precision, float32 | bfloat16 (or fp32 | bf16); weights, grads, AdamW stay float32."""
    reduce_dtype: TrainDtype = "float32"
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

    strategy: Strategy = "torch"
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
    loss_agg_mode: LossAggMode = "token-mean"
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

    name: RolloutName = "hf"
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
    dtype: RolloutDtype = "auto"
    """Rollout model precision: auto (hf float32; vLLM float32 on CPU, bf16 on GPU) | float32 | bfloat16."""
    update_weights_bucket_megabytes: int = 512
    """Weight sync: the bucket the actor's tensors travel in, MiB (verl's key); no message is larger."""
    weight_transport: WeightTransport = "auto"
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
    dtype: RefDtype = "float32"
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
