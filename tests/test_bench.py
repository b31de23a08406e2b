"""The decode benchmark harness without a GPU: the PyTorch baseline step against HF, the
statistics, the roofline floor and its guard, the correctness gate, the whole harness on
the ReferenceVM, the CLI's argument handling. GPU-only paths (CUDA graphs, torch.compile,
CUDA events, the bandwidth copy, the megakernel) are `@pytest.mark.gpu` and skip here."""

from __future__ import annotations

import json

import pytest
import torch

from amk.eval import roofline
from amk.eval.baselines import (
    COMPILE_KW, CompiledRunner, CudaGraphRunner, EagerRunner, HFRunner, LlamaDecodeStep, build_hf_shared, make_runner,
)
from amk.eval.bench import (
    BenchError, BenchOptions, GateFailed, compare_logits, correctness_gate, format_table, load_weights, merge_rows,
    run_bench, summarize,
)
from amk.eval.oracle import hf_logits
from amk.eval.shapes import SHAPES, random_weights_like, shape_config
from amk.schedule.importer import build_hf_model, check_weights, random_state_dict, spec_from_hf_config, zoo_configs

ZOO = zoo_configs()
CUDA = torch.cuda.is_available()


def tiny(name: str, dtype: str = "float32", seed: int = 0):
    spec = spec_from_hf_config(ZOO[name], name=name)
    return check_weights(spec, random_state_dict(spec.hf_config, seed), dtype)


