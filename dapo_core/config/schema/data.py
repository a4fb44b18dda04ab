"""The `data` section: dataset files, prompt/response lengths, batch sizes, prompt sampling and the
generated arithmetic data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dapo_core.config.choices import SyntheticKind, SyntheticOp, Truncation


@dataclass
class SyntheticDataConfig:
    """Generated arithmetic word problems: the CPU default's training and validation data."""

    enable: bool = False
    """Generate the dataset instead of reading `train_files`/`val_files` from disk."""
    kind: SyntheticKind = "arith"
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
    ops: list[SyntheticOp] = field(default_factory=lambda: ["+", "-"])
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
    truncation: Truncation = "left"
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
