"""eval/ncu_step's reader of an Nsight Compute source page (no GPU): per-line samples and stall
reasons, the per-file shares and a region's reason mix, from a CSV in ncu's layout."""

from __future__ import annotations

from amk.eval.ncu_step import read_source_page, region_reasons, summarize

HEAD = ('"Line No","Source","Address","Source","Warp Stall Sampling (All Samples)",'
        '"Warp Stall Sampling (Not-issued Samples)","stall_barrier","stall_long_sb","stall_no_inst",'
        '"stall_barrier (Not Issued)"')


def _page(tmp_path):
    rows = [
        '"Function Name","amk_megakernel"', '"File Path","/x/instructions/attention.cuh"', HEAD,
        '"10","<Unable to open source file>","-","-","60","50","20","10","30","18"',
        '"","","0x10","LDS R1, [R2]","40","35","20","0","20","18"',  # a SASS row: not counted again
        '"11","<Unable to open source file>","-","-","40","40","0","40","0","0"',
        '"Function Name","amk_megakernel"', '"File Path","/x/instructions/gemv.cuh"', HEAD,
        '"10","<Unable to open source file>","-","-","1,900","100","0","1,900","0","0"',
    ]
    p = tmp_path / "page.csv"
    p.write_text("\n".join(rows) + "\n")
    return str(p)


def test_lines_and_reasons(tmp_path):
    lines = read_source_page(_page(tmp_path))
    assert set(lines) == {("attention.cuh", 10), ("attention.cuh", 11), ("gemv.cuh", 10)}
    a = lines[("attention.cuh", 10)]
    assert a["samples"] == 60 and a["barrier"] == 20 and a["long_sb"] == 10 and a["no_inst"] == 30
    assert lines[("gemv.cuh", 10)]["samples"] == 1900  # thousands separators


def test_region_and_summary(tmp_path):
    path = _page(tmp_path)
    r = region_reasons(read_source_page(path), "attention.cuh", 10, 11)
    assert abs(r["share"] - 100 / 2000) < 1e-12
    assert abs(r["no_inst"] - 0.3) < 1e-12 and abs(r["long_sb"] - 0.5) < 1e-12 and abs(r["barrier"] - 0.2) < 1e-12
    out = summarize(path, top=2, regions=("attention.cuh:10-11",))
    assert out[0].startswith("2000 stall samples; per file: gemv.cuh 95.0 %, attention.cuh 5.0 %")
    assert "attention.cuh:10-11: 5.0 % of the samples; long_sb 50.0 %, no_inst 30.0 %, barrier 20.0 %" in out[1]
    assert out[2].strip().startswith("95.0 %  gemv.cuh:10")


def test_reasons_of_all_samples(tmp_path):
    out = summarize(_page(tmp_path), top=2)
    # 2000 samples: long_sb 1950, no_inst 30, barrier 20; without the barrier's: 1980
    assert out[-2] == "  all samples by reason: long_sb 97.5 %, no_inst 1.5 %, barrier 1.0 %"
    assert out[-1] == "  leaving out barrier and sleep: long_sb 98.5 %, no_inst 1.5 %"