def random_prefix(spec, ctx: int, dtype=torch.float32, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    shape = (ctx, spec.num_kv_heads, spec.head_dim)
    return [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
            for _ in range(spec.num_layers)]


# ----------------------------------------------------------------------------- the baseline step
@pytest.mark.parametrize("name", ["llama-gqa-tied", "llama-mqa", "llama3-rope", "smollm2-like", "qwen2-bias",
                                  "qwen3-qknorm", "mistral"])
def test_baseline_steps_match_hf_full_sequence(name):
    """fp32: the static-cache decode step, one token at a time, equals HF's full-sequence
    forward at every position."""
    spec, w = tiny(name)
    ids = torch.randint(0, spec.vocab_size, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    ref = hf_logits(build_hf_model(spec, w), ids)
    r = EagerRunner(LlamaDecodeStep(spec, w, capacity=16))
    for pos, tok in enumerate(ids):
        r.enqueue(tok, pos)
        r.finish()
        torch.testing.assert_close(r.logits(), ref[pos], rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["llama-gqa-tied", "qwen3-qknorm"])
def test_hf_runner_with_a_written_prefix_matches_the_baseline(name):
    """The same random K/V prefix written into the static cache and HF's DynamicCache gives
    the same next steps; the shared HF model holds the very weight tensors."""
    spec, w = tiny(name)
    model = build_hf_shared(spec, w)
    assert model.model.embed_tokens.weight.data_ptr() == w["model.embed_tokens.weight"].data_ptr()
    hf, base = HFRunner(model, spec), EagerRunner(LlamaDecodeStep(spec, w, capacity=16))
    for layer, (k, v) in enumerate(random_prefix(spec, 6)):
        hf.write_kv(layer, k, v)
        base.write_kv(layer, k, v)
    for pos in range(6, 9):
        for r in (hf, base):
            r.enqueue(pos + 11, pos)
            r.finish()
        torch.testing.assert_close(base.logits(), hf.logits(), rtol=0, atol=1e-4)
    with pytest.raises(Exception, match="position 3"):
        hf.enqueue(1, 3)  # HF's cache only grows: positions must be consecutive


def test_baseline_bf16_equals_hf_bf16():
    spec, w = tiny("llama3-rope", "bfloat16")
    ids = [5, 9, 300, 2, 77]
    ref = hf_logits(build_hf_model(spec, w, dtype="bfloat16"), ids)
    r = EagerRunner(LlamaDecodeStep(spec, w, capacity=8))
    for pos, tok in enumerate(ids):
        r.enqueue(tok, pos)
        torch.testing.assert_close(r.logits(), ref[pos], rtol=0, atol=1e-2)


def test_baseline_is_one_static_graph():
    """No Python-int dependency: dynamo traces the whole step (fullgraph, aot functionalization
    of the in-place KV writes) and it computes the same logits and cache."""
    spec, w = tiny("qwen3-qknorm")
    a, b = LlamaDecodeStep(spec, w, capacity=8), LlamaDecodeStep(spec, w, capacity=8)
    fn = torch.compile(a, backend="aot_eager", **COMPILE_KW)
    with torch.no_grad():
        for pos in range(3):
            tok, p = torch.tensor([pos + 4]), torch.tensor([pos])
            (la, ta), (lb, tb) = fn(tok, p), b(tok, p)
            torch.testing.assert_close(la, lb, rtol=0, atol=1e-6)
            assert int(ta) == int(tb)
    torch.testing.assert_close(a.layers[0].k_cache, b.layers[0].k_cache)


def test_compiled_step_inputs_are_static_except_token_and_pos():
    """reduce-overhead skips CUDA graphs when a mutated graph input is not static: every
    weight and KV-cache buffer must reach the graph as a static input (only the token and
    the position are copied in per replay, and those are never mutated)."""
    spec, w = tiny("qwen2-bias")
    static: dict[str, bool] = {}

    def inspect(gm, example_inputs):
        for node in gm.graph.find_nodes(op="placeholder"):
            static[node.name] = bool(node.meta.get("tensor_dict", {}).get("_dynamo_static_input_type"))
        return gm.forward

    fn = torch.compile(LlamaDecodeStep(spec, w, capacity=8), backend=inspect, **COMPILE_KW)
    with torch.no_grad():
        fn(torch.tensor([3]), torch.tensor([0]))
    dynamic = sorted(name for name, s in static.items() if not s)
    assert len(static) > 20 and len(dynamic) == 2 and "token" in dynamic[1] and "pos" in dynamic[0], dynamic


def test_make_runner_refuses_gpu_baselines_on_cpu():
    spec, w = tiny("llama-mha")
    for kind in ("cuda_graph", "torch_compile"):
        with pytest.raises(Exception, match="CUDA"):
            make_runner(kind, spec, w, 8)
    with pytest.raises(Exception, match="unknown baseline"):
        make_runner("vllm", spec, w, 8)


# ----------------------------------------------------------------------------- statistics, floor
def test_summarize():
    s = summarize(range(1, 11))
    assert s["median"] == pytest.approx(5.5) and s["p10"] == pytest.approx(1.9) and s["p90"] == pytest.approx(9.1)
    assert (s["min"], s["max"], s["n"]) == (1, 10, 10)
    assert summarize([7.0])["p10"] == 7.0
    with pytest.raises(ValueError):
        summarize([])


def test_floor_numbers():
    spec = spec_from_hf_config(shape_config("llama-3.1-8b"), name="llama-3.1-8b")
    kv = roofline.kv_bytes(spec, "bfloat16", 1024)
    assert kv == 2 * 32 * 1024 * 8 * 128 * 2
    b = roofline.step_bytes(spec, "bfloat16", 1024)
    assert b["total"] == b["weights"] + kv and 14.9e9 < b["weights"] < 15.1e9  # untied: one embedding row
    f = roofline.floor_us(b["total"], 3000.0)
    assert f == pytest.approx(b["total"] / 3e12 * 1e6)
    assert roofline.pct_of_floor(2 * f, f) == pytest.approx(50.0)
    with pytest.raises(ValueError):
        roofline.floor_us(1, 0.0)


@pytest.mark.parametrize("name", ["llama-mha", "llama-gqa-tied", "qwen2-bias", "qwen3-qknorm"])
def test_closed_form_bytes_equal_program_stats(name):
    from amk.schedule.config import ScheduleConfig
    from amk.schedule.lower import lower
    from amk.schedule.targets import get_target

    spec = spec_from_hf_config(ZOO[name], name=name).model_copy(update={"dtype": "bfloat16"})
    prog = lower(spec, ScheduleConfig(), get_target("h100"), kv_capacity=64)
    assert roofline.step_bytes(spec, "bfloat16", 10, prog)["weights"] == roofline.step_bytes(spec, "bfloat16", 10)["weights"]
    q8 = lower(spec, ScheduleConfig(quant="int8", quant_group="channel"), get_target("h100"), kv_capacity=64)
    assert roofline.step_bytes(spec, "bfloat16", 10, q8)["weights"] < roofline.step_bytes(spec, "bfloat16", 10)["weights"]


def test_floor_guard_refuses_a_too_fast_latency():
    ok = {"megakernel": {"median_us": 120.0, "p10_us": 110.0, "p90_us": 130.0}}
    roofline.check_floor(ok, 100.0)
    too_fast = {"megakernel": {"median_us": 120.0, "p10_us": 95.0, "p90_us": 130.0},
                "cuda_graph": {"median_us": 90.0, "p10_us": 85.0, "p90_us": 99.0}}
    with pytest.raises(roofline.FloorViolation) as e:
        roofline.check_floor(too_fast, 100.0)
    msg = str(e.value)
    assert "megakernel p10" in msg and "cuda_graph median" in msg and "no latency reported" in msg
    assert "95" not in msg and "85" not in msg  # the refused numbers are not printed


# ----------------------------------------------------------------------------- the gate
def test_compare_logits():
    ref = torch.tensor([0.1, 2.0, -1.0, 1.99])
    assert compare_logits(ref.clone(), ref, 1e-3)["passed"]
    far = ref.clone()
    far[2] += 0.5
    r = compare_logits(far, ref, 5e-2)
    assert not r["passed"] and r["max_rel_err"] == pytest.approx(0.25)
    swapped = torch.tensor([0.1, 1.985, -1.0, 1.995])  # argmax flips inside the tolerance: a near-tie
    r = compare_logits(swapped, ref, 5e-2)
    assert r["passed"] and r["near_tie"] and not r["argmax_equal"]
    assert not compare_logits(swapped, ref, 1e-3)["passed"]
    nan = ref.clone()
    nan[0] = float("nan")
    assert not compare_logits(nan, ref, 1.0)["passed"]


class _Fixed:
    def __init__(self, name, logits):
        self.name, self._l = name, logits

    def enqueue(self, token, pos):
        pass

    def finish(self):
        pass

    def logits(self):
        return self._l


def test_correctness_gate_refuses_on_mismatch():
    ref = torch.linspace(-3, 3, 50)
    bad = ref.clone()
    bad[10] += 1.0
    runners = [_Fixed("megakernel", bad), _Fixed("cuda_graph", ref.clone()), _Fixed("hf_eager", ref)]
    gate = correctness_gate(runners, "hf_eager", [1, 2], [10, 11], 5e-2)
    assert not gate["passed"]
    assert not gate["checks"]["megakernel"]["passed"] and gate["checks"]["cuda_graph"]["passed"]
    assert gate["checks"]["megakernel"]["max_rel_err"] == pytest.approx(1 / 3)


# ----------------------------------------------------------------------------- the harness on the CPU
def _config_file(tmp_path, name):
    p = tmp_path / f"{name}.json"
    p.write_text(json.dumps(ZOO[name]))
    return str(p)


def _cpu_opts(model, **kw):
    base = dict(model=model, random_init=True, dtype="float32", ctx=6, steps=3, warmup=1, check_steps=2,
                baselines=("eager", "hf_eager"), device="cpu", bandwidth_gbps=1e9, command="test")
    base.update(kw)
    return BenchOptions(**base)


def test_run_bench_on_the_reference_vm(tmp_path):
    """The whole harness, with the ReferenceVM standing in for the GPU: the random KV prefix
    lands in the megakernel's cache layout (its logits equal HF's at fp32), rows come out
    complete, and the table prints."""
    row = run_bench(_cpu_opts(_config_file(tmp_path, "llama3-rope")), log=lambda m: None)
    gate = row["correctness"]
    assert gate["passed"] and gate["reference"] == "hf_eager"
    assert gate["checks"]["megakernel"]["max_rel_err"] < 1e-5 and gate["checks"]["megakernel"]["argmax_equal"] == 2
    assert set(row["variants"]) == {"megakernel", "eager", "hf_eager"}
    assert all(v["n"] == 3 for v in row["variants"].values())
    assert row["faster_baseline"] == "eager" and set(row["speedup"]) == {"eager", "hf_eager"}
    assert row["model"] == "llama3-rope" and row["shape_only"] and row["quant"] == "none" and row["ctx"] == 6
    assert row["bytes_per_step"]["kv"] == roofline.kv_bytes(
        spec_from_hf_config(ZOO["llama3-rope"], name="x"), "float32", 6)
    assert row["method"]["kv_capacity"] == 6 + 2 + 1 + 3 + 8
    json.dumps(row)  # serialisable
    assert "megakernel" in format_table(row)


def test_run_bench_int8_gates_against_dequantized_weights(tmp_path):
    from amk.schedule.config import ScheduleConfig

    opts = _cpu_opts(_config_file(tmp_path, "llama-mha"), config=ScheduleConfig(quant="int8", quant_group=64),
                     baselines=("eager",))
    row = run_bench(opts, log=lambda m: None)
    assert row["quant"] == "int8" and row["correctness"]["reference"] == "eager"
    assert row["correctness"]["checks"]["megakernel"]["max_rel_err"] < 1e-5
    assert "dequantized" in row["baseline_weights"]


def test_run_bench_quantized_tied_head_gates_against_an_untied_baseline(tmp_path):
    """A tied model whose LM head the program quantizes: the baselines (and the fp32
    reference) run untied, with the float embedding and the dequantized head copy."""
    from amk.schedule.config import ScheduleConfig

    cfg = ScheduleConfig(quant="int8", quant_group=64, quant_lm_head=True)
    opts = _cpu_opts(_config_file(tmp_path, "llama-gqa-tied"), config=cfg, baselines=("eager", "hf_eager"))
    row = run_bench(opts, log=lambda m: None)
    assert row["quant"] == "int8+head" and "untied head" in row["baseline_weights"]
    assert row["correctness"]["passed"]
    assert row["correctness"]["checks"]["megakernel"]["max_rel_err"] < 1e-5


def test_run_bench_refuses_when_the_gate_fails(tmp_path, monkeypatch):
    from amk.eval import bench

    real = bench.MegakernelRunner.logits
    monkeypatch.setattr(bench.MegakernelRunner, "logits", lambda self: real(self) * 1.5)
    with pytest.raises(GateFailed) as e:
        run_bench(_cpu_opts(_config_file(tmp_path, "llama-mha"), baselines=("eager",)), log=lambda m: None)
    assert not e.value.report["passed"] and "variants" not in e.value.report


def test_run_bench_refuses_latencies_below_the_floor(tmp_path):
    # 1e-6 GB/s: the floor is hours, so every measured step is "faster than physics"
    with pytest.raises(roofline.FloorViolation):
        run_bench(_cpu_opts(_config_file(tmp_path, "llama-mha"), bandwidth_gbps=1e-6, baselines=("eager",)),
                  log=lambda m: None)


def test_options_are_checked():
    with pytest.raises(BenchError, match="CUDA"):
        run_bench(BenchOptions(model="llama-3.2-1b", random_init=True, device="cpu", bandwidth_gbps=1.0,
                               baselines=("cuda_graph",)))
    with pytest.raises(BenchError, match="--random-init"):
        load_weights(BenchOptions(model="llama-3.2-1b", device="cpu"), "bfloat16")
    with pytest.raises(BenchError, match="dtype"):
        run_bench(BenchOptions(dtype="float8", device="cpu", bandwidth_gbps=1.0, baselines=("eager",)))
    with pytest.raises(BenchError, match="steps"):
        run_bench(BenchOptions(steps=0, device="cpu", bandwidth_gbps=1.0, baselines=("eager",)))
    if not CUDA:
        with pytest.raises(BenchError, match="needs a CUDA GPU"):
            run_bench(BenchOptions(model="llama-3.2-1b", random_init=True))


def test_merge_rows():
    a = {"model": "m", "dtype": "bfloat16", "ctx": 1024, "quant": "none", "v": 1}
    b = {"model": "m", "dtype": "bfloat16", "ctx": 2048, "quant": "none", "v": 2}
    doc = merge_rows(merge_rows(None, a), b)
    assert [r["v"] for r in doc["rows"]] == [1, 2]
    doc = merge_rows(doc, dict(a, v=3))
    assert [r["v"] for r in doc["rows"]] == [3, 2]
    assert merge_rows({"note": "x", "rows": []}, a)["note"] == "x"


# ----------------------------------------------------------------------------- shapes
def test_shapes():
    s1 = spec_from_hf_config(shape_config("llama-3.2-1b"), name="1b")
    s8 = spec_from_hf_config(shape_config("llama-3.1-8b"), name="8b")
    sm = spec_from_hf_config(shape_config("SmolLM2-135M"), name="smol")
    assert (s1.hidden_size, s1.num_layers, s1.num_heads, s1.num_kv_heads, s1.vocab_size, s1.intermediate_size,
            s1.tie_word_embeddings) == (2048, 16, 32, 8, 128256, 8192, True)
    assert (s8.hidden_size, s8.num_layers, s8.num_heads, s8.num_kv_heads, s8.vocab_size, s8.intermediate_size,
            s8.tie_word_embeddings) == (4096, 32, 32, 8, 128256, 14336, False)
    for s in (s1, s8):
        assert s.rope_theta == 500000.0 and s.rope_scaling["rope_type"] == "llama3"
    assert (sm.hidden_size, sm.num_layers, sm.num_heads, sm.num_kv_heads, sm.vocab_size) == (576, 30, 9, 3, 49152)
    assert 1.23e9 < s1.weight_bytes(2) / 2 < 1.24e9 and 8.0e9 < s8.weight_bytes(2) / 2 < 8.04e9
    shape_config("llama-3.1-8b")["rope_scaling"]["factor"] = 0  # a copy: the table is untouched
    assert SHAPES["llama-3.1-8b"]["rope_scaling"]["factor"] == 8.0


def test_random_weights_like():
    spec = spec_from_hf_config(ZOO["qwen2-bias"], name="q")
    w = random_weights_like(spec, "cpu", "bfloat16", seed=3)
    spec2, clean = check_weights(spec, w, None)  # exactly the expected tensors and shapes
    assert spec2.dtype == "bfloat16" and all(t.dtype == torch.bfloat16 for t in clean.values())
    assert torch.equal(w["model.norm.weight"], random_weights_like(spec, "cpu", "bfloat16", seed=3)["model.norm.weight"])
    norm = w["model.layers.0.input_layernorm.weight"].float()
    assert 0.7 < float(norm.mean()) < 1.3 and float(norm.std()) > 0.02
    assert 0.01 < float(w["model.layers.0.mlp.up_proj.weight"].float().std()) < 0.03


# ----------------------------------------------------------------------------- the CLI
def test_cli_bench_without_a_gpu_is_a_one_line_error():
    import typer
    from typer.testing import CliRunner

    from amk.commands.bench_cmd import bench_command

    app = typer.Typer()
    app.command("bench")(bench_command)
    app.command("other")(lambda: None)  # two commands: `bench` stays a subcommand
    runner = CliRunner()
    assert runner.invoke(app, ["bench", "--help"]).exit_code == 0
    r = runner.invoke(app, ["bench", "llama-3.2-1b", "--random-init", "--dtype", "float8"])
    assert r.exit_code == 1 and "dtype" in r.output
    r = runner.invoke(app, ["bench", "x", "--steps", "0"])
    assert r.exit_code == 2  # typer's range check
    if not CUDA:
        r = runner.invoke(app, ["bench", "llama-3.2-1b", "--random-init", "--dtype", "bfloat16"])
        assert r.exit_code == 1 and "needs a CUDA GPU" in r.output and "Traceback" not in r.output


# ----------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_bandwidth_is_plausible():
    from amk.eval.peak_bandwidth import measure_bandwidth

    assert 100.0 < measure_bandwidth(size_bytes=256 * 1024**2, iters=5) < 20000.0


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_graph_and_compiled_baselines_match_eager():
    spec, w = tiny("llama-gqa-tied", "bfloat16")
    w = {k: v.cuda() for k, v in w.items()}
    runners = [EagerRunner(LlamaDecodeStep(spec, w, 16)), CudaGraphRunner(LlamaDecodeStep(spec, w, 16)),
               CompiledRunner(LlamaDecodeStep(spec, w, 16))]
    for r in runners:
        r.prepare(5, 0)
    for pos in range(4):
        out = []
        for r in runners:
            r.enqueue(pos + 5, pos)
            r.finish()
            out.append(r.logits())
        for o in out[1:]:
            torch.testing.assert_close(o, out[0], rtol=0, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_run_bench_tiny(tmp_path):
    opts = BenchOptions(model=_config_file(tmp_path, "llama-gqa-tied"), random_init=True, dtype="bfloat16", ctx=64,
                        steps=5, warmup=2, check_steps=2, command="test")
    row = run_bench(opts, log=lambda m: None)
    assert row["correctness"]["passed"] and row["variants"]["megakernel"]["n"] == 5


def test_vm_define_experiments_are_part_of_the_recorded_command(monkeypatch):
    from amk.eval.bench import _with_vm_defines

    monkeypatch.delenv("AMK_VM_DEFINES", raising=False)
    assert _with_vm_defines("amk bench x") == "amk bench x"
    monkeypatch.setenv("AMK_VM_DEFINES", "AMK_SPIN_MAX_NS=512")
    assert _with_vm_defines("amk bench x") == "AMK_VM_DEFINES=AMK_SPIN_MAX_NS=512 amk bench x"
