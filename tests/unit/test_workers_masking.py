import numpy as np
import pytest

from workers.masking import BlockKind, TileBounds, sees_a_key, visible
from workers.options import AttentionOptions
from workers.problem import Arange


@pytest.mark.parametrize("seed", range(20))
def test_block_classification_is_sound_against_the_elementwise_mask(seed):
    rng = np.random.default_rng(seed)
    opts = AttentionOptions(
        causal=bool(rng.random() < 0.5),
        window=(None if rng.random() < 0.3 else int(rng.integers(0, 20)), None if rng.random() < 0.5 else int(rng.integers(0, 5))),
    )
    if not opts.masked:
        return
    for _ in range(200):
        q_pos = rng.integers(0, 100, int(rng.integers(1, 6)))
        k_pos = rng.integers(0, 100, int(rng.integers(1, 9)))
        ok = visible(q_pos, k_pos, opts)
        kind = TileBounds.of(int(q_pos.min()), int(q_pos.max()), opts).classify(int(k_pos.min()), int(k_pos.max()))
        if kind is BlockKind.SKIP:
            assert not ok.any()
        elif kind is BlockKind.FULL:
            assert ok.all()


def test_causal_blocks_after_the_last_query_are_skipped():
    b = TileBounds.of(100, 163, AttentionOptions(causal=True))
    assert b.classify(164, 300) is BlockKind.SKIP
    assert b.classify(0, 100) is BlockKind.FULL
    assert b.classify(90, 120) is BlockKind.PARTIAL


def test_window_blocks_before_the_window_are_skipped():
    b = TileBounds.of(1000, 1000, AttentionOptions(window=(128, 0)))
    assert b.classify(0, 871) is BlockKind.SKIP
    assert b.classify(872, 1000) is BlockKind.FULL


def test_causal_caps_a_window_right_bound_at_zero():
    assert AttentionOptions(causal=True, window=(5, 9)).right == 0
    assert AttentionOptions(causal=True).left is None
    assert AttentionOptions(window=(None, 3)).right == 3


@pytest.mark.parametrize("seed", range(4))
def test_which_rows_see_a_key_agrees_with_the_elementwise_mask_for_any_positions(seed):
    rng = np.random.default_rng(seed)
    for _ in range(500):
        n_q, n_k = int(rng.integers(1, 6)), int(rng.integers(0, 9))
        q_pos = rng.integers(-20, 20, n_q).astype(np.int64)
        bound = lambda: None if rng.integers(3) == 0 else int(rng.integers(0, 6))  # noqa: E731
        opts = AttentionOptions(causal=bool(rng.integers(2)), window=[bound(), bound()])
        if rng.integers(2):  # the default positions, never materialised
            k_pos = Arange(int(rng.integers(-20, 20)), n_k)
            keys = k_pos.materialize()
        else:  # any order, repeats
            k_pos = keys = rng.integers(-20, 20, n_k).astype(np.int64)
        if opts.left is None and opts.right is None:
            want = np.full(n_q, n_k > 0)
        else:
            want = visible(q_pos, keys, opts).any(axis=1) if n_k else np.zeros(n_q, bool)
        np.testing.assert_array_equal(sees_a_key(q_pos, k_pos, opts), want)
