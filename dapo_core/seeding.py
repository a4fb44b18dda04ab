"""Seeds: one stable seed per sampled row, process-wide seeding, and the RNG states checkpoints keep.

`request_seed` derives the seed of one generation request from (run seed, generation step, uid, sample
index) with blake2b, so it is the same in every process and on every machine (Python's `hash` is salted
per process and would not be). Engines seed each sampled row with it, which makes a re-run stage
reproducible wherever the engine's sampling is deterministic.
"""

from __future__ import annotations

import hashlib
import os
import random
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["get_rng_state", "request_seed", "seed_everything", "set_rng_state", "torch_generator"]

_MASK_63 = (1 << 63) - 1


def request_seed(seed: int, gen_step: int, uid: str, sample_idx: int) -> int:
    """Stable 63-bit seed of one sampled row: blake2b of the four fields, top bit cleared.

    The result is a non-negative int < 2**63 (fits int64 and torch's `manual_seed`). Any change of
    any field gives an unrelated seed.
    """
    payload = f"{int(seed)}\x1f{int(gen_step)}\x1f{uid}\x1f{int(sample_idx)}".encode()
    digest = hashlib.blake2b(payload, digest_size=8, person=b"dapo-request").digest()
    return int.from_bytes(digest, "big") & _MASK_63


def seed_everything(seed: int) -> None:
    """Seed Python's `random`, NumPy's global generator and torch (CPU and all CUDA devices).

    Also sets `PYTHONHASHSEED` for child processes (it cannot change the current one's hashing).
    """
    seed = int(seed)
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    os.environ["PYTHONHASHSEED"] = str(seed % (1 << 32))


def torch_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A fresh `torch.Generator` on `device` seeded with `seed` (leaves the global RNG untouched)."""
    gen = torch.Generator(device=device)
    gen.manual_seed(int(seed) & _MASK_63)
    return gen


def uid_factory(*namespace: object) -> Callable[[], str]:
    """A callable returning reproducible uids (32 hex chars, no `_`) unique within `namespace`.

    Used instead of uuid4 for the uids of sampled prompts, so that a re-run of a step (after a crash, or a
    second run with the same seed) gives the same uids and therefore the same sampling seeds
    (`request_seed(seed, gen_step, uid, sample_idx)`). Different namespaces (seed, step, generation batch)
    never collide in practice (128-bit blake2b).
    """
    prefix = "/".join(str(x) for x in namespace)
    counter = iter(range(1 << 62))

    def make() -> str:
        return hashlib.blake2b(f"{prefix}#{next(counter)}".encode(), digest_size=16).hexdigest()

    return make


def get_rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU (and CUDA when available) RNG states, for checkpoints."""
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore states saved by `get_rng_state`."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
