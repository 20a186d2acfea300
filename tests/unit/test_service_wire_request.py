"""The typed requests: every tensor rule checked once, where a request enters."""

from __future__ import annotations

import numpy as np
import pytest
from expect import service_error

from service.wire.request import Decoded, attention_request, check_finite, context_write
from service.wire.rules import ATTENTION, CONTEXT_APPEND, CONTEXT_CREATE, RequestOptions, check_options
from workers import BFLOAT16
from workers.options import AttentionOptions


def arrays(n_q=2, h_q=4, h_kv=2, d=8, d_v=3, n_k=5, dtype=np.float32):
    rng = np.random.default_rng(0)
    return {"q": rng.standard_normal((n_q, h_q, d)).astype(dtype),
            "k": rng.standard_normal((n_k, h_kv, d)).astype(dtype),
            "v": rng.standard_normal((n_k, h_kv, d_v)).astype(dtype)}


def attention(tensors, **options) -> Decoded:
    return Decoded(tensors, check_options(options, ATTENTION, alibi_slopes=tensors.get("alibi_slopes")))


def test_an_attention_request_carries_its_arrays_positions_and_the_options_built_once():
    t = arrays()
    t["k_pos"] = np.arange(10, 15, dtype=np.int32)
    decoded = attention(t, causal=True, window=[3, None])
    req = attention_request(decoded)
    assert req.q is t["q"] and req.kv.k is t["k"] and req.kv.v is t["v"]  # no copies
    assert req.kv.k_pos.dtype == np.int64 and req.kv.k_pos.tolist() == list(range(10, 15))
    assert req.q_pos is None and req.contexts == ()
    assert req.options is decoded.options.attention and req.options.right == 0
    assert (req.n_q, req.h_q, req.d) == (2, 4, 8) and req.kv.dims.d_v == 3


def test_a_query_over_contexts_alone_has_no_inline_keys():
    req = attention_request(attention({"q": arrays()["q"]}, contexts=["ctx-a"]))
    assert req.kv is None and req.contexts == ("ctx-a",)


@pytest.mark.parametrize("change, code, fragment", [
    (lambda t: t.update(q=t["q"][0]), "invalid_tensor", "q must be [n_q, h_q, d], got shape (4, 8)"),
    (lambda t: t.update(q=t["q"].astype(np.int32)), "invalid_tensor", "q must have dtype float16"),
    (lambda t: t.update(v=t["v"][:4]), "invalid_tensor", "v must be [n_k, h_kv, d_v] with [n_k, h_kv] = [5, 2]"),
    (lambda t: t.update(k=t["k"][:, :, :4]), "invalid_tensor", "k must have head dim d = 8 as q, got 4"),
    (lambda t: t.update(q=t["q"][:, :3]), "invalid_tensor", "h_q must be a positive multiple of h_kv, got h_q = 3"),
    (lambda t: t.update(q_pos=np.arange(3)), "invalid_tensor", "q_pos must have shape [2], got (3,)"),
    (lambda t: t.update(k_pos=np.zeros(5)), "invalid_tensor", "k_pos must be an integer array, got dtype float64"),
    (lambda t: t.update(k_pos=np.array([0, 1, 2, 3, 2**61 + 1])), "invalid_tensor", "k_pos must lie within +-2**61"),
    (lambda t: t["k"].__setitem__((1, 0, 2), np.nan), "invalid_tensor", "k must be finite, got NaN or infinity"),
    (lambda t: t["q"].__setitem__((0, 0, 0), np.inf), "invalid_tensor", "q must be finite"),
    (lambda t: t.update(alibi_slopes=np.ones(3)), "invalid_tensor", "alibi_slopes must have shape [4], got (3,)"),
    (lambda t: t.update(alibi_slopes=np.array([1.0, np.nan, 1, 1])), "invalid_tensor", "alibi_slopes must be finite"),
])
def test_each_tensor_rule_is_a_4xx_naming_the_tensor(change, code, fragment):
    t = arrays()
    change(t)
    with service_error(code, fragment):
        attention_request(attention(t))


def test_alibi_slopes_are_checked_against_the_query_heads_without_inline_keys():
    t = {"q": arrays()["q"], "alibi_slopes": np.ones(5)}
    with service_error("invalid_tensor", "alibi_slopes must have shape [4], got (5,)"):
        attention_request(attention(t, contexts=["c"]))


def test_a_context_write_holds_one_dtype():
    t = arrays(dtype=np.float16)
    write = context_write(Decoded({"k": t["k"], "v": t["v"]}, check_options({"replicas": 2}, CONTEXT_CREATE)))
    assert write.replicas == 2 and write.shards is None and write.kv.k_pos is None
    with service_error("invalid_tensor", "v must have k's dtype float16, got bfloat16"):
        context_write(Decoded({"k": t["k"], "v": t["v"].astype(BFLOAT16)}, RequestOptions()))


def test_a_context_write_carries_expected_length_and_after():
    t = arrays(n_k=5)
    kv = {"k": t["k"], "v": t["v"]}
    create = context_write(Decoded(kv, check_options({"expected_length": 5}, CONTEXT_CREATE)))
    assert (create.expected_length, create.after) == (5, None)
    append = context_write(Decoded(kv, check_options({"after": 0}, CONTEXT_APPEND)))
    assert (append.expected_length, append.after) == (None, 0)


def test_expected_length_must_cover_the_keys_of_the_body():
    t = arrays(n_k=5)
    with service_error("invalid_option", "expected_length must be at least the 5 keys of this body, got 4"):
        context_write(Decoded({"k": t["k"], "v": t["v"]}, check_options({"expected_length": 4}, CONTEXT_CREATE)))


def test_finiteness_is_checked_in_chunks_and_skips_integer_tensors(monkeypatch):
    from service.wire import request

    monkeypatch.setattr(request, "FINITE_CHUNK", 7)
    x = np.zeros(100, np.float32)
    check_finite("x", x)
    x[99] = -np.inf
    with service_error("invalid_tensor", "x must be finite"):
        check_finite("x", x)
    check_finite("pos", np.arange(10))


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16, np.float32, np.float64], ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_every_float_dtype_refuses_nan_and_infinity_anywhere(monkeypatch, dtype, bad):
    from service.wire import request

    monkeypatch.setattr(request, "FINITE_CHUNK", 7)
    x = np.full(100, 65000.0, dtype=dtype)  # large, finite: not mistaken for an infinity
    x[::3] = -x[::3]
    check_finite("k", x)
    for at in (0, 50, 99):
        y = x.copy()
        y[at] = bad
        with service_error("invalid_tensor", "k must be finite"):
            check_finite("k", y)


def test_every_finite_16_bit_value_passes():
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    for dtype in (np.float16, BFLOAT16):
        values = bits.view(dtype)
        finite = values[np.isfinite(values.astype(np.float32))]
        check_finite("k", finite)
        assert len(finite) == 2**16 - (2048 if dtype == np.float16 else 256)  # exponent all ones: 2**(16-5), 2**(16-8)


def test_options_default_to_the_library_defaults():
    assert attention_request(attention(arrays())).options.__dict__ == AttentionOptions().__dict__
