"""Where the next trial comes from: the search space over `ScheduleConfig` and the proposers.

`SearchSpace` lists every field of `ScheduleConfig` as a dimension with its candidate values
(work split, placement, VM knobs, fusion, the int8/int4 quantization knobs, and the program
dtype when asked), minus the fields the user pins (`fixed`). `repair` makes any point
consistent (quant knobs only with quant, 'channel' groups only for int8 without split-K,
blocks x threads within one SM). `sm_assignment='explicit'` is reached by mutation only:
it moves a few tasks of a measured program to other queues (the lowering needs one queue
per task, known only once a program exists).

Proposers share one interface: `propose(state) -> Proposal | None`, `observe(Observation)`
for every finished trial (whoever proposed it), `hop()` on a plateau, and `warm_start`
with the passing trials of earlier campaigns on the same model and device.

* `RandomProposer`       uniform over the space.
* `LocalSearchProposer`  mutates 1-3 fields of its current point; moves when the child beats
                         it; after `patience` misses restarts at a fresh random point (the
                         global best is the campaign's, never lost).
* `TpeProposer`          optuna's TPE over the same dimensions (categorical), fed every
                         observation (its own via tell, others via add_trial); lazy import.
* `SequenceProposer`     a fixed list (warm-start bests, tests), then nothing.
* `PortfolioProposer`    cycles through several (the default `auto`: local, tpe, local,
                         tpe, random).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Optional

from amk.agent.evaluators import PASS, config_hash
from amk.schedule.config import ScheduleConfig
from amk.schedule.ir import MAX_KV_SPLITS, GpuTarget

BOOL = (False, True)
QUANT_FIELDS = ("quant", "quant_group", "quant_asym", "quant_lm_head", "quant_unpack")


@dataclass(frozen=True)
class Dim:
    name: str
    choices: tuple
    ordered: bool = True  # neighbours are adjacent choices


@dataclass
class Proposal:
    config: ScheduleConfig
    parent: Optional[ScheduleConfig] = None  # the point it was derived from (A/B and walker acceptance)
    proposer: str = ""
    note: str = ""
    token: Any = None  # proposer-private (an optuna trial)


@dataclass
class Observation:
    config: ScheduleConfig
    parent: Optional[ScheduleConfig]
    verdict: str
    latency_us: Optional[float]
    accepted: bool = False  # beat its parent
    kept: bool = False  # became the global best
    proposer: str = ""
    token: Any = None
    detail: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.verdict == PASS and self.latency_us is not None


@dataclass
class SearchState:
    """What the loop tells a proposer: the global best and the default (baseline)."""

    best: Optional[Observation] = None
    default: Optional[ScheduleConfig] = None
    trials: int = 0


def _pow2(lo: int, hi: int) -> list[int]:
    out, v = [], lo
    while v <= hi:
        out.append(v)
        v *= 2
    return out


# Fields with a Dim that the search does not move: explicit_queues (moved by _move_tasks).
NOT_SEARCHED = ("explicit_queues",)


class SearchSpace:
    def __init__(self, target: GpuTarget, *, fixed: Optional[dict] = None, search_dtype: bool = False,
                 base: Optional[ScheduleConfig] = None):
        self.target = target
        self.fixed = dict(fixed or {})
        if not search_dtype:
            self.fixed.setdefault("dtype", (base or ScheduleConfig()).dtype)
        self.base = (base or ScheduleConfig()).with_(**self.fixed) if self.fixed else (base or ScheduleConfig())
        sms = target.compute_units
        mq = self.fixed.get("max_queues")
        q = min(mq or sms, sms * 8)
        slabs = sorted({*_pow2(1, 1024), *(max(1, q * f // 4) for f in (1, 2, 4, 8, 12, 16))} - {0})
        slabs = [s for s in slabs if s <= 4096]
        queue_caps = sorted({max(1, sms * f // 8) for f in (1, 2, 4, 6)})
        dims = [
            Dim("gemv_tasks_per_matrix", ("auto", *slabs)),
            Dim("split_k", (1, 2, 3, 4, 6, 8, 12, 16)),
            Dim("kv_splits", ("auto", *_pow2(1, MAX_KV_SPLITS))),
            Dim("kv_block", tuple(_pow2(8, 1024))),
            Dim("argmax_splits", ("auto", 1, 2, 4, 8, 16, 32)),
            Dim("fuse_argmax", BOOL, ordered=False),
            Dim("sm_assignment", ("lpt", "round_robin"), ordered=False),
            Dim("blocks_per_sm", tuple(range(1, 9))),
            Dim("max_queues", (None, *queue_caps)),
            Dim("threads_per_block", (64, 128, 192, 256, 384, 512, 768, 1024)),
            Dim("prefetch_depth", ("auto", 0, 1, 2, 3, 4)),
            Dim("prefetch_kb", (16, 32, 64, 128, 256, 1024, 8192)),
            Dim("prefetch_min_kb", (0, 64, 128, 256, 512, 1024)),
            Dim("gemv_unroll", ("auto", 2, 4, 6, 8)),
            Dim("gemv_unroll_quant", ("auto", 2, 4, 8)),
            Dim("poll_cap_ns", ("auto", 64, 128, 256, 512, 1024)),
            Dim("gemv_loads_ahead", ("auto", False, True), ordered=False),
            Dim("fuse_norm", BOOL, ordered=False),
            Dim("fuse_rope_append", BOOL, ordered=False),
            Dim("rope_rows", ("auto", 16, 32, 64), ordered=False),  # a value the model's head_dim refuses: an error trial
            Dim("rope_multi_run", BOOL, ordered=False),
            Dim("kv_head_counters", BOOL, ordered=False),
            Dim("kv_head_major", BOOL, ordered=False),
            Dim("fuse_attn_combine", BOOL, ordered=False),
            Dim("o_proj_kv_slices", (0, 1, 2, 4)),  # a count the model's KV heads refuse: an error trial
            Dim("fuse_residual", BOOL, ordered=False),
            Dim("fuse_silu_mul", BOOL, ordered=False),
            Dim("quant", ("none", "int8", "int4"), ordered=False),
            Dim("quant_group", (32, 64, 128, "channel")),
            Dim("quant_asym", BOOL, ordered=False),
            Dim("quant_lm_head", BOOL, ordered=False),
            Dim("quant_unpack", (0, 1, 2)),
            Dim("dtype", (None, "float32", "bfloat16", "float16"), ordered=False),
            # chiplet placement exists only on multi-XCD targets ('auto' is off elsewhere)
            Dim("xcd_placement", ("auto", False) if target.xcds > 1 else ("auto",), ordered=False),
        ]
        self.dims = [d for d in dims if d.name not in self.fixed and d.name not in NOT_SEARCHED]
        missing = set(ScheduleConfig.model_fields) - {d.name for d in dims} - {"explicit_queues"}
        assert not missing, f"search space misses ScheduleConfig fields {missing}"

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.dims]

    # ------------------------------------------------------------------ points
    def repair(self, d: dict) -> dict:
        d = {**d, **self.fixed}
        if d.get("quant", "none") == "none":
            d.update(quant_lm_head=False, quant_unpack=0, quant_group=128)
        if d.get("quant_group") == "channel" and (d.get("quant") != "int8" or d.get("split_k", 1) > 1):
            d["quant_group"] = 128
        if d.get("quant") != "int8":
            d["quant_asym"] = False
        if d.get("split_k", 1) > 1 or not d.get("fuse_norm", True) or not d.get("fuse_residual", True) \
                or d.get("fuse_attn_combine"):
            d["o_proj_kv_slices"] = 0
        if d.get("sm_assignment") == "explicit" and not d.get("explicit_queues"):
            d["sm_assignment"] = "lpt"
        if d.get("sm_assignment") != "explicit":
            d["explicit_queues"] = None
        tg = self.target
        if tg.xcds < 2:
            d["xcd_placement"] = "auto"
        tpb = d.get("threads_per_block", 256)
        tpb = max(tg.warp_size, tpb - tpb % tg.warp_size)
        d["threads_per_block"] = tpb
        bps = d.get("blocks_per_sm", 1)
        d["blocks_per_sm"] = max(1, min(bps, tg.max_blocks_per_cu, tg.max_threads_per_cu // tpb))
        return d

    def config(self, params: dict) -> ScheduleConfig:
        return ScheduleConfig.model_validate(self.repair({**self.base.model_dump(), **params}))

    def params_of(self, cfg: ScheduleConfig) -> Optional[dict]:
        """cfg as dimension values, or None if some value is outside the choices."""
        d = cfg.model_dump()
        out = {}
        for dim in self.dims:
            if d[dim.name] not in dim.choices:
                return None
            out[dim.name] = d[dim.name]
        return out

    def random(self, rng: random.Random) -> ScheduleConfig:
        return self.config({dim.name: rng.choice(dim.choices) for dim in self.dims})

    def mutate(self, cfg: ScheduleConfig, rng: random.Random, *, n_fields: Optional[int] = None,
               queue_of: Optional[list[int]] = None) -> ScheduleConfig:
        """A neighbour: 1-3 fields moved (ordered fields by one or two steps), or, when the
        program's task->queue map is known, a few tasks moved to other queues."""
        if queue_of and rng.random() < 0.12 and "sm_assignment" in self.names:
            return self._move_tasks(cfg, rng, queue_of)
        d = cfg.model_dump()
        if d["sm_assignment"] == "explicit":  # a structural change invalidates the queue list
            d.update(sm_assignment="lpt", explicit_queues=None)
        k = n_fields or rng.choices((1, 2, 3), weights=(0.65, 0.25, 0.10))[0]
        for dim in rng.sample(self.dims, min(k, len(self.dims))):
            cur = d[dim.name]
            others = [c for c in dim.choices if c != cur]
            if not others:
                continue
            if dim.ordered and cur in dim.choices:
                i = dim.choices.index(cur)
                step = rng.choice((-2, -1, -1, 1, 1, 2))
                d[dim.name] = dim.choices[max(0, min(len(dim.choices) - 1, i + step))]
                if d[dim.name] == cur:
                    d[dim.name] = rng.choice(others)
            else:
                d[dim.name] = rng.choice(others)
        return ScheduleConfig.model_validate(self.repair(d))

    def _move_tasks(self, cfg: ScheduleConfig, rng: random.Random, queue_of: list[int]) -> ScheduleConfig:
        q = list(queue_of)
        n_queues = max(q) + 1
        for _ in range(rng.choice((1, 2, 4, 8))):
            t = rng.randrange(len(q))
            if rng.random() < 0.5:  # swap two tasks' queues
                u = rng.randrange(len(q))
                q[t], q[u] = q[u], q[t]
            else:
                q[t] = rng.randrange(n_queues)
        return ScheduleConfig.model_validate(self.repair({**cfg.model_dump(), "sm_assignment": "explicit",
                                                          "explicit_queues": q}))

    def describe(self) -> dict:
        return {"fixed": self.fixed, "dims": {d.name: list(d.choices) for d in self.dims}}


