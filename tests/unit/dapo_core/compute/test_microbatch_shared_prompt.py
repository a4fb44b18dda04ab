"""Shared-prompt forwards (`use_shared_prompt`): each distinct prompt of a micro-batch runs once, either as
one row per prompt group with its responses back to back under a 4-D mask (`group_rows`, "grouped") or with a
KV cache the responses run on ("cache", where grouping would not save positions or its mask is too large). The
numbers must not move on either path: log-probs, entropy and gradients equal the per-row padded forward's
(float64 to 1e-10), whatever the order of the rows, and a whole PPO update through the actor worker lands on
the same weights."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pytest
import torch

from dapo_core.compute import microbatch
from dapo_core.compute.engines import train as train_engines
from dapo_core.compute.engines.train import make_train_engine
from dapo_core.compute.microbatch import group_rows, grouped_order, shared_prompts
from dapo_core.compute.models import build_tiny_model
from dapo_core.compute.workers.actor import ActorWorker
from dapo_core.config.schema import ActorConfig
from tests.helpers import tiny_model_cfg

torch.set_num_threads(1)

TINY = tiny_model_cfg(hidden_size=32, intermediate_size=64, max_position_embeddings=128)
P, L = 7, 9


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), TINY, seed=4)


@pytest.fixture(params=["grouped", "cache"])
def path(request, monkeypatch):
    """Which shared-prompt path the engine takes: a zero mask budget sends every batch the KV-cache way."""
    if request.param == "cache":
        monkeypatch.setattr(microbatch, "MAX_GROUP_MASK_ELEMENTS", 0)
    return request.param


def grouped_batch(groups=3, n=4, seed=0, shuffle=False):
    """`groups` prompts of different lengths (left-padded to P), each with `n` responses of 1..L tokens
    (right-padded); one response fills the whole width, so the trimmed response pass is not always shorter."""
    g = torch.Generator().manual_seed(seed)
    rows = groups * n
    ids = torch.zeros(rows, P + L, dtype=torch.long)
    mask = torch.zeros(rows, P + L, dtype=torch.long)
    for gi in range(groups):
        plen = 2 + (3 * gi) % (P - 1)
        prompt = torch.randint(4, 99, (plen,), generator=g)
        for j in range(n):
            r = gi * n + j
            ids[r, P - plen : P] = prompt
            mask[r, P - plen : P] = 1
            rlen = L if r == 1 else 1 + int(torch.randint(0, L, (1,), generator=g))
            ids[r, P : P + rlen] = torch.randint(4, 99, (rlen,), generator=g)
            mask[r, P : P + rlen] = 1
    if shuffle:
        perm = torch.randperm(rows, generator=g)
        ids, mask = ids[perm], mask[perm]
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def _update_table(ids: torch.Tensor, mask: torch.Tensor, advantages: list[float]) -> pa.Table:
    """The padded (B, P+L) batch as the update's table, one advantage per row."""
    prompt_ids = [ids[r, :P][mask[r, :P].bool()].tolist() for r in range(ids.shape[0])]
    response_ids = [ids[r, P:][mask[r, P:].bool()].tolist() for r in range(ids.shape[0])]
    return pa.table(
        {
            "prompt_ids": prompt_ids,
            "response_ids": response_ids,
            "advantages": [[a] * len(r) for a, r in zip(advantages, response_ids, strict=True)],
        }
    )


def _actor(tiny_dir, *, mini: int, micro: int, total_steps: int, share: bool) -> ActorWorker:
    cfg = ActorConfig(ppo_mini_batch_size=mini, ppo_micro_batch_size_per_gpu=micro)
    actor_cfg = dataclasses.asdict(dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=1e-2)))
    return ActorWorker(
        str(tiny_dir),
        actor_cfg,
        pad_token_id=0,
        temperature=1.0,
        rollout_n=4,
        total_steps=total_steps,
        use_shared_prompt=share,
    )


