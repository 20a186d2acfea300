"""benchmarks/service.py, contexts.py, common.py and bare_asgi.py: their pure helpers, without a server.

No timing is asserted and nothing is started: the percentile and ratio math,
Server-Timing parsing, table formatting, the memory and upload plans, that
the in-process baselines compute the same thing as the reference, and which
servers and cases ``service.py --sections`` runs (with stand-ins for both).
"""

import asyncio
import contextlib
import json
import math

import numpy as np
import pytest
from benchloader import benchmark_module
from reference import reference


def script(name, filename):
    """A module-scoped fixture ``name``: ``benchmarks/<filename>`` loaded by benchloader."""
    @pytest.fixture(scope="module", name=name)
    def fixture():
        with benchmark_module(filename) as module:
            yield module

    return fixture


common = script("common", "common.py")
svc = script("svc", "service.py")
ctx = script("ctx", "contexts.py")
bare = script("bare", "bare_asgi.py")


# ------------------------------------------------------------------ statistics and formatting


def test_server_timing_is_parsed_to_seconds(svc):
    got = svc.parse_server_timing("parse;dur=1.5, scatter;dur=0.25;desc=x, merge, total;dur=2")
    assert got == pytest.approx({"parse": 0.0015, "scatter": 0.00025, "total": 0.002})
    assert svc.parse_server_timing("") == {} and svc.parse_server_timing(None) == {}
    assert svc.parse_server_timing("parse;dur=oops") == {}


def test_summary_percentiles_and_range(common):
    s = common.summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.n, s.p50, s.lo, s.hi) == (5, 3.0, 1.0, 5.0)
    assert s.p90 == pytest.approx(4.6)
    empty = common.summarize([])
    assert empty.n == 0 and math.isnan(empty.p50)
    assert common.ms_spread(empty) == "-" and common.ms(float("nan")) == "-"
    assert common.ms_spread(s) == "3000 (1000-5000)"


def test_ratio_difference_rates_and_targets(common, svc, ctx):
    ratio, diff = common.overhead(0.012, 0.010)
    assert ratio == pytest.approx(1.2) and diff == pytest.approx(0.002)
    assert svc.gbs(2e9, 4.0) == pytest.approx(0.5) and math.isnan(svc.gbs(1, 0))
    assert ctx.target_s(0.100) == pytest.approx(0.128)
    assert ctx.baseline_s([3.0, 1.0, 2.0], [1.5], []) == 1.5 and math.isnan(ctx.baseline_s([]))
    assert common.met(True) == "met" and common.met(False) == "missed"


def test_number_labels(common):
    assert [common.ms(x) for x in (0.00123, 0.0456, 0.789)] == ["1.23", "45.6", "789"]
    assert [common.size_label(n) for n in (1024, 2**20, 3000, 65536)] == ["1K", "1M", "3000", "64K"]
    assert common.bytes_label(8 * 2**30) == "8 GiB" and common.bytes_label(300) == "300 B"
    assert common.parse_keys("1K, 1M,3000") == [1024, 2**20, 3000]


def test_stages_median_and_cells(common):
    records = [{"parse": 0.001, "total": 0.004}, {"parse": 0.003, "total": 0.006, "merge": 0.0001}]
    med = common.median_stages(records)
    assert med == pytest.approx({"parse": 0.002, "total": 0.005, "merge": 0.0001})
    assert common.STAGES == ("parse", "lookup", "scatter", "compute", "merge", "encode", "total")
    assert common.stage_cells(med) == ["2.00", "-", "-", "-", "0.10", "-", "5.00"]


def test_model_stages_take_the_lookup_stage_and_read_older_results_by_the_probe(common):
    # Two requests of 10 ms; the probe: directory calls of 1 ms, rounds of 6 ms wall for 5 ms of compute.
    probe = ([0.001, 0.001, 0.001], [0.006], [[0.005]], ["w"])
    with_lookup = {"parse": 0.0005, "lookup": 0.0001, "scatter": 0.0002, "compute": 0.007, "merge": 0.0003}
    d = common.model_stages([(0.010, with_lookup)] * 2, *probe)
    assert d["directory"] == pytest.approx(0.0001) and d["scatter"] == pytest.approx(0.0002)
    assert d["frontend"] == pytest.approx(0.010 - 0.0001 - 0.0002 - 0.007 - 0.0003)
    assert d["state_return"] == pytest.approx(0.001) and d["compute"] == pytest.approx(0.006)
    # Before the lookup stage, scatter began with the directory call: the probe's median comes out of it.
    older = {"parse": 0.0005, "scatter": 0.0012, "compute": 0.007, "merge": 0.0003}
    d = common.model_stages([(0.010, older)] * 2, *probe)
    assert d["directory"] == pytest.approx(0.001) and d["scatter"] == pytest.approx(0.0002)
    assert d["frontend"] == pytest.approx(0.010 - 0.0012 - 0.007 - 0.0003)


