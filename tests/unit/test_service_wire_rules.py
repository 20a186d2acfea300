"""The rules of a request body: limits, required tensors, and options from JSON values and URL
query text, checked into one typed RequestOptions."""

from __future__ import annotations

import pytest
from expect import given_options, service_error
from hypothesis import given, settings
from hypothesis import strategies as st

from service.core.errors import ServiceError
from service.wire.rules import (
    ATTENTION,
    CONTEXT_APPEND,
    CONTEXT_CREATE,
    Limits,
    check_options,
    check_present,
    parse_query_options,
    show,
)
from workers.options import AttentionOptions

# -- limits ----------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_limits_must_be_positive_ints(bad):
    with pytest.raises(ValueError, match="max_dims must be an int >= 1"):
        Limits(max_dims=bad)


def test_limits_travel_as_json_and_come_back_the_same():
    limits = Limits(max_body_bytes=4096, max_replicas=3)
    doc = limits.to_json()
    assert doc["max_body_bytes"] == 4096 and doc["max_elements"] == 2**28 and len(doc) == 11
    assert Limits.from_json(doc) == limits
    # A newer server's extra limits are ignored; ones it does not send keep their defaults.
    assert Limits.from_json({"max_body_bytes": 4096, "max_new_thing": 1}) == Limits(max_body_bytes=4096)
    with pytest.raises(ValueError, match="max_body_bytes must be an int >= 1"):
        Limits.from_json({"max_body_bytes": "4096"})


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


# -- options from JSON values ------------------------------------------------------------------

def test_check_options_normalises_and_drops_nulls_and_a_zero_softcap():
    opts = check_options({"scale": 1, "causal": False, "window": [3, None], "softcap": 0, "contexts": None},
                         ATTENTION, Limits())
    a = opts.attention
    assert (a.scale, a.causal, a.window, a.softcap, opts.contexts) == (1.0, False, (3, None), None, ())
    assert type(a.scale) is float


@pytest.mark.parametrize("raw, fragments", [
    ({"scale": True}, ["scale must be a number", "got true"]),
    ({"scale": "0.125"}, ["scale must be a number", 'got "0.125"']),
    ({"scale": 0}, ["scale must be a finite number > 0", "got 0"]),
    ({"scale": float("nan")}, ["scale must be a finite number", "nan"]),
    ({"softcap": -1.0}, ["softcap must be a finite number >= 0"]),
    ({"causal": 0}, ["causal must be true or false", "got 0"]),
    ({"causal": "true"}, ["causal must be true or false", 'got "true"']),
    ({"window": [1.0, None]}, ["window must be [left, right]", "got [1.0, null]"]),
    ({"window": [True, None]}, ["window must be [left, right]"]),
    ({"window": [1]}, ["window must be [left, right]"]),
    ({"window": "128,"}, ["window must be [left, right]"]),
    ({"window": [-1, 0]}, ["window must be [left, right], each null or an int in [0, 2**62]", "got [-1, 0]"]),
    ({"window": [-1, None]}, ["got [-1, null]"]),  # the client's JSON, not Python's None
    ({"window": [None, 2**62 + 1]}, ["got [null, 4611686018427387905]"]),
    ({"window": [0, 2**63]}, ["window must be [left, right]"]),
    ({"window": [0, 10**4000]}, ["window must be [left, right]", "..."]),
    ({"contexts": "abc"}, ["contexts must be a list of 1 to 64 ids", 'got "abc"']),
    ({"contexts": []}, ["contexts must be a list of 1 to 64 ids"]),
    ({"contexts": ["a", 1]}, ["contexts[1] must be an id", "got 1"]),
    ({"contexts": ["a,b"]}, ["contexts[0] must be an id", 'got "a,b"']),
    ({"contexts": ["x" * 129]}, ["contexts[0] must be an id of 1 to 128 characters"]),
    ({"contexts": ["a", "a"]}, ["contexts must not repeat an id", 'got "a" twice']),
    ({"contexts": [str(i) for i in range(65)]}, ["contexts must be a list of 1 to 64 ids"]),
    ({"replicas": 1}, ["replicas is not an option of attention requests"]),
])
def test_attention_options_are_strictly_typed_and_name_the_field(raw, fragments):
    with service_error("invalid_option", *fragments):
        check_options(raw, ATTENTION, Limits())


@pytest.mark.parametrize("raw, fragments", [
    ({"replicas": 0}, ["replicas must be an int in [1, 8]", "got 0"]),
    ({"replicas": 9}, ["replicas must be an int in [1, 8]", "got 9"]),
    ({"replicas": 2.0}, ["replicas must be an int", "got 2.0"]),
    ({"shards": True}, ["shards must be an int", "got true"]),
    ({"shards": "2"}, ["shards must be an int", 'got "2"']),
    ({"shards": 1025}, ["shards must be an int in [1, 1024]", "got 1025"]),
    ({"causal": True}, ["causal is not an option of context requests"]),
    ({"expected_length": 0}, ["expected_length must be an int in [1, 2**62]", "got 0"]),
    ({"expected_length": 2**62 + 1}, ["expected_length must be an int in [1, 2**62]"]),
    ({"expected_length": True}, ["expected_length must be an int", "got true"]),
    ({"expected_length": 4096.0}, ["expected_length must be an int", "got 4096.0"]),
    ({"after": 0}, ["after is not an option of context requests"]),
])
def test_context_options_are_positive_bounded_ints(raw, fragments):
    with service_error("invalid_option", *fragments):
        check_options(raw, CONTEXT_CREATE, Limits())


