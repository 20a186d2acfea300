"""Limits, the named tensors and body kinds: which tensors a request must carry."""

from __future__ import annotations

import pytest
from expect import service_error

from service.wire.rules import ATTENTION, CONTEXT_APPEND, CONTEXT_CREATE, Limits, check_present, show

# -- limits ----------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_limits_must_be_positive_ints(bad):
    with pytest.raises(ValueError, match="max_dims must be an int >= 1"):
        Limits(max_dims=bad)


# -- whole requests --------------------------------------------------------------------------

@pytest.mark.parametrize("names, contexts, fragments", [
    ({"k", "v"}, (), ["q is required in attention requests"]),
    ({"q", "k"}, (), ["v must be given with k, got k alone"]),
    ({"q", "v"}, ("a",), ["k must be given with v, got v alone"]),
    ({"q"}, (), ["k and v must be given when no contexts are"]),
])
def test_attention_requests_need_q_and_keys(names, contexts, fragments):
    with service_error("invalid_tensor", *fragments):
        check_present(names, contexts, ATTENTION)


@pytest.mark.parametrize("names, contexts", [({"q", "k", "v"}, ()), ({"q"}, ("a",))])
def test_attention_requests_with_inline_keys_or_contexts_pass(names, contexts):
    check_present(names, contexts, ATTENTION)


@pytest.mark.parametrize("kind", [CONTEXT_CREATE, CONTEXT_APPEND])
def test_context_requests_need_k_and_v(kind):
    with service_error("invalid_tensor", "v is required"):
        check_present({"k"}, (), kind)


def test_values_too_long_to_print_are_shown_by_type():
    assert show([10**5000]) == "a list"
    assert show("x" * 100).endswith('...') and len(show("x" * 100)) == 60


