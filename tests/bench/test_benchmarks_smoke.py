"""benchmarks/kernel.py on tiny sizes: its implementations agree, and the report is written.

No timing is asserted: this only guards against the benchmark comparing
different computations (wrong layout, scale, head mapping or mask alignment).
"""


import numpy as np
import pytest
from benchloader import benchmark_module
from reference import contract_layout, reference


@pytest.fixture(scope="module")
def bench():
    with benchmark_module("kernel.py") as module:
        yield module


@pytest.mark.parametrize("n_q, n_k, causal", [(1, 700, False), (5, 300, True), (9, 257, False)])
def test_implementations_agree_with_the_reference(bench, n_q, n_k, causal):
    h_q, h_kv, d = 8, 2, 16
    q = bench.queries(n_q, h_q, d, seed=3)  # [n_q, h_q, d]
    k, v = bench.contract_kv(n_k, h_kv, d, d, seed=4)  # [n_k, h_kv, d] each
    view, _ = bench.resident_kv(n_k, h_kv, d, d, seed=4, torch=None)
    np.testing.assert_array_equal(contract_layout(view)[0], k)  # same seed, same keys in both layouts
    want, want_lse = reference(q, k, v, causal=causal)
    results = {
        "resident": bench.ours_resident(q, view, causal, threads=2),
        "inline": bench.ours_inline(q, k, v, causal, threads=2),
        "naive": bench.naive_numpy(q, k, v, causal, threads=1),
        "fused_resident": bench.ours_resident(q, view, causal, threads=2, kernels=bench.FUSED),
        "fused_inline": bench.ours_inline(q, k, v, causal, threads=2, kernels=bench.FUSED),
    }
    for name, (out, lse) in results.items():
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5, err_msg=name)
        np.testing.assert_allclose(lse, want_lse, rtol=1e-4, atol=1e-5, err_msg=name)
        assert bench.check_agree(name, out, results["resident"][0]) < 1e-4


def test_sdpa_agrees_with_the_kernel_when_torch_is_installed(bench):
    torch = pytest.importorskip("torch")
    q = bench.queries(6, 8, 16, seed=5)
    view, k_sdpa = bench.resident_kv(300, 2, 16, 16, seed=6, torch=torch)
    v_sdpa = torch.from_numpy(view.v)[None]  # [1, h_kv, n_k, d]
    for causal in (False, True):
        out, _ = bench.sdpa(torch, q, k_sdpa, v_sdpa, causal)
        ref, _ = bench.ours_resident(q, view, causal, threads=1)
        assert bench.check_agree("SDPA", out, ref) < 1e-4


def test_disagreement_stops_the_run(bench):
    out = np.ones((1, 4, 8), np.float32)
    with pytest.raises(RuntimeError, match="disagrees"):
        bench.check_agree("wrong", out * 1.01, out)


def test_decode_roof_is_the_lower_of_bandwidth_and_the_kernels_own_rate_in_cache(bench):
    # g = 32 / 8 = 4 query rows per kv head: 2 g flops per key element, read once.
    assert bench.decode_flop_per_byte("float32") == 2.0
    assert bench.decode_flop_per_byte("bfloat16") == bench.decode_flop_per_byte("float16") == 4.0
    assert bench.decode_roof(gemv_gbs=30.0, in_cache_gbs=50.0) == (30.0, "memory")
    assert bench.decode_roof(gemv_gbs=30.0, in_cache_gbs=25.0) == (25.0, "compute")


def test_in_cache_operands_repeat_and_give_the_kernel_the_cases_shape(bench):
    view, k, v = bench.in_cache_kv(65536, 2, 16, 16, np.float32)
    assert view.kt.shape == (2, 16, 65536) and view.v.shape == (2, 65536, 16)
    assert k.shape == v.shape == (65536, 2, 16)
    flat = k.reshape(-1)
    period = next(p for p in range(1, flat.size) if flat[p] == flat[0] and np.array_equal(flat[p:p + 64], flat[:64]))
    assert period < flat.size // 4  # the memory repeats: the kernel streams it from cache
    out, lse = bench.ours_resident(bench.queries(1, 8, 16, seed=3), view, False, threads=2, kernels=bench.FUSED)
    assert np.isfinite(out).all() and np.isfinite(lse).all()


def test_sizes_and_quick_arguments(bench):
    assert bench.parse_args(["--sizes", "64K,1M,3000"]).sizes == [65536, 2**20, 3000]
    quick = bench.parse_args(["--quick"])
    assert quick.sizes == list(bench.QUICK_DECODE_KEYS) and quick.repeat == 2
    assert bench.parse_args([]).sizes == [64 * 1024, 256 * 1024, 1024 * 1024]
    with pytest.raises(SystemExit):
        bench.parse_args(["--sizes", "0"])


def test_quick_run_writes_the_markdown_report(bench, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "QUICK_PREFILL", {"n_q": 4, "n_k": 512})
    out = tmp_path / "bench.md"
    monkeypatch.setattr(bench, "SETTLE_S", 0.0)
    assert bench.main(["--quick", "--no-torch", "--repeat", "1", "--sizes", "2K", "--out", str(out)]) == 0
    text = out.read_text()
    assert text in capsys.readouterr().out
    for heading in ("### Limits measured in the same run", "### Decode", "### Prefill"):
        assert heading in text
    rows = [ln for ln in text.splitlines() if ln.startswith("| 2K |")]
    assert len(rows) == 3 and all(r.count("|") == 21 for r in rows)  # a row per dtype, 20 columns
    for r in rows:  # each fused layout's "/ roof" names what binds it (the two layouts may differ)
        bounds = [c for c in r.split("|") if "(memory)" in c or "(compute)" in c]
        assert len(bounds) == 2 and all(("(memory)" in c) != ("(compute)" in c) for c in bounds), r
    assert "in-cache" in text and "fused kernel: numba for" in text
    for dtype in ("float32", "bfloat16", "float16"):
        assert f"#### K and V {dtype}" in text