def test_shared_prompts_groups_rows_by_prompt_tokens_and_mask():
    ids, mask, _ = grouped_batch(groups=3, n=4, shuffle=True, seed=2)
    groups = shared_prompts(ids, mask, L)
    assert groups is not None and groups.first.numel() == 3
    for r in range(ids.shape[0]):
        f = int(groups.first[groups.inverse[r]])
        assert torch.equal(ids[r, :P], ids[f, :P]) and torch.equal(mask[r, :P], mask[f, :P])
    assert groups.first.tolist() == sorted(groups.first.tolist())  # numbered in order of first appearance
    assert int(groups.inverse[0]) == 0
    # Same tokens under the mask but one more padding column: a different prompt.
    ids2, mask2 = ids[:2].clone(), mask[:2].clone()
    ids2[1, :P], mask2[1, :P] = ids2[0, :P], mask2[0, :P]
    first_valid = int(mask2[1, :P].nonzero()[0])
    mask2[1, first_valid] = 0
    assert shared_prompts(ids2, mask2, L) is None
    # Every prompt different: nothing to share.
    ids3, mask3, _ = grouped_batch(groups=4, n=1)
    assert shared_prompts(ids3, mask3, L) is None


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 3e-5), (torch.float64, 1e-10)])
@pytest.mark.parametrize("shuffle", [False, True])
def test_shared_prompt_forward_equals_the_padded_forward_with_gradients(tiny_dir, dtype, tol, shuffle, path):
    ids, mask, pos = grouped_batch(shuffle=shuffle, seed=1)
    grouped = group_rows(ids, mask, pos, L, shared_prompts(ids, mask, L))
    assert (grouped is not None) == (path == "grouped")
    m = mask[:, P:].bool()
    weights = torch.randn(m.shape, generator=torch.Generator().manual_seed(9), dtype=dtype)
    out = {}
    for share in (False, True):
        eng = make_train_engine("torch", tiny_dir, {"lr": 0.0}, total_steps=1, grad_clip=1.0, dtype=dtype)
        eng.train()
        lp, ent = eng.forward(ids, mask, pos, L, temperature=0.7, calculate_entropy=True, share_prompt=share)
        ((lp * weights)[m].sum() + (ent * weights)[m].sum()).backward()
        grads = {k: p.grad.detach().clone() for k, p in eng.model.named_parameters()}
        out[share] = (lp.detach(), ent.detach(), grads)
    (lp0, ent0, g0), (lp1, ent1, g1) = out[False], out[True]
    assert float((lp0 - lp1)[m].abs().max()) < tol
    assert float((ent0 - ent1)[m].abs().max()) < tol
    assert float(lp1[~m].abs().max()) == 0.0 and float(ent1[~m].abs().max()) == 0.0
    # Gradients sum the n responses' shares of a prompt in another order than the per-row forward, and
    # Qwen2's RMSNorm computes in float32 even in a float64 model, so they agree to float32 precision.
    for k in g0:
        assert float((g0[k] - g1[k]).abs().max()) < 1e-5 * max(1.0, float(g0[k].abs().max())), k
    # The gradient through the shared prompt is not zero: the prompt's activations get every response's share.
    assert float(g1["model.embed_tokens.weight"].abs().sum()) > 0


def test_shared_prompt_falls_back_under_gradient_checkpointing(tiny_dir):
    ids, mask, pos = grouped_batch(seed=3)
    m = mask[:, P:].bool()
    eng = make_train_engine(
        "torch",
        tiny_dir,
        {"lr": 0.0},
        total_steps=1,
        grad_clip=1.0,
        dtype=torch.float64,
        gradient_checkpointing=True,
    )
    eng.train()
    lp_shared, _ = eng.forward(ids, mask, pos, L, share_prompt=True)
    lp_plain, _ = eng.forward(ids, mask, pos, L)
    assert torch.equal(lp_shared[m], lp_plain[m])  # the same (per-row) path ran
    eng.eval()  # no backward in eval mode: the shared path applies again, within float error
    lp_eval, _ = eng.forward(ids, mask, pos, L, share_prompt=True)
    assert float((lp_eval - lp_plain.detach())[m].abs().max()) < 1e-10


