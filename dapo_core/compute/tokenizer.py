"""Loading a model folder's tokenizer without importing torch or transformers' modeling code, so a process
that only tokenizes (the reward worker) starts light. `dapo_core.compute.models` re-exports these names.

`load_tokenizer` always builds a `PreTrainedTokenizerFast` from `tokenizer.json`: `AutoTokenizer` on a folder
whose config.json says `qwen2` swaps in Qwen2's byte-level tokenizer (docs/STACK_NOTES.md)."""

from __future__ import annotations

from pathlib import Path

from transformers import PreTrainedTokenizerFast

TOKENIZER_SUBDIR = "tokenizer"
"""Sub-folder of every saved model holding a copy of the tokenizer that `AutoTokenizer` loads safely."""


def tokenizer_dir(path: str | Path) -> Path:
    """The folder an `AutoTokenizer` user (vLLM) should load: `<path>/tokenizer` if present, else `path`."""
    p = Path(path)
    sub = p / TOKENIZER_SUBDIR
    return sub if (sub / "tokenizer.json").is_file() else p


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """Load the tokenizer of a model folder (or of a tokenizer folder) from its `tokenizer.json`.

    Never uses `AutoTokenizer`, so a Qwen2 config.json cannot swap in a byte-level tokenizer.
    """
    p = Path(path)
    for cand in (p, p / TOKENIZER_SUBDIR):
        if (cand / "tokenizer.json").is_file():
            tok = PreTrainedTokenizerFast.from_pretrained(str(cand))
            if tok.pad_token_id is None and tok.eos_token_id is not None:
                tok.pad_token = tok.eos_token
            return tok
    raise FileNotFoundError(
        f"no tokenizer.json in {p} or {p / TOKENIZER_SUBDIR}; set actor_rollout_ref.model.tokenizer_path to "
        "a folder with tokenizer.json (HF fast tokenizer) or build one with "
        "dapo_core.compute.models.build_tiny_model."
    )