def test_markdown_table_shape(common):
    text = common.markdown_table(["a", "b"], [[1, "x"], [2.5, "y"]])
    assert text.splitlines() == ["| a | b |", "| --- | --- |", "| 1 | x |", "| 2.5 | y |"]
    with pytest.raises(ValueError, match="2 cells"):
        common.markdown_table(["a", "b"], [[1]])


def test_the_scripts_share_one_copy_of_the_helpers(svc, ctx):
    import benchmarks.common  # the module the scripts import (they put the repository root on sys.path)

    assert ctx.common is benchmarks.common
    for name in ("parse_keys", "summarize", "markdown_table", "wait_for_quiet", "splitkey_server", "Record"):
        assert getattr(svc, name) is getattr(benchmarks.common, name), name


def test_report_is_printed_and_written(common, tmp_path, capsys):
    out = tmp_path / "new" / "report.md"
    common.emit_report("# report\n", str(out))
    assert out.read_text() == "# report\n" and capsys.readouterr().out == "# report\n\n"


def test_arguments(svc, ctx):
    quick = svc.parse_args(["--quick"])
    assert quick.repeat == 2 and quick.sweep == svc.QUICK_SWEEP and quick.ingest_mib == list(svc.QUICK_INGEST_MIB)
    assert svc.parse_args([]).ingest_mib == [256, 512]
    c = ctx.parse_args(["--levels", "1,4,16", "--sizes", "64K,1M"])
    assert c.levels == [1, 4, 16] and c.sizes == [65536, 2**20]
    assert ctx.parse_args(["--quick"]).sizes == list(ctx.QUICK_SIZES)
    with pytest.raises(SystemExit):
        svc.parse_args(["--repeat", "0"])


def test_sections_argument_and_plan(svc):
    assert svc.parse_args([]).sections == ("sweep", "small", "ingest")
    assert svc.parse_args(["--sections", "small"]).sections == ("small",)
    assert svc.parse_args(["--sections", "ingest, sweep"]).sections == ("sweep", "ingest")  # in run order
    for bad in ("", ",", "small,bogus"):
        with pytest.raises(SystemExit):
            svc.parse_args(["--sections", bad])
    sweep, small, ingest = svc.plan(svc.parse_args(["--quick", "--sections", "small"]))
    assert sweep == [] and ingest == [] and [c.label for c in small] == ["tiny 1K", "decode 1K"]
    sweep, small, ingest = svc.plan(svc.parse_args(["--quick"]))
    assert len(sweep) == len(svc.QUICK_SWEEP) and len(small) == 2 and [c.mib for c in ingest] == [8, 16]


@pytest.fixture
def stand_ins(svc, monkeypatch):
    """service.py's servers and measurements replaced by stand-ins that record what ran, in order."""
    ran = []
    stages = {"parse": 0.001, "total": 0.002, "alloc": 0.0005, "read": 0.001}

    def server(name):
        @contextlib.contextmanager
        def start(*args, **kwargs):
            ran.append(name)
            yield name

        return start

    def inprocess(cases, repeat, seed):
        ran.append(("in-process", [c.label for c in cases]))
        for c in cases:
            c.inprocess = [0.001]

    def service_case(url, case, repeat, seed, c2):
        ran.append((url, case.label))
        case.c1, case.diff = [svc.Record(0.002, stages)] * repeat, 0.0

    def ingest_service(url, case, body, repeat, seed):
        ran.append((url, f"{case.mib} MiB"))
        case.body_bytes = case.mib * 2**20
        case.service_curl = case.service_client = [svc.Record(0.01, stages)]

    def ingest_bare(url, variant, case, body, repeat):
        case.bare[variant] = [svc.Record(0.01, stages)]

    for name, fake in (("splitkey_server", server("splitkey")), ("bare_server", server("bare")),
                       ("measure_inprocess", inprocess), ("measure_service_case", service_case),
                       ("measure_ingest_service", ingest_service), ("measure_ingest_bare", ingest_bare)):
        monkeypatch.setattr(svc, name, fake)
    return ran