@pytest.mark.parametrize("shuffle", [False, True])
def test_actor_update_with_shared_prompts_lands_on_the_same_weights(tiny_dir, path, shuffle, monkeypatch):
    """Also when the batch comes in another order (`trainer.balance_batch` sorts it by length): the
    micro-batches of a mini-batch then still hold whole prompt groups (here one group of 4 rows each; the
    shuffled batch is one mini-batch, since a mini-batch's rows are fixed by the batch order)."""
    ids, mask, _ = grouped_batch(groups=4, n=4, seed=5, shuffle=shuffle)
    seen: list[int] = []

    def spy(input_ids, *args, **kwargs):
        seen.append(int(shared_prompts(input_ids, args[0], args[2]).first.numel()))
        return group_rows(input_ids, *args, **kwargs)

    monkeypatch.setattr(train_engines, "group_rows", spy)
    g = torch.Generator().manual_seed(6)
    table = _update_table(ids, mask, torch.randn(4, generator=g).repeat_interleave(4).tolist())
    results = {}
    for share in (False, True):
        w = _actor(tiny_dir, mini=4 if shuffle else 2, micro=4, total_steps=2, share=share)
        old = w.compute_log_prob(table)
        metrics = w.update_actor(old, global_steps=1)
        results[share] = (
            old.column("old_log_probs").to_pylist(),
            metrics,
            {k: v.detach().clone() for k, v in w.sync_tensors()},
        )
    (lp0, m0, w0), (lp1, m1, w1) = results[False], results[True]
    if path == "grouped":  # the log-probs in one micro-batch, then update micro-batches of one prompt each
        assert seen == [4, 1, 1, 1, 1]
    assert max(abs(x - y) for a, b in zip(lp0, lp1, strict=True) for x, y in zip(a, b, strict=True)) < 3e-5
    assert abs(m0["actor/pg_loss"] - m1["actor/pg_loss"]) < 1e-5
    assert abs(m0["actor/grad_norm"] - m1["actor/grad_norm"]) < 1e-4 * max(1.0, m0["actor/grad_norm"])
    # Adam's first step moves each weight by about lr = 1e-2; the two paths agree to 1 % of that (a wrong
    # gradient would move many weights the other way).
    assert max(float((w0[k] - w1[k]).abs().max()) for k in w0) < 1e-4


def test_shared_prompt_forward_of_rows_without_response_tokens_is_zero(tiny_dir, path):
    ids, mask, pos = grouped_batch(seed=7)
    mask[:, P:] = 0  # no response token in any row
    eng = make_train_engine("torch", tiny_dir, {"lr": 0.0}, total_steps=1, grad_clip=1.0)
    eng.eval()
    lp, ent = eng.forward(ids, mask, pos, L, calculate_entropy=True, share_prompt=True)
    assert lp.shape == ent.shape == (ids.shape[0], L)
    assert float(lp.abs().max()) == 0.0 and float(ent.abs().max()) == 0.0


def test_group_rows_lays_each_prompt_out_once_with_its_responses_back_to_back():
    # Prompts of 2 and 3 tokens (left-padded to P = 3), rows interleaved; responses of 2, 1, 3 and 0 tokens.
    ids = torch.tensor([[0, 5, 6, 11, 12, 0], [7, 8, 9, 21, 0, 0], [0, 5, 6, 13, 14, 15], [7, 8, 9, 0, 0, 0]])
    mask = (ids != 0).long()
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    groups = shared_prompts(ids, mask, 3)
    g = group_rows(ids, mask, pos, 3, groups)
    assert g is not None and g.prompt_width == 3 and g.response_width == 3 and g.keep == 8 - 3 + 1
    assert g.input_ids.tolist() == [[0, 5, 6, 11, 12, 13, 14, 15], [7, 8, 9, 21, 0, 0, 0, 0]]
    # A response restarts right after its prompt: rows 0 and 2 both begin at position 2.
    assert g.position_ids.tolist() == [[0, 0, 1, 2, 3, 2, 3, 4], [0, 1, 2, 3, 0, 0, 0, 0]]
    a = g.attend[0, 0]
    assert a[5].tolist() == [
        False,
        True,
        True,
        False,
        False,
        True,
        False,
        False,
    ]  # row 2's 1st: prompt, itself
    assert a[7].tolist() == [False, True, True, False, False, True, True, True]  # its 3rd: not row 0's tokens
    assert a[2].tolist() == [False, True, True] + [False] * 5  # a prompt token: the prompt up to itself
    assert bool(a.sum(dim=1).min() >= 1)  # every query has a key (padding attends to itself)
    # Logits for k = 0 come from the prompt's last token (kept column 0), then from the row's own tokens.
    assert g.logit_index.tolist()[:3] == [[0, 1, 2], [0, 1, 2], [0, 3, 4]]  # row 3 has no response
    assert g.group.tolist() == [0, 1, 0, 1]
    assert group_rows(ids, mask, pos, 3, groups, max_mask_elements=2 * 8 * 8 - 1) is None


