"""The wake-up report of a campaign: Markdown, a PNG of best-so-far latency, the best config.

    paths = write_report(journal, campaign_id, out_dir)
    # out_dir/report.md, out_dir/best_latency.png, out_dir/best_config.json

Every file is written atomically (temporary file + rename, `amk.commands.common.write_atomic`):
a reader, or a campaign killed mid-write, never sees half a file. `best_config.json` is a
plain `ScheduleConfig` JSON, ready for `amk compile MODEL --config best_config.json`.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Optional

from amk.agent.journal import Journal

from amk.commands.common import write_atomic

FILES = {"md": "report.md", "png": "best_latency.png", "json": "best_config.json"}


def best_so_far(trials: list[dict]) -> list[Optional[float]]:
    """Per trial, the latency of the kept config as of that trial (None before the first)."""
    cur, out = None, []
    for t in trials:
        if t["kept"] and t["latency_us"] is not None:
            cur = t["latency_us"]
        out.append(cur)
    return out


def plot_png(trials: list[dict], title: str) -> bytes:
    """Best-so-far latency per trial (step), passing trials (dots), failures (x at the
    bottom), the floor of the best config (dashed) and the default's latency (dotted)."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 4.5), dpi=110)
    ax = fig.add_subplot(1, 1, 1)
    xs = [t["n"] for t in trials]
    best = best_so_far(trials)
    ok = [(t["n"], t["latency_us"]) for t in trials if t["verdict"] == "pass" and t["latency_us"] is not None]
    if ok:
        ax.scatter([x for x, _ in ok], [y for _, y in ok], s=10, alpha=0.35, label="passing trial")
    bx = [x for x, b in zip(xs, best) if b is not None]
    by = [b for b in best if b is not None]
    if bx:
        ax.step(bx, by, where="post", linewidth=2, label="best so far")
    floors, cur = [], None
    for t in trials:
        if t["kept"] and t["floor_us"] is not None:
            cur = t["floor_us"]
        floors.append(cur)
    fx = [x for x, f in zip(xs, floors) if f is not None]
    if fx:
        ax.step(fx, [f for f in floors if f is not None], where="post", linestyle="--", color="black",
                linewidth=1, label="floor (bytes / bandwidth) of the best")
    default = next((t["latency_us"] for t in trials if t["note"] == "default" and t["latency_us"]), None)
    if default:
        ax.axhline(default, linestyle=":", color="gray", label="default config")
    bad = [t["n"] for t in trials if t["verdict"] not in ("pass", None)]
    if bad and (ok or fx):
        lo = min([y for _, y in ok] + [f for f in floors if f is not None])
        ax.scatter(bad, [lo * 0.97] * len(bad), marker="x", color="red", s=14, label="failed / rejected trial")
    ax.set_xlabel("trial")
    ax.set_ylabel("decode step latency (us)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper right")
    else:
        ax.text(0.5, 0.5, "no passing trial yet", ha="center", va="center", transform=ax.transAxes)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def _has_mpl() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _fmt(x, nd=2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _diff(cfg: dict, base: dict) -> str:
    keys = [k for k in cfg if cfg.get(k) != base.get(k) and k != "explicit_queues"]
    parts = [f"{k}={json.dumps(cfg[k])}" for k in keys]
    if cfg.get("explicit_queues") and cfg.get("explicit_queues") != base.get("explicit_queues"):
        parts.append(f"explicit_queues=[{len(cfg['explicit_queues'])} entries]")
    return ", ".join(parts) or "(the default)"


def markdown(journal: Journal, cid: str, files: dict[str, str]) -> str:
    c = journal.campaign(cid)
    trials = journal.trials(cid)
    st = journal.status(cid)
    info, settings = c["info"], c["settings"]
    default = next((t for t in trials if t["note"] == "default"), None)
    base_cfg = default["config"] if default else {}
    best = st["best"]
    lines = [f"# AMK autotune: {c['model']} on {c['device']}", "",
             f"- campaign `{cid}`, status **{c['status']}**, started {time.strftime('%Y-%m-%d %H:%M', time.localtime(c['created']))},"
             f" last update {time.strftime('%Y-%m-%d %H:%M', time.localtime(c['updated']))}",
             f"- target {c['target']}, evaluator `{c['evaluator']}`, KV capacity {info.get('kv_capacity')}, "
             f"context {info.get('context')}, model key `{c['model_key']}`",
             f"- {len(trials)} trials: " + ", ".join(f"{v} {k}" for k, v in sorted(st["by_verdict"].items())), ""]
    if c["evaluator"] == "cpu":
        lines += ["> Latencies come from the analytic cost model (`amk.agent.evaluators.CostModel`), not a GPU: "
                  "they rank configs, they are not measurements.", ""]
    lines += ["## Best config", ""]
    if best:
        dl = st["default_latency_us"]
        floor = best["floor_us"]
        lines += [f"- trial {best['trial']}: **{_fmt(best['latency_us'])} us** (p10 {_fmt(best['p10_us'])}, "
                  f"p90 {_fmt(best['p90_us'])})" + (f", **{dl / best['latency_us']:.3f}x** the default "
                                                    f"({_fmt(dl)} us)" if dl else ""),
                  f"- floor (bytes / bandwidth) {_fmt(floor, 3)} us: the best is at "
                  f"{100 * floor / best['latency_us']:.1f}% of the floor" if floor else "- floor: -",
                  f"- changes from the default: {_diff(best['config'], base_cfg)}",
                  f"- `{files['json']}`: `amk compile MODEL --config {files['json']}`", ""]
        bt = next(t for t in trials if t["n"] == best["trial"])
        q = bt["detail"].get("quality")
        if q:
            lines += [f"- quality vs the unquantized model ({q['vs']}): relative logits drift {q['drift_rel']:.4g}, "
                      f"argmax agreement {100 * q['argmax_agree']:.1f}% (reported, "
                      f"{'gated at ' + str(settings.get('max_quant_drift')) if settings.get('max_quant_drift') else 'not gated'})", ""]
    else:
        lines += ["No passing trial yet.", ""]
    lines += [f"![best-so-far latency]({files['png']})" if _has_mpl() else "(no plot: matplotlib is not installed)",
              "", "## Top configs", "",
              "| trial | latency us | p10 | p90 | floor us | speedup | proposer | changes from default |",
              "|---:|---:|---:|---:|---:|---:|---|---|"]
    ok = sorted((t for t in trials if t["verdict"] == "pass" and t["latency_us"] is not None),
                key=lambda t: t["latency_us"])
    for t in ok[:10]:
        lines.append(f"| {t['n']} | {_fmt(t['latency_us'])} | {_fmt(t['p10_us'])} | {_fmt(t['p90_us'])} | "
                     f"{_fmt(t['floor_us'], 3)} | {_fmt(t['speedup'], 3)} | {t['proposer']} | "
                     f"{_diff(t['config'], base_cfg)} |")
    quant = [t for t in ok if t["detail"].get("quality")]
    if quant:
        lines += ["", "## Quantized / re-typed configs: quality (reported, not gated unless --max-quant-drift)", "",
                  "| trial | quant | group | lm head | latency us | drift (rel. max-abs logits) | argmax agree |",
                  "|---:|---|---|---|---:|---:|---:|"]
        for t in sorted(quant, key=lambda t: t["latency_us"])[:10]:
            q, cf = t["detail"]["quality"], t["config"]
            lines.append(f"| {t['n']} | {cf.get('quant')} | {cf.get('quant_group')} | {cf.get('quant_lm_head')} | "
                         f"{_fmt(t['latency_us'])} | {q['drift_rel']:.4g} | {100 * q['argmax_agree']:.1f}% |")
    failed = [t for t in trials if t["verdict"] not in ("pass", None)]
    if failed:
        lines += ["", "## Failed trials", "", "| trial | verdict | first reason |", "|---:|---|---|"]
        for t in failed[-30:]:
            why = (t["violations"] or [""])[0].replace("|", "/")[:160]
            lines.append(f"| {t['n']} | {t['verdict']} | {why} |")
        if len(failed) > 30:
            lines.append(f"\n({len(failed) - 30} earlier failures in the journal)")
    model = settings.get("model") or ""
    flags = f" --random-init --seed {settings.get('seed', 0)}" if settings.get("random_init") else ""
    flags += f" --kv-capacity {settings.get('kv_capacity', 2048)}"
    for k in ("target", "dtype"):
        if settings.get(k):
            flags += f" --{k} {settings[k]}"
    lines += ["", "## Reproduce / continue", "", "```",
              f"amk compile {model}{flags} --config {files['json']}",
              f"amk evaluate {model}{flags} --config {files['json']} --evaluator {c['evaluator']} --json",
              f"amk autotune {model}{flags} --journal {settings.get('journal_dir')} --resume "
              f"--evaluator {c['evaluator']}", "```", ""]
    return "\n".join(lines)


def write_report(journal: Journal, cid: str, out_dir: Path) -> dict[str, str]:
    """Write report.md, best_latency.png, best_config.json (atomically); returns their paths."""
    out_dir = Path(out_dir)
    trials = journal.trials(cid)
    st = journal.status(cid)
    c = journal.campaign(cid)
    paths = {k: str(out_dir / v) for k, v in FILES.items()}
    title = f"{c['model']} on {c['device']} ({c['evaluator']} evaluator), campaign {cid}"
    try:
        png = plot_png(trials, title)
    except ImportError:  # matplotlib missing: the Markdown and the best config still matter
        png = None
        paths.pop("png")
    if png is not None:
        write_atomic(out_dir / FILES["png"], png)
    if st["best"]:
        write_atomic(out_dir / FILES["json"], json.dumps(st["best"]["config"], indent=2) + "\n")
    else:
        paths.pop("json")
    write_atomic(out_dir / FILES["md"], markdown(journal, cid, FILES))
    return paths
