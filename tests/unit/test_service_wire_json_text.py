"""service.wire.json_text: the same text as one json.dumps, written in pieces."""

import asyncio
import json

import numpy as np
import pytest

from service.wire.json_text import PIECE_NUMBERS, JsonArray, write_json
from service.wire.values import array_to_json


def _dumps_json(doc):
    """The text ``write_json`` answers with, at once."""
    return asyncio.run(write_json(doc))


def one_dumps(doc) -> bytes:
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


SHAPES = [(0, 3, 4), (1, 1, 1), (3, 0, 2), (2, 3, 5000), (5000, 2, 3), (1, 1, 9000), (70, 70, 3),
          (PIECE_NUMBERS + 1,), (2, PIECE_NUMBERS), (1, PIECE_NUMBERS + 1, 2), ()]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("flat", [False, True])
def test_pieces_make_the_text_of_one_dumps_with_non_finite_values_as_null(rng, shape, dtype, flat):
    a = rng.standard_normal(shape).astype(dtype)
    if a.size >= 3:
        a.flat[rng.choice(a.size, 3, replace=False)] = [np.inf, -np.inf, np.nan]
    doc = {"id": 'é"\\x', "n": [1, None, 2.5, True, {"k": []}], "x": JsonArray("x", a, flat), "y": [JsonArray("y", a)]}
    want = one_dumps({"id": 'é"\\x', "n": [1, None, 2.5, True, {"k": []}], "x": array_to_json("x", a, flat=flat),
                      "y": [array_to_json("y", a)]})
    assert _dumps_json(doc) == want
    assert asyncio.run(write_json(doc)) == want


def test_writing_on_the_loop_lets_other_tasks_run_between_the_pieces():
    a = np.zeros((8 * PIECE_NUMBERS,), np.float32)
    ticks = []

    async def other() -> None:
        while True:
            ticks.append(1)
            await asyncio.sleep(0)

    async def main() -> bytes:
        task = asyncio.create_task(other())
        await asyncio.sleep(0)
        text = await write_json({"x": JsonArray("x", a)})
        task.cancel()
        return text

    assert asyncio.run(main()) == one_dumps({"x": a.tolist()})
    assert len(ticks) >= 8  # the other task ran between every two pieces of the eight


@pytest.mark.parametrize("bad", [np.zeros(3, np.int32), np.zeros(3, np.float16), [1.0, 2.0]])
def test_an_array_that_is_not_float32_or_float64_is_refused(bad):
    with pytest.raises(ValueError, match="x must be a float32 or float64 numpy array"):
        _dumps_json({"x": JsonArray("x", bad)})


def test_non_string_keys_and_non_finite_plain_numbers_are_refused():
    with pytest.raises(ValueError, match="keys must be strings"):
        _dumps_json({1: 2})
    with pytest.raises(ValueError):
        _dumps_json({"x": float("nan")})
