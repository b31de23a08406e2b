"""`amk generate`: greedy decoding through the megakernel, optionally verified against HF."""

from __future__ import annotations

from typing import Optional

import typer

from amk.commands import model_args as A
from amk.commands.common import emit_json, fail


def generate_command(
    model: Optional[str] = A.MODEL,
    prompt: Optional[str] = typer.Option(None, "--prompt", help="Prompt text. Without a tokenizer (--random-init) "
                                         "the text's UTF-8 bytes modulo the vocabulary are the ids."),
    prompt_ids: Optional[str] = typer.Option(None, "--prompt-ids", help="Comma-separated token ids, e.g. 1,2,3."),
    max_new_tokens: int = typer.Option(32, "--max-new-tokens", min=1),
    device: str = typer.Option("auto", "--device", help="cpu (the ReferenceVM), cuda (the megakernel) or auto."),
    verify: bool = typer.Option(False, "--verify", help="Check token for token against HF generate on the same weights."),
    config: Optional[str] = A.CONFIG,
    target: Optional[str] = A.TARGET,
    dtype: Optional[str] = A.DTYPE,
    random_init: bool = A.RANDOM_INIT,
    seed: int = A.SEED,
    kv_capacity: int = A.KV_CAPACITY,
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Generate MAX_NEW_TOKENS greedy tokens; exit 1 if --verify finds a difference."""
    import torch

    from amk.errors import AmkError

    if (prompt is None) == (prompt_ids is None):
        fail("give exactly one of --prompt and --prompt-ids")
    ids_in = prompt
    if prompt_ids is not None:
        try:
            ids_in = [int(x) for x in prompt_ids.split(",") if x.strip()]
        except ValueError:
            fail(f"--prompt-ids must be comma-separated integers, got {prompt_ids!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    mk = A.build(model, config, target, dtype, random_init, seed, kv_capacity, progress=not as_json)
    try:
        ids = mk.encode(ids_in)
        new = mk.generate(ids, max_new_tokens, device=device, progress=not as_json)
    except AmkError as exc:
        fail(str(exc), code=1)
    result = {"model": mk.spec.name, "device": device, "prompt_ids": ids, "new_ids": new, "text": mk.decode(new)}
    ok = True
    if verify:
        from amk.eval.oracle import hf_greedy, matching_prefix
        from amk.schedule.importer import build_hf_model

        # the reference runs at the program's precision (bf16 programs against HF in bf16)
        ref_dtype = mk.config.dtype or mk.spec.dtype
        hf = hf_greedy(build_hf_model(mk.spec, mk.source_weights, dtype=ref_dtype), ids, max_new_tokens)
        match = matching_prefix(new, hf)
        ok = match == len(hf)
        result.update(verify={"hf_ids": hf, "matching": match, "of": len(hf), "pass": ok})
    if as_json:
        emit_json(result)
    else:
        typer.echo(result["text"])
        if verify:
            v = result["verify"]
            typer.echo(f"verify vs HF generate: {v['matching']}/{v['of']} tokens identical - {'PASS' if ok else 'FAIL'}")
    raise typer.Exit(0 if ok else 1)
