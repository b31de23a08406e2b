"""PyTorch baselines of one batch-1 decode step, at the megakernel's precision.

`LlamaDecodeStep` is a hand-written Llama-family decode step (gpt-fast style): embedding,
RMSNorm, q/k/v (+bias for Qwen2, +q/k head norm for Qwen3), RoPE from the model's own
inverse frequencies, the new K/V row written into static [kv_heads, capacity, head_dim]
caches with `index_copy_` at a *tensor* position, GQA attention over every cache row with
the rows after `pos` masked by a tensor comparison, O-proj, SwiGLU MLP, final norm, LM
head, argmax. Nothing depends on a Python int, so the whole step is one static graph. Its
ops and roundings follow transformers' eager Llama, so it matches HF to float rounding.

Runners (a common interface the benchmark drives, one per variant):

    EagerRunner        the module called directly (CPU tests; a GPU reference); with
                       `LlamaDecodeStep(..., compute_dtype=torch.float32)` the fp32 reference of
                       half-precision weights (`fp32_reference`, the half-precision gate's yardstick)
    CudaGraphRunner    the module captured once in a torch.cuda.CUDAGraph; token and
                       position live in device tensors written before each replay
    CompiledRunner     torch.compile(mode="reduce-overhead", fullgraph=True): inductor
                       kernels replayed through CUDA graphs (refuses to run if they were skipped)
    HFRunner           the transformers model, eager attention, a DynamicCache: the oracle

    r.write_kv(layer, k, v)   # prefix rows 0..ctx-1, k/v: [ctx, kv_heads, head_dim] (post-RoPE)
    r.prepare(token, pos)     # capture / compile, running the step at (token, pos): idempotent
    r.enqueue(token, pos)     # one step, asynchronous on a GPU (no host sync)
    r.finish()                # wait for it, raise on device errors
    r.logits()                # fp32 [vocab] of the last step

Every runner owns its KV cache; module runners share the weight tensors they are given
(no copies), so the megakernel and all baselines read the same weight memory.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from amk.schedule.modelspec import ModelSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class BaselineError(RuntimeError):
    """A baseline cannot run as required (e.g. torch.compile skipped its CUDA graphs)."""


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: statistics in fp32, the weight applied in the input dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class _Layer(nn.Module):
    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], i: int, capacity: int,
                 compute_dtype: Optional[torch.dtype] = None):
        super().__init__()
        p = f"model.layers.{i}."
        a = p + "self_attn."
        names = {"ln1": p + "input_layernorm.weight", "ln2": p + "post_attention_layernorm.weight",
                 "wq": a + "q_proj.weight", "wk": a + "k_proj.weight", "wv": a + "v_proj.weight",
                 "wo": a + "o_proj.weight", "wg": p + "mlp.gate_proj.weight", "wu": p + "mlp.up_proj.weight",
                 "wd": p + "mlp.down_proj.weight"}
        if spec.qkv_bias:
            names.update(bq=a + "q_proj.bias", bk=a + "k_proj.bias", bv=a + "v_proj.bias")
        if spec.qk_norm:
            names.update(qn=a + "q_norm.weight", kn=a + "k_norm.weight")
        for attr, name in names.items():
            self.register_buffer(attr, weights[name], persistent=False)
        self.has_bias, self.has_qk_norm = spec.qkv_bias, spec.qk_norm
        self.n_heads, self.n_kv, self.d = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.group = spec.q_per_kv
        self.eps = spec.rms_norm_eps
        self.scale = spec.head_dim**-0.5
        ref = weights[names["wq"]]
        self.cd = compute_dtype  # None: compute in the weights' dtype
        shape = (spec.num_kv_heads, capacity, spec.head_dim)
        # zeros, never NaN: masked rows still meet the probabilities (0) in the P @ V matmul
        cache_dtype = compute_dtype or ref.dtype
        self.register_buffer("k_cache", torch.zeros(shape, dtype=cache_dtype, device=ref.device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=cache_dtype, device=ref.device), persistent=False)

    def w(self, t: torch.Tensor) -> torch.Tensor:
        """A weight in the compute dtype (a transient copy when it differs: no second resident set)."""
        return t if self.cd is None else t.to(self.cd)

    def forward(self, x, pos, cos, sin, masked):
        w = self.w
        h = rms_norm(x, w(self.ln1), self.eps)
        q = F.linear(h, w(self.wq), w(self.bq) if self.has_bias else None).view(self.n_heads, self.d)
        k = F.linear(h, w(self.wk), w(self.bk) if self.has_bias else None).view(self.n_kv, self.d)
        v = F.linear(h, w(self.wv), w(self.bv) if self.has_bias else None).view(self.n_kv, self.d)
        if self.has_qk_norm:
            q, k = rms_norm(q, w(self.qn), self.eps), rms_norm(k, w(self.kn), self.eps)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        self.k_cache.index_copy_(1, pos, k.unsqueeze(1))
        self.v_cache.index_copy_(1, pos, v.unsqueeze(1))
        qg = q.view(self.n_kv, self.group, self.d)  # q head g*group + j reads kv head g (HF repeat_kv)
        scores = torch.matmul(qg, self.k_cache.transpose(1, 2)) * self.scale  # [kv, group, capacity]
        scores = scores.masked_fill(masked, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        o = torch.matmul(probs, self.v_cache).reshape(1, self.n_heads * self.d)
        x = x + F.linear(o, w(self.wo))
        h = rms_norm(x, w(self.ln2), self.eps)
        return x + F.linear(F.silu(F.linear(h, w(self.wg))) * F.linear(h, w(self.wu)), w(self.wd))


class LlamaDecodeStep(nn.Module):
    """forward(token: int64 [1], pos: int64 [1]) -> (logits fp32 [vocab], next token int64 []).

    `compute_dtype` (e.g. torch.float32 over bf16 weights): compute, and keep the KV cache,
    in that dtype, each weight converted where it is used (no second copy stays resident)."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], capacity: int,
                 inv_freq: Optional[torch.Tensor] = None, compute_dtype: Optional[torch.dtype] = None):
        super().__init__()
        if spec.family not in ("llama", "mistral", "qwen2", "qwen3"):
            raise BaselineError(f"no baseline for family {spec.family!r}")
        embed = weights["model.embed_tokens.weight"]
        self.dtype, self.device, self.capacity = compute_dtype or embed.dtype, embed.device, capacity
        self.cd = compute_dtype
        self.eps = spec.rms_norm_eps
        if inv_freq is None:
            from amk.schedule.weights import rope_inv_freq

            inv_freq = rope_inv_freq(spec)
        self.register_buffer("embed", embed, persistent=False)
        self.layers = nn.ModuleList(_Layer(spec, weights, i, capacity, compute_dtype) for i in range(spec.num_layers))
        self.register_buffer("norm", weights["model.norm.weight"], persistent=False)
        head = embed if spec.tie_word_embeddings else weights["lm_head.weight"]
        self.register_buffer("head", head, persistent=False)
        self.register_buffer("inv_freq", inv_freq.to(self.device, torch.float32), persistent=False)
        self.register_buffer("rows", torch.arange(capacity, device=self.device), persistent=False)

    def forward(self, token: torch.Tensor, pos: torch.Tensor):
        x = self.embed.index_select(0, token).to(self.dtype)  # [1, hidden]
        freqs = pos.float()[:, None] * self.inv_freq[None, :]  # [1, head_dim / 2], fp32 like HF
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)
        masked = self.rows > pos  # [capacity]: rows not yet written at this step
        for layer in self.layers:
            x = layer(x, pos, cos, sin, masked)
        x = rms_norm(x, self.norm.to(self.dtype), self.eps)
        logits = F.linear(x, self.head.to(self.dtype))[0].float()
        return logits, torch.argmax(logits)

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Rows 0..ctx-1 of a layer's caches from [ctx, kv_heads, head_dim] tensors."""
        lay = self.layers[layer]
        n = k.shape[0]  # (copy_ converts to the cache dtype)
        lay.k_cache[:, :n].copy_(k.transpose(0, 1))
        lay.v_cache[:, :n].copy_(v.transpose(0, 1))


