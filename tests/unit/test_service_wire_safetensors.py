"""safetensors bodies: round trips, agreement with the reference package, every malformed header."""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from expect import given_options
from expect import service_error as api_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.core.errors import ServiceError
from service.wire.rules import ATTENTION, CONTEXT_CREATE, Limits
from service.wire.safetensors import (
    MEMO_HEADER_BYTES,
    MEMO_HEADERS,
    MEMO_TENSORS,
    _header_text,
    _memo_header,
    decode_binary_request,
    decode_safetensors,
    encode_safetensors,
    header_span,
    peek_safetensors_header,
    to_bytes,
)

NAMES = {"a", "b", "c", "d", "e", "f", "x"}
NUMPY_DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]
ALL_DTYPES = [*NUMPY_DTYPES, ml_dtypes.bfloat16]


def sample(dtype, shape, rng) -> np.ndarray:
    return np.asarray(rng.standard_normal(shape) * 100).astype(dtype)


def raw(header, data: bytes = b"", length: int | None = None) -> bytes:
    """A hand-made body: the length field, a header (object -> compact JSON, or raw bytes), the data."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(text) if length is None else length) + text + data


def entry(dtype: str, shape: list, begin: int, end: int) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def equal(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# -- round trips -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3), (2, 0, 4), (3, 2, 5)])
def test_every_dtype_and_shape_round_trips_bit_exactly(dtype, shape, rng):
    x = sample(dtype, shape, rng)
    back = decode_safetensors(to_bytes(encode_safetensors({"x": x})), {"x"})
    assert equal(back["x"], x)


def test_bfloat16_travels_as_the_top_16_bits_of_float32(rng):
    f32 = sample(np.float32, (4, 3), rng).astype(ml_dtypes.bfloat16).astype(np.float32)  # exactly representable
    body = to_bytes(encode_safetensors({"x": f32.astype(ml_dtypes.bfloat16)}))
    header = peek_safetensors_header(body, len(body), Limits(), {"x"})
    assert header.tensors["x"].wire.safetensors == "BF16"
    assert body[header.data_start:] == (f32.view(np.uint32) >> 16).astype("<u2").tobytes()
    back = decode_safetensors(body, {"x"})["x"]
    assert back.dtype == ml_dtypes.bfloat16 and np.array_equal(back.astype(np.float32), f32)


def test_many_tensors_of_mixed_dtypes_round_trip_with_metadata(rng):
    tensors = {name: sample(dt, (3, 2), rng) for name, dt in zip("abcdef", ALL_DTYPES)}
    body = to_bytes(encode_safetensors(tensors, {"format": "np", "ünï": "çødé"}))
    back = decode_safetensors(body, NAMES)
    assert back.keys() == tensors.keys() and all(equal(back[n], tensors[n]) for n in tensors)
    assert peek_safetensors_header(body, len(body), Limits(), NAMES).metadata == {"format": "np", "ünï": "çødé"}


def test_encode_accepts_big_endian_and_strided_arrays(rng):
    x = sample(np.float64, (4, 6), rng)
    tensors = {"a": x.astype(">f8"), "b": x[:, ::2], "c": x.T}
    back = decode_safetensors(to_bytes(encode_safetensors(tensors)), NAMES)
    assert np.array_equal(back["a"], x) and np.array_equal(back["b"], x[:, ::2]) and np.array_equal(back["c"], x.T)
    assert all(a.dtype.isnative for a in back.values())


def test_encode_returns_separate_buffers_with_a_space_padded_8_byte_aligned_header(rng):
    tensors = {"a": sample(np.float16, (3,), rng), "b": sample(np.float64, (2,), rng), "c": np.zeros(0, np.int32)}
    buffers = encode_safetensors(tensors)
    (n,) = struct.unpack("<Q", buffers[0])
    assert len(buffers) == 4 and n == len(buffers[1]) and n % 8 == 0  # the empty tensor sends no buffer
    assert buffers[1].rstrip(b" ") == json.dumps(json.loads(buffers[1]), separators=(",", ":")).encode()
    assert to_bytes(buffers) == b"".join(bytes(b) for b in buffers)


def test_encoded_tensors_start_aligned_to_their_item_size(rng):
    tensors = {name: sample(dt, (3,), rng) for name, dt in zip("abcdef", ALL_DTYPES)}
    body = to_bytes(encode_safetensors(tensors))
    header = peek_safetensors_header(body, len(body), Limits(), NAMES)
    for name, info in header.tensors.items():
        assert (header.data_start + info.begin) % tensors[name].dtype.itemsize == 0, name


def test_decode_returns_zero_copy_views_of_the_body(rng):
    body = bytearray(to_bytes(encode_safetensors({"x": np.zeros(4, np.float32)})))
    x = decode_safetensors(body, {"x"})["x"]
    struct.pack_into("<f", body, len(body) - 4, 2.5)
    assert x[-1] == 2.5
    assert not decode_safetensors(bytes(body), {"x"})["x"].flags.writeable


@pytest.mark.parametrize("bad, message", [
    ({"x": np.zeros(2, np.uint8)}, "x dtype must be float16, bfloat16"),
    ({"x": np.zeros(2, np.complex64)}, "x dtype must be"),
    ({"__metadata__": np.zeros(2)}, "tensor names must be non-empty strings"),
    ({"": np.zeros(2)}, "tensor names must be non-empty strings"),
])
def test_encode_rejects_what_safetensors_cannot_carry(bad, message):
    with pytest.raises(ValueError, match=message):
        encode_safetensors(bad)


def test_encode_takes_only_numpy_arrays():
    with pytest.raises(TypeError, match="x must be a numpy array, got list"):
        encode_safetensors({"x": [1.0]})


def test_encode_rejects_metadata_that_is_not_string_to_string():
    with pytest.raises(ValueError, match="metadata must map strings to strings"):
        encode_safetensors({"x": np.zeros(1)}, {"n": 1})


# -- the reference implementation ------------------------------------------------------------

@pytest.mark.parametrize("metadata", [None, {"k": "v"}])
def test_encode_is_byte_identical_to_the_reference_writer(metadata, rng):
    tensors = {name: sample(dt, (2, 3), rng) for name, dt in zip("abcde", NUMPY_DTYPES)}
    tensors["f"] = np.zeros((0, 3), np.float32)
    assert to_bytes(encode_safetensors(tensors, metadata)) == safetensors.numpy.save(tensors, metadata=metadata)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=lambda d: np.dtype(d).name)
def test_the_reference_reads_what_we_write(dtype, rng):
    tensors = {"a": sample(dtype, (3, 4), rng), "b": sample(dtype, (5,), rng)}
    back = safetensors.numpy.load(to_bytes(encode_safetensors(tensors)))
    assert back.keys() == tensors.keys() and all(equal(back[n], tensors[n]) for n in tensors)


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=lambda d: np.dtype(d).name)
def test_we_read_what_the_reference_writes(dtype, rng):
    tensors = {"a": sample(dtype, (3, 4), rng), "x": sample(dtype, (2, 1, 2), rng), "c": np.zeros((0,), dtype)}
    back = decode_safetensors(safetensors.numpy.save(tensors, metadata={"m": "1"}), NAMES)
    assert back.keys() == tensors.keys() and all(equal(back[n], tensors[n]) for n in tensors)


# -- peeking at the header -------------------------------------------------------------------

def test_the_header_is_checked_from_its_own_bytes_before_the_data_arrives(rng):
    body = to_bytes(encode_safetensors({"q": sample(np.float32, (2, 4, 8), rng)}))
    span = header_span(body[:8], len(body), Limits())
    header = peek_safetensors_header(body[:span], len(body), Limits(), {"q"})
    assert header.data_start == span and header.body_len == len(body)
    assert header.tensors["q"].shape == (2, 4, 8) and header.tensors["q"].count == 64
    with api_error("invalid_body", "must belong to a tensor, got trailing bytes"):
        peek_safetensors_header(body[:span], len(body) + 4, Limits(), {"q"})


def test_peeking_without_the_whole_header_is_a_caller_error(rng):
    body = to_bytes(encode_safetensors({"q": sample(np.float32, (1, 1, 1), rng)}))
    with pytest.raises(ValueError, match="prefix must hold the first"):
        peek_safetensors_header(body[:20], len(body), Limits(), {"q"})
    with pytest.raises(ValueError, match="prefix must hold the first 8 bytes"):
        header_span(body[:4], len(body), Limits())


# -- malformed bodies ------------------------------------------------------------------------

F32_8 = entry("F32", [2], 0, 8)


@pytest.mark.parametrize("body, fragments", [
    (b"", ["must start with an 8-byte header length, got 0 bytes"]),
    (b"\x01\x00\x00", ["got 3 bytes"]),
    (raw(b"{}", length=100), ["header length must be at most the 2 bytes after it, got 100"]),
    (raw(b"{}", length=2**64 - 1), ["header length must be at most"]),
    (raw(b'{"x": '), ["safetensors header must be valid JSON"]),
    (raw(b""), ["safetensors header must be valid JSON"]),
    (raw(b"\xff\xfe{}"), ["safetensors header must be UTF-8, got byte 0xff at 0"]),
    (raw(b"[" * 100_000), ["nested too deeply"]),
    (raw(b'{"x": {"dtype": "F32", "shape": [1e999999]}}'), ["x must be an object with keys"]),
    (raw(b"[]"), ["safetensors header must be a JSON object, got []"]),
    (raw(b'{"x": 1, "x": 2}'), ["must not repeat a key, got \"x\" twice"]),
    (raw({"x": 3}), ["x must be an object with keys dtype, shape, data_offsets, got 3"]),
    (raw({"x": {"dtype": "F32", "shape": [2]}}, bytes(8)), ["x must be an object with keys"]),
    (raw({"x": dict(F32_8, extra=1)}, bytes(8)), ["x must be an object with keys"]),
    (raw({"x": entry("F32", [-2], 0, 8)}, bytes(8)), ["x shape must be a list of ints >= 0, got [-2]"]),
    (raw({"x": entry("F32", [2.0], 0, 8)}, bytes(8)), ["x shape must be a list of ints >= 0, got [2.0]"]),
    (raw({"x": entry("F32", [True], 0, 4)}, bytes(4)), ["x shape must be a list of ints >= 0, got [true]"]),
    (raw({"x": entry("F32", "2", 0, 8)}, bytes(8)), ["x shape must be a list"]),
    (raw({"x": entry("F32", [2**62, 2**62, 2**62], 0, 8)}, bytes(8)), ["x data_offsets must span"]),
    (raw({"x": entry("F32", [3], 0, 8)}, bytes(8)), ["x data_offsets must span prod(shape) * itemsize = 12 bytes"]),
    (raw({"x": entry("F32", [2], 8, 0)}, bytes(8)), ["x data_offsets must be [begin, end] with 0 <= begin <= end"]),
    (raw({"x": entry("F32", [2], -8, 0)}, bytes(8)), ["x data_offsets must be [begin, end]"]),
    (raw({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0]}}, bytes(8)), ["x data_offsets must be"]),
    (raw({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0.0, 8]}}, bytes(8)), ["x data_offsets must be"]),
    (raw({"x": entry("F32", [2], 4, 12)}, bytes(12)), ["data bytes [0, 4) must belong to a tensor, got a gap"]),
    (raw({"x": F32_8}, bytes(4)), ["x data_offsets must end within the 4 data bytes, got [0, 8]"]),
    (raw({"x": F32_8}, bytes(12)), ["data bytes [8, 12) must belong to a tensor, got trailing bytes"]),
    (raw({"a": F32_8, "b": entry("F32", [2], 4, 12)}, bytes(12)), ["b data_offsets must not overlap a"]),
    (raw({"a": F32_8, "b": F32_8}, bytes(8)), ["b data_offsets must not overlap a"]),
    (raw({"a": F32_8, "b": entry("F32", [2], 12, 20)}, bytes(20)), ["data bytes [8, 12) must belong to a tensor"]),
    (raw({"a": F32_8, "b": entry("F32", [0], 4, 4)}, bytes(8)), ["b data_offsets must not overlap a"]),
    (raw({"__metadata__": {"n": 1}}), ['__metadata__ must map strings to strings, got {"n": 1}']),
    (raw({"__metadata__": ["a"]}), ["__metadata__ must map strings to strings"]),
])
def test_a_malformed_body_is_400_naming_what_is_wrong(body, fragments):
    with api_error("invalid_body", *fragments):
        decode_safetensors(body, NAMES)


@pytest.mark.parametrize("body, allowed, fragments", [
    (raw({"y": F32_8}, bytes(8)), NAMES, ["tensor names must be among a, b, c, d, e, f, x, got \"y\""]),
    (raw({"q": entry("F32", [1, 1, 2], 0, 8), "o": F32_8}, bytes(16)), ATTENTION.tensors, ['got "o"']),
    (raw({"x": entry("U8", [8], 0, 8)}, bytes(8)), NAMES,
     ['x dtype must be one of BF16, F16, F32, F64, I32, I64, got "U8"']),
    (raw({"x": entry("BOOL", [8], 0, 8)}, bytes(8)), NAMES, ['x dtype must be one of', 'got "BOOL"']),
    (raw({"x": entry(["F32"], [2], 0, 8)}, bytes(8)), NAMES, ['x dtype must be one of', 'got ["F32"]']),
    (raw({"x": entry("F32", [1, 1, 1, 2], 0, 8)}, bytes(8)), NAMES, ["x must have at most 3 dims, got shape [1, 1, 1"]),
    (raw({"x": entry("F32", [1] * 100_000, 0, 4)}, bytes(4)), NAMES, ["x must have at most 3 dims"]),
    (raw({"q": F32_8}, bytes(8)), ATTENTION.tensors, ["q must be [n_q, h_q, d] (3 dims), got shape [2]"]),
    (raw({"k_pos": entry("I64", [1, 1], 0, 8)}, bytes(8)), ATTENTION.tensors, ["k_pos must be [n_k] (1 dims)"]),
    (raw({"q_pos": F32_8}, bytes(8)), ATTENTION.tensors, ["q_pos dtype must be I32 or I64, got F32"]),
    # a dtype the service takes for no tensor, given to a tensor of known kind: that tensor's choices
    (raw({"q_pos": entry("U64", [1], 0, 8)}, bytes(8)), ATTENTION.tensors, ['q_pos dtype must be I32 or I64, got "U64"']),
    (raw({"q": entry("F8_E4M3", [1, 1, 8], 0, 8)}, bytes(8)), ATTENTION.tensors,
     ['q dtype must be F16, BF16, F32 or F64, got "F8_E4M3"']),
    (raw({"v": entry("I32", [1, 1, 2], 0, 8)}, bytes(8)), ATTENTION.tensors,
     ["v dtype must be F16, BF16, F32 or F64, got I32"]),
])
def test_a_well_formed_body_with_a_tensor_we_do_not_take_is_422_naming_it(body, allowed, fragments):
    with api_error("invalid_tensor", *fragments):
        decode_safetensors(body, allowed)


def test_sizes_over_the_limits_are_413():
    body = raw({"x": entry("F32", [4], 0, 16)}, bytes(16))
    with api_error("body_too_large", "x must have at most 3 elements, got 4"):
        decode_safetensors(body, NAMES, Limits(max_elements=3))
    with api_error("body_too_large", "safetensors header must be at most 16 bytes, got"):
        decode_safetensors(body, NAMES, Limits(max_header_bytes=16))
    with api_error("body_too_large", f"body must be at most 40 bytes, got {len(body)}"):
        decode_safetensors(body, NAMES, Limits(max_body_bytes=40))


def test_empty_header_and_data_is_a_valid_empty_body():
    assert decode_safetensors(raw({}), NAMES) == {}
    assert decode_safetensors(raw(b"{}      "), NAMES) == {}


# -- headers checked once ---------------------------------------------------------------------

def test_a_repeated_header_is_checked_once_and_decodes_each_body_of_its_own(rng):
    a, b = sample(np.float32, (1, 4, 8), rng), sample(np.float32, (1, 4, 8), rng)
    body_a, body_b = to_bytes(encode_safetensors({"q": a})), to_bytes(encode_safetensors({"q": b}))
    assert body_a[:header_span(body_a[:8], len(body_a), Limits())] == body_b[:header_span(body_b[:8], len(body_b), Limits())]
    decode_safetensors(body_a, {"q"})
    hits = _memo_header.cache_info().hits
    back = decode_safetensors(body_b, {"q"})
    assert _memo_header.cache_info().hits == hits + 1
    assert equal(back["q"], b)  # the same header, this body's values


def test_a_remembered_header_is_read_only(rng):
    body = to_bytes(encode_safetensors({"q": sample(np.float32, (1, 2, 4), rng)}, {"m": "1"}))
    header = peek_safetensors_header(body, len(body), Limits(), {"q"})
    with pytest.raises(TypeError):
        header.tensors["k"] = header.tensors["q"]  # type: ignore[index]
    with pytest.raises(TypeError):
        header.metadata["m"] = "2"  # type: ignore[index]
    assert peek_safetensors_header(body, len(body), Limits(), {"q"}).tensors.keys() == {"q"}


def test_a_header_that_passed_is_checked_again_for_another_length_names_or_limits(rng):
    body = to_bytes(encode_safetensors({"q": sample(np.float32, (2, 4, 8), rng)}))
    decode_safetensors(body, {"q"})  # remembered as good for this length, these names and limits
    with api_error("invalid_body", "must belong to a tensor, got trailing bytes"):
        decode_safetensors(body + bytes(8), {"q"})
    with api_error("invalid_tensor", "tensor names must be among"):
        decode_safetensors(body, {"k"})
    with api_error("body_too_large", "q must have at most 63 elements, got 64"):
        decode_safetensors(body, {"q"}, Limits(max_elements=63))
    assert decode_safetensors(body, {"q"})["q"].shape == (2, 4, 8)


def test_a_header_that_failed_fails_every_time_and_is_not_remembered():
    body = raw({"x": entry("F32", [4], 0, 12)}, bytes(12))
    size = _memo_header.cache_info().currsize
    for _ in range(2):
        with api_error("invalid_body", "x data_offsets must span prod(shape) * itemsize = 16 bytes"):
            decode_safetensors(body, NAMES)
    assert _memo_header.cache_info().currsize <= size  # nothing added (others may have been dropped)


def test_a_header_over_the_memo_bound_is_checked_every_time_and_not_remembered(rng):
    metadata = {"pad": "x" * MEMO_HEADER_BYTES}
    body = to_bytes(encode_safetensors({"x": sample(np.float32, (3,), rng)}, metadata))
    misses = _memo_header.cache_info().misses
    for _ in range(2):
        assert dict(peek_safetensors_header(body, len(body), Limits(), NAMES).metadata) == metadata
    assert _memo_header.cache_info().misses == misses


def test_the_memo_of_headers_stays_bounded(rng):
    for n in range(MEMO_HEADERS + 20):
        decode_safetensors(to_bytes(encode_safetensors({"x": np.zeros(n, np.float32)})), NAMES)
    assert _memo_header.cache_info().currsize <= MEMO_HEADERS
    assert _header_text.cache_info().currsize <= MEMO_HEADERS


@pytest.mark.parametrize("count", [1, MEMO_TENSORS, MEMO_TENSORS + 1])
def test_an_encoded_header_is_the_reference_writers_whether_remembered_or_not(count, rng):
    tensors = {f"t{i}": sample(NUMPY_DTYPES[i % len(NUMPY_DTYPES)], (i % 3, 2), rng) for i in range(count)}
    for _ in range(2):  # the second from the memo (up to MEMO_TENSORS tensors)
        assert to_bytes(encode_safetensors(tensors)) == safetensors.numpy.save(tensors)


# -- fuzzing ---------------------------------------------------------------------------------

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def decodes_or_raises_service_error(body: bytes, allowed=NAMES) -> None:
    try:
        decode_safetensors(body, allowed, Limits(max_header_bytes=4096, max_elements=10_000))
    except ServiceError as err:
        assert err.status in (400, 413, 422)


@FUZZ
@given(st.binary(max_size=256))
def test_random_bytes_only_ever_raise_service_errors(body):
    decodes_or_raises_service_error(body)


@FUZZ
@given(st.integers(0, 2**64 - 1), st.binary(max_size=64))
def test_random_header_lengths_only_ever_raise_service_errors(length, rest):
    decodes_or_raises_service_error(struct.pack("<Q", length) + rest)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats()
    | st.sampled_from(["F32", "BF16", "I64", "x"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(
        ["dtype", "shape", "data_offsets", "x", "q", "__metadata__"]), inner, max_size=4),
    max_leaves=12,
)
ENTRIES = st.fixed_dictionaries({
    "dtype": st.sampled_from(["F16", "BF16", "F32", "F64", "I32", "I64", "U8"]) | JSON_VALUES,
    "shape": st.lists(st.integers(-2, 5), max_size=4) | JSON_VALUES,
    "data_offsets": st.lists(st.integers(-4, 200), min_size=2, max_size=2) | JSON_VALUES,
})


@FUZZ
@given(st.dictionaries(st.sampled_from(sorted(NAMES | {"q", "q_pos", "__metadata__"})), ENTRIES | JSON_VALUES,
                       max_size=4), st.integers(0, 200))
def test_random_headers_only_ever_raise_service_errors(header, data_len):
    body = raw(json.dumps(header).encode(), bytes(data_len))
    decodes_or_raises_service_error(body, NAMES | ATTENTION.tensors)


@FUZZ
@given(st.data())
def test_corrupting_a_valid_body_only_ever_raises_api_error(data):
    body = bytearray(safetensors.numpy.save({"a": np.arange(6, dtype=np.float32), "b": np.arange(3, dtype=np.int64)}))
    for _ in range(data.draw(st.integers(1, 4))):
        body[data.draw(st.integers(0, len(body) - 1))] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(body)))
    decodes_or_raises_service_error(bytes(body[:cut]))


# -- binary requests -------------------------------------------------------------------------

def test_a_binary_attention_request_decodes_tensors_and_query_options(rng):
    q = sample(np.float16, (2, 4, 8), rng)
    k = sample(ml_dtypes.bfloat16, (5, 2, 8), rng)
    v = sample(ml_dtypes.bfloat16, (5, 2, 3), rng)
    pos = np.arange(5, dtype=np.int32)
    body = to_bytes(encode_safetensors({"q": q, "k": k, "v": v, "k_pos": pos}))
    decoded = decode_binary_request(body, {"causal": "true", "window": "4,"})
    assert all(equal(decoded.tensors[n], x) for n, x in (("q", q), ("k", k), ("v", v), ("k_pos", pos)))
    assert given_options(decoded.options) == {"causal": True, "window": (4, None)}


def test_a_binary_request_names_a_missing_tensor(rng):
    body = to_bytes(encode_safetensors({"k": sample(np.float32, (5, 2, 8), rng)}))
    with api_error("invalid_tensor", "v is required in context requests"):
        decode_binary_request(body, {"shards": "2"}, CONTEXT_CREATE)
    with api_error("invalid_tensor", 'tensor names must be among k, k_pos, v, got "q"'):
        decode_binary_request(to_bytes(encode_safetensors({"q": np.zeros((1, 1, 1), np.float32)})), {},
                              CONTEXT_CREATE)
