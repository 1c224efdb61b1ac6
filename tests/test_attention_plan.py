"""The step's attention plan: the rows kernel's row lists built from Python ints for causal rows see exactly the
slots the general per-sequence builder lists, and a padded group builds its tensors only when asked."""

from __future__ import annotations

import random

import torch

from leapdecode.layers.attention import (
    SeqAttention,
    _causal_rows,
    _listed_rows,
    build_attention_metadata,
)

BLOCK = 16


def _seqs(rng: random.Random) -> list[SeqAttention]:
    """Decode rows, draft chains and prompt chunks over fragmented block tables, laid end to end."""
    seqs, q_start = [], 0
    for _ in range(rng.randint(1, 9)):
        q_len = rng.choice([1, 1, 1, 3, 5, 40])
        ctx = q_len + rng.randint(0, 150)
        table = rng.sample(range(400), -(-ctx // BLOCK) + rng.randint(0, 2))  # spare blocks past ctx, too
        seqs.append(SeqAttention(q_start, q_len, ctx, table, BLOCK))
        q_start += q_len
    return seqs


def _seen(rows: torch.Tensor, spans: torch.Tensor, slots: torch.Tensor) -> dict[int, list[int]]:
    return {int(r): slots[int(a) : int(b)].tolist() for r, (a, b) in zip(rows, spans)}


def test_causal_rows_see_the_slots_the_general_builder_lists() -> None:
    rng = random.Random(0)
    for _ in range(50):
        seqs = _seqs(rng)
        fast, general = _causal_rows(seqs), _listed_rows(seqs)
        assert fast[0].tolist() == general[0].tolist()
        assert _seen(*fast) == _seen(*general)
        # and each row sees its sequence's cache positions 0 .. its own position, in order
        for s in seqs:
            for i in range(s.q_len):
                assert _seen(*fast)[s.q_start + i] == s.slots()[: s.ctx_len - s.q_len + i + 1].tolist()


def test_a_padded_group_builds_its_tensors_only_when_asked() -> None:
    seqs = [SeqAttention(i, 1, 20 + i, [2 * i, 2 * i + 1], BLOCK) for i in range(4)]
    slot_mapping = torch.tensor([s.slots()[-1] for s in seqs])
    meta = build_attention_metadata(seqs, slot_mapping, 3, torch.device("cpu"))
    (g,) = meta.groups
    assert meta.all_kernel_rows() and g.mask is None and g.kv_slots is None  # the rows kernel needs neither
    g.fill()
    assert g.q_rows.tolist() == [0, 1, 2, 3] and g.q_valid.all()
    assert g.kv_slots.view(4, -1)[3].tolist() == seqs[3].slots().tolist()
    assert g.mask.shape == (4, 1, 3, 23) and g.mask[0, 0, 0].tolist() == [True] * 20 + [False] * 3
