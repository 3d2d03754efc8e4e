"""CPU tests of the benchmark helpers: FLOP and byte counting, shapes, tables and plots."""

import pytest
import torch

from tests.benchmark import bench_utils, first_call
from tests.benchmark.bench_utils import Result, Shape
from tilegym.ops.attention.reference import causal_mask


@pytest.mark.parametrize("seqlen_q, seqlen_k", [(1, 1), (7, 7), (5, 12), (12, 5), (300, 100), (1, 300), (64, 65)])
@pytest.mark.parametrize("causal", [False, True])
def test_bench_visible_pairs_match_the_mask(seqlen_q, seqlen_k, causal):
    expected = int(causal_mask(seqlen_q, seqlen_k).sum()) if causal else seqlen_q * seqlen_k
    assert bench_utils.visible_pairs(seqlen_q, seqlen_k, causal) == expected


def test_bench_flops_per_mode():
    full = Shape(2, 16, 16, 1024, 1024, 128, False, "bfloat16")
    causal = Shape(2, 16, 16, 1024, 1024, 128, True, "bfloat16")
    assert bench_utils.flops("fwd", full) == 4 * 2 * 16 * 128 * 1024 * 1024
    # Causal with Sq = Sk keeps the diagonal: a bit more than half the pairs.
    assert bench_utils.flops("fwd", causal) == 4 * 2 * 16 * 128 * (1024 * 1025 // 2)
    assert bench_utils.flops("bwd", full) == 2.5 * bench_utils.flops("fwd", full)
    assert bench_utils.flops("fwd+bwd", causal) == 3.5 * bench_utils.flops("fwd", causal)
    # Sq > Sk, bottom-right: the first Sq - Sk queries see nothing.
    tall = Shape(1, 1, 1, 300, 100, 64, True, "float16")
    assert bench_utils.flops("fwd", tall) == 4 * 64 * (100 * 101 // 2)


def test_bench_min_bytes():
    shape = Shape(batch=1, q_heads=4, kv_heads=2, seqlen_q=8, seqlen_k=16, head_dim=32, causal=True, dtype="float16")
    q, kv, rows = 1 * 4 * 8 * 32, 1 * 2 * 16 * 32, 1 * 4 * 8
    forward = 2 * (q + 2 * kv) + 2 * q + 4 * rows  # read q, k, v; write out and LSE
    backward = 2 * (3 * q + 2 * kv) + 4 * rows + 2 * (q + 2 * kv) + 8 * rows  # + dq, dk, dv, Delta
    assert bench_utils.min_bytes("fwd", shape) == forward
    assert bench_utils.min_bytes("fwd", shape, with_lse=False) == forward - 4 * rows
    assert bench_utils.min_bytes("bwd", shape) == backward
    assert bench_utils.min_bytes("fwd+bwd", shape) == forward + backward


def test_bench_shapes_follow_the_token_and_hidden_convention():
    shapes = bench_utils.shapes([64, 128], [False, True], ["bfloat16", "float16"], gqa=True)
    for shape in shapes:
        assert shape.batch * shape.seqlen_q == bench_utils.TOKENS
        assert shape.q_heads * shape.head_dim == bench_utils.HIDDEN
    gqa = [s for s in shapes if s.kv_heads != s.q_heads]
    assert gqa and all(s.q_heads == 8 * s.kv_heads and s.dtype == "bfloat16" for s in gqa)
    assert {s.series for s in gqa} == {"d64-full-bfloat16-gqa8", "d64-causal-bfloat16-gqa8",
                                       "d128-full-bfloat16-gqa8", "d128-causal-bfloat16-gqa8"}  # fmt: skip


def _synthetic_results():
    results = []
    for seqlen in (512, 1024, 2048):
        shape = Shape(16384 // seqlen, 16, 16, seqlen, seqlen, 128, True, "bfloat16")
        for provider, speed in (("cutile", 1.0), ("cudnn", 1.25)):
            ms = bench_utils.flops("fwd", shape) / (speed * 400e12) * 1e3
            results.append(Result("fwd", provider, shape, ms=ms, tflops=400 * speed, gbps=100 * speed, max_error=1e-3))
    results.append(Result("fwd", "math", shape, note="skipped: scores do not fit in memory"))
    return results


def test_bench_table_shows_ratio_and_notes():
    text = bench_utils.table(_synthetic_results())
    assert "0.80x" in text and "scores do not fit" in text


def test_bench_plots_and_json_round_trip(tmp_path):
    results = _synthetic_results()
    bench_utils.save_json(results, tmp_path / "run.json", {"gpu": "synthetic"})
    loaded, meta = bench_utils.load_json(tmp_path / "run.json")
    assert loaded == results and meta == {"gpu": "synthetic"}
    drawn = bench_utils.figures("attention_training", loaded, tmp_path / "plots", [meta])
    names = [figure.path.name for figure in drawn]
    assert names == ["attention_training-overview-ours_vs_cuDNN.png",
                     "attention_training-fwd-d128-causal-bfloat16-TFLOPS.png",
                     "attention_training-fwd-d128-causal-bfloat16-GBps.png"]  # fmt: skip
    # The file name is the title, spelled for a file system.
    assert drawn[1].title == "attention training · fwd · d128-causal-bfloat16 · TFLOPS"
    for figure in drawn:
        assert figure.path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and figure.path.stat().st_size > 1000


def test_bench_figures_name_their_gpu_and_versions():
    meta = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "cuda_tile": "1.7.0"}
    assert bench_utils.environment([meta]) == "NVIDIA H100 80GB HBM3, PyTorch 2.11.0, cuda-tile 1.7.0"
    # What a file lacks is said, the rest shown; files of one environment show it once.
    assert bench_utils.environment([{"torch": "2.11.0"}, {"torch": "2.11.0"}]) == "GPU not recorded, PyTorch 2.11.0"
    assert bench_utils.environment([]) == "GPU and versions not recorded"


def _option_results():
    results = []
    for seqlen, plain_ms, softcap_ms in ((1024, 1.0, 1.5), (4096, 2.0, 2.5)):
        for option, ms in (("", plain_ms), ("softcap", softcap_ms)):
            shape = Shape(16384 // seqlen, 16, 16, seqlen, seqlen, 128, True, "bfloat16", option)
            results.append(Result("fwd", "cutile", shape, ms=ms, tflops=100 / ms, gbps=10 / ms))
    return results


def test_bench_option_figures_draw_each_modifier_against_plain(tmp_path):
    drawn = bench_utils.figures("attention_variants", _option_results(), tmp_path, [{}])
    assert [figure.path.name for figure in drawn] == [
        "attention_variants-overview-time_vs_plain.png",
        "attention_variants-fwd-d128-causal-bfloat16-softcap_vs_plain-TFLOPS.png",
    ]
    assert all(figure.path.stat().st_size > 1000 for figure in drawn)


def test_bench_quick_run_skips_cleanly_without_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only behaviour")
    result = bench_utils.measure("fwd", "cudnn", Shape(1, 2, 2, 64, 64, 64, False, "bfloat16"))
    assert result.tflops is None and result.note


def test_bench_markdown_summary_has_ratio():
    text = bench_utils.markdown_summary(_synthetic_results(), seqlens=(1024,))
    assert "| d128, causal | 1024 | 400 / 500 / n/a (0.80x) |" in text


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [(3, 0), (2, 5), (-1, 4), (6, -1)])
@pytest.mark.parametrize("seqlen_q, seqlen_k", [(9, 9), (5, 12), (12, 5)])
def test_visible_pairs_with_window_match_mask(seqlen_q, seqlen_k, causal, window):
    from tilegym.ops.attention.reference import causal_mask, window_mask

    if causal and window[1] > 0:
        window = (window[0], 0)
    mask = window_mask(seqlen_q, seqlen_k, *window)
    if causal:
        mask &= causal_mask(seqlen_q, seqlen_k)
    assert bench_utils.visible_pairs(seqlen_q, seqlen_k, causal, window) == int(mask.sum())


def test_option_cost_summary_divides_by_plain():
    def result(option, ms):
        shape = bench_utils.Shape(4, 16, 16, 4096, 4096, 128, True, "bfloat16", option)
        return bench_utils.Result("fwd", "cutile", shape, ms=ms)

    text = bench_utils.option_cost_summary([result("", 2.0), result("softcap", 3.0)])
    assert "| softcap | 128, causal | 4096 | 3.00 (1.50x) |" in text


def test_first_call_reads_the_first_step_of_train_step():
    output = "first step (compile + autotune): 8.390 s\nstep 1: 0.003 s\nmax |out - fp64 reference|: 7e-03\n"
    assert float(first_call._FIRST_STEP.search(output).group(1)) == 8.39
    text = first_call.summary({"shape": first_call.SHAPE, "cold_s": 8.39, "warm_s": 0.207})
    assert "8.4 s with empty caches" in text and "0.21 s with warm caches" in text


def test_bench_marks_cells_whose_host_time_nears_the_measured_time():
    results = _synthetic_results()
    ours_1024 = next(r for r in results if r.provider == "cutile" and r.shape.seqlen_q == 1024)
    assert bench_utils.HOST_BOUND_NOTE not in bench_utils.table(results)
    assert bench_utils.HOST_BOUND_NOTE not in bench_utils.markdown_summary(results, seqlens=(1024,))

    ours_1024.host_ms = 0.5 * ours_1024.ms  # well below: not marked
    assert not ours_1024.host_bound and "400*" not in bench_utils.markdown_summary(results, seqlens=(1024,))
    ours_1024.host_ms = bench_utils.HOST_BOUND_SHARE * ours_1024.ms
    assert ours_1024.host_bound
    text = bench_utils.table(results)
    assert bench_utils.HOST_BOUND_NOTE in text and text.count("400*") == 1
    summary = bench_utils.markdown_summary(results, seqlens=(1024,))
    assert "| d128, causal | 1024 | 400* / 500 / n/a (0.80x) |" in summary
    assert bench_utils.HOST_BOUND_NOTE in summary
    # A marked cell outside the summarized lengths leaves the summary's note out.
    assert bench_utils.HOST_BOUND_NOTE not in bench_utils.markdown_summary(results, seqlens=(2048,))


def test_bench_figures_read_well(tmp_path, monkeypatch):
    """Y from zero, lengths written out, the GPU in the footer, a modifier beside plain."""
    seen = {}

    def save(figure, drawn, footer):
        (axis, *_) = figure.axes
        seen[drawn.path.name] = axis, footer, [line.get_label() for line in axis.lines]
        bench_utils._pyplot().close(figure)
        return drawn

    monkeypatch.setattr(bench_utils, "_save", save)
    meta = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "cuda_tile": "1.7.0"}
    bench_utils.figures("attention_training", _synthetic_results(), tmp_path, [meta])
    bench_utils.figures("attention_variants", _option_results(), tmp_path, [meta])
    axis, footer, lines = seen["attention_training-fwd-d128-causal-bfloat16-TFLOPS.png"]
    assert axis.get_ylim()[0] == 0 and lines == ["tilegym (cuTile)", "SDPA cuDNN"]
    assert [label.get_text() for label in axis.get_xticklabels()] == ["512", "1024", "2048"]
    assert footer.startswith("NVIDIA H100 80GB HBM3, PyTorch 2.11.0, cuda-tile 1.7.0")
    axis, footer, lines = seen["attention_variants-fwd-d128-causal-bfloat16-softcap_vs_plain-TFLOPS.png"]
    assert axis.get_ylim()[0] == 0 and lines == ["plain attention, same run", "softcap 30"]
    assert sorted(text.get_text() for text in axis.texts) == ["1.25x time", "1.50x time"]
    axis, footer, _ = seen["attention_training-overview-ours_vs_cuDNN.png"]
    assert [text.get_text() for text in axis.texts] == ["0.80", "0.80", "0.80"]  # ours / cuDNN per length


def test_goal_cells_and_summary():
    """--goal measures every cell of the backward-speed goal, and its summary says per cell
    whether ours is at or above cuDNN (same run) and FlashAttention-4's figures."""
    shapes = bench_utils.goal_shapes()
    plain = [s for s in shapes if not s.option and s.q_heads == s.kv_heads]
    assert len(plain) == 4 * 2 * 3
    assert {(s.head_dim, s.causal, s.seqlen_q) for s in plain} == {
        (d, c, n) for d in (64, 96, 128, 256) for c in (False, True) for n in (1024, 4096, 16384)
    }
    assert all(s.batch * s.seqlen_q == 16384 and s.q_heads == 2048 // s.head_dim for s in shapes)
    extra = {s.series for s in shapes} - {s.series for s in plain}
    assert extra == {"d128-causal-bfloat16-gqa8", "d128-causal-bfloat16-window"}

    def result(provider, shape, mode, tflops, ms=1.0):
        return bench_utils.Result(mode, provider, shape, ms=ms, tflops=tflops)

    cell = next(s for s in plain if (s.head_dim, s.causal, s.seqlen_q) == (128, True, 4096))
    d96 = next(s for s in plain if (s.head_dim, s.causal, s.seqlen_q) == (96, True, 4096))
    results = [
        result("cutile", cell, mode, t) for mode, t in zip(("fwd", "bwd", "fwd+bwd"), (600, 510, 530), strict=True)
    ]
    results += [
        result("cudnn", cell, mode, t) for mode, t in zip(("fwd", "bwd", "fwd+bwd"), (558, 429, 459), strict=True)
    ]
    results += [result("cutile", d96, mode, 300, ms=2.5) for mode in ("fwd", "bwd", "fwd+bwd")]
    summary = bench_utils.goal_summary(results).splitlines()
    row_128 = next(line for line in summary if line.startswith("| d128-causal-bfloat16 | 4096"))
    assert "597 / 505 / 519" in row_128 and row_128.endswith("| yes |")
    row_96 = next(line for line in summary if line.startswith("| d96-causal-bfloat16 | 4096"))
    assert "fwd+bwd 2.03 ms" in row_96 and "0.81x" in row_96 and row_96.endswith("| no |")  # 2.03 / 2.5