HEADINGS = {"sweep": "#### Inline requests", "small": "#### Small requests", "ingest": "#### Ingest"}
QUICK_CASES = {"sweep": ["decode 1K", "decode 4K", "small 1K", "small 16K"], "small": ["tiny 1K", "decode 1K"],
               "ingest": ["8 MiB", "16 MiB"]}


@pytest.mark.parametrize("sections", ["small", "ingest", "sweep,small,ingest"])
def test_sections_run_only_their_cases_and_servers(svc, stand_ins, tmp_path, sections):
    text = svc.run(svc.parse_args(["--quick", "--no-wait", "--sections", sections]), tmp_path)
    chosen = sections.split(",")
    inline = [case for s in ("sweep", "small") if s in chosen for case in QUICK_CASES[s]]
    ingest = QUICK_CASES["ingest"] if "ingest" in chosen else []
    bare = ["bare"] * len(svc.BARE_VARIANTS) if ingest else []  # the bare app only for ingest
    assert stand_ins == [("in-process", inline), "splitkey", *[("splitkey", c) for c in inline + ingest], *bare]
    for section, heading in HEADINGS.items():
        assert (heading in text) == (section in chosen), heading
    assert ("- in-process:" in text) == bool(inline) and ("- service:" in text) == ("sweep" in chosen)
    assert f"Command: `.venv/bin/python benchmarks/service.py --quick --no-wait --sections {sections}`" in text
    if sections == "small":
        assert "| tiny 1K | 128 KiB | 20 | 2.00 (2.00-2.00) |" in text


def test_waiting_can_be_skipped_and_finds_no_such_process(common):
    assert "skipped" in common.wait_for_quiet(False)
    assert common.others_running("no-such-process-7f3a9c1e") is False


# ------------------------------------------------------------------ inputs and in-process baselines


def test_shapes_and_ingest_sizes(svc):
    assert svc.SHAPES["decode"].kv_bytes(1) == 8192 and svc.SHAPES["small"].kv_bytes(2**20) == 2**30
    assert svc.ingest_keys(256) == 32768 and svc.ingest_keys(512) == 65536


def test_inputs_are_reproducible_and_inprocess_is_exact(svc):
    shape = svc.Shape("t", 3, 4, 2, 8)
    q, k, v = svc.make_inputs(shape, 300, seed=1)
    q2, k2, _ = svc.make_inputs(shape, 300, seed=1)
    np.testing.assert_array_equal(k, k2)
    np.testing.assert_array_equal(q, q2)
    assert k.shape == (300, 2, 8) and k.dtype == np.float32
    out, lse = svc.inprocess(q, k, v)
    want, want_lse = reference(q, k, v)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-4, atol=1e-5)
    assert svc.check_same("same", out, want) < 1e-4
    with pytest.raises(RuntimeError, match="differs"):
        svc.check_same("wrong", out + 1, want)


def test_body_file_is_the_clients_safetensors(svc, tmp_path):
    from service.wire.safetensors import decode_safetensors

    q, k, v = svc.make_inputs(svc.Shape("t", 1, 2, 1, 4), 16, seed=2)
    n = svc.write_body(tmp_path / "b.bin", {"q": q, "k": k, "v": v})
    data = (tmp_path / "b.bin").read_bytes()
    assert n == len(data)
    got = decode_safetensors(data, {"q", "k", "v"})
    np.testing.assert_array_equal(got["k"], k)


def test_context_plans(ctx):
    assert ctx.kv_bytes(2**20, "float32") == 8 * 2**30 and ctx.kv_bytes(2**20, "bfloat16") == 4 * 2**30
    plan = ctx.upload_plan(2**20)
    assert len(plan) == 16 and plan[0] == (0, 65536) and plan[-1][1] == 2**20
    assert ctx.upload_plan(8192) == [(0, 4096), (4096, 8192)]  # the create fills at most one shard
    assert ctx.choose_dtype(2**20, None) == "float32"
    assert ctx.choose_dtype(2**20, 8 * 2**30) == "bfloat16"
    assert ctx.choose_dtype(2**20, 64 * 2**30) == "float32"
    half = ctx.kv_bytes(2**20, "float32") // 2
    assert ctx.worker_budget(2**20, "float32") >= 1.5 * half  # old + new while the shard grows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_context_inprocess_baselines_agree(ctx, dtype):
    res = ctx.SizeResult(512, dtype)
    ctx.measure_inprocess(res, repeat=1, seed=3)  # raises if workers.attention and the resident kernel differ
    ctx.measure_inprocess_after(res, repeat=1, seed=3)
    assert len(res.resident) == 2 and res.reference.shape == (1, 32, 128)
    k, v = ctx.contract_kv(512, dtype, seed=3)
    q = ctx.query(3, dtype)
    want, _ = reference(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))
    np.testing.assert_allclose(res.reference, want, rtol=2e-3, atol=2e-3)


