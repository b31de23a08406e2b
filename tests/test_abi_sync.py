"""vm/abi.h mirrors the enum codes and caps of ir.py; any drift fails here."""

import re
from pathlib import Path

from amk.schedule import ir

HEADER = Path(__file__).resolve().parents[1] / "vm" / "abi.h"


def _parse_header() -> tuple[dict[str, dict[str, int]], dict[str, int], int]:
    text = HEADER.read_text()
    enums: dict[str, dict[str, int]] = {}
    for name, body in re.findall(r"enum\s+Amk(\w+)\s*\{(.*?)\};", text, re.S):
        members = dict(re.findall(r"AMK_\w+?_(\w+)\s*=\s*(\d+)", body.replace(f"AMK_{name.upper()}_", "AMK_X_")))
        enums[name] = {k: int(v) for k, v in members.items()}
    caps = {k: int(v) for k, v in re.findall(r"#define\s+AMK_(MAX_\w+)\s+(\d+)LL", text)}
    version = int(re.search(r"#define\s+AMK_IR_VERSION\s+(\d+)", text).group(1))
    return enums, caps, version


def test_enums_match():
    enums, _, _ = _parse_header()
    assert enums == ir.enum_table()


def test_caps_match():
    _, caps, _ = _parse_header()
    assert caps == ir.capacity_table()


def test_version_matches():
    assert _parse_header()[2] == ir.IR_VERSION


def test_zero_chunk_matches_the_gemv_x_sums():
    """The lowering's 32-column chunks of an asymmetric I8 group (schedule/lower.py ZERO_CHUNK)
    are the GEMV's x sums (instructions/gemv.cuh AMK_XSUM_CHUNK, mirrored by vm/loader.py)."""
    from amk.schedule.lower import ZERO_CHUNK
    from amk.vm.loader import XSUM_CHUNK

    gemv = (HEADER.parent.parent / "instructions" / "gemv.cuh").read_text()
    assert ZERO_CHUNK == XSUM_CHUNK == int(re.search(r"#define\s+AMK_XSUM_CHUNK\s+(\d+)", gemv).group(1))
