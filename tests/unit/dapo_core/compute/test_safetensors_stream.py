"""`StreamedSafetensors`: a safetensors file written tensor by tensor, read back by safetensors itself."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dapo_core.compute.safetensors_stream import StreamedSafetensors


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(5, 3, generator=g),
        "b.bias": torch.randn(7, generator=g).to(torch.bfloat16),
        "c.ids": torch.arange(4, dtype=torch.int64),
        "d.empty": torch.zeros(0, 2),
    }


def test_written_in_any_order_it_reads_back_like_save_file(tmp_path):
    ts = _tensors()
    save_file(ts, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    entries = [(k, v.dtype, tuple(v.shape)) for k, v in ts.items()]
    w = StreamedSafetensors(tmp_path / "reversed.safetensors", entries)
    for k in reversed(list(ts)):
        w.write(k, ts[k])
    w.close()
    back, ref = (
        load_file(str(tmp_path / "reversed.safetensors")),
        load_file(str(tmp_path / "ref.safetensors")),
    )
    assert back.keys() == ref.keys() == ts.keys()
    assert all(torch.equal(back[k], ref[k]) and back[k].dtype == ts[k].dtype for k in ts)
    with safe_open(str(tmp_path / "reversed.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_an_unwritten_entry_leaves_no_file(tmp_path):
    ts = _tensors()
    w = StreamedSafetensors(tmp_path / "x.safetensors", [(k, v.dtype, tuple(v.shape)) for k, v in ts.items()])
    w.write("a.weight", ts["a.weight"])
    with pytest.raises(ValueError, match="tensors never written"):
        w.close()
    assert list(tmp_path.iterdir()) == []
    w2 = StreamedSafetensors(tmp_path / "y.safetensors", [("a", torch.float32, (2,))])
    with pytest.raises(ValueError, match="the header says"):
        w2.write("a", torch.zeros(3))
    w2.abort()
    assert list(tmp_path.iterdir()) == []