# ------------------------------------------------------------------ reports from made-up results


def test_service_report_from_made_up_records(svc):
    level = svc.Level(1, 2, 0, 1.0, 10.0, 12.0, 12.0, 2.0)
    stages = {"parse": 0.004, "scatter": 0.002, "compute": 0.003, "merge": 0.0001, "encode": 0.0001, "total": 0.0095}
    case = svc.InlineCase(svc.SHAPES["decode"], 1024, inprocess=[0.002, 0.002], diff=0.0,
                          c1=[svc.Record(0.010, stages), svc.Record(0.012, stages)], level1=level, level2=level)
    ingest = svc.IngestCase(256, body_bytes=2**28,
                            service_curl=[svc.Record(1.0, {"parse": 0.8})], service_client=[svc.Record(1.1, {"parse": 0.8})],
                            bare={"bare": [svc.Record(0.9, {"alloc": 0.1, "read": 0.62})]})
    assert svc.ingest_ratio(ingest, "bare") == pytest.approx(0.72 / 0.8)
    assert math.isnan(svc.ingest_ratio(ingest, "bare, heap kept"))
    readers = [(reader, stage) for reader, stage, _, _ in svc.ingest_rows(ingest)]
    assert readers == [("bare", "alloc + read"), ("bare", "read only"), ("service, curl", "parse"),
                       ("service, Client", "parse")]
    text = svc.report(svc.parse_args(["--quick"]), [case], [case], [ingest], ["- note"])
    assert "| decode 1K | 8 MiB | 2.00 (2.00-2.00) | 11.0 (10.0-12.0) |" in text
    assert "5.5x" in text and "| 90% (met) | - |" in text and "missed" in text  # 11 ms > 5 ms; 0.72/0.8 of bare
    assert "| 256 MiB | bare | read only | 0.43 (0.43-0.43) | 0.30 (0.30-0.30) |" in text


def test_contexts_report_from_made_up_records(common, ctx, svc):
    res = ctx.SizeResult(65536, "float32", resident_before=[0.060], resident_after=[0.040], natural=[0.050],
                         upload_s=[1.0, 1.0], placement="p", diff=0.0,
                         c1=[common.Record(0.050, {"compute": 0.045, "total": 0.049})],
                         levels=[svc.Level(4, 8, 0, 1.0, 90.0, 100.0, 110.0, 40.0)])
    text = ctx.report(ctx.parse_args(["--quick"]), [res], ["- note"])
    assert res.baseline == pytest.approx(0.040)  # the lower median: load only slows a run down
    assert "| 64K | float32 | 512 MiB | 60.0 (60.0-60.0) | 40.0 (40.0-40.0) | 40.0 | 50.0 (50.0-50.0) |" in text
    assert "| 53.0 | met |" in text  # 1.25 x 40 + 3 = 53 ms >= 50 ms
    assert "| 64K | 4 | 8 | 0 | 90.0 | 100 | 40.00 | 21.5 |" in text
    assert "| 64K | 512 MiB | 2 | 256 MiB | 2.0 | 0.27 | 1000 (1000-1000) | p |" in text


# ------------------------------------------------------------------ the bare ASGI app


def bare_timing_stages(header):
    return [part.strip().split(";")[0] for part in header.split(",")]


def run_bare(bare, chunks, length):
    sent = []
    messages = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    headers = [(b"content-length", str(length).encode())] if length is not None else []
    asyncio.run(bare.app({"type": "http", "headers": headers}, receive, send))
    return sent


@pytest.mark.parametrize("length", [10, None])
def test_bare_app_reads_the_whole_body(bare, length):
    sent = run_bare(bare, [b"abc", b"defg", b"hij"], length)
    assert sent[0]["status"] == 200
    timing = dict(sent[0]["headers"])[b"server-timing"].decode()
    assert set(bare_timing_stages(timing)) == {"alloc", "read"}
    assert json.loads(sent[1]["body"]) == {"bytes": 10}


def test_busy_fraction_from_cpu_samples(common):
    assert common.busy_fraction((100, 1000), (150, 1100)) == pytest.approx(0.5)
    assert common.busy_fraction(None, (1, 2)) == 0.0 and common.busy_fraction((5, 10), (5, 10)) == 0.0
