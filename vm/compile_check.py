"""Compile the megakernel with nvcc for every NVIDIA target arch, warnings as errors.

    python -m amk.vm.compile_check            # sm_80, sm_90, sm_120
    python -m amk.vm.compile_check 90         # one arch
    python -m amk.vm.compile_check 90 --build int4 -D AMK_ATTN_PV_WIDE=1   # a loader build, a define
    python -m amk.vm.compile_check 90 --build bf16 --code-size --by-source 20 [--sources DIR]
                                              # code bytes, and which functions make them up
    python -m amk.vm.compile_check 90 --build int8 --loops 150   # the hot loops: instructions per byte
    python -m amk.vm.compile_check 90 --build bf16 --load-waits  # waits behind loads just issued
    python -m amk.vm.compile_check 90 --build bf16 --divisions 20  # run-time integer divisions, by caller
    python -m amk.vm.compile_check 90 --build int8 --jump-tables 10  # switches lowered to jump tables (BRX)
    python -m amk.vm.compile_check 90 --build int8_ahead --ptx a.ptx [--sources DIR]  # PTX, for `cmp`

No GPU needed. Fails on any compile error, nvcc warning, or register spill at the default
block size (256 threads), and prints the spill bytes where ptxas spilled (the figures
eval/PERF_NOTES.md gives). tests/test_vm_compile.py runs the same check.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ARCHS = (80, 90, 120)
DEFAULT_THREADS = 256
# builds for one program, as vm/loader.py makes them: its dtypes (AMK_DTYPES, AMK_GEMV_WDTYPES bit
# masks of ir.DType codes) and what a fused Llama program runs (AMK_OPS: EMBED, GEMV,
# ATTN_PARTIAL, ATTN_COMBINE, ARGMAX; all six epilogues, no bias, no head norm; a test checks
# these against PackedProgram.defines of a lowered Llama). Some tunables (AMK_ATTN_UNROLL) take
# more registers there than in the everything build above, so these are checked for spills too.
# a lowered Llama's bf16 KV caches take only the wide attention passes, so the loader leaves the
# split-layout ones out (loader._only_wide_define), except with U4 weights or o_proj_kv_slices
ONLY_WIDE = {"AMK_ATTN_ONLY_WIDE": 1}
# and its GEMVs all stream aligned vectors, so the loader leaves the scalar rows out (_only_vec_define)
# and no operand it reads through amk_flat has runs apart, so amk_flat is one run (AMK_FLAT_RUNS 0)
LLAMA_FEATURES = {"AMK_OPS": 0x4C5, "AMK_EPILOGUES": 0x3F, "AMK_EPI_BIAS": 0, "AMK_EPI_HEAD_NORM": 0,
                  "AMK_GEMV_ONLY_VEC": 1, "AMK_FLAT_RUNS": 0}
SPECIALIZED = {"bf16": {**ONLY_WIDE, "AMK_DTYPES": 0x0D, "AMK_GEMV_WDTYPES": 0x04, **LLAMA_FEATURES},  # F32, BF16, I32; BF16 weights
               # a quantized program's: F32, BF16, I32 and its codes' dtype (its F16 scales, AMK_QCOMP_DTYPE 1,
               # convert themselves: loader.compiled_dtypes); weights of that dtype and BF16 (the LM head,
               # kept in bf16 by default)
               "int8": {**ONLY_WIDE, "AMK_DTYPES": 0x1D, "AMK_GEMV_WDTYPES": 0x14, "AMK_QCOMP_DTYPE": 1, **LLAMA_FEATURES},
               # U4 weights, dotted in integers against x packed as fixed point (_xq_define)
               "int4": {"AMK_DTYPES": 0x2D, "AMK_GEMV_WDTYPES": 0x24, "AMK_QCOMP_DTYPE": 1, **LLAMA_FEATURES, "AMK_GEMV_U4_XQ": 1},
               # asymmetric int8 (ScheduleConfig.quant_asym): I8 weights with zeros
               "int8_asym": {**ONLY_WIDE, "AMK_DTYPES": 0x1D, "AMK_GEMV_WDTYPES": 0x14, "AMK_GEMV_I8_ZERO": 1, "AMK_QCOMP_DTYPE": 1,
                             **LLAMA_FEATURES},
               # ScheduleConfig.gemv_loads_ahead (on for the 1B and the 8B by 'auto': bf16, int8, int4); with
               # float or symmetric int8 weights the loader leaves the rows' tail out of it (_whole_vecs_define)
               "bf16_ahead": {**ONLY_WIDE, "AMK_DTYPES": 0x0D, "AMK_GEMV_WDTYPES": 0x04, **LLAMA_FEATURES, "AMK_GEMV_LOADS_AHEAD": 1,
                              "AMK_GEMV_WHOLE_VECS": 1},
               # and, with symmetric int8 weights too, x packed as fixed point for integer dots (_xq_define)
               "int8_ahead": {**ONLY_WIDE, "AMK_DTYPES": 0x1D, "AMK_GEMV_WDTYPES": 0x14, "AMK_QCOMP_DTYPE": 1, **LLAMA_FEATURES,
                              "AMK_GEMV_LOADS_AHEAD": 1, "AMK_GEMV_WHOLE_VECS": 1, "AMK_GEMV_I8_XQ": 1},
               "int4_ahead": {"AMK_DTYPES": 0x2D, "AMK_GEMV_WDTYPES": 0x24, "AMK_QCOMP_DTYPE": 1, **LLAMA_FEATURES,
                              "AMK_GEMV_LOADS_AHEAD": 1, "AMK_GEMV_U4_XQ": 1},
               # ScheduleConfig.o_proj_kv_slices: no ATTN_COMBINE op; the o-proj's combine prologue and
               # the MLP's reads of x with partials
               "bf16_oslices": {"AMK_DTYPES": 0x0D, "AMK_GEMV_WDTYPES": 0x04, **LLAMA_FEATURES, "AMK_OPS": 0x445,
                                "AMK_GEMV_COMBINE": 1, "AMK_GEMV_PARTIALS": 1},
               # ScheduleConfig.fuse_argmax: the LM head's epilogue writes the argmax pairs (off by default)
               "bf16_fargmax": {**ONLY_WIDE, "AMK_DTYPES": 0x0D, "AMK_GEMV_WDTYPES": 0x04, **LLAMA_FEATURES, "AMK_GEMV_ARGMAX": 1}}


def nvcc_path() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    default = Path("/usr/local/cuda/bin/nvcc")
    return str(default) if default.exists() else None


def _source_dirs(root: Path | None) -> tuple[Path, Path]:
    """(vm/, instructions/) of this tree, or of another one at root (e.g. an older commit's export)."""
    from amk.vm.build import source_dirs

    return (Path(root) / "vm", Path(root) / "instructions") if root else source_dirs()


def _nvcc() -> str:
    nvcc = nvcc_path()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found")
    return nvcc


def nvcc_command(nvcc: str, arch: int, out: Path, threads: int = DEFAULT_THREADS, defines: dict | None = None,
                 root: Path | None = None) -> list[str]:
    """root: another source tree (its vm/ and instructions/), e.g. an older commit's export."""
    from amk.vm.build import MAIN_SOURCE

    vm_dir, ins_dir = _source_dirs(root)
    return [nvcc, "-c", "-std=c++17", f"-arch=sm_{arch}", f"-DAMK_BLOCK_THREADS={threads}",
            *(f"-D{k}={v}" for k, v in (defines or {}).items()),
            "-Werror", "all-warnings", "-Xptxas", "-warn-spills", "-Xcompiler", "-Wall,-Wextra",
            f"-I{vm_dir}", f"-I{ins_dir}", str(vm_dir / MAIN_SOURCE), "-o", str(out)]


def nvcc_compile(arch: int, threads: int = DEFAULT_THREADS, defines: dict | None = None,
                 root: Path | None = None) -> tuple[bool, str]:
    """(ok, compiler output). ok is False on an error or on any warning line."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = nvcc_command(_nvcc(), arch, Path(tmp) / "megakernel.o", threads, defines, root)
        proc = subprocess.run(cmd, capture_output=True, text=True)
    output = (proc.stdout + proc.stderr).strip()
    bad = proc.returncode != 0 or any("warning" in line.lower() for line in output.splitlines())
    return not bad, f"$ {' '.join(cmd)}\n{output}"


def nvcc_ptx(arch: int, out: Path, threads: int = DEFAULT_THREADS, defines: dict | None = None,
             root: Path | None = None) -> None:
    """The megakernel's PTX for `arch` into `out` (nvcc -ptx of the same command): two trees' or two
    define sets' PTX compared byte for byte (`cmp`) show whether a change reaches the code at all."""
    cmd = [c if c != "-c" else "-ptx" for c in nvcc_command(_nvcc(), arch, out, threads, defines, root)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")


def elf_text_bytes(data: bytes) -> int:
    """Bytes of machine code in an ELF64 little-endian object (a cubin): the sizes of its
    `.text*` sections summed (the kernel and the device functions kept out of line)."""
    import struct

    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise ValueError("not a little-endian ELF64 object")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", data, shoff + k * shentsize) for k in range(shnum)]
    names_at = sections[shstrndx][4]

    def name(off: int) -> str:
        end = data.index(b"\0", names_at + off)
        return data[names_at + off:end].decode()

    return sum(sec[5] for sec in sections if name(sec[0]).startswith(".text"))


def _cubin(arch: int, threads: int, defines: dict | None, root: Path | None, tmp: str, lineinfo: bool = False) -> Path:
    """The megakernel's cubin, to measure (code size, disassembly): warnings, spills among them,
    do not stop it (nvcc_compile is the check that refuses them)."""
    out = Path(tmp) / "megakernel.cubin"
    cmd = [c if c != "-c" else "-cubin" for c in nvcc_command(_nvcc(), arch, out, threads, defines, root)]
    for flag, arg in (("-Werror", "all-warnings"), ("-Xptxas", "-warn-spills")):
        at = next((i for i in range(len(cmd) - 1) if cmd[i:i + 2] == [flag, arg]), None)
        if at is not None:
            del cmd[at:at + 2]
    if lineinfo:
        cmd.insert(2, "-lineinfo")  # source lines only: the same SASS
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"$ {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    return out


def nvcc_code_bytes(arch: int, threads: int = DEFAULT_THREADS, defines: dict | None = None,
                    root: Path | None = None) -> int:
    """Machine-code bytes of the megakernel for `arch` (nvcc -cubin): what the instruction
    caches hold. Code that the latency-bound phases run once per task is fetched anew each
    time, so its size costs time (eval/PERF_NOTES.md items 78-79)."""
    with tempfile.TemporaryDirectory() as tmp:
        return elf_text_bytes(_cubin(arch, threads, defines, root, tmp).read_bytes())


# a function's first line in the device sources: AMK_DEVICE[_NOINLINE] ... name(, the kernel, or a struct
_FUNC_HEAD = re.compile(r"\s*(?:template <.*>\s*)?(?:AMK_DEVICE(?:_NOINLINE)?\b[^(]*?\b(\w+)\s*\(|"
                        r"extern \"C\" AMK_KERNEL\([^)]*\)\s*$|struct (\w+))")


def enclosing_functions(source: str) -> list[str]:
    """For each line of a device source (index = line number - 1), the function or struct it
    belongs to: the nearest head at or above it ("?" before the first)."""
    out, cur = [], "?"
    for line in source.splitlines():
        m = _FUNC_HEAD.match(line)
        if m:
            cur = m.group(1) or m.group(2) or "amk_megakernel"
        out.append(cur)
    return out


# nvdisasm --print-line-info's mark of the source line the next instructions come from
_SASS_FILE_LINE = re.compile(r'//## File "([^"]+)", line (\d+)')


def _inline_chains(disasm: str):
    """(index, chain, line) for each line of nvdisasm --print-line-info[-inline] output that is
    not a source mark: chain is the (file, line) of each inlined call level of the code the line
    belongs to, the innermost first (one level from plain --print-line-info; --print-line-info-
    inline prints one `//## File` mark a level, consecutively)."""
    chain: list[tuple[str, int]] = [("?", 0)]
    in_marks = False  # the previous line was a mark too: the same chain, one level out
    for i, line in enumerate(disasm.splitlines()):
        fl = _SASS_FILE_LINE.search(line)
        if fl:
            level = (Path(fl.group(1)).name, int(fl.group(2)))
            chain = [*chain, level] if in_marks else [level]
            in_marks = True
            continue
        in_marks = False
        yield i, tuple(chain), line


def instructions_by_source(disasm: str, sources: dict[str, str]) -> dict[tuple[str, str], int]:
    """Instruction counts per (file, enclosing function) from `nvdisasm --print-line-info`
    output; `sources` maps a file name to its text (files not in it count under their name)."""
    funcs = {name: enclosing_functions(text) for name, text in sources.items()}
    counts: dict[tuple[str, str], int] = {}
    where = None
    for line in disasm.splitlines():
        m = _SASS_FILE_LINE.search(line)
        if m:
            name, n = Path(m.group(1)).name, int(m.group(2))
            f = funcs.get(name)
            where = (name, f[n - 1] if f and 0 < n <= len(f) else "?")
        elif where and re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+\S", line):
            counts[where] = counts.get(where, 0) + 1
    return counts


def nvdisasm_path() -> str | None:
    """nvdisasm on PATH, beside nvcc, or from pip's nvidia-cuda-nvdisasm wheel (nvidia/cu*/bin)."""
    found = shutil.which("nvdisasm")
    nvcc = nvcc_path()
    beside = Path(nvcc).parent / "nvdisasm" if nvcc else None
    if found or (beside and beside.exists()):
        return found or str(beside)
    try:
        import nvidia  # a namespace package of NVIDIA's pip wheels
    except ImportError:
        return None
    wheel = [p for d in nvidia.__path__ for p in sorted(Path(d).glob("cu*/bin/nvdisasm"))]
    return str(wheel[0]) if wheel else None


def _disassemble(arch: int, threads: int, defines: dict | None, root: Path | None, encoding: bool = False,
                 inlining: bool = False) -> str:
    """nvdisasm --print-line-info of the megakernel for `arch` (nvcc -cubin -lineinfo); with
    `encoding`, each instruction's two 64-bit words too (-hex; control_bits reads the second);
    with `inlining`, each source line's chain of inlined calls (--print-line-info-inline: one
    `//## File` line a level, the innermost first)."""
    tool = nvdisasm_path()
    if tool is None:
        raise FileNotFoundError("nvdisasm not found (the CUDA toolkit's, or pip's nvidia-cuda-nvdisasm: "
                                "`pip install nvidia-cuda-nvdisasm`)")
    with tempfile.TemporaryDirectory() as tmp:
        cubin = _cubin(arch, threads, defines, root, tmp, lineinfo=True)
        line_info = "--print-line-info-inline" if inlining else "--print-line-info"
        return subprocess.run([tool, line_info, *(["-hex"] if encoding else []), "-c", str(cubin)],
                              capture_output=True, text=True, check=True).stdout


def spill_sites(disasm: str) -> dict[tuple[str, int], int]:
    """The spill stores and refills (the STL / LDL that nvdisasm marks "SpillRefill") per source
    (file name, line): whether a spill sits in a hot loop or on a cold path."""
    counts: dict[tuple[str, int], int] = {}
    where = ("?", 0)
    for line in disasm.splitlines():
        m = _SASS_FILE_LINE.search(line)
        if m:
            where = (Path(m.group(1)).name, int(m.group(2)))
        elif "SpillRefill" in line and re.search(r"\b(STL|LDL)(\.\w+)*\b", line):
            counts[where] = counts.get(where, 0) + 1
    return counts


_SASS_OP = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
_SASS_LABEL = re.compile(r"^(\.L_x_\d+):")
_SASS_BRANCH = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")


def loops(disasm: str, min_instructions: int = 1) -> list[dict]:
    """The innermost loops of a disassembly (a label and a later branch back to it, holding no
    other such loop): their instructions, 16-byte global loads and opcode mix, largest first.
    The loads are LDG ... .128 (the weights' `ld.global.nc`) and generic LD ... .128 (`amk_ld16`:
    the KV rows, partials and activations, all global memory in this kernel), counted in the mix as
    LDG128 and LD128. A hot loop's instructions over its loads' bytes is what it issues per byte
    streamed."""
    ops: list[str] = []
    labels: dict[str, int] = {}
    found = []
    for line in disasm.splitlines():
        m = _SASS_LABEL.match(line)
        if m:
            labels[m.group(1)] = len(ops)
            continue
        m = _SASS_OP.match(line)
        if not m:
            continue
        op = m.group(1)
        ops.append(op + "128" if op in ("LDG", "LD") and ".128" in line else op)
        b = _SASS_BRANCH.search(line)
        if b and b.group(1) in labels:
            found.append((labels[b.group(1)], len(ops), b.group(1)))
    inner = [(a, e, lab) for a, e, lab in found
             if e - a >= min_instructions and not any(a <= a2 and e2 <= e and (a2, e2) != (a, e) for a2, e2, _ in found)]
    out = []
    for a, e, lab in inner:
        body = ops[a:e]
        mix = Counter(body)
        out.append({"label": lab, "instructions": len(body), "loads16": mix["LDG128"] + mix["LD128"],
                    "mix": dict(sorted(mix.items(), key=lambda kv: (-kv[1], kv[0])))})
    return sorted(out, key=lambda d: -d["instructions"])


# Each SASS instruction's second 64-bit word (nvdisasm -hex prints it on the next line) carries its
# scheduling controls from bit 41 (sm_70 and later): stall cycles (4 bits), yield (1), the
# dependency barrier its result sets (3; 7 = none), the one its source reads release (3), and
# the mask of barriers it waits on (6). A barrier counts its instructions in flight, and a wait
# is for all of them.
_SASS_HEX_WORD = re.compile(r"/\* (0x[0-9a-f]{16}) \*/\s*$")


def control_bits(hi: int) -> dict:
    """The scheduling controls of an instruction's high word (see above)."""
    wb, rb, mask = (hi >> 46) & 7, (hi >> 49) & 7, (hi >> 52) & 0x3F
    return {"stall": (hi >> 41) & 0xF, "yield": (hi >> 45) & 1, "write_barrier": None if wb == 7 else wb,
            "read_barrier": None if rb == 7 else rb, "waits": tuple(b for b in range(6) if mask >> b & 1)}


def serial_load_waits(hex_disasm: str) -> list[dict]:
    """Waits on a dependency barrier that 16-byte global loads (LDG ... .128) set since its last
    wait, in program order (nvdisasm -hex --print-line-info): each is a memory latency a warp
    sits out. ptxas puts a lane's 16-byte weight loads on one barrier, so a loop that issues a
    load and then waits on that barrier waits for the load it just issued (eval/PERF_NOTES.md
    item 168). One record a wait: address, source file and line, barrier, loads pending on it,
    and `reads`: whether the waiting instruction names a register those loads write (False: it
    waits only for loads it does not use; None for a branch, which waits on behalf of the code it
    jumps to), and `older`: whether it names a register an earlier 16-byte load wrote whose wait
    has passed (reads False and older True: a use of older loads held up by loads issued ahead of
    it, item 168's mark; with older False it is other work, such as a loop's index arithmetic
    just before the first use of a round's loads, which waits no longer than that use would).
    `chain`: the (file, line)
    of each inlined call level, the innermost (file, line) first, from --print-line-info-inline
    output (one level from plain --print-line-info)."""
    lines = hex_disasm.splitlines()
    pending = [0] * 6
    regs: list[set[int]] = [set() for _ in range(6)]  # the registers the pending loads write
    landed: set[int] = set()  # registers of 16-byte loads whose wait has passed (not rewritten by one since)
    out = []
    for i, chain, line in _inline_chains(hex_disasm):
        where = chain[0]
        m = _SASS_OP.match(line)
        nxt = _SASS_HEX_WORD.search(lines[i + 1]) if m and i + 1 < len(lines) else None
        if not nxt:
            continue
        ctl = control_bits(int(nxt.group(1), 16))
        named = {int(r) for r in re.findall(r"\bR(\d+)\b", line)}
        for b in ctl["waits"]:
            if pending[b]:
                addr = int(re.match(r"\s+/\*([0-9a-f]+)\*/", line).group(1), 16)
                branch = m.group(1) == "BRA"  # a branch waits for its targets
                out.append({"addr": addr, "file": where[0], "line": where[1], "barrier": b, "loads": pending[b],
                            "reads": None if branch else bool(named & regs[b]),
                            "older": None if branch else bool(named & landed), "chain": chain})
                landed |= regs[b]
                pending[b], regs[b] = 0, set()
        dest = re.search(r"\bLDG\S*\.128\S*\s+R(\d+),", line)
        if dest and ctl["write_barrier"] is not None:
            written = set(range(int(dest.group(1)), int(dest.group(1)) + 4))
            pending[ctl["write_barrier"]] += 1
            regs[ctl["write_barrier"]] |= written
            landed -= written
    return out


def _source_texts(root: Path | None) -> dict[str, str]:
    """The device sources by file name (vm/ and instructions/ of the tree at `root`)."""
    return {f.name: f.read_text() for d in _source_dirs(root) for f in sorted(d.iterdir())
            if f.suffix in (".cu", ".cuh", ".h")}


def _source_functions(root: Path | None) -> dict[str, list[str]]:
    """enclosing_functions of each device source of the tree at `root`, by file name."""
    return {name: enclosing_functions(text) for name, text in _source_texts(root).items()}


def code_by_source(arch: int, threads: int = DEFAULT_THREADS, defines: dict | None = None,
                   root: Path | None = None) -> dict[tuple[str, str], int]:
    """Instructions of the megakernel per (source file, function): what makes the code large
    (nvcc -cubin -lineinfo, then nvdisasm --print-line-info)."""
    return instructions_by_source(_disassemble(arch, threads, defines, root), _source_texts(root))


def chain_disassembly(arch: int, defines: dict | None = None, root: Path | None = None,
                      threads: int = DEFAULT_THREADS) -> str:
    """The megakernel's disassembly that load_waits and division_sites read (each instruction's
    encoding, each source line's inlined call chain): one compile serves both."""
    return _disassemble(arch, threads, defines, root, encoding=True, inlining=True)


def load_waits(arch: int, defines: dict | None = None, root: Path | None = None,
               threads: int = DEFAULT_THREADS, disasm: str | None = None) -> list[dict]:
    """serial_load_waits of the megakernel for `arch` (or of `disasm`, its chain_disassembly),
    each wait with `functions` too: the enclosing function of each level of its inlined call
    chain, innermost first (so a wait in the scalar weight path has amk_w_at among them)."""
    funcs = _source_functions(root)
    waits = serial_load_waits(disasm or chain_disassembly(arch, defines, root, threads))
    for w in waits:
        w["functions"] = _functions_of(w["chain"], funcs)
    return waits


def _functions_of(chain: tuple[tuple[str, int], ...], funcs: dict[str, list[str]]) -> tuple[str, ...]:
    """The enclosing function of each (file, line) of an inlined call chain (enclosing_functions
    of each source in `funcs`), "?" where the line is not in them."""
    return tuple(funcs[f][n - 1] if f in funcs and 0 < n <= len(funcs[f]) else "?" for f, n in chain)


# nvcc's sequence for an integer division (or remainder) by a value known only at run time
# begins with a round-up conversion of the divisor (I2F.RP signed, I2F.U32.RP unsigned), then a
# MUFU.RCP: ~20 dependent instructions (64-bit ones: I2F.U64.RP, or a call)
_SASS_INT_DIVISION = re.compile(r"\bI2F(?:\.U32|\.U64)?\.RP\b")


def integer_divisions(disasm: str) -> Counter:
    """Run-time integer divisions in nvdisasm --print-line-info[-inline] output, counted
    by inlined call chain (innermost (file, line) first). One whose result the first loads'
    addresses need delays them by more than its instructions (eval/PERF_NOTES.md items 172,
    178-179: removing such divisions gained 0.5-1.9 %)."""
    return _chains_of(_SASS_INT_DIVISION, disasm)


# a jump table's indirect branch (a switch's lowering where it has four or more cases): its target
# is read from the constant bank first (eval/PERF_NOTES.md item 242)
_SASS_JUMP_TABLE = re.compile(r"\bBRX\b")


def _chains_of(pattern: re.Pattern, disasm: str) -> Counter:
    """The instructions matching `pattern` in nvdisasm --print-line-info[-inline] output, counted by
    inlined call chain (innermost (file, line) first)."""
    return Counter(chain for _, chain, line in _inline_chains(disasm) if _SASS_OP.match(line) and pattern.search(line))


def _sites(counts: Counter, root: Path | None) -> list[dict]:
    """One record a call chain of `counts`, with `count` and `functions` (the enclosing function of
    each level, innermost first), the most first."""
    funcs = _source_functions(root)
    return [{"chain": chain, "count": n, "functions": _functions_of(chain, funcs)}
            for chain, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def division_sites(arch: int, defines: dict | None = None, root: Path | None = None,
                   threads: int = DEFAULT_THREADS, disasm: str | None = None) -> list[dict]:
    """integer_divisions of the megakernel for `arch` (or of `disasm`, its chain_disassembly), by
    call chain (_sites)."""
    return _sites(integer_divisions(disasm or chain_disassembly(arch, defines, root, threads)), root)


def jump_table_sites(arch: int, defines: dict | None = None, root: Path | None = None,
                     threads: int = DEFAULT_THREADS, disasm: str | None = None) -> list[dict]:
    """The megakernel's jump-table branches (BRX) for `arch` (or in `disasm`, its chain_disassembly),
    by call chain (_sites)."""
    return _sites(_chains_of(_SASS_JUMP_TABLE, disasm or chain_disassembly(arch, defines, root, threads)), root)


def print_sites(label: str, what: str, sites: list[dict], n: int) -> None:
    """The total of `sites` (division_sites, jump_table_sites) and its n call chains with the most."""
    print(f"{label}: {sum(d['count'] for d in sites)} {what}"
          + (f"; the {min(n, len(sites))} call chains with the most:" if sites else ""))
    for d in sites[:n]:
        print(f"  {d['count']:4}  {_call_path(d['functions'])}  ({d['chain'][0][0]}:{d['chain'][0][1]})")


_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def spill_bytes(ok: bool, output: str) -> tuple[int, int] | None:
    """(spill store bytes, spill load bytes) of an `nvcc_compile` result: (0, 0) for a clean
    build, None when it failed for another reason than spills."""
    if ok:
        return 0, 0
    found = _SPILL.search(output)
    others = [line for line in output.splitlines()[1:] if "spill" not in line and line.strip()]
    return (int(found.group(1)), int(found.group(2))) if found and not others else None


def report(results) -> int:
    """Print `label: ok` / `label: FAILED` and the failure's output for each (label, ok, output);
    the exit status: 1 if any failed. Shared with vm/hip_compile_check.py."""
    failed = 0
    for label, ok, out in results:
        print(f"{label}: {'ok' if ok else 'FAILED'}")
        if not ok:
            failed += 1
            spills = spill_bytes(ok, out)
            print(f"  spill stores {spills[0]} B, spill loads {spills[1]} B" if spills else out)
    return 1 if failed else 0


def bad_defines(defines: list[str]) -> list[str]:
    """The `-D` arguments not of the form AMK_NAME=INT (the CLIs here and in hip_compile_check)."""
    return [d for d in defines if not d.partition("=")[2].lstrip("-").isdigit()]


def parse_defines(defines: list[str]) -> dict[str, int]:
    """`-D` arguments (AMK_NAME=INT, checked by bad_defines) as build defines."""
    return {k: int(v) for k, _, v in (d.partition("=") for d in defines)}


def _call_path(functions: tuple[str, ...], most: int = 6) -> str:
    """The innermost `most` functions of a call chain, each once ('a < b < c': a called from b)."""
    names = [f for i, f in enumerate(functions) if i == 0 or f != functions[i - 1]]
    return " < ".join(names[:most]) + (" < ..." if len(names) > most else "")


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m amk.vm.compile_check", description=(__doc__ or "").strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("archs", nargs="*", metavar="sm_NN", help=f"default: {' '.join(f'sm_{a}' for a in ARCHS)}")
    ap.add_argument("--build", choices=["generic", *SPECIALIZED], default="generic",
                    help="the every-dtype build, or one the loader makes for a program's dtypes")
    ap.add_argument("-D", "--define", action="append", default=[], metavar="AMK_NAME=INT",
                    help="an extra integer define (as $AMK_VM_DEFINES gives the loader's builds)")
    ap.add_argument("--code-size", action="store_true",
                    help="also print each build's machine-code bytes (nvcc -cubin; the instruction-cache footprint)")
    ap.add_argument("--by-source", type=int, default=0, metavar="N",
                    help="also print the N (file, function) pairs with the most instructions (needs nvdisasm)")
    ap.add_argument("--spill-sites", action="store_true",
                    help="also print the source lines of the spill stores and refills (needs nvdisasm): "
                         "a spill on a cold path costs nothing, one in a loop does")
    ap.add_argument("--loops", type=int, default=0, metavar="N",
                    help="also print every loop of at least N instructions, its 16-byte global loads and its "
                         "most frequent opcodes (needs nvdisasm): instructions issued per byte streamed")
    ap.add_argument("--jump-tables", type=int, metavar="N", default=0,
                    help="also print the N inlined call chains with the most jump-table branches (BRX: a "
                         "switch of four or more cases; its target is a constant-bank load away) (needs nvdisasm)")
    ap.add_argument("--divisions", type=int, metavar="N", default=0,
                    help="also print the N inlined call chains with the most run-time integer divisions "
                         "(needs nvdisasm): one ahead of a task's first loads delays them")
    ap.add_argument("--load-waits", action="store_true",
                    help="also print the source lines whose instructions wait on 16-byte loads issued since "
                         "that barrier's last wait (needs nvdisasm): a memory latency each, in program order; "
                         "a pipelined loop that shows one a vector serialises its loads")
    ap.add_argument("--ptx", default=None, metavar="FILE",
                    help="also write the build's PTX (nvcc -ptx; one arch) to FILE, to compare two trees or "
                         "define sets byte for byte")
    ap.add_argument("--sources", default=None, metavar="DIR",
                    help="check and measure the tree at DIR (its vm/ and instructions/) instead of this one, "
                         "e.g. an older commit's `git archive`")
    a = ap.parse_args(argv)
    bad = [x for x in a.archs if not x.removeprefix("sm_").isdigit()]
    bad += bad_defines(a.define)
    if bad:
        print(f"error: not an architecture or NAME=INT: {' '.join(bad)}", file=sys.stderr)
        return 2
    defines = {**SPECIALIZED.get(a.build, {}), **parse_defines(a.define)}
    archs = [int(x.removeprefix("sm_")) for x in a.archs] or list(ARCHS)
    if a.ptx and len(archs) != 1:
        print("error: --ptx writes one arch's PTX: name one (e.g. 90)", file=sys.stderr)
        return 2
    tag = "" if a.build == "generic" and not a.define else f" {a.build} {' '.join(a.define)}".rstrip()
    check = functools.partial(nvcc_compile, root=a.sources) if a.sources else nvcc_compile
    status = report((f"sm_{arch}{tag}", *check(arch, defines=defines)) for arch in archs)
    if a.ptx:
        nvcc_ptx(archs[0], Path(a.ptx), defines=defines, root=a.sources)
        print(f"sm_{archs[0]}{tag}: PTX written to {a.ptx}")
    for arch in archs if a.code_size else ():
        print(f"sm_{arch}{tag}: {nvcc_code_bytes(arch, defines=defines, root=a.sources):,} bytes of code")
    for arch in archs if a.by_source else ():
        counts = code_by_source(arch, defines=defines, root=a.sources)
        total = sum(counts.values())
        print(f"sm_{arch}{tag}: {total:,} instructions; the largest (file: function):")
        for (f, fn), n in sorted(counts.items(), key=lambda kv: -kv[1])[:a.by_source]:
            print(f"  {n:7,}  {n / total * 100:5.1f} %  {f}: {fn}")
    for arch in archs if a.spill_sites else ():
        sites = spill_sites(_disassemble(arch, DEFAULT_THREADS, defines, a.sources))
        print(f"sm_{arch}{tag}: {sum(sites.values())} spill stores and refills" + (":" if sites else ""))
        for (f, line), n in sorted(sites.items()):
            print(f"  {n:4}  {f}:{line}")
    for arch in archs if a.loops else ():
        print(f"sm_{arch}{tag}: loops of {a.loops} instructions or more:")
        for lp in loops(_disassemble(arch, DEFAULT_THREADS, defines, a.sources), a.loops):
            per_byte = f"{lp['instructions'] / (16 * lp['loads16']):.2f} a byte" if lp["loads16"] else "no 16-byte loads"
            mix = ", ".join(f"{o} {n}" for o, n in list(lp["mix"].items())[:8])
            print(f"  {lp['label']}: {lp['instructions']} instructions, {lp['loads16']} 16-byte loads ({per_byte}); {mix}")
    for arch in archs if a.divisions else ():
        print_sites(f"sm_{arch}{tag}", "run-time integer divisions", division_sites(arch, defines, a.sources),
                    a.divisions)
    for arch in archs if a.jump_tables else ():
        print_sites(f"sm_{arch}{tag}", "jump-table branches (BRX)", jump_table_sites(arch, defines, a.sources),
                    a.jump_tables)
    for arch in archs if a.load_waits else ():
        waits = load_waits(arch, defines, a.sources)
        by_line = Counter((w["file"], w["line"]) for w in waits)
        unused = sum(w["reads"] is False for w in waits)
        held = sum(w["reads"] is False and bool(w["older"]) for w in waits)
        print(f"sm_{arch}{tag}: {len(waits)} waits on 16-byte loads issued since the barrier's last wait, "
              f"{unused} of them for loads the waiting instruction does not read, {held} of those by a "
              f"use of older loads (item 168's mark)"
              + (" (by source line):" if waits else ""))
        for (f, line), n in sorted(by_line.items()):
            here = [w for w in waits if (w["file"], w["line"]) == (f, line)]
            loads = [w["loads"] for w in here]
            print(f"  {n:4}  {f}:{line}  (loads pending: {min(loads)}-{max(loads)}; "
                  f"not read: {sum(w['reads'] is False for w in here)})")
            for calls, older in sorted({(_call_path(w["functions"]), bool(w["older"])) for w in here
                                        if w["reads"] is False}):
                print(f"          not read{', by a use of older loads' if older else ''}, in {calls}")
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
