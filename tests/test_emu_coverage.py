"""tests/emu_coverage.py: the one-way branches of a program's emulated build, from gcov's counters."""

import json
import shutil

import pytest

from emu_coverage import main, one_way_lines
from emu_vm import compiler

pytestmark = pytest.mark.skipif(compiler() is None or shutil.which("gcov") is None,
                                reason="needs g++ (C++20) and gcov to build and read the emulated megakernel")


def _norm_line() -> int:
    """gemv.cuh's line of the GEMV prologue's `if (norm) {` (x staged with its RMSNorm, or as it is)."""
    from amk.vm.build import source_dirs

    lines = (source_dirs()[1] / "gemv.cuh").read_text().splitlines()
    return next(i + 1 for i, s in enumerate(lines) if s.strip() == "if (norm) {")


@pytest.mark.parametrize("fused", [True, False])
def test_a_branch_is_listed_where_the_program_takes_it_one_way_only(tmp_path, capsys, fused):
    """With the RMSNorm fused, the q/k/v and gate/up GEMVs stage x normalised and the o and down GEMVs
    as it is: the prologue's `if (norm)` goes both ways and is not listed. Unfused, no GEMV has the
    norm: the branch is one-way and listed."""
    cfg = tmp_path / "cfg.json"
    cfg.write_text("{}" if fused else '{"fuse_norm": false}')
    main(["--zoo", "llama-gqa-tied", "--config", str(cfg), "--queues", "2", "--threads", "64", "--steps", "2",
          "--json", "--out", str(tmp_path / "build")])
    lines = json.loads(capsys.readouterr().out)["lines"]
    assert lines and all(e["count"] > 0 and e["never"] > 0 and e["taken"] > 0 for e in lines)
    listed = {(e["file"], e["line"]) for e in lines}
    assert (("instructions/gemv.cuh", _norm_line()) in listed) == (not fused)


def test_one_way_lines_reads_gcov_json(tmp_path):
    """Lines that ran with a branch never taken, hottest first; lines outside vm/ and instructions/,
    lines that never ran and branches taken every way are left out; a line one-way in two functions
    (a header's, a template's instantiations) is one entry with their counts summed."""
    (tmp_path / "instructions").mkdir()
    (tmp_path / "instructions" / "a.cuh").write_text("one\ntwo\nthree\n")
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "b.h").write_text("x\n")

    def line(n, count, *branch_counts):
        return {"line_number": n, "count": count, "branches": [{"count": c, "throw": False} for c in branch_counts]}

    gj = {"files": [{"file": str(tmp_path / "instructions" / "a.cuh"),
                     "lines": [line(1, 5, 5, 0), line(2, 9, 4, 5), line(3, 0, 0, 0)]},
                    {"file": str(tmp_path / "instructions" / "a.cuh"), "lines": [line(1, 7, 0, 7), line(2, 20, 20, 0)]},
                    {"file": str(tmp_path / "tests" / "b.h"), "lines": [line(1, 99, 99, 0)]}]}
    got = [(e["line"], e["count"], e["source"]) for e in one_way_lines(gj, root=tmp_path)]
    assert got == [(2, 20, "two"), (1, 12, "one")]
