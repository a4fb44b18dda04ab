"""The driver-side shortcuts of a training step give exactly what the slower paths gave:
prompts drawn as one table and tokenised once per row, and the one-partition sequence balance."""

from __future__ import annotations

import heapq

import numpy as np
import pyarrow as pa
import pytest

from dapo_core.data import batch as B
from dapo_core.data.datasets import DataError, PromptSampler, make_synthetic_math, tokenize_prompt
from dapo_core.data.sampler import HistorySampler
from tasks.runtime import ChunkSampler

ROWS = 24


@pytest.fixture(scope="module")
def tokenizer():
    from dapo_core.compute.models import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture(scope="module")
def table():
    return pa.Table.from_pylist(make_synthetic_math(ROWS, seed=11))


class CountingTokenizer:
    """The real tokenizer, counting how many prompt texts it was asked to encode."""

    def __init__(self, inner):
        self.inner = inner
        self.encoded = 0

    def apply_chat_template(self, *args, **kwargs):
        return self.inner.apply_chat_template(*args, **kwargs)

    def __call__(self, texts, **kwargs):
        self.encoded += len(texts) if isinstance(texts, list) else 1
        return self.inner(texts, **kwargs)


def _one_by_one(table: pa.Table, tokenizer, rows: list[int], max_len: int, truncation: str) -> list:
    """What the sampler drew before: `tokenize_prompt` of each row, then truncation."""
    out = []
    for r in rows:
        ids = tokenize_prompt(tokenizer, table.column("prompt")[r].as_py())
        if len(ids) > max_len:
            ids = ids[-max_len:] if truncation == "left" else ids[:max_len]
        out.append(ids)
    return out


@pytest.mark.parametrize(("truncation", "max_len"), [("error", 128), ("left", 12), ("right", 12)])
def test_chunk_draw_gives_the_token_ids_of_row_by_row_tokenising(table, tokenizer, truncation, max_len):
    """A chunk of 2.5 epochs drawn as one table: the rows of the seeded epochs in order, and for each the
    token ids `tokenize_prompt` gives (truncated as configured), the other columns as drawn row by row."""
    kw = {"batch_size": 1, "seed": 4, "max_prompt_length": max_len, "truncation": truncation}
    chunk = ChunkSampler(PromptSampler(table, tokenizer, **kw))
    single = PromptSampler(table, tokenizer, **kw)
    size = ROWS * 5 // 2
    got = pa.concat_tables([chunk.next_batch(7), chunk.next_batch(size - 7)])
    want = pa.concat_tables([single.next_batch() for _ in range(size)])
    assert got.schema == want.schema
    assert got.equals(want)
    rows = got.column("prompt_id").to_pylist()
    assert got.column("prompt_ids").to_pylist() == _one_by_one(table, tokenizer, rows, max_len, truncation)
    assert chunk.state_dict() == single.state_dict()


def test_a_row_is_tokenised_once_per_sampler(table, tokenizer):
    """Three epochs encode each prompt text once; the ids of a later epoch are those of the first."""
    counting = CountingTokenizer(tokenizer)
    chunk = ChunkSampler(PromptSampler(table, counting, batch_size=1, seed=2, max_prompt_length=128))
    first = chunk.next_batch(ROWS)
    assert counting.encoded == ROWS
    later = pa.concat_tables([chunk.next_batch(ROWS), chunk.next_batch(ROWS)])
    assert counting.encoded == ROWS
    ids = dict(zip(*first.select(["prompt_id", "prompt_ids"]).to_pydict().values(), strict=True))
    for pid, toks in zip(*later.select(["prompt_id", "prompt_ids"]).to_pydict().values(), strict=True):
        assert toks == ids[pid]


def test_too_long_prompt_is_refused_naming_the_row_and_keys(table, tokenizer):
    s = ChunkSampler(PromptSampler(table, tokenizer, batch_size=1, seed=0, max_prompt_length=5))
    refused = r"prompt of row \d+ has \d+ tokens > max_prompt_length=5.*data.truncation"
    with pytest.raises(DataError, match=refused):
        s.next_batch(3)


def test_history_sampler_chunks_match_its_single_draws(table, tokenizer):
    """The history sampler's passing-over happens per drawn prompt inside a chunk too (same rows, state)."""
    kw = {"batch_size": 1, "seed": 5, "max_prompt_length": 128, "window": 1, "explore_prob": 0.3}
    a, b = HistorySampler(table, tokenizer, **kw), HistorySampler(table, tokenizer, **kw)
    outcome = {pid: [True] * 4 if pid % 3 else [True, False] * 2 for pid in range(ROWS)}
    for s in (a, b):
        for pid, accs in outcome.items():
            s.observe([pid] * 4, accs)
    got = ChunkSampler(a).next_batch(ROWS + 5)
    want = pa.concat_tables([b.next_batch() for _ in range(ROWS + 5)])
    assert got.equals(want)
    assert a.state_dict() == b.state_dict() and a.passed_over > 0


def _karmarkar_karp_heap(workloads: np.ndarray, k: int) -> list[list[int]]:
    """The heap loop of `balance_partitions`, run for any k (the one-partition shortcut skips it)."""
    order = sorted((int(wl), i) for i, wl in enumerate(workloads.tolist()))
    heap = [B._KKState([(i, wl) for wl, i in order[off : off + k]], k) for off in range(0, len(order), k)]
    heapq.heapify(heap)
    while len(heap) > 1:
        a, b = heapq.heappop(heap), heapq.heappop(heap)
        a.merge(b)
        heapq.heappush(heap, a)
    return [sorted(i for i, _ in s.items) for s in heap[0].sets]


@pytest.mark.parametrize("n", [1, 2, 7, 256])
def test_one_partition_balance_is_the_karmarkar_karp_answer(n):
    rng = np.random.default_rng(n)
    w = B.calculate_workload(rng.integers(1, 96, size=n))
    assert B.balance_partitions(w, 1) == _karmarkar_karp_heap(w, 1)
    assert B.balance_partitions(w, 2 if n % 2 == 0 else 1) == _karmarkar_karp_heap(w, 2 if n % 2 == 0 else 1)
    perm = B.balance_order(rng.integers(1, 96, size=n), 1)
    assert sorted(perm.tolist()) == list(range(n))
