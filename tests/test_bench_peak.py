"""The fraction of peak (einattn.bench.roof, einattn.bench.work): each row's FLOP count against
a count by hand over every (τ, σ) pair, with all-distinct sizes; the bytes a decoding step
reads against what the steps of a decoding form attend; rates as work over median over the
roof; the roof's JSON naming its figures. No timing assertions (STYLE §6)."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from einattn import bench, cli

FB = "forward+backward"
MODES = {"forward": 1.0, FB: 3.5}  # FlashAttention's backward: 2.5 × the forward


def pairs_by_hand(L: int, keep) -> int:
    return sum(1 for tau in range(L) for sigma in range(L) if keep(tau, sigma))


@pytest.mark.parametrize("mode", list(MODES))
def test_pattern_flops_count_the_pairs_each_pattern_keeps(mode):
    """n=2, μ=3, L=13, a=5, w=4: 4·n·μ·a FLOP per kept pair (×3.5 forward+backward), the
    pairs counted one by one: the window's, causal's, the packed documents' (block-diagonal,
    not causal: every pair inside a document); a form the section does not name is not
    rated."""
    size = bench.PatternSize(2, 3, 13, 5, 4)
    d = bench.patterns.document_ids(13)[0].tolist()
    kept = {"window": pairs_by_hand(13, lambda t, s: t - 4 < s <= t),
            "causal": pairs_by_hand(13, lambda t, s: s <= t),
            "documents": pairs_by_hand(13, lambda t, s: d[t] == d[s])}
    assert kept["window"] == 1 + 2 + 3 + 4 * 10 and kept["causal"] == 13 * 14 // 2
    assert len(set(d)) == 8 and kept["documents"] == sum(d.count(k) ** 2 for k in set(d))
    for name, pattern in (("chunked", "window"), ("sdpa_dense", "window"),
                          ("chunked_mask", "window"), ("chunked_causal", "causal"),
                          ("sdpa_causal", "causal"), ("chunked_documents", "documents"),
                          ("sdpa_documents", "documents"), ("flex_documents", "documents")):
        assert bench.pattern_flops(size, name, mode) == 4 * 2 * 3 * 5 * kept[pattern] \
            * MODES[mode], name
    assert bench.pattern_flops(size, "a form not named", mode) is None


@pytest.mark.parametrize("causal", [False, True])
def test_layer_flops_count_attention_and_projections(causal):
    """n=3, L=7, i=30, μ=5, a=6: the attention's 4·n·μ·a per pair (49 dense, 28 causal)
    and the projections' 2·n·L·i·(3i) + 2·n·L·i·i; forward+backward ×3.5 and ×3."""
    size = bench.Size(3, 7, 30, 5, causal=causal)
    pairs = pairs_by_hand(7, lambda t, s: s <= t or not causal)
    attention = 4 * 3 * 5 * 6 * pairs
    projections = 2 * 3 * 7 * 30 * 90 + 2 * 3 * 7 * 30 * 30
    assert bench.layer_flops(size, "forward") == attention + projections
    assert bench.layer_flops(size, FB) == 3.5 * attention + 3 * projections


def test_cache_read_bytes_are_what_the_steps_attend():
    """Three crops' worth of steps of einattn's sdpa form: the mean number of keys a step
    attends, × K and V × n × i × 4 bytes, is the figure the decoding rows are rated by."""
    size = bench.DecodingSize(2, 12, 3, 7)
    x = torch.randn(2, 7 + bench.decoding.SLACK, 12)
    form = bench.decoding_forms(size, x, names=("sdpa",))["sdpa"]
    keys = []
    for _ in range(3 * bench.decoding.SLACK):
        keys.append(len(form.cache) + 1)  # the keys this step attends: the cache and itself
        form()
    assert bench.cache_read_bytes(size) == pytest.approx(
        2 * 2 * 12 * 4 * sum(keys) / len(keys), rel=1e-12)


ROOF = bench.Roof(2, {1: 50.0, 2: 80.0}, {1: 4.0, 2: 10.0}, "by hand")