# ---------------------------------------------------------------------------------- runners
class _ModuleRunner:
    name = "module"

    def __init__(self, module: LlamaDecodeStep):
        self.module = module
        dev = module.device
        self.token = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self._out: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.module.write_kv(layer, k, v)

    def _set(self, token: int, pos: int) -> None:
        if not 0 <= pos < self.module.capacity:
            raise ValueError(f"position {pos} outside the cache capacity {self.module.capacity}")
        self.token.fill_(int(token))
        self.pos.fill_(int(pos))

    def prepare(self, token: int, pos: int) -> None:
        pass

    def finish(self) -> None:
        if self.module.device.type == "cuda":
            torch.cuda.synchronize(self.module.device)

    def logits(self) -> torch.Tensor:
        """A copy: graph outputs are static buffers that the next replay overwrites."""
        if self._out is None:
            raise BaselineError(f"{self.name}: no step has run")
        return self._out[0].clone()


class EagerRunner(_ModuleRunner):
    name = "eager"

    @torch.no_grad()
    def enqueue(self, token: int, pos: int) -> None:
        self._set(token, pos)
        self._out = self.module(self.token, self.pos)


class CudaGraphRunner(_ModuleRunner):
    """The module's step captured once in a CUDA graph; each step is one replay."""

    name = "cuda_graph"

    def __init__(self, module: LlamaDecodeStep, warmup: int = 2):
        if module.device.type != "cuda":
            raise BaselineError("the CUDA-graph baseline needs the module on a CUDA device")
        super().__init__(module)
        self.warmup = warmup
        self.graph: Optional[torch.cuda.CUDAGraph] = None

    @torch.no_grad()
    def prepare(self, token: int, pos: int) -> None:
        self._set(token, pos)
        side = torch.cuda.Stream(self.module.device)
        side.wait_stream(torch.cuda.current_stream(self.module.device))
        with torch.cuda.stream(side):  # warm-up off the capture stream (cuBLAS handles, allocator)
            for _ in range(self.warmup):
                self.module(self.token, self.pos)
        torch.cuda.current_stream(self.module.device).wait_stream(side)
        torch.cuda.synchronize(self.module.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._out = self.module(self.token, self.pos)
        self.graph.replay()  # capture does not execute: run the step once for real
        torch.cuda.synchronize(self.module.device)

    def enqueue(self, token: int, pos: int) -> None:
        if self.graph is None:
            raise BaselineError("cuda_graph: prepare() must capture the graph first")
        self._set(token, pos)
        self.graph.replay()


# dynamic=False: no automatic-dynamic recompiles; without it a float attribute seen with two
# values (e.g. head_dim**-0.5 of two models, remembered across processes by dynamo's profile
# cache) turns into a graph input, which can push the step off CUDA graphs
COMPILE_KW = {"fullgraph": True, "dynamic": False}


class CompiledRunner(_ModuleRunner):
    """torch.compile(mode="reduce-overhead", fullgraph=True, dynamic=False) of the module: inductor kernels
    under CUDA graphs. Weights and caches are module buffers (static addresses), the KV
    writes are in place and the position is a tensor, so the graphs are not skipped;
    `prepare` checks inductor's skip counter and refuses to go on if they were."""

    name = "torch_compile"

    def __init__(self, module: LlamaDecodeStep, calls: int = 3):
        if module.device.type != "cuda":
            raise BaselineError("the torch.compile reduce-overhead baseline needs a CUDA device")
        super().__init__(module)
        self.calls = calls  # cudagraph trees: warm-up run, recording, then replays
        self.fn = torch.compile(module, mode="reduce-overhead", **COMPILE_KW)

    @torch.no_grad()
    def prepare(self, token: int, pos: int) -> None:
        from torch._dynamo.utils import counters

        before = counters["inductor"]["cudagraph_skips"]
        for _ in range(self.calls):
            self.enqueue(token, pos)
        torch.cuda.synchronize(self.module.device)
        if counters["inductor"]["cudagraph_skips"] != before:
            raise BaselineError("torch.compile skipped CUDA graphs for the decode step (run with "
                                "TORCH_LOGS=perf_hints to see why); refusing to time it as 'reduce-overhead'")

    @torch.no_grad()
    def enqueue(self, token: int, pos: int) -> None:
        self._set(token, pos)
        torch.compiler.cudagraph_mark_step_begin()
        self._out = self.fn(self.token, self.pos)


# ---------------------------------------------------------------------------------- HF eager
def build_hf_shared(spec: ModelSpec, weights: dict[str, torch.Tensor]):
    """The transformers model (eager attention) holding exactly `weights`, without copies:
    built on the meta device, then the tensors are assigned. RoPE's inverse frequencies
    (non-persistent buffers, still on meta) are set from `rope_inv_freq`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from amk.schedule.weights import rope_inv_freq

    embed = weights["model.embed_tokens.weight"]
    config = AutoConfig.for_model(**spec.hf_config)
    config._attn_implementation = "eager"
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=embed.dtype)
    state = dict(weights)
    if spec.tie_word_embeddings:
        state["lm_head.weight"] = embed
    model.load_state_dict(state, strict=True, assign=True)
    if spec.tie_word_embeddings:
        model.tie_weights()
    inv = rope_inv_freq(spec).to(embed.device)
    for mod in model.modules():
        for buf in ("inv_freq", "original_inv_freq"):
            t = getattr(mod, buf, None)
            if isinstance(t, torch.Tensor) and t.is_meta:
                setattr(mod, buf, inv.clone())
    left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise BaselineError(f"HF model tensors left on the meta device: {left[:4]}")
    return model.eval()


class HFRunner:
    """transformers eager forward, one token per call, over a DynamicCache (post-RoPE K/V,
    [1, kv_heads, len, head_dim]). Positions must be consecutive from the prefix length."""

    name = "hf_eager"

    def __init__(self, model, spec: ModelSpec):
        from transformers import DynamicCache

        self.model, self.spec = model, spec
        dev = next(model.parameters()).device
        self.device = dev
        self.cache = DynamicCache()
        self.ids = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.pos_ids = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self._logits: Optional[torch.Tensor] = None
        self._filled = 0

    def write_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if layer != self._filled:
            raise BaselineError("hf_eager: the KV prefix must be written layer by layer from 0")
        self.cache.update(k.transpose(0, 1).unsqueeze(0).contiguous(), v.transpose(0, 1).unsqueeze(0).contiguous(),
                          layer)
        self._filled += 1

    def prepare(self, token: int, pos: int) -> None:
        pass

    @torch.no_grad()
    def enqueue(self, token: int, pos: int) -> None:
        have = self.cache.get_seq_length()
        if pos != have:
            raise BaselineError(f"hf_eager: step at position {pos} but the cache holds {have} rows")
        self.ids.fill_(int(token))
        self.pos_ids.fill_(int(pos))
        # no cache_position: newer transformers dropped it, older ones derive it from the cache length (= pos)
        out = self.model(input_ids=self.ids, position_ids=self.pos_ids, past_key_values=self.cache, use_cache=True)
        self._logits = out.logits[0, -1]

    def finish(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def logits(self) -> torch.Tensor:
        if self._logits is None:
            raise BaselineError("hf_eager: no step has run")
        return self._logits.float()


BASELINES = ("cuda_graph", "torch_compile", "hf_eager", "eager")
FP32_REFERENCE = "fp32_reference"  # not a baseline: the yardstick of the half-precision gate
DEFAULT_GPU_BASELINES = ("cuda_graph", "torch_compile", "hf_eager")


def make_runner(kind: str, spec: ModelSpec, weights: dict[str, torch.Tensor], capacity: int,
                inv_freq: Optional[torch.Tensor] = None):
    """A fresh runner of `kind` (its own KV cache) over `weights` (shared, not copied)."""
    if kind == "hf_eager":
        return HFRunner(build_hf_shared(spec, weights), spec)
    if kind == FP32_REFERENCE:
        runner = EagerRunner(LlamaDecodeStep(spec, weights, capacity, inv_freq, compute_dtype=torch.float32).eval())
        runner.name = FP32_REFERENCE
        return runner
    module = LlamaDecodeStep(spec, weights, capacity, inv_freq).eval()
    if kind == "eager":
        return EagerRunner(module)
    if kind == "cuda_graph":
        return CudaGraphRunner(module)
    if kind == "torch_compile":
        return CompiledRunner(module)
    raise BaselineError(f"unknown baseline {kind!r}; known: {', '.join(BASELINES)}")


def optional_engines() -> dict[str, str]:
    """vLLM / SGLang: not wired into this harness (their engines own the KV cache, so the
    same prefix cannot be written into them); reported as skipped with the reason."""
    import importlib.util

    out = {}
    for name in ("vllm", "sglang"):
        found = importlib.util.find_spec(name) is not None
        out[name] = "skipped: importable but not wired into this harness" if found else "skipped: not importable"
    return out
