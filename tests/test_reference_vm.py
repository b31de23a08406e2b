"""The ReferenceVM on hand-made programs: each against an independent torch formulation
(HF modules where they exist), plus the scheduling simulation itself (queue vs random
order, deadlock, poison) and the region addressing."""

from __future__ import annotations

import pytest
import torch
from amk.schedule.ir import (
    AddParams,
    Buffer,
    BufferKind,
    DType,
    Epilogue,
    KvMode,
    Operand,
    ValidationResult,
    Violation,
)
from amk.vm.reference import DeadlockError, ReferenceVM
from amk.vm.regions import RegionError, region, region_index
from programs import (
    Builder,
    GemvCase,
    attention_program,
    gemv_program,
    lm_head_program,
    opd,
    tiny_model_program,
    with_threshold,
)
from refs import attention, dequant, hf_rmsnorm, hf_rope, unpack_u4_slow
from vm_cases import hf_model

close = torch.testing.assert_close
K = BufferKind


# ----------------------------------------------------------------------------- regions
def test_region_flat_strided():
    b = Buffer(id=0, name="w", kind=K.WEIGHT, dtype=DType.F32, shape=[4, 10])
    idx = region_index(Operand(buf=0, off=12, len=3, count=2, stride=10), b)
    assert idx.tolist() == [[12, 13, 14], [22, 23, 24]]
    with pytest.raises(RegionError):
        region(Operand(buf=0, off=35, len=3, count=2, stride=10), b)  # second run ends at 48 > 40


def test_region_kv_append_and_prefix():
    kv = Buffer(id=1, name="kc", kind=K.KV_CACHE, dtype=DType.F32, shape=[8, 6])
    assert region_index(Operand(buf=1, off=2, len=2, kv=KvMode.APPEND), kv, pos=3).tolist() == [[20, 21]]
    assert region_index(Operand(buf=1, off=2, len=2, kv=KvMode.PREFIX), kv, pos=2).tolist() == [[2, 3], [8, 9], [14, 15]]
    flat = torch.arange(48.0)
    assert region(Operand(buf=1, off=2, len=2, kv=KvMode.PREFIX), kv, pos=2).view(flat).tolist() == [[2, 3], [8, 9], [14, 15]]
    with pytest.raises(RegionError):
        region(Operand(buf=1, off=0, len=2, kv=KvMode.APPEND), kv, pos=8)  # past capacity
    with pytest.raises(RegionError):
        region(Operand(buf=1, off=0, len=2), kv, pos=0)  # a KV cache needs APPEND/PREFIX


# ----------------------------------------------------------------------------- programs
def test_embed_norm_head_argmax():
    prog, t = lm_head_program()
    vm = ReferenceVM(prog, t)
    for token in (0, 7, 39):
        out = vm.run_step(token, 0)
        logits = t["embed"] @ hf_rmsnorm(t["embed"][token], t["norm"], 1e-5)
        close(out["logits"], logits)
        assert out["next_token"].dtype == torch.int32 and out["next_token"].item() == int(torch.argmax(logits))


def _expected_gemv(c: GemvCase, t: dict, token: int, pos: int) -> torch.Tensor:
    """The GEMV case computed whole-matrix, independently of the semantics module."""
    def weight(name):
        if c.quant is None:
            return t[name]
        codes = t[name] if c.quant == "i8" else unpack_u4_slow(t[name], c.rows * c.k).reshape(c.rows, c.k)
        return dequant(codes, t[name + ".scale"], t.get(name + ".zero"), c.group)

    x = t["x_table"][token]
    if c.norm_eps is not None:
        x = hf_rmsnorm(x, t["gamma"], c.norm_eps)
    a = weight("w") @ x + (t["bias"] if c.bias else 0)
    if c.epilogue == Epilogue.ADD:
        return t["r_table"][token] + a
    if c.epilogue == Epilogue.SILU_MUL:
        return torch.nn.functional.silu(a) * (weight("w2") @ x)
    if c.epilogue in (Epilogue.ROPE, Epilogue.ROPE_APPEND):
        if c.head_norm_eps is not None:
            a = hf_rmsnorm(a.reshape(-1, c.head_dim), t["head_gamma"], c.head_norm_eps).reshape(-1)
        heads = a.reshape(-1, c.head_dim)  # head h's frequencies are (h + 1) times HF's (programs.py)
        return torch.cat([hf_rope(heads[h], (h + 1) * pos, c.head_dim) for h in range(len(heads))])
    return a