def test_rates_are_work_over_median_over_the_roof_at_the_run_threads():
    t = bench.Timing
    layer = bench.Row(bench.SIZES[3], FB, {"einsum": t((2e-3,), 1)})
    found = bench.rates(layer, ROOF, 2)["einsum"]
    flop = bench.layer_flops(bench.SIZES[3], FB)
    assert found == {"FLOP": flop, "GFLOP/s": flop / 2e-3 / 1e9,
                     "fraction_of_peak_GFLOP/s": flop / 2e-3 / 1e9 / 80.0}
    size = bench.DECODING_SIZES[0]
    decoding = bench.DecodingRow(size, "per token", {"sdpa": t((1e-3,), 1)}, {}, {})
    read = bench.cache_read_bytes(size)
    assert bench.rates(decoding, ROOF, 1)["sdpa"] == {
        "cache_read_bytes": read, "bandwidth_GB/s": read / 1e-3 / 1e9,
        "fraction_of_peak_bandwidth": read / 1e-3 / 1e9 / 4.0}
    pattern = bench.PatternRow(bench.QUICK_PATTERN_SIZES[0], "forward",
                               {"chunked": t((1.0,), 1), "new form": t((1.0,), 1)})
    assert set(bench.rates(pattern, ROOF, 1)) == {"chunked"}


def test_rated_rows_show_their_fraction_in_the_table_and_json(monkeypatch):
    """A stand-in run with a roof: the header names it, each section's table has the
    fraction columns, the JSON each form's figures and the roof's, named "peak", "GFLOP/s"
    and "bandwidth"."""
    t, tiny = bench.Timing, bench.SIZES[3]
    report = bench.Report(bench.Settings.build(sizes=(tiny,), compile=False, memory=False,
                                               sections=("layer", "decoding")), threads=2)
    report.rows = [bench.Row(tiny, FB, {"einsum": t((1e-3,), 1), "textbook": t((1e-3,), 1)},
                             {"einsum": 0.0, "textbook": 0.0})]
    report.decoding.rows = [bench.DecodingRow(bench.DECODING_SIZES[0], "per token",
                                              {"sdpa": t((1e-3,), 1)}, {"sdpa": 0.0},
                                              {"sdpa": 2**20})]
    report.decoding.ran = True
    report.rate(ROOF)
    data = report.as_json()
    assert data["peak"]["peak_matmul_GFLOP/s"] == {"1": 50.0, "2": 80.0}
    assert data["peak"]["peak_bandwidth_GB/s"] == {"1": 4.0, "2": 10.0}
    assert data["peak"]["threads"] == 2 and "FlashAttention" in data["peak"]["work"]
    einsum = data["timings"][0]["paths"]["einsum"]
    assert einsum["fraction_of_peak_GFLOP/s"] == einsum["GFLOP/s"] / 80.0
    sdpa = data["decoding"]["timings"][0]["paths"]["sdpa"]
    assert sdpa["fraction_of_peak_bandwidth"] == sdpa["bandwidth_GB/s"] / 10.0
    monkeypatch.setattr(bench, "run", lambda settings, progress=None: report)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        cli.main(["bench"])
    text = out.getvalue()
    assert "peak: matmul 50 GFLOP/s on 1 thread, 80 GFLOP/s on 2 threads; bandwidth 4 GB/s " \
           "on 1 thread, 10 GB/s on 2 threads; rows rated at 2 threads" in text
    assert "  how: by hand" in text
    assert all(column in text for column in ("GFLOP/s", "of peak", "GB/s read", "of bandwidth"))


def test_measure_roof_names_its_figures_and_puts_the_threads_back():
    was = torch.get_num_threads()
    roof = bench.measure_roof((1,), quick=True, all_threads=3)
    assert torch.get_num_threads() == was and roof.threads == 3
    assert set(roof.gflops) == set(roof.bandwidth) == {1}
    assert roof.gflops[1] > 0 and roof.bandwidth[1] > 0
    data = roof.as_json()
    assert set(data) == {"method", "all_threads", "peak_matmul_GFLOP/s", "peak_bandwidth_GB/s"}
    assert "N = 512" in data["method"] and "vector of 64 MiB" in data["method"]
    assert "by the wall clock" in data["method"]
