"""Does asymmetric int8 give the 64-of-64 greedy tokens that symmetric int8 misses?

A probe in plain transformers, written before the format existed in the IR (eval/PERF_NOTES.md
item 129) and now using its quantizers (`amk.schedule.quantize`), so it checks them outside the VM:
transformers' float32 model of the embedded SmolLM2 GGUF (the reference of
`amk.eval.quant_quality`) with every linear layer's weight replaced by its int8 round trip,
then 64 greedy tokens after the quality table's prompt, compared with the float model's.

    python -m amk.eval.int8_asym_probe [--gguf FILE] [--tokens 64]

Formats (groups along K, the LM head / tied embedding left float as in the quality table):
  sym:   codes -127..127 times absmax / 127 (the IR's symmetric I8);
  asym:  codes -128..127 times (max - min) / 255 plus a zero (the value of code 0; `quant_asym`), scale and
         zero rounded to float32 or float16 (the bf16 programs' companion dtype).
The checkpoint's linears are Q4_1: each block of 32 lies on 16 levels from its minimum, which
asymmetric int8 at group 32 reproduces (codes 17 apart) up to the rounding of its scale and
zero; symmetric int8 cannot. CPU only; ~1 minute.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from amk.eval.quant_quality import PROMPT


def sym_int8(w: torch.Tensor, group: int) -> torch.Tensor:
    """w's round trip through the IR's symmetric I8 (float32 scales)."""
    from amk.schedule.quantize import dequantize, quantize_int8

    return dequantize(*quantize_int8(w, group, torch.float32))


def asym_int8(w: torch.Tensor, group: int, companion: torch.dtype) -> torch.Tensor:
    """w's round trip through the IR's asymmetric I8 (`quant_asym`), scale and zero in `companion`."""
    from amk.schedule.quantize import dequantize, quantize_int8_asym

    return dequantize(*quantize_int8_asym(w, group, companion))


def main(argv=None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from amk.schedule.importer.default_model import default_gguf_path
    from amk.schedule.importer.errors import ModelLoadError

    ap = argparse.ArgumentParser(prog="python -m amk.eval.int8_asym_probe", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=None, help="the GGUF file (default: the embedded SmolLM2)")
    ap.add_argument("--tokens", type=int, default=64)
    a = ap.parse_args(argv)
    try:
        path = a.gguf or default_gguf_path()
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not path.is_file():
        print(f"error: no file {path}", file=sys.stderr)
        return 2
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = tok(PROMPT, return_tensors="pt").input_ids

    def greedy() -> list[int]:
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=a.tokens, do_sample=False)
        return out[0, ids.shape[1]:].tolist()

    ref = greedy()
    linears = {n: p.detach().clone() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n
               and "lm_head" not in n}
    formats = [("sym g32", lambda w: sym_int8(w, 32))]
    for g in (32, 64):
        for name, dt in (("f32", torch.float32), ("f16", torch.float16)):
            formats.append((f"asym g{g} {name}", lambda w, g=g, dt=dt: asym_int8(w, g, dt)))
    print(f"{'format':<16}{'same prefix':>12}{'same positions':>16}{'max |dw|':>12}")
    for label, fmt in formats:
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in linears:
                    p.copy_(fmt(linears[n]))
        got = greedy()
        prefix = next((i for i, (x, y) in enumerate(zip(got, ref)) if x != y), len(ref))
        same = sum(x == y for x, y in zip(got, ref))
        err = max((fmt(w) - w).abs().max().item() for w in linears.values())
        print(f"{label:<16}{prefix:>12}{same:>16}{err:>12.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
