"""The policy part of a LoRA checkpoint: the adapter, not the model.

A LoRA engine's checkpoint keeps of the policy only what training changed: `write_adapter_folder` writes the
adapter in peft's format (`lora_adapter/`), the model's config.json and tokenizer, and `lora_base.json`, which
names the frozen base model folder: the adapter's bytes per checkpoint, not the whole model's. Whatever needs
an HF model folder of such a checkpoint (evaluation, the final and milestone exports) gets one from
`merge_into` (base + B·A·alpha/r, under the base model's names, with the adapter kept in `lora_adapter/`) or,
for the length of a `with`, from `hf_folder`. Reading a folder (`is_adapter_folder`, `base_model_of`) imports
neither torch nor peft.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "BASE_FILE",
    "base_model_of",
    "hf_folder",
    "is_adapter_folder",
    "merge_into",
    "write_adapter_folder",
]

BASE_FILE = "lora_base.json"
"""The file of an adapter folder that names its frozen base model folder (as configured, and absolute)."""


def write_adapter_folder(
    peft_model: Any,
    out_dir: str | Path,
    model_path: str | Path,
    state: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """Write the adapter folder of `peft_model` (whose frozen base was loaded from `model_path`) into
    `out_dir`: `lora_adapter/` (`lora.save_adapter`; `state` the gathered adapter of a sharded model),
    config.json, the base folder's tokenizer files and `BASE_FILE`. Returns `out_dir`."""
    from dapo_core.compute.lora import ADAPTER_SUBDIR, save_adapter
    from dapo_core.compute.models import copy_model_files

    out = Path(out_dir)
    save_adapter(peft_model, out / ADAPTER_SUBDIR, state)
    peft_model.get_base_model().config.save_pretrained(str(out))
    copy_model_files(model_path, out)
    base = {"base_model": str(model_path), "absolute": str(Path(model_path).resolve())}
    (out / BASE_FILE).write_text(json.dumps(base, indent=1) + "\n")
    return out


def is_adapter_folder(folder: str | Path) -> bool:
    """Whether `folder` is an adapter folder (`write_adapter_folder`) rather than an HF model folder."""
    p = Path(folder)
    return (p / BASE_FILE).is_file() and not (p / "model.safetensors").exists()


def base_model_of(folder: str | Path) -> Path:
    """The base model folder an adapter folder was trained on: its absolute path when it still exists, else
    the configured path (relative to the working directory, as the run read it); a `DapoUserError` naming
    both when neither holds a model."""
    from dapo_core.errors import DapoUserError

    p = Path(folder)
    base = json.loads((p / BASE_FILE).read_text())
    tried = [Path(base["absolute"]), Path(base["base_model"])]
    for cand in tried:
        if (cand / "config.json").is_file():
            return cand
    raise DapoUserError(
        f"{p} holds a LoRA adapter whose base model is gone: neither {tried[0]} nor {tried[1]} (relative to "
        f"{Path.cwd()}) is an HF model folder",
        where=str(p / BASE_FILE),
        fix="put the base model back there (where actor_rollout_ref.model.path had it), or run from the "
        "folder the run was started in",
    )


def merge_into(folder: str | Path, out_dir: str | Path) -> Path:
    """Write the HF model folder of the adapter folder `folder` into `out_dir`: its base model with the
    adapter merged (`lora.merged_state_dict`, float32 like the training engines' exports), the tokenizer
    and, in `lora_adapter/`, the adapter itself. Returns `out_dir`."""
    from dapo_core.compute.lora import (
        ADAPTER_CONFIG,
        ADAPTER_SUBDIR,
        LoraSpec,
        add_lora,
        load_adapter_state,
        merged_state_dict,
    )
    from dapo_core.compute.models import copy_model_files, load_model, save_model

    src = Path(folder)
    conf = json.loads((src / ADAPTER_SUBDIR / ADAPTER_CONFIG).read_text())
    targets, excl = conf.get("target_modules", "all-linear"), conf.get("exclude_modules")
    spec = LoraSpec(
        rank=int(conf["r"]),
        alpha=int(conf["lora_alpha"]),
        target_modules=targets if isinstance(targets, str) else tuple(sorted(targets)),
        exclude_modules=excl if excl is None or isinstance(excl, str) else tuple(sorted(excl)),
    )
    model = load_model(base_model_of(src))
    peft_model = add_lora(model, spec)
    load_adapter_state(peft_model, src / ADAPTER_SUBDIR)
    out = save_model(model, None, out_dir, state_dict=merged_state_dict(model))
    copy_model_files(src, out)
    shutil.copytree(src / ADAPTER_SUBDIR, out / ADAPTER_SUBDIR, dirs_exist_ok=True)
    return out


@contextlib.contextmanager
def hf_folder(folder: str | Path) -> Iterator[str]:
    """`folder` itself when it is an HF model folder; for an adapter folder, its merged model (`merge_into`)
    in a temporary folder that is removed when the context closes."""
    if not is_adapter_folder(folder):
        yield str(folder)
        return
    tmp = tempfile.mkdtemp(prefix="dapo-merged-")
    try:
        yield str(merge_into(folder, tmp))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