@pytest.mark.parametrize("raw, fragments", [
    ({"after": -1}, ["after must be an int in [0, 2**62]", "got -1"]),
    ({"after": "4096"}, ["after must be an int in [0, 2**62]", 'got "4096"']),
    ({"after": False}, ["after must be an int", "got false"]),
    ({"expected_length": 10}, ["expected_length is not an option of append requests"]),
])
def test_append_options_are_a_key_count(raw, fragments):
    with service_error("invalid_option", *fragments):
        check_options(raw, CONTEXT_APPEND, Limits())


def test_context_options_take_key_counts_up_to_2_62():
    assert check_options({"expected_length": 2**62}, CONTEXT_CREATE).expected_length == 2**62
    assert check_options({"after": 0}, CONTEXT_APPEND).after == 0


def test_an_unknown_option_is_rejected_even_when_null():
    with service_error("invalid_option", "replicas is not an option of append requests"):
        check_options({"replicas": None}, CONTEXT_APPEND, Limits())


def test_check_options_builds_the_library_options_with_the_slopes():
    opts = check_options({"scale": 0.5, "causal": True, "window": [4, None]}, ATTENTION, alibi_slopes=[0.5]).attention
    assert isinstance(opts, AttentionOptions)
    assert (opts.scale, opts.causal, opts.window, opts.softcap, opts.right) == (0.5, True, (4, None), None, 0)
    assert opts.alibi_slopes == [0.5]


# -- options as URL query parameters ---------------------------------------------------------

@pytest.mark.parametrize("params, expected", [
    ({}, {}),
    ({"scale": "0.125"}, {"scale": 0.125}),
    ({"scale": "1e-3"}, {"scale": 0.001}),
    ({"scale": "2"}, {"scale": 2.0}),
    ({"causal": "true"}, {"causal": True}),
    ({"causal": "false"}, {}),
    ({"softcap": "30"}, {"softcap": 30.0}),
    ({"softcap": "0"}, {}),
    ({"window": "128,"}, {"window": (128, None)}),
    ({"window": "128,0"}, {"window": (128, 0)}),
    ({"window": ",0"}, {"window": (None, 0)}),
    ({"window": ","}, {"window": (None, None)}),
    ({"contexts": "ID1,ID2"}, {"contexts": ("ID1", "ID2")}),
    ({"contexts": "ctx_0.a~b-c"}, {"contexts": ("ctx_0.a~b-c",)}),
])
def test_query_options_parse_the_documented_syntax(params, expected):
    assert given_options(parse_query_options(params)) == expected


@pytest.mark.parametrize("params, fragments", [
    ({"causal": "1"}, ["causal must be true or false", 'got "1"']),
    ({"causal": "0"}, ["causal must be true or false"]),
    ({"causal": "True"}, ["causal must be true or false", 'got "True"']),
    ({"causal": ""}, ["causal must be true or false", 'got ""']),
    ({"scale": "nan"}, ["scale must be a number", 'got "nan"']),
    ({"scale": "inf"}, ["scale must be a number"]),
    ({"scale": "0x10"}, ["scale must be a number"]),
    ({"scale": " 1"}, ["scale must be a number"]),
    ({"scale": "1_000"}, ["scale must be a number"]),
    ({"scale": ".5"}, ["scale must be a number"]),
    ({"scale": ""}, ["scale must be a number"]),
    ({"scale": "1e999"}, ["scale must be a finite number"]),
    ({"scale": "-1"}, ["scale must be a finite number > 0", "got -1.0"]),
    ({"softcap": "-30"}, ["softcap must be a finite number >= 0"]),
    ({"window": "128"}, ["window must be LEFT,RIGHT", 'got "128"']),
    ({"window": "1,2,3"}, ["window must be LEFT,RIGHT"]),
    ({"window": "-1,0"}, ["window must be LEFT,RIGHT", 'got "-1,0"']),
    ({"window": "1.5,"}, ["window must be LEFT,RIGHT"]),
    ({"window": "01,"}, ["window must be LEFT,RIGHT"]),
    ({"window": "a,b"}, ["window must be LEFT,RIGHT"]),
    ({"window": "9" * 22 + ","}, ["window must be LEFT,RIGHT"]),
    ({"window": str(2**63) + ","}, ["window must be [left, right], each null or an int in [0, 2**62]"]),
    ({"contexts": ""}, ["contexts[0] must be an id", 'got ""']),
    ({"contexts": "a,,b"}, ["contexts[1] must be an id"]),
    ({"contexts": "a,a"}, ["contexts must not repeat an id"]),
    ({"contexts": "a b"}, ["contexts[0] must be an id", 'got "a b"']),
    ({"q_pos": "1,2"}, ["query parameters of attention requests must be among", 'got "q_pos"']),
    ({"Causal": "true"}, ['got "Causal"']),
])
def test_query_options_reject_bad_values_naming_parameter_and_value(params, fragments):
    with service_error("invalid_option", *fragments):
        parse_query_options(params)


