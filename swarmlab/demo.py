"""`agora demo`: a local swarm (2 stages x 2 replicas) training on the embedded corpus.

Starts a coordinator and four nodes on loopback, shows a live progress line, kills one
replica part-way and starts a fresh node in its place, then drains everything, runs the
audit and writes `demo-out/`: `loss.csv`, `loss.png` and `summary.json`.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from node.plotting import Series, plot_series, write_csv
from swarmlab.swarm import LocalSwarm


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="agora demo",
        description="Run a coordinator and a 2-stage x 2-replica swarm on this machine, "
        "training on the Python standard library's source. Kills and replaces a peer "
        "on the way, then writes a loss plot, a CSV and summary.json.",
    )
    p.add_argument("--out", type=Path, default=Path("demo-out"), help="output directory")
    p.add_argument("--minutes", type=float, default=4.0, help="training time (default 4)")
    p.add_argument("--preset", default="small", help="model preset (default small)")
    p.add_argument(
        "--kill-at", type=float, default=0.4, help="fraction of the run at which to kill"
    )
    p.add_argument(
        "--outer-every-steps", type=int, default=10, help="inner steps between DiLoCo rounds"
    )
    return p.parse_args(argv)


def _line(row: dict[str, Any]) -> str:
    loss = f"{row['loss']:.3f}" if row["loss"] is not None else "  -  "
    return (
        f"\r[{row['t']:6.1f}s] tokens {row['tokens']:>9,}  loss {loss}  "
        f"{row['tokens_per_s']:>7.0f} tok/s  peers/stage {row['peers']}   "
    )


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    swarm = LocalSwarm(
        workdir=out / "run",
        preset=args.preset,
        stages=2,
        node_args=["--outer-every-steps", str(args.outer_every_steps)],
    )
    print(f"agora demo: preset {args.preset}, 2 stages x 2 replicas, {args.minutes:g} min;"
          f" logs in {out / 'run'}")  # fmt: skip
    rows: list[dict[str, Any]] = []
    seen_bytes: dict[str, tuple[float, float]] = {}  # node -> last scraped (raw, wire)
    events: list[str] = []
    kills = joins = 0
    try:
        addr = swarm.start_coordinator()
        print(f"coordinator listening on {addr}")
        for name, stage in (("s0-a", 0), ("s0-b", 0), ("s1-a", 1), ("s1-b", 1)):
            swarm.add_node(name, stage)
        print("started 4 nodes: s0-a, s0-b (stage 0), s1-a, s1-b (stage 1)")
        print("metrics: each node serves Prometheus text on its --metrics-port; "
              "`agora status --coordinator " + addr + "` shows the run")  # fmt: skip
        t0 = time.monotonic()
        duration = args.minutes * 60
        killed = replaced = False
        while (now := time.monotonic() - t0) < duration:
            time.sleep(2.0)
            for proc in swarm.nodes.values():
                if not proc.alive() and proc.popen.returncode not in (-9, 0):
                    raise RuntimeError(f"node {proc.name} crashed:\n{proc.tail()}")
            row = _sample(swarm, now, seen_bytes)
            rows.append(row)
            sys.stdout.write(_line(row))
            sys.stdout.flush()
            if not killed and now > args.kill_at * duration:
                swarm.nodes["s1-a"].signal(signal.SIGKILL)
                kills += 1
                killed = True
                events.append(f"{now:.0f}s: killed s1-a (SIGKILL)")
                print(f"\n>>> killed replica s1-a with SIGKILL at {now:.0f}s;"
                      " its micro-batches re-route to s1-b")  # fmt: skip
            elif killed and not replaced and now > args.kill_at * duration + 10:
                swarm.add_node("s1-c", 1)
                joins += 1
                replaced = True
                events.append(f"{now:.0f}s: started s1-c")
                print(f"\n>>> started a fresh node s1-c on stage 1 at {now:.0f}s")
        print("\ndraining: every node finishes its in-flight work, commits and leaves ...")
        codes = swarm.stop_nodes()
        final = _sample(swarm, time.monotonic() - t0, seen_bytes)
        codes.update(swarm.stop_coordinator())
    finally:
        swarm.kill_all()
    audit = swarm.audit()
    print(audit.stdout.strip())
    losses = [r for r in rows if r["loss"] is not None]
    bytes_total = final["bytes"]
    summary = {
        "preset": args.preset,
        "stages": 2,
        "replicas": 2,
        "seconds": round(final["t"], 1),
        "initial_loss": losses[0]["loss"] if losses else None,
        "final_loss": losses[-1]["loss"] if losses else None,
        "tokens": final["tokens"],
        "kills": kills,
        "joins": joins,  # nodes that joined the running swarm after the start
        "nodes_started": 4 + joins,
        "raw_bytes": bytes_total["raw"],
        "wire_bytes": bytes_total["wire"],
        "compression_ratio": bytes_total["raw"] / bytes_total["wire"]
        if bytes_total["wire"]
        else None,
        "exit_codes": codes,
        "events": events,
        "audit": {
            "clean": audit.clean,
            "exit_code": audit.exit_code,
            "report": audit.stdout,
        },
    }
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "loss.csv", rows, ["t", "tokens", "loss", "tokens_per_s"])
    plot_series(
        out / "loss.png",
        [Series("swarm training loss", [r["t"] for r in losses], [r["loss"] for r in losses])],
        title=f"agora demo: {args.preset}, 2 stages x 2 replicas, one kill + one join",
        xlabel="seconds",
        ylabel="loss (nats per byte)",
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(
        f"loss {summary['initial_loss']} -> {summary['final_loss']} over {summary['tokens']:,} tokens;"
        f" {kills} kill, {joins} join; audit {'clean' if audit.clean else 'NOT CLEAN'}"
    )
    print(f"wrote {out / 'loss.png'}, {out / 'loss.csv'} and {out / 'summary.json'}")
    return 0 if audit.clean else 1


def _sample(
    swarm: LocalSwarm, t: float, seen_bytes: dict[str, tuple[float, float]]
) -> dict[str, Any]:
    """One progress row: coordinator status plus the nodes' Prometheus metrics."""
    status = swarm.status()
    losses = []
    for name, proc in swarm.nodes.items():
        m = swarm.scrape(name) if proc.alive() else {}
        if name.startswith("s0") and m.get("agora_node_loss", 0.0) > 0:
            losses.append(m["agora_node_loss"])
        if m:  # a killed node keeps the bytes it last reported
            seen_bytes[name] = (_sum(m, 'kind="raw"'), _sum(m, 'kind="wire"'))
    raw = sum(r for r, _ in seen_bytes.values())
    wire = sum(w for _, w in seen_bytes.values())
    return {
        "t": round(t, 1),
        "tokens": status.committed_tokens,
        "loss": round(sum(losses) / len(losses), 4) if losses else None,
        "tokens_per_s": status.tokens_per_s,
        "peers": "/".join(str(s.peers) for s in status.stages),
        "bytes": {"raw": raw, "wire": wire},
    }


def _sum(metrics: dict[str, float], label: str) -> float:
    return sum(
        v
        for k, v in metrics.items()
        if k.startswith("agora_node_boundary_bytes_total") and label in k
    )
