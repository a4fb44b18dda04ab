"""`HostWeights`: HF-named CPU tensors that cross Ray's object store as numpy buffers (weight sync).

Ray hands numpy arrays to a reader on the same node as views of the object store's shared memory, without a
copy; a pickled torch tensor is rebuilt from bytes instead (a full copy of the weights, and more while it is
assembled). So the actor's weights are pickled as one numpy array per distinct tensor: the HF engine maps
them and copies each straight into its own parameters, so its memory grows by nothing but the mapped pages
(the vLLM engine passes them on to its engine process, which receives a copy). Names that share a tensor
(tied embeddings) share one array; dtypes numpy lacks (bfloat16) travel as integers of the same width and
are viewed back. In one process (no Ray) it is a plain mapping of the tensors. Receivers only read the
tensors: the store's pages are shared by every replica on the node, and torch does not enforce numpy's
read-only flag, so a write would reach the other replicas."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping

import numpy as np
import torch

__all__ = ["HostWeights"]

_SAME_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NUMPY_DTYPES = {
    torch.float64,
    torch.float32,
    torch.float16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
}


class HostWeights(Mapping[str, torch.Tensor]):
    """A read-only mapping name → CPU tensor, pickled as numpy buffers (see the module docstring)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = dict(tensors)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def __reduce__(self) -> tuple:
        arrays: list[np.ndarray] = []
        dtypes: list[str] = []
        slot: dict[tuple[int, tuple[int, ...], torch.dtype], int] = {}
        index: dict[str, int] = {}
        for name, t in self._tensors.items():
            t = t.detach().to("cpu").contiguous()
            key = (t.data_ptr(), tuple(t.shape), t.dtype)
            if key not in slot:
                slot[key] = len(arrays)
                arrays.append(_as_numpy(t))
                dtypes.append(str(t.dtype).removeprefix("torch."))
            index[name] = slot[key]
        return (_rebuild, (index, arrays, dtypes))


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    """`t` as a numpy array sharing its memory (dtypes numpy lacks as integers of the same width)."""
    if t.dtype not in _NUMPY_DTYPES:
        t = t.view(_SAME_WIDTH[t.element_size()])
    return t.numpy()


def _rebuild(index: dict[str, int], arrays: list[np.ndarray], dtypes: list[str]) -> HostWeights:
    """The receiving side of `HostWeights.__reduce__`: tensors viewing the received arrays, no copy."""
    with warnings.catch_warnings():  # the object store's buffers are read-only; nothing writes them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensors = [torch.from_numpy(a) for a in arrays]
    views = [
        t if str(t.dtype).removeprefix("torch.") == d else t.view(getattr(torch, d))
        for t, d in zip(tensors, dtypes, strict=True)
    ]
    return HostWeights({name: views[i] for name, i in index.items()})