@pytest.mark.parametrize("params, fragments", [
    ({"replicas": "0"}, ["replicas must be an int >= 1", 'got "0"']),
    ({"replicas": "01"}, ["replicas must be an int >= 1"]),
    ({"replicas": "1.0"}, ["replicas must be an int >= 1"]),
    ({"replicas": "-1"}, ["replicas must be an int >= 1"]),
    ({"shards": "99999999999"}, ["shards must be an int >= 1"]),
    ({"shards": "2000"}, ["shards must be an int in [1, 1024]", "got 2000"]),
    ({"contexts": "a"}, ["query parameters of context requests must be among"]),
])
def test_query_options_of_context_requests_are_bounded_counts(params, fragments):
    with service_error("invalid_option", *fragments):
        parse_query_options(params, CONTEXT_CREATE)


def test_query_options_of_context_requests_parse_counts():
    assert given_options(parse_query_options({"replicas": "2", "shards": "16"}, CONTEXT_CREATE)) == \
        {"replicas": 2, "shards": 16}
    assert given_options(parse_query_options({"expected_length": "1048576"}, CONTEXT_CREATE)) == \
        {"expected_length": 1048576}
    assert given_options(parse_query_options({"after": "0"}, CONTEXT_APPEND)) == {"after": 0}
    assert given_options(parse_query_options({"after": "8192"}, CONTEXT_APPEND)) == {"after": 8192}


@pytest.mark.parametrize("params, kind, fragments", [
    ({"expected_length": "0"}, CONTEXT_CREATE, ["expected_length must be an int in [1, 2**62]", "got 0"]),
    ({"expected_length": "01"}, CONTEXT_CREATE, ["expected_length must be an int >= 1 in decimal", 'got "01"']),
    ({"expected_length": "1e6"}, CONTEXT_CREATE, ["expected_length must be an int >= 1 in decimal"]),
    ({"expected_length": "9" * 20}, CONTEXT_CREATE, ["expected_length must be an int >= 1 in decimal"]),
    ({"expected_length": str(2**62 + 1)}, CONTEXT_CREATE, ["expected_length must be an int in [1, 2**62]"]),
    ({"after": "-1"}, CONTEXT_APPEND, ["after must be an int >= 0 in decimal", 'got "-1"']),
    ({"after": ""}, CONTEXT_APPEND, ["after must be an int >= 0 in decimal", 'got ""']),
    ({"after": "1"}, CONTEXT_CREATE, ["query parameters of context requests must be among", 'got "after"']),
])
def test_query_key_counts_are_decimal_ints_in_range(params, kind, fragments):
    with service_error("invalid_option", *fragments):
        parse_query_options(params, kind)


class MultiDict:
    """Stands in for Starlette's QueryParams, which keeps repeated keys in ``multi_items``."""

    def __init__(self, items):
        self.items = items

    def multi_items(self):
        return list(self.items)


@pytest.mark.parametrize("params", [
    [("causal", "true"), ("causal", "false")],
    MultiDict([("causal", "true"), ("causal", "true")]),
])
def test_a_repeated_query_parameter_is_rejected(params):
    with service_error("invalid_option", "causal must be given once"):
        parse_query_options(params)


def test_query_options_accept_a_list_of_pairs():
    assert given_options(parse_query_options([("scale", "0.5"), ("window", "2,")])) == {"scale": 0.5, "window": (2, None)}


def test_an_option_too_long_to_print_is_named_by_type():
    with service_error("invalid_option", "scale must be a number, got a list"):
        check_options({"scale": [10**5000]}, ATTENTION, Limits())


def test_the_replica_bound_is_the_settings_one():
    with service_error("invalid_option", "replicas must be an int in [1, 3]"):
        check_options({"replicas": 4}, CONTEXT_CREATE, Limits(max_replicas=3))


@pytest.mark.parametrize("name", ["scale", "softcap"])
def test_an_int_option_beyond_float64_is_422(name):
    with service_error("invalid_option", f"{name} must be a finite number, got 1000"):
        check_options({name: 10**400}, ATTENTION, Limits())


QUERY_NAMES = st.sampled_from(["scale", "causal", "window", "softcap", "contexts", "replicas", "shards",
                               "expected_length", "after", "x"])
QUERY_TEXT = st.text(alphabet="0123456789,.-+eE_ abtrufalsnixNI", max_size=12)


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(QUERY_NAMES, QUERY_TEXT), max_size=4),
       st.sampled_from([ATTENTION, CONTEXT_CREATE, CONTEXT_APPEND]))
def test_random_query_parameters_only_ever_raise_service_error(pairs, kind):
    try:
        parse_query_options(pairs, kind)
    except ServiceError as err:
        assert err.code == "invalid_option"