# ============================================================================ proposers
class Proposer:
    name = "base"

    def propose(self, state: SearchState) -> Optional[Proposal]:
        raise NotImplementedError

    def observe(self, obs: Observation) -> None:
        pass

    def hop(self) -> None:
        pass

    def warm_start(self, results: list[dict]) -> None:
        pass


class RandomProposer(Proposer):
    name = "random"

    def __init__(self, space: SearchSpace, seed: int = 0):
        self.space, self.rng = space, random.Random(seed)

    def propose(self, state):
        parent = state.best.config if state.best else None
        return Proposal(self.space.random(self.rng), parent=parent, proposer=self.name)


class SequenceProposer(Proposer):
    """Proposes the given configs in order (each against the current best), then None."""

    name = "sequence"

    def __init__(self, configs: list[ScheduleConfig], name: str = "sequence"):
        self.configs, self.name = list(configs), name

    def propose(self, state):
        if not self.configs:
            return None
        return Proposal(self.configs.pop(0), parent=state.best.config if state.best else None, proposer=self.name)


class LocalSearchProposer(Proposer):
    """Hill climbing by mutation with restarts. Its point moves when a child it proposed
    beats it (`accepted`, which the loop decides: cost model or A/B); after `patience`
    misses in a row it restarts at a fresh random point."""

    name = "local"

    def __init__(self, space: SearchSpace, seed: int = 0, patience: int = 12):
        self.space, self.rng, self.patience = space, random.Random(seed + 7), patience
        self.point: Optional[Observation] = None
        self.misses = 0
        self.restart_pending = False

    def propose(self, state):
        if self.restart_pending or (self.point is None and state.best is None):
            self.restart_pending = False
            self.point = None
            return Proposal(self.space.random(self.rng), parent=state.best.config if state.best else None,
                            proposer=self.name, note="restart")
        if self.point is None:
            self.point = state.best
        qo = self.point.detail.get("queue_of") if self.point.detail else None
        return Proposal(self.space.mutate(self.point.config, self.rng, queue_of=qo), parent=self.point.config,
                        proposer=self.name)

    def observe(self, obs):
        if not obs.ok:
            if obs.proposer == self.name:
                self._miss()
            return
        if self.point is None and obs.proposer == self.name:  # a restart point that ran
            self.point, self.misses = obs, 0
            return
        if self.point is not None and obs.parent is not None and \
                config_hash(obs.parent) == config_hash(self.point.config):
            if obs.accepted:
                self.point, self.misses = obs, 0
            elif obs.proposer == self.name:
                self._miss()
        elif obs.kept and self.point is not None and obs.latency_us is not None and \
                self.point.latency_us is not None and obs.latency_us < self.point.latency_us:
            self.point, self.misses = obs, 0  # someone else found better: climb from there

    def _miss(self):
        self.misses += 1
        if self.misses >= self.patience:
            self.misses = 0
            self.restart_pending = True

    def hop(self):
        self.restart_pending = True

    def warm_start(self, results):
        pass  # the loop evaluates earlier campaigns' bests first; the walker starts from the best


