import numpy as np
import pytest

from workers.options import KernelOptions
from workers.plan import DECODE_ROWS, make_plan


@pytest.mark.parametrize("n_rows", [1, 4, DECODE_ROWS, DECODE_ROWS + 1, 1000])
@pytest.mark.parametrize("threads", [1, 2, 5])
@pytest.mark.parametrize("n_k", [0, 1, 63, 5000])
def test_plan_covers_every_head_row_and_key_exactly_once(n_rows, threads, n_k):
    h_kv = 3
    plan = make_plan(n_rows, h_kv, n_k, 64, 64, 4, KernelOptions(threads=threads))
    cover = np.zeros((h_kv, n_rows, max(n_k, 1)), dtype=int)
    for it in plan.items:
        cover[it.h0:it.h1, it.r0:it.r1, it.k0:it.k1] += 1
    if n_k:
        assert np.all(cover == 1)
    grouped = sorted(i for g in plan.groups for i in g)
    assert grouped == list(range(len(plan.items)))
    for g in plan.groups:
        ks = [(plan.items[i].k0, plan.items[i].k1) for i in g]
        assert ks == sorted(ks), "key splits must be listed in key order"


def test_decode_batches_all_heads_and_splits_keys_over_threads():
    plan = make_plan(4, 8, 100_000, 128, 128, 4, KernelOptions(threads=2))
    assert {(it.h0, it.h1) for it in plan.items} == {(0, 8)}
    assert len(plan.items) == 2


def test_block_size_fits_the_scratch_budget_and_user_block_wins():
    budget = 2**20
    plan = make_plan(1024, 8, 10**6, 128, 128, 4, KernelOptions(scratch_bytes=budget))
    it = plan.items[0]
    assert (it.h1 - it.h0) * (it.r1 - it.r0) * plan.block_size * 4 <= budget
    assert make_plan(4, 8, 1000, 128, 128, 4, KernelOptions(block_size=7)).block_size == 7
