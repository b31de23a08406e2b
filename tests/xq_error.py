"""How far the emulated VM's GEMV outputs sit from the ReferenceVM's and from an fp64 dot, under
build defines: the figures eval/PERF_NOTES.md items 235 and 236 give for the packed x of
AMK_GEMV_I8_XQ and AMK_GEMV_U4_XQ.

    python tests/xq_error.py i8_large_x "" AMK_GEMV_I8_XQ=1
    python tests/xq_error.py --lowered ""   # fp32 int8 and int4 loads-ahead models, packed by the loader

Per define set (one emulated build each; needs g++) and GEMV case of tests/vm_cases.py GEMV_CASES,
over four steps: the worst |got - want| as a share of close()'s bound (1e-4 + 1e-4 |want|), the same
against that bound widened by xq_bound, and the worst error of the VM and of the ReferenceVM against
the fp64 dot (relative to 1 + |y|; int8 STORE cases). --lowered: the logits of the lowered smollm2-like
and llama-gqa-tied models with int8 and int4 weights in the loads-ahead loop (packed by the loader),
against close()'s bound.
A diagnostic script, not a test.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from amk.vm.loader import PackedProgram, knob_defines  # noqa: E402
from amk.vm.reference import ReferenceVM  # noqa: E402
from emu_vm import EmuVM, build  # noqa: E402
from vm_cases import GEMV_CASES, PROMPT, case_program, lowered, xq_bound  # noqa: E402


def share(err: torch.Tensor, bound: torch.Tensor) -> float:
    return float((err / bound).max())


def gemv_errors(name: str, out: Path) -> str:
    case = GEMV_CASES[name]
    prog, t = case_program(name)
    ref, vm = ReferenceVM(prog, t), EmuVM(prog, t, build(out, knob_defines(prog)))
    plain = widened = vm64 = ref64 = 0.0
    for pos, tok in enumerate([1, 3, 0, 2]):
        want = ref.run_step(tok, pos)["y"].double()
        got = vm.run_step(tok, pos)["y"].double().cpu()
        bound = 1e-4 + 1e-4 * want.abs()
        extra = xq_bound(case, t, tok)
        plain = max(plain, share((got - want).abs(), bound))
        widened = max(widened, share((got - want).abs(), bound + (0 if extra is None else extra)))
        if case.quant == "i8" and case.epilogue == 0 and case.norm_eps is None and case.split_k == 1:
            w = t["w"].double() * t["w.scale"].double().repeat_interleave(case.group, 1)
            y64 = w @ t["x_table"][tok].double()
            vm64 = max(vm64, share((got - y64).abs(), 1 + y64.abs()))
            ref64 = max(ref64, share((want - y64).abs(), 1 + y64.abs()))
    fp64 = f"; against fp64: VM {vm64:.2e}, ReferenceVM {ref64:.2e}" if vm64 else ""
    return f"worst / close()'s bound {plain:.3f}; / widened by xq_bound {widened:.3f}{fp64}"


def lowered_errors(out: Path) -> list[str]:
    lines = []
    for model, quant in [(m, q) for q in ("int8", "int4") for m in ("smollm2-like", "llama-gqa-tied")]:
        prog, t = lowered(model, kv_splits=4, kv_block=8, quant=quant, gemv_loads_ahead=True, max_queues=4,
                          threads_per_block=64)
        defines = {**PackedProgram(prog).defines, **knob_defines(prog)}
        vm, ref = EmuVM(prog, t, build(out, defines)), ReferenceVM(prog, t)
        got = torch.stack([vm.run_step(tok, pos)["logits"].cpu() for pos, tok in enumerate(PROMPT)]).double()
        want = ref.logits_for(PROMPT).double()
        err = share((got.reshape(want.shape) - want).abs(), 1e-4 + 1e-4 * want.abs())
        xq = "AMK_GEMV_I8_XQ" if quant == "int8" else "AMK_GEMV_U4_XQ"
        lines.append(f"{model} {quant} ({xq}={defines.get(xq, 0)}): worst / close()'s bound {err:.3f}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("case", nargs="?", help="a GEMV_CASES name (not with --lowered)")
    ap.add_argument("defines", nargs="*", help='define sets, e.g. "" (none) and "AMK_GEMV_I8_XQ=1"')
    ap.add_argument("--lowered", action="store_true", help="the lowered int8 loads-ahead models instead")
    args = ap.parse_args()
    out = Path(tempfile.mkdtemp())
    if args.lowered:
        os.environ["AMK_VM_DEFINES"] = ""
        print("\n".join(lowered_errors(out)))
        return
    if args.case not in GEMV_CASES:
        ap.error(f"unknown case {args.case!r}; one of {', '.join(GEMV_CASES)}")
    for defs in args.defines or [""]:
        os.environ["AMK_VM_DEFINES"] = defs
        print(f"{args.case} [{defs or 'no defines'}]: {gemv_errors(args.case, out)}")


if __name__ == "__main__":
    main()
