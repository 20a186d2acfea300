"""Context writes over the direct channel (workers.channel): the write and streamed append frames round trip
exactly, carried bfloat16 included, and a malformed one is refused (issue 47)."""

from __future__ import annotations

import numpy as np
import pytest

from workers import channel, frames
from workers.dtypes import BFLOAT16
from workers.tasks import ShardWrite, carry


def roundtrip(buffers) -> tuple[dict, list[np.ndarray]]:
    data = b"".join(bytes(b) for b in buffers)
    header_len, _ = frames.sizes(data[:frames.PREFIX.size])
    head = data[frames.PREFIX.size:frames.PREFIX.size + header_len]
    return frames.decode(head, bytearray(data[frames.PREFIX.size + header_len:]))


def kv(rng, n: int, dtype=BFLOAT16) -> tuple[np.ndarray, np.ndarray]:
    return (rng.standard_normal((n, 2, 8)).astype(np.float32).astype(dtype),
            rng.standard_normal((n, 2, 4)).astype(np.float32).astype(dtype))


def test_a_create_frame_carries_its_writes_record_and_arrays_bit_for_bit(rng):
    k, v = kv(rng, 10)
    writes = [ShardWrite("ctx", 0, "bfloat16", 8, np.arange(6), reserve=8, span=(0, 6)),
              ShardWrite("ctx", 1, "bfloat16", 8, np.arange(6, 10), span=(6, 10))]
    record = {"id": "ctx", "version": 1, "shards": [{"index": 0, "length": 6, "workers": ["w0"]}]}
    header, arrays = roundtrip(channel.write_frame(3, writes, carry(k), carry(v), record=record))
    got, gk, gv, got_record, committed = channel.parse_write(header, arrays)
    assert header["id"] == 3 and got_record == record and committed is None
    assert gk.dtype == BFLOAT16 and gk.tobytes() == k.tobytes() and gv.tobytes() == v.tobytes()
    for a, b in zip(got, writes):
        assert (a.context_id, a.index, a.dtype, a.max_capacity, a.reserve, a.span) == \
            (b.context_id, b.index, b.dtype, b.max_capacity, b.reserve, b.span)
        assert np.array_equal(a.k_pos, b.k_pos)


def test_a_write_frame_needs_a_record_or_a_committed_length(rng):
    k, v = kv(rng, 2)
    w = [ShardWrite("ctx", 0, "bfloat16", 8, np.arange(2))]
    with pytest.raises(ValueError, match="exactly one"):
        channel.write_frame(0, w, k, v)
    header, arrays = roundtrip(channel.write_frame(0, w, k, v, committed=4))
    header.pop("committed")
    with pytest.raises(frames.FrameError, match="record"):
        channel.parse_write(header, arrays)
    with pytest.raises(frames.FrameError, match="k_pos per write"):
        channel.parse_write({**header, "committed": 4}, arrays[:2])


@pytest.mark.parametrize("n, part, want", [(10, 4, [4, 4, 2]), (8, 8, [8]), (3, 100, [3]), (0, 4, [0])])
def test_an_append_frame_cuts_its_keys_into_parts_in_order(rng, n, part, want):
    k, v = kv(rng, n)
    write = ShardWrite("ctx", 2, "bfloat16", 64, np.arange(5, 5 + n))
    header, arrays = roundtrip(channel.append_frame(7, write, carry(k), carry(v), 12, part))
    assert header["op"] == channel.STREAMED_OP and header["parts"] == want
    got, committed, parts = channel.parse_append(header, arrays[0])
    assert (got.context_id, got.index, got.max_capacity, got.span, committed, parts) == ("ctx", 2, 64, None, 12, want)
    assert np.array_equal(got.k_pos, np.arange(5, 5 + n))
    ks = np.concatenate([arrays[1 + 2 * i] for i in range(len(parts))])
    vs = np.concatenate([arrays[2 + 2 * i] for i in range(len(parts))])
    assert ks.tobytes() == k.tobytes() and vs.tobytes() == v.tobytes()


def test_an_append_frame_whose_parts_do_not_match_its_arrays_is_refused(rng):
    k, v = kv(rng, 6)
    header, arrays = roundtrip(channel.append_frame(0, ShardWrite("ctx", 0, "bfloat16", 8, np.arange(6)), k, v,
                                                    0, 4))
    for bad in ({**header, "parts": [4, 1]}, {**header, "parts": [6]}, {**header, "parts": "6"},
                {**header, "write": {}}):
        with pytest.raises(frames.FrameError):
            channel.parse_append(bad, arrays[0])
