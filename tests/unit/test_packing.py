"""Packed tokens (engine/models/packing.py) on hand-built tensors: the packed order, the padded grid,
the logits positions, and a store written token by token."""

from __future__ import annotations

import torch

from engine.models.kv_cache import write_kv
from engine.models.packing import PackedTokens


def test_packing_keeps_each_rows_fed_tokens_in_order_and_pads_back_with_zeros():
    fed = torch.tensor([3, 0, 1, 2])
    packed = PackedTokens.from_counts(fed, int(fed.sum()), 3)
    assert packed.row.tolist() == [0, 0, 0, 2, 3, 3]
    assert packed.column.tolist() == [0, 1, 2, 0, 0, 1]
    grid = torch.arange(4 * 3 * 2).view(4, 3, 2)
    flat = packed.pack(grid)
    assert flat.shape == (1, 6, 2)
    assert flat[0].tolist() == [grid[0, 0].tolist(), grid[0, 1].tolist(), grid[0, 2].tolist(), grid[2, 0].tolist(),
                                grid[3, 0].tolist(), grid[3, 1].tolist()]
    back = packed.pad(flat)
    fed_positions = torch.arange(3)[None, :] < fed[:, None]
    assert torch.equal(back[fed_positions], grid[fed_positions])
    assert not back[~fed_positions].any()


def test_logits_positions_point_at_each_rows_tokens_and_stay_inside_the_pack():
    fed = torch.tensor([2, 3, 0])
    packed = PackedTokens.from_counts(fed, 5, 3)
    at = torch.tensor([[0, 1], [1, 2], [0, 1]])
    tokens = torch.arange(10, 15)[None, :, None]  # [1, T, 1]: token t holds 10 + t
    taken = packed.take(tokens, at)
    assert taken.shape == (3, 2, 1)
    assert taken[:2, :, 0].tolist() == [[10, 11], [13, 14]]  # the feeding-nothing row's (never read) stay in range


def test_write_kv_takes_a_store_row_per_packed_token():
    generator = torch.Generator().manual_seed(0)
    store = torch.randn(3, 2, 8, 4, generator=generator)
    fed = torch.tensor([2, 0, 3])
    packed = PackedTokens.from_counts(fed, 5, 3)
    columns = torch.tensor([[4, 5, 7], [7, 7, 7], [0, 1, 2]])  # the padded grid's write index
    new = torch.randn(1, 2, 5, 4, generator=generator)
    expected = store.clone()
    for t, (row, column) in enumerate(zip(packed.row.tolist(), packed.column.tolist(), strict=True)):
        expected[row, :, columns[row, column]] = new[0, :, t]
    write_kv(store, new, packed.pack(columns), packed.row[None])
    assert torch.equal(store, expected)
