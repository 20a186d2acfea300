import time

"""Stage timings and the metrics registry of one app."""

import numpy as np
import pytest

from service.metrics import Metrics, Timings


def test_timings_accumulate_and_render_server_timing():
    t = Timings()
    t.add("parse", 0.001)
    t.add("parse", 0.002)
    t.add("merge", 0.0005)
    assert t.stages == pytest.approx({"parse": 0.003, "merge": 0.0005})
    assert t.header() == "parse;dur=3.000, merge;dur=0.500"
    assert np.isfinite(sum(t.stages.values()))


def test_timings_know_only_the_stages_of_a_request():
    with pytest.raises(ValueError, match="stage must be one of parse, lookup, scatter, .*, total, got 'prase'"):
        Timings().add("prase", 0.1)


def test_a_measured_block_adds_its_time_even_when_it_raises():
    t = Timings()
    with pytest.raises(KeyError), t.measure("store"):
        time.sleep(0.01)
        raise KeyError("x")
    with t.measure("store"):
        pass
    assert 0.01 <= t.stages["store"] < 5 and list(t.stages) == ["store"]


def test_stage_timings_feed_the_histogram_of_their_route():
    m = Metrics()
    t = Timings()
    t.add("compute", 0.25)
    m.observe_stages("/v1/attention", t)
    text = m.render().decode()
    assert 'splitkey_request_stage_seconds_count{route="/v1/attention",stage="compute"} 1.0' in text
    assert 'splitkey_request_stage_seconds_sum{route="/v1/attention",stage="compute"} 0.25' in text
