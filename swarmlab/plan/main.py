"""`agora plan`: predict a swarm before running it.

    agora plan --model llama-1b --fleet fleet.toml --json plan.json --plots plots/
    agora plan --model deploy/plan/llama-8b.toml --fleet deploy/plan/consumer-330.toml
    agora plan --model small --validate --json validation.json

Prints the predicted tokens/s, efficiency against the same devices in one data centre,
time per outer round and bytes per peer per day, for the given `--stages` or for the
stage count it recommends; writes plots of efficiency against RTT, bandwidth, churn and
replicas per stage (PNG), and JSON with `prediction` and `validation` (real loopback
swarms against the simulator, with `--validate`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

from protocol.model_config import PRESETS, ModelConfig, preset
from swarmlab.plan.fleet import load_fleet
from swarmlab.plan.predict import predict, profiles_for, recommend, sweep

SWEEP_LABELS = {
    "rtt_ms": ("RTT to peers (ms)", "efficiency_vs_rtt.png"),
    "mbit": ("link bandwidth, each way (Mbit/s)", "efficiency_vs_bandwidth.png"),
    "churn": ("departures per peer-hour", "efficiency_vs_churn.png"),
    "replicas": ("replicas per stage", "efficiency_vs_replicas.png"),
}


def load_model(spec: str) -> ModelConfig:
    """A preset name, or a TOML file with a [model] table of ModelConfig fields."""
    if spec in PRESETS:
        return preset(spec)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"--model {spec!r} is neither a preset {sorted(PRESETS)} nor a file")
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"model file {path}: {exc}") from exc
    if "model" not in data:
        raise ValueError(f"model file {path}: needs a [model] table")
    return ModelConfig.from_dict(data["model"])


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agora plan",
        description=(
            "Predict a swarm with a discrete-event simulation that runs Agora's own routing,"
            " placement, lease and outer-round rules on simulated time. Compute comes from"
            " stages measured here (device cpu) or from published GPU figures (labelled)."
        ),
    )
    p.add_argument("--model", default="small", help="model preset or TOML with [model]")
    p.add_argument("--fleet", type=Path, help="fleet TOML (groups, churn, timings, node)")
    p.add_argument("--stages", type=int, help="pipeline stages (default: the recommended)")
    p.add_argument("--codec", help="boundary codec, overriding the fleet's [node] codec")
    p.add_argument("--minutes", type=float, default=20.0, help="simulated minutes per run")
    p.add_argument(
        "--sweep-minutes", type=float, help="simulated minutes per sweep point (default minutes/4)"
    )
    p.add_argument("--seed", type=int, default=0, help="seeds latencies, routing and churn")
    p.add_argument("--no-sweeps", action="store_true", help="skip the sweeps and plots")
    p.add_argument("--plots", type=Path, help="directory for the PNG plots")
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument(
        "--validate",
        action="store_true",
        help="run real loopback swarms (2x2, 3x2, 2x3 and a shaped 2x2) against the simulator",
    )
    p.add_argument("--validate-window", type=float, default=90.0, help="seconds per real run")
    p.add_argument("--no-shaped", action="store_true", help="validate without the shaped run")
    p.add_argument(
        "--keep-swarms",
        type=Path,
        metavar="DIR",
        help="keep each validation swarm's logs, events and database under DIR "
        "(default: a temporary directory, removed)",
    )
    p.add_argument(
        "--measured",
        type=Path,
        help="validate against the real runs stored in an earlier --validate report (JSON)",
    )
    return p


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _print_prediction(pred: dict[str, Any]) -> None:
    rnd = pred["round_s"]
    committed = (
        f"{pred['committed_tokens_per_s']:,.0f}"
        if pred["committed_tokens_per_s"]
        else "none in the window (no outer round ended: run more --minutes)"
    )
    print(
        f"prediction: {pred['stages']} stages x {pred['replicas_per_stage']:.1f} replicas\n"
        f"  tokens/s trained    {pred['tokens_per_s']:,.0f}\n"
        f"  tokens/s committed  {committed}\n"
        f"  data centre         {pred['dc_tokens_per_s']:,.0f} tokens/s (same devices)\n"
        f"  efficiency          {pred['efficiency']:.2f}\n"
        f"  outer round         {'-' if rnd is None else f'{rnd:.1f} s'}\n"
        f"  per peer per day    {pred['bytes_per_peer_per_day'] / 1e9:,.1f} GB\n"
        f"  joins / departures  {pred['joins']} / {pred['departures']}"
    )


def _print_validation(rows: list[dict[str, Any]]) -> None:
    print(f"{'shape':<12}{'metric':<14}{'measured':>10}{'predicted':>11}{'error':>8}")
    for row in rows:
        if "error" in row:
            print(f"{row['shape']:<12}the real swarm failed: {row['error'][:200]}")
            continue
        for k in ("tokens_per_s", "round_s", "reroute_s"):
            v = row[k]
            if v["measured"] is None:
                continue
            err = "-" if v["error"] is None else f"{v['error']:+.0%}"
            pred = "-" if v["predicted"] is None else f"{v['predicted']:.2f}"
            print(f"{row['shape']:<12}{k:<14}{v['measured']:>10.2f}{pred:>11}{err:>8}")


def _plots(directory: Path, sweeps: dict[str, list[dict[str, float]]], title: str) -> list[str]:
    from node.plotting import Series, plot_series

    out = []
    for key, (label, name) in SWEEP_LABELS.items():
        pts = sweeps[key]
        series = [Series("swarm / data centre", [p["x"] for p in pts], [p["efficiency"] for p in pts], "o")]  # fmt: skip
        plot_series(directory / name, series, title=title, xlabel=label, ylabel="efficiency")
        out.append(str(directory / name))
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = load_model(args.model)
    report: dict[str, Any] = {"model": args.model, "prediction": None, "validation": None}
    if args.validate or args.measured:
        from swarmlab.plan.validate import measure_all, validate

        if args.model not in PRESETS:
            raise ValueError("--validate runs real swarms: give --model as a preset name")
        if args.keep_swarms and not args.validate:
            raise ValueError("--keep-swarms keeps the real swarms of --validate")
        if args.measured:
            try:
                measured = json.loads(args.measured.read_text())["validation"]["measured"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"--measured {args.measured}: no validation runs ({exc})") from exc
        else:
            measured = measure_all(
                model, args.model, window_s=args.validate_window, warmup_s=20.0,
                shaped=not args.no_shaped, say=_say, keep=args.keep_swarms,
            )  # fmt: skip
        report["validation"] = validate(measured)
        _print_validation(report["validation"]["rows"])
    if args.fleet is None:
        return report
    fleet = load_fleet(args.fleet)
    if args.codec:
        fleet = dataclasses.replace(fleet, node=dataclasses.replace(fleet.node, codec=args.codec))
    t0 = time.monotonic()
    stages = args.stages
    if stages is None:
        _say(f"choosing the stage count for {fleet.n_peers} peers")
        rec = recommend(model, fleet, minutes=args.minutes / 4, seed=args.seed, say=_say)
        stages = rec["stages"]
        report["recommendation"] = rec
    pred = predict(model, fleet, stages, minutes=args.minutes, seed=args.seed)
    report["prediction"] = pred
    _print_prediction(pred)
    if not args.no_sweeps:
        _say("sweeping RTT, bandwidth, churn and replicas per stage")
        profiles = profiles_for(model, fleet, stages)
        minutes = args.sweep_minutes or args.minutes / 4
        report["sweeps"] = sweep(fleet, profiles, stages, minutes=minutes, seed=args.seed, say=_say)
        if args.plots:
            title = f"{args.model}: {stages} stages, {fleet.n_peers} peers ({args.fleet.name})"
            report["plots"] = _plots(args.plots, report["sweeps"], title)
    report["wall_s"] = time.monotonic() - t0
    return report


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.fleet is None and not (args.validate or args.measured):
        _parser().error("give --fleet FILE (a prediction) and/or --validate")
    if args.stages is not None and args.stages < 2:
        _parser().error(f"--stages must be >= 2 (a pipeline), got {args.stages}")
    try:
        report = run(args)
    except ValueError as exc:
        print(f"agora plan: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("agora plan: interrupted", file=sys.stderr)
        return 130
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
