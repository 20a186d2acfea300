"""An independent, materialising attention: simple enough to trust.

``reference(..., dtype=np.float64)`` is the ground truth. The same function in
float32 is the "one-shot computation in the same precision" whose error sets
the tolerance of every kernel test (FlashAttention's criterion: the kernel's
error is at most twice the one-shot error, plus a few ulps of the output).
"""

from __future__ import annotations

import numpy as np

from workers.dtypes import accumulation_dtype


def reference(q, k, v, *, scale=None, causal=False, q_pos=None, k_pos=None, window=None, softcap=None,
              alibi_slopes=None, dtype=np.float64):
    """Materialised softmax attention computed in ``dtype`` (float32, float64 or longdouble); returns (out, lse)."""
    n_q, h_q, d = q.shape
    n_k, h_kv, _ = k.shape
    g = h_q // h_kv
    # Query head h_kv * g + i reads kv head h_kv: K and V are broadcast over i (a view), not repeated
    # g times (at service shapes in extended precision those copies took most of the reference's time).
    q = np.asarray(q).astype(dtype).reshape(n_q, h_kv, g, d)  # [n_q, h_kv, g, d]
    k = np.asarray(k).astype(dtype)[:, :, None]  # [n_k, h_kv, 1, d]
    v = np.asarray(v).astype(dtype)[:, :, None]  # [n_k, h_kv, 1, d_v]
    k = np.broadcast_to(k, (n_k, h_kv, g, d))  # [n_k, h_kv, g, d], stride 0 over g
    v = np.broadcast_to(v, (n_k, h_kv, g, v.shape[-1]))  # [n_k, h_kv, g, d_v]
    scale = 1.0 / np.sqrt(d) if scale is None else scale
    q_pos = np.arange(n_k - n_q, n_k) if q_pos is None else np.asarray(q_pos)
    k_pos = np.arange(n_k) if k_pos is None else np.asarray(k_pos)
    s = np.einsum("qhid,khid->hiqk", q, k).reshape(h_q, n_q, n_k) * dtype(scale)  # [h_q, n_q, n_k]
    if softcap:
        s = dtype(softcap) * np.tanh(s / dtype(softcap))
    dist = np.abs(q_pos[:, None].astype(np.int64) - k_pos[None, :].astype(np.int64))  # [n_q, n_k]
    if alibi_slopes is not None:
        s = s - np.asarray(alibi_slopes).astype(dtype)[:, None, None] * dist[None].astype(dtype)
    rel = q_pos[:, None].astype(np.int64) - k_pos[None, :].astype(np.int64)  # q_pos - k_pos
    ok = np.ones((n_q, n_k), dtype=bool)
    if causal:
        ok &= rel >= 0
    if window is not None:
        left, right = window
        if left is not None:
            ok &= rel <= left
        if right is not None:
            ok &= -rel <= right
    s = np.where(ok[None], s, -np.inf)
    m = s.max(axis=-1, initial=-np.inf)  # [h_q, n_q]
    seen = np.isfinite(m)
    m0 = np.where(seen, m, 0)
    p = np.exp(s - m0[..., None])
    l = p.sum(axis=-1)
    p4 = p.reshape(h_kv, g, n_q, n_k)  # [h_kv, g, n_q, n_k]
    out = np.einsum("hiqk,khid->qhid", p4, v).reshape(n_q, h_q, -1)  # [n_q, h_q, d_v]
    out = out / np.where(seen, l, 1).T[..., None]
    lse = np.where(seen, m0 + np.log(np.where(seen, l, 1)), -np.inf).T  # [n_q, h_q]
    return out, lse


def one_shot_dtype(*arrays) -> type:
    """The precision a one-shot computation of these inputs would run in."""
    return accumulation_dtype(*(a.dtype for a in arrays)).type


def assert_close_to_reference(out, lse, q, k, v, factor: float = 2.0, **opts) -> None:
    """Assert ``out, lse`` are within ``factor`` x the one-shot error of the float64 reference.

    Inputs are used as given (already rounded to their dtype) by both the
    reference and the one-shot baseline, so only the arithmetic differs.
    """
    dt = one_shot_dtype(q, k, v)
    # Ground truth one step wider than the one-shot: float64 for float32 work,
    # x87 extended precision (np.longdouble) for float64 work.
    truth = np.longdouble if dt is np.float64 else np.float64
    ref_out, ref_lse = reference(q, k, v, dtype=truth, **opts)
    base_out, base_lse = reference(q, k, v, dtype=dt, **opts)
    eps = np.finfo(dt).eps
    vmax = float(np.max(np.abs(np.asarray(v, dtype=np.float64)), initial=1.0))
    # Floor: a few ulps of the output's scale, for cases where the one-shot
    # computation happens to be exact (one key, ties, zeros).
    out_floor = 4 * eps * max(vmax, 1.0)
    err_out = np.max(np.abs(out.astype(truth) - ref_out), initial=0.0)
    base_err_out = np.max(np.abs(base_out.astype(truth) - ref_out), initial=0.0)
    assert err_out <= factor * base_err_out + out_floor, (
        f"out error {err_out:.3g} > {factor} x one-shot error {base_err_out:.3g} + {out_floor:.3g}"
    )
    assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse)), "lse -inf rows differ from the reference"
    fin = np.isfinite(ref_lse)
    if fin.any():
        lse_floor = 4 * eps * max(float(np.max(np.abs(ref_lse[fin].astype(np.float64)))), 1.0)
        err_lse = np.max(np.abs(lse[fin].astype(truth) - ref_lse[fin]))
        base_err_lse = np.max(np.abs(base_lse[fin].astype(truth) - ref_lse[fin]))
        assert err_lse <= factor * base_err_lse + lse_floor, (
            f"lse error {err_lse:.3g} > {factor} x one-shot error {base_err_lse:.3g} + {lse_floor:.3g}"
        )
    assert np.all(out[~np.isfinite(lse)] == 0), "fully masked rows must give out = 0"


def contract_layout(view) -> tuple[np.ndarray, np.ndarray]:
    """The keys and values of a ``StreamingView`` (or of a ``ShardView``'s parts, in order) back in the
    contract layout (copies): ``k [n_k, h_kv, d]``, ``v [n_k, h_kv, d_v]``."""
    parts = getattr(view, "parts", (view,))
    return (np.concatenate([p.kt.transpose(2, 0, 1) for p in parts]),
            np.concatenate([p.v.transpose(1, 0, 2) for p in parts]))
