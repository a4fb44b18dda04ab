"""`HostWeights`: the actor's weights as they cross Ray's object store to the rollout replicas."""

from __future__ import annotations

import pickle

import numpy as np
import torch

from dapo_core.compute.host_weights import HostWeights


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    emb = torch.randn(7, 4, generator=g)
    return {
        "model.embed_tokens.weight": emb,
        "lm_head.weight": emb,  # tied: the same tensor under two names
        "model.norm.weight": torch.randn(4, generator=g).to(torch.bfloat16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(3, 4, generator=g),
    }


def test_a_pickled_round_trip_keeps_names_values_dtypes_and_ties():
    w = _weights()
    back = pickle.loads(pickle.dumps(HostWeights(w), protocol=5))
    assert isinstance(back, HostWeights)
    assert list(back) == list(w)
    for name, t in w.items():
        assert back[name].dtype == t.dtype, name
        assert torch.equal(back[name], t), name
    assert back["lm_head.weight"].data_ptr() == back["model.embed_tokens.weight"].data_ptr()


def test_the_pickle_carries_each_distinct_tensor_once_as_an_out_of_band_buffer():
    # Protocol 5 hands numpy buffers out of band (Ray places them in the object store and a reader maps
    # them); the tied pair travels once and the bfloat16 tensor travels as int16 of the same bytes.
    w = _weights()
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(HostWeights(w), protocol=5, buffer_callback=buffers.append)
    distinct = {"model.embed_tokens.weight", "model.norm.weight", "model.layers.0.mlp.up_proj.weight"}
    assert sum(memoryview(b).nbytes for b in buffers) == sum(w[k].nbytes for k in distinct)
    assert len(data) < 4096  # names and metadata only, no tensor bytes in-band
    back = pickle.loads(data, buffers=buffers)
    assert torch.equal(back["model.norm.weight"], w["model.norm.weight"])


def test_received_tensors_view_the_buffers_without_a_copy():
    w = _weights()
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(HostWeights(w), protocol=5, buffer_callback=buffers.append)
    raw = [np.frombuffer(memoryview(b), dtype=np.uint8) for b in buffers]
    back = pickle.loads(data, buffers=buffers)
    starts = {a.__array_interface__["data"][0] for a in raw}
    assert {back[k].data_ptr() for k in back} <= starts
