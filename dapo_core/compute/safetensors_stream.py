"""A safetensors file written one tensor at a time: the header (names, dtypes, shapes, offsets) is known
before any tensor is, so each tensor goes to its place as it arrives and is dropped; the writer never holds
more than the tensor in hand. The format is safetensors' own (8-byte header length, JSON header, data in the
entries' order), so `safe_open` and transformers read it."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = ["StreamedSafetensors"]

_CODES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class StreamedSafetensors:
    """`write(name, tensor)` each of `entries` (name, dtype, shape), in any order, then `close()`; the file
    appears at `path` only when every entry was written (a temporary name until then)."""

    def __init__(self, path: str | Path, entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        self._slots: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]] = {}
        offset = 0
        for name, dtype, shape in entries:
            if dtype not in _CODES:
                raise ValueError(f"{name}: dtype {dtype} has no safetensors code")
            n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            header[name] = {
                "dtype": _CODES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + n],
            }
            self._slots[name] = (offset, n, dtype, tuple(shape))
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._data_start = 8 + len(raw)
        self._tmp = self.path.with_name(self.path.name + ".partial")
        self._f = open(self._tmp, "wb")  # noqa: SIM115 - held open across write() calls, closed in close()
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._f.truncate(self._data_start + offset)
        self._written: set[str] = set()

    @property
    def names(self) -> set[str]:
        return set(self._slots)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        offset, n, dtype, shape = self._slots[name]
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(
                f"{name}: got {tensor.dtype} {tuple(tensor.shape)}, the header says {dtype} {shape}"
            )
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        assert data.nbytes == n
        self._f.seek(self._data_start + offset)
        self._f.write(data.data)
        self._written.add(name)

    def abort(self) -> None:
        """Drop the unfinished file."""
        if not self._f.closed:
            self._f.close()
        self._tmp.unlink(missing_ok=True)

    def close(self) -> Path:
        """Finish the file (atomically renamed into place); raise naming the entries never written."""
        if self._f.closed:
            return self.path
        self._f.close()
        missing = sorted(self.names - self._written)
        if missing:
            self._tmp.unlink(missing_ok=True)
            raise ValueError(f"{self.path}: tensors never written: {missing[:5]}")
        os.replace(self._tmp, self.path)
        return self.path
