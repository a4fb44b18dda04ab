"""Nested training state (optimizer, LR schedule, counters, RNG states) as safetensors + JSON: nothing read
back is ever executed.

`save_state(folder, name, obj)` writes `<name>.tensors` (safetensors format: every tensor and NumPy array of
`obj`; not named `*.safetensors`, so model loaders that glob a folder's weights never take it for weights) and
`<name>.json` (the structure and the scalars, with a reference in place of each tensor). `load_state`
reads them back with `safetensors.torch.load_file` and `json.loads`, neither of which can run code, so a
crafted checkpoint can at worst hold wrong numbers, never a program. This replaces `torch.save` /
`torch.load(weights_only=False)`, which unpickle whatever the file says.

Encoded: dict (str keys stay a JSON object; other keys as a list of pairs), list, tuple, str, int, float
(exactly, incl. nan/inf), bool, None, `torch.Tensor`, `numpy.ndarray`, NumPy scalars. Anything else is
refused at save time (it would have needed pickle).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dapo_core.errors import DapoUserError

__all__ = [
    "STATE_FORMAT",
    "StateFileError",
    "StateFileMissing",
    "load_state",
    "refuse_pickled_state",
    "refuse_unsafe_pickles",
    "save_state",
    "state_files",
]

STATE_FORMAT = "dapo-state/1"
"""The `format` field of a state JSON file."""


class StateFileError(DapoUserError, ValueError):
    """A state file pair is missing, unreadable, of an unknown format, or a value cannot be saved safely."""


class StateFileMissing(StateFileError, FileNotFoundError):
    """A state file of a checkpoint is missing (the folder is not a complete checkpoint)."""


def state_files(folder: str | Path, name: str) -> tuple[Path, Path]:
    """The (`<name>.json`, `<name>.tensors`) paths of state `name` in `folder`."""
    folder = Path(folder)
    return folder / f"{name}.json", folder / f"{name}.tensors"


def _encode(obj: Any, tensors: dict, path: str) -> Any:
    import numpy as np
    import torch

    if obj is None or isinstance(obj, bool | str | int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else {"__float__": repr(obj)}
    if isinstance(obj, torch.Tensor):
        key = f"t{len(tensors)}"
        tensors[key] = obj.detach().to("cpu").contiguous().clone()
        return {"__tensor__": key}
    if isinstance(obj, np.ndarray):
        key = f"t{len(tensors)}"
        tensors[key] = torch.from_numpy(np.ascontiguousarray(obj).copy())
        return {"__ndarray__": key}
    if isinstance(obj, np.generic):
        return _encode(obj.item(), tensors, path)
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [_encode(v, tensors, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, tensors, f"{path}.{k}") for k, v in obj.items()}
        return {
            "__items__": [
                [_encode(k, tensors, f"{path}<key>"), _encode(v, tensors, f"{path}[{k!r}]")]
                for k, v in obj.items()
            ]
        }
    raise StateFileError(
        f"cannot save {path or 'the state'}: a {type(obj).__name__} is neither a tensor, an array nor a "
        f"JSON value",
        fix="convert it to tensors/lists/numbers before saving (pickled objects are never written)",
    )


def _decode(obj: Any, tensors: dict, where: str) -> Any:
    if isinstance(obj, list):
        return [_decode(v, tensors, where) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if "__tensor__" in obj or "__ndarray__" in obj:
        key = obj.get("__tensor__", obj.get("__ndarray__"))
        if key not in tensors:
            raise StateFileError(
                f"{where} refers to tensor {key!r}, which its .tensors file lacks",
                fix="the checkpoint is damaged: resume from an older checkpoint",
            )
        return tensors[key].numpy() if "__ndarray__" in obj else tensors[key]
    if "__float__" in obj:
        return float(obj["__float__"])
    if "__tuple__" in obj:
        return tuple(_decode(v, tensors, where) for v in obj["__tuple__"])
    if "__items__" in obj:
        return {_decode(k, tensors, where): _decode(v, tensors, where) for k, v in obj["__items__"]}
    return {k: _decode(v, tensors, where) for k, v in obj.items()}


def save_state(folder: str | Path, name: str, obj: Any) -> tuple[Path, Path]:
    """Write `obj` as `<folder>/<name>.json` + `<name>.tensors` (safetensors); returns both paths."""
    from safetensors.torch import save_file

    tensors: dict = {}
    tree = _encode(obj, tensors, name)
    json_path, st_path = state_files(folder, name)
    save_file(tensors, str(st_path))
    json_path.write_text(json.dumps({"format": STATE_FORMAT, "tree": tree}, indent=None, allow_nan=False))
    return json_path, st_path


def refuse_pickled_state(folder: str | Path, pickled_names: tuple[str, ...]) -> None:
    """Refuse a checkpoint of the older layout (`optim.pt` / `extra_state.pt`, pickled by `torch.save`)
    that has no safetensors + JSON state: unpickling runs whatever the file says, so it is never loaded."""
    folder = Path(folder)
    old = [n for n in pickled_names if (folder / n).is_file()]
    if old and not state_files(folder, Path(old[0]).stem)[0].is_file():
        raise StateFileError(
            f"{folder} is a checkpoint of the older layout: its {', '.join(old)} "
            f"{'is a pickle' if len(old) == 1 else 'are pickles'}, which can run arbitrary code when "
            f"loaded, so dapo does not read them",
            fix=(
                f"start a new run from its weights (actor_rollout_ref.model.path={folder}, the HF "
                f"safetensors beside them are safe to load), or resume from a checkpoint written by "
                f"this version"
            ),
        )


def refuse_unsafe_pickles(folder: str | Path, allowed: Sequence[Any] = ()) -> list[Path]:
    """Check every `*.pt` under `folder` (files a third-party library such as DeepSpeed will unpickle in full)
    with torch's restricted unpickler (`weights_only=True`), allowing only tensors, plain data and the
    classes in `allowed`; raise :class:`StateFileError` naming the first file that needs anything else (it
    could run code when loaded). Returns the files checked."""
    import torch

    files = sorted(Path(folder).rglob("*.pt"))
    for f in files:
        try:
            with torch.serialization.safe_globals(list(allowed)):
                torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # the restricted unpickler's refusal, or a damaged file
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise StateFileError(
                f"{f} holds more than tensors and plain data ({first[:200]}); unpickling it could run "
                f"code, so dapo does not load it",
                fix=(
                    "resume from a checkpoint written by this version with the same DeepSpeed version, or "
                    "start a new run from the checkpoint's HF weights (actor_rollout_ref.model.path)"
                ),
            ) from None
    return files


def load_state(folder: str | Path, name: str, device: str = "cpu") -> Any:
    """Read back what `save_state(folder, name, ...)` wrote (tensors on `device`); nothing is executed."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    json_path, st_path = state_files(folder, name)
    for p in (json_path, st_path):
        if not p.is_file():
            raise StateFileMissing(
                f"{p} is missing, so {p.parent} is not a complete checkpoint",
                fix="point at a ckpt/step_<n>/actor folder written by dapo, or resume from an older one",
            )
    try:
        doc = json.loads(json_path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise StateFileError(
            f"{json_path} is not valid JSON ({e})", fix="the checkpoint is damaged: resume from an older one"
        ) from None
    if not isinstance(doc, dict) or doc.get("format") != STATE_FORMAT or "tree" not in doc:
        raise StateFileError(
            f"{json_path} is not a {STATE_FORMAT} state file",
            fix="point at a checkpoint written by this version of dapo",
        )
    try:
        tensors = load_file(str(st_path), device=device)
    except (SafetensorError, OSError, ValueError) as e:
        raise StateFileError(
            f"{st_path} is not a readable safetensors file ({e})",
            fix="the checkpoint is damaged: resume from an older checkpoint",
        ) from None
    return _decode(doc["tree"], tensors, str(json_path))