GEMV_CASES = {
    "store": GemvCase(rows=12, k=32),
    "store-splitk-bias": GemvCase(rows=12, k=32, split_k=3, bias=True),
    "add-inplace": GemvCase(rows=16, k=24, epilogue=Epilogue.ADD, slabs=3),
    "add-splitk-norm": GemvCase(rows=16, k=48, split_k=2, epilogue=Epilogue.ADD, norm_eps=1e-5),
    "silu": GemvCase(rows=10, k=32, epilogue=Epilogue.SILU_MUL, norm_eps=1e-6),
    "silu-splitk": GemvCase(rows=10, k=32, split_k=4, epilogue=Epilogue.SILU_MUL),
    "rope": GemvCase(rows=32, k=24, epilogue=Epilogue.ROPE, head_dim=8, slabs=2),
    "rope-headnorm-splitk": GemvCase(rows=32, k=24, split_k=2, epilogue=Epilogue.ROPE, head_dim=8,
                                     head_norm_eps=1e-6, bias=True),
    "rope-append": GemvCase(rows=16, k=24, epilogue=Epilogue.ROPE_APPEND, head_dim=8, norm_eps=1e-5),
    "append-splitk": GemvCase(rows=16, k=24, split_k=2, epilogue=Epilogue.APPEND),
    "i8": GemvCase(rows=12, k=64, quant="i8", group=16, split_k=2),
    "u4": GemvCase(rows=12, k=64, quant="u4", group=16, split_k=2, norm_eps=1e-5),
    "u4-odd-rows-silu": GemvCase(rows=7, k=32, quant="u4", group=8, epilogue=Epilogue.SILU_MUL, slabs=3),
    "i8-add": GemvCase(rows=8, k=32, quant="i8", group=32, epilogue=Epilogue.ADD),
    # groups of 5 codes straddle bytes; the second K slice starts at a high nibble (column 15)
    "u4-odd-group": GemvCase(rows=3, k=30, quant="u4", group=5, split_k=2, slabs=2),
}


@pytest.mark.parametrize("name", list(GEMV_CASES))
def test_gemv_program(name):
    c = GEMV_CASES[name]
    prog, t = gemv_program(c, seed=hash(name) % 1000)
    vm = ReferenceVM(prog, t)
    for token, pos in ((1, 0), (3, 1), (0, 5)):
        out = vm.run_step(token, pos)
        got = vm.read_buffer("cache").reshape(c.kv_capacity, c.rows)[pos] if "y" not in out else out["y"]
        close(got, _expected_gemv(c, t, token, pos), rtol=1e-5, atol=1e-5)
    if c.quant:  # dequantizing per step instead of once gives the same bits
        again = ReferenceVM(prog, t, cache_weights=False).run_step(0, 5)
        assert torch.equal(again.get("y", torch.empty(0)), out.get("y", torch.empty(0)))