class TpeProposer(Proposer):
    """optuna TPE (multivariate) over the categorical dimensions of the space."""

    name = "tpe"

    def __init__(self, space: SearchSpace, seed: int = 0, n_startup: int = 8):
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self.optuna = optuna
        self.space = space
        self.dists = {d.name: optuna.distributions.CategoricalDistribution(list(d.choices)) for d in space.dims}
        import warnings

        with warnings.catch_warnings():  # multivariate TPE is flagged experimental
            warnings.simplefilter("ignore")
            sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=n_startup, multivariate=True)
        self.study = optuna.create_study(direction="minimize", sampler=sampler)
        self._seen: set[str] = set()

    def propose(self, state):
        trial = self.study.ask(self.dists)
        cfg = self.space.config(dict(trial.params))
        return Proposal(cfg, parent=state.best.config if state.best else None, proposer=self.name, token=trial)

    def _add(self, cfg: ScheduleConfig, value: Optional[float]) -> None:
        params = self.space.params_of(cfg)
        h = config_hash(cfg)
        if params is None or h in self._seen:
            return
        self._seen.add(h)
        ft = self.optuna.trial
        st = ft.TrialState.COMPLETE if value is not None else ft.TrialState.FAIL
        self.study.add_trial(ft.create_trial(params=params, distributions=self.dists, value=value, state=st))

    def observe(self, obs):
        value = obs.latency_us if obs.ok else None
        if obs.token is not None and obs.proposer == self.name:
            ts = self.optuna.trial.TrialState
            if value is None:
                self.study.tell(obs.token, state=ts.FAIL)
            else:
                self.study.tell(obs.token, value)
            self._seen.add(config_hash(obs.config))
        else:
            self._add(obs.config, value)

    def warm_start(self, results):
        for r in results:
            try:
                self._add(ScheduleConfig.model_validate(r["config"]), r["latency_us"])
            except Exception:
                continue