def test_group_rows_declines_when_it_would_not_save_positions():
    # Two full-width responses per prompt: back to back they take as many positions as padded rows do.
    ids = torch.tensor([[5, 6, 11, 12], [5, 6, 13, 14]])
    mask = torch.ones_like(ids)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    assert group_rows(ids, mask, pos, 2, shared_prompts(ids, mask, 2)) is None
    # An empty prompt has no last token to predict the first response token from.
    ids2 = torch.tensor([[0, 0, 11, 0], [0, 0, 13, 0]])
    mask2 = (ids2 != 0).long()
    assert group_rows(ids2, mask2, pos, 2, shared_prompts(ids2, mask2, 2)) is None


def test_grouped_order_puts_equal_keys_together_in_order_of_first_appearance():
    keys = torch.tensor([7, 3, 7, 9, 3, 3, 9, 7])
    order = grouped_order(keys)
    assert order.tolist() == [0, 2, 7, 1, 4, 5, 3, 6]
    assert sorted(order.tolist()) == list(range(8))
    assert grouped_order(torch.zeros(0, dtype=torch.long)).numel() == 0


def test_grouped_order_with_lengths_puts_the_longest_groups_first():
    """Groups by summed length, longest first (ties: first appearance); rows keep their order in a group,
    so consecutive micro-batches hold groups of like size."""
    keys = torch.tensor([7, 3, 7, 9, 3, 3, 9, 7, 5, 5])
    lengths = torch.tensor([1, 4, 1, 2, 3, 2, 1, 1, 6, 3])  # sums: 7 -> 3, 3 -> 9, 9 -> 3, 5 -> 9
    order = grouped_order(keys, lengths)
    assert order.tolist() == [1, 4, 5, 8, 9, 0, 2, 7, 3, 6]
    assert grouped_order(keys, torch.ones(10, dtype=torch.long)).tolist() == [0, 2, 7, 1, 4, 5, 3, 6, 8, 9]


def test_update_micro_batches_take_the_longest_prompt_groups_first(tiny_dir, monkeypatch):
    """`ppo_update` with shared prompts hands the engine whole groups, longest summed response first, and
    pads each micro-batch only to its own longest group."""
    ids, mask, _ = grouped_batch(groups=4, n=4, seed=5, shuffle=True)
    widths: list[list[int]] = []

    def spy(input_ids, *args, **kwargs):
        groups = shared_prompts(input_ids, args[0], args[2])
        r_len = args[0][:, -args[2] :].sum(dim=1)
        totals = torch.zeros(int(groups.first.numel()), dtype=torch.long).index_add_(0, groups.inverse, r_len)
        widths.append(sorted(totals.tolist(), reverse=True))
        return group_rows(input_ids, *args, **kwargs)

    monkeypatch.setattr(train_engines, "group_rows", spy)
    table = _update_table(ids, mask, [0.5] * ids.shape[0])
    _actor(tiny_dir, mini=4, micro=8, total_steps=1, share=True).update_actor(table, 1, "current")
    group_len: dict[tuple, int] = {}
    for p, r in zip(table["prompt_ids"].to_pylist(), table["response_ids"].to_pylist(), strict=True):
        group_len[tuple(p)] = group_len.get(tuple(p), 0) + len(r)
    expected = sorted(group_len.values(), reverse=True)
    assert [len(w_) for w_ in widths] == [2, 2]
    assert widths[0] + widths[1] == expected