def test_bf16_output_is_the_fp32_result_rounded():
    """A store rounds the fp32 result once (RNE) to the buffer dtype; nothing else changes."""
    case = GemvCase(rows=16, k=48, split_k=2, bias=True)
    y32, y16 = (ReferenceVM(*gemv_program(c, seed=5)).run_step(2, 0)["y"]
                for c in (case, GemvCase(**{**case.__dict__, "out_dtype": DType.BF16})))
    assert y16.dtype == torch.bfloat16 and torch.equal(y16, y32.to(torch.bfloat16))


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("splits,block", [(1, 1), (3, 2), (5, 4)])
def test_attention_program_over_steps(qk_norm, splits, block):
    heads, kv_heads, d = 4, 2, 8
    prog, t = attention_program(heads=heads, kv_heads=kv_heads, head_dim=d, splits=splits, block=block,
                                qk_norm=qk_norm)
    vm = ReferenceVM(prog, t)
    ks, vs = [], []
    for pos, token in enumerate([3, 1, 4, 1, 5, 7, 2]):  # early steps leave splits empty
        out = vm.run_step(token, pos)
        q, k, v = (t[f"{n}_table"][token] for n in "qkv")
        if qk_norm:
            q = hf_rmsnorm(q.reshape(heads, d), t["q_norm"], 1e-6).reshape(-1)
            k = hf_rmsnorm(k.reshape(kv_heads, d), t["k_norm"], 1e-6).reshape(-1)
        ks.append(hf_rope(k, pos, d))
        vs.append(v)
        want = attention(hf_rope(q, pos, d), torch.stack(ks), torch.stack(vs), heads, kv_heads)
        close(out["out"], want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- whole models vs HF
@pytest.fixture(scope="module")
def llama():
    model = hf_model("llama")
    return model, tiny_model_program(model)


PROMPT = [1, 17, 42, 5, 9, 88, 3]


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_tiny_model_logits_match_hf(family, llama):
    """Llama (split-K down, 2 attention splits); Qwen2 (q/k/v biases); Qwen3 (q/k head norm,
    head_dim != hidden/heads, tied embeddings); both with 3 attention splits, no split-K."""
    if family == "llama":
        model, (prog, t) = llama
    else:
        model = hf_model(family)
        if family == "qwen2":  # HF initialises biases to 0; make them matter
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("proj.bias"):
                        p.normal_()
        prog, t = tiny_model_program(model, split_k=1, splits=3)
    got = ReferenceVM(prog, t).logits_for(PROMPT)
    with torch.no_grad():
        want = model(torch.tensor([PROMPT])).logits[0]
    close(got, want, rtol=1e-4, atol=1e-4)


def test_tiny_llama_generate_matches_hf_greedy(llama):
    model, (prog, t) = llama
    ids = list(PROMPT[:3])
    with torch.no_grad():
        for _ in range(6):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert ReferenceVM(prog, t).generate(PROMPT[:3], 6) == ids[3:]


# ----------------------------------------------------------------------------- scheduling
def test_random_order_is_bitwise_queue_order(llama):
    _, (prog, t) = llama
    vm = ReferenceVM(prog, t)
    want = vm.logits_for(PROMPT[:4])
    orders = []
    for seed in range(4):
        assert torch.equal(vm.logits_for(PROMPT[:4], order="random", seed=seed), want)
        orders.append(tuple(vm.last_order))
    assert len(set(orders)) > 1  # the random walks really differ


def test_attention_random_order_bitwise():
    prog, t = attention_program(splits=3, block=1)
    vm = ReferenceVM(prog, t)
    ref = [vm.run_step(tok, p)["out"] for p, tok in enumerate([1, 2, 3, 4])]
    for seed in (0, 1, 2):
        vm.reset()
        got = [vm.run_step(tok, p, order="random", seed=seed)["out"] for p, tok in enumerate([1, 2, 3, 4])]
        assert all(torch.equal(a, b) for a, b in zip(got, ref))


def _add_chain(*, threshold: int = 1, wait: bool = True, same_queue: bool = False):
    """x = a + b, then y = x + b: the second task waits on the first (or, broken, not)."""
    b = Builder("chain", queues=2)
    a_, b_ = b.buf("a", K.CONST, [4]), b.buf("b", K.CONST, [4])
    x, y = b.buf("x", K.ACTIVATION, [4]), b.buf("y", K.IO_OUTPUT, [4])
    s1, s2 = b.stage("first"), b.stage("second")
    b.task(AddParams(n=4), [opd(a_), opd(b_)], [opd(x)], stage=s1, queue=0, name="first")
    t2 = b.task(AddParams(n=4), [opd(x), opd(b_)], [opd(y)], stage=s2, after=[s1] if wait else [],
                queue=0 if same_queue else 1, name="second")
    prog = with_threshold(b.build(), t2.id, threshold) if wait else b.build()
    return prog, {"a": torch.arange(4.0), "b": torch.ones(4)}


def test_unsatisfiable_wait_deadlocks():
    prog, t = _add_chain(threshold=2)  # only one task ever signals `first`
    with pytest.raises(DeadlockError, match=r"queue 1: task 1 'second' waits counter 0 >= 2 \(is 1\)"):
        ReferenceVM(prog, t, check=False).run_step(0, 0)


def test_queue_order_against_the_dag_deadlocks():
    prog, t = _add_chain()
    prog = prog.replace(queues=[[1, 0]])  # the waiter sits in front of its only producer on the same block
    with pytest.raises(DeadlockError, match="task 1 'second'"):
        ReferenceVM(prog, t, check=False).run_step(0, 0)


def test_missing_wait_reads_poison_in_some_order():
    prog, t = _add_chain(wait=False)
    vm = ReferenceVM(prog, t, check=False)
    results = [vm.run_step(0, 0, order="random", seed=s)["y"] for s in range(16)]
    assert any(r.isnan().all() for r in results)  # `second` ran first and read unwritten x
    assert any(torch.equal(r, torch.arange(4.0) + 2) for r in results)


def test_unwritten_output_stays_poisoned():
    prog, t = lm_head_program(slabs=3)
    last_slab = next(x for x in prog.tasks if x.name.startswith("head[") and x.outputs[0].off > 0)
    argmax = next(x for x in prog.tasks if x.name == "argmax")
    gone = (last_slab.id, argmax.id)
    queues = tuple(tuple(i for i in q if i not in gone) for q in prog.queues)
    tasks = tuple(x.model_copy(update={"waits": tuple(  # nobody waits on the removed slab any more
        w.model_copy(update={"threshold": w.threshold - 1}) if w.counter == last_slab.out_counter else w for w in x.waits)})
        for x in prog.tasks if x.id not in gone)
    prog = prog.model_copy(update={"queues": queues, "tasks": tasks})
    out = ReferenceVM(prog, t, check=False).run_step(1, 0)
    lo, n = last_slab.outputs[0].off, last_slab.outputs[0].len
    assert out["logits"][lo : lo + n].isnan().all() and not out["logits"][:lo].isnan().any()
    assert out["next_token"].item() == -(2**31)  # integer poison


def test_kv_cache_persists_and_reset_poisons():
    prog, t = attention_program()
    vm = ReferenceVM(prog, t)
    assert vm.read_buffer("k_cache").isnan().all()
    vm.run_step(1, 0)
    vm.run_step(2, 1)
    rows = vm.read_buffer("k_cache").reshape(16, -1)
    assert not rows[:2].isnan().any() and rows[2:].isnan().all()
    vm.reset()
    assert vm.read_buffer("k_cache").isnan().all()


# ----------------------------------------------------------------------------- refusals
def test_refuses_rejected_validation():
    prog, t = lm_head_program()
    bad = ValidationResult(accepted=False, violations=[Violation(check="race", reason="made up")])
    with pytest.raises(ValueError, match="made up"):
        ReferenceVM(prog, t, validation=bad)


def test_tensors_must_match_buffers():
    prog, t = lm_head_program()
    with pytest.raises(ValueError, match="missing"):
        ReferenceVM(prog, {"embed": t["embed"]})
    with pytest.raises(ValueError, match="expected"):
        ReferenceVM(prog, {**t, "norm": t["norm"].half()})


def test_position_outside_capacity():
    prog, t = attention_program(capacity=4)
    vm = ReferenceVM(prog, t)
    with pytest.raises(ValueError, match="kv_capacity"):
        vm.run_step(0, 4)
    with pytest.raises(ValueError, match="exceed"):
        vm.generate([1, 2], 4)  # 5 steps: the last new token is never fed back


def test_step_progress_rewrites_on_a_terminal_and_prints_quarters_elsewhere():
    import io

    from amk.vm.progress import StepProgress

    class Tty(io.StringIO):
        def isatty(self):
            return True

    log, tty = io.StringIO(), Tty()
    for stream in (log, tty):
        bar = StepProgress("step", 10, stream=stream)
        for _ in range(10):
            bar.tick()
        bar.close()
    assert log.getvalue().splitlines() == ["step 3/10", "step 5/10", "step 8/10", "step 10/10"]
    assert tty.getvalue() == "".join(f"\rstep {i}/10" for i in range(1, 11)) + "\n"
    quiet = io.StringIO()
    bar = StepProgress("step", 3, enabled=False, stream=quiet)
    bar.tick()
    bar.close()
    assert quiet.getvalue() == ""