class PortfolioProposer(Proposer):
    """Cycles through `members` in `order`; every observation goes to all of them."""

    name = "auto"

    def __init__(self, members: dict[str, Proposer], order: list[str]):
        self.members, self.order, self.i = members, order, 0

    def propose(self, state):
        for _ in range(len(self.order)):
            p = self.members[self.order[self.i % len(self.order)]]
            self.i += 1
            prop = p.propose(state)
            if prop is not None:
                return prop
        return None

    def observe(self, obs):
        for p in self.members.values():
            p.observe(obs)

    def hop(self):
        for p in self.members.values():
            p.hop()

    def warm_start(self, results):
        for p in self.members.values():
            p.warm_start(results)


def has_optuna() -> bool:
    try:
        import optuna  # noqa: F401
    except ImportError:
        return False
    return True


PROPOSERS = ("auto", "random", "local", "tpe")


def make_proposer(name: str, space: SearchSpace, seed: int = 0) -> Proposer:
    if name == "random":
        return RandomProposer(space, seed)
    if name == "local":
        return LocalSearchProposer(space, seed)
    if name == "tpe":
        if not has_optuna():
            raise ImportError("the tpe proposer needs optuna (pip install optuna)")
        return TpeProposer(space, seed)
    if name == "auto":
        members: dict[str, Proposer] = {"local": LocalSearchProposer(space, seed), "random": RandomProposer(space, seed)}
        order = ["local", "random"]
        if has_optuna():
            members["tpe"] = TpeProposer(space, seed)
            order = ["local", "tpe", "local", "tpe", "random"]
        return PortfolioProposer(members, order)
    raise ValueError(f"unknown proposer {name!r}; one of {', '.join(PROPOSERS)}")


def parse_fixed(items: list[str]) -> dict:
    """`--fix field=value` items -> {field: value} (values as JSON, else strings)."""
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep or k not in ScheduleConfig.model_fields:
            raise ValueError(f"--fix expects FIELD=VALUE with a ScheduleConfig field, got {it!r}")
        try:
            out[k] = json.loads(v)
        except ValueError:
            out[k] = v
    ScheduleConfig().with_(**out)  # validates
    return out
