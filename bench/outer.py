"""`agora bench outer`: bytes per replica per round and round time of the outer averaging,
by scheme and group size, with real outer-loop processes (hivemind DHT + averager) on
loopback; then the same bytes, from each scheme's byte model, up to 64 replicas.

For every scheme (`all_gather`, `reduce_scatter`) and group size R, R outer processes of
one fresh stage start (each bootstraps from the first), the others download the first's
state, and all begin one round at once with their own pseudo-gradient. A round counts only
when every member reports a group of R (matchmaking may split a group under load; then a
fresh stage retries). Bytes are the wire bytes of pseudo-gradient tensors each member sent
(acknowledged) and received, as its `RoundResult` reports them; `compressed` is one whole
pseudo-gradient in the wire codec. The model column is `bytes_model`, checked against the
measurement at every measured size, then extended to larger groups.
`cpu_s_per_member` is the CPU time of a member's outer process, its hivemind children
and their p2p daemon, from the first member's `begin_round` to its result; with
`--stagger S` each member begins S seconds after the one before, so the first ones wait
in matchmaking for the rest, as replicas of a swarm do.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from bench.efficiency_ft import cpu_seconds
from node.diloco import DilocoConfig
from node.outer.settings import AVERAGINGS, COMPRESSIONS
from node.outer_link import OuterConfig, OuterLink, RoundResult

BYTES_PER_ELEMENT = {"none": 4, "fp16": 2}  # wire bytes per element of the exact codecs


def bytes_model(scheme: str, members: int, compressed: float) -> dict[str, float]:
    """Mean wire bytes one member sends and receives per round, for a group of `members`
    whose whole compressed pseudo-gradient is `compressed` bytes (parts of length
    numel / R, so each part is compressed / R).

    - all-gather: every member sends its whole contribution to the R - 1 others and
      receives theirs: (R - 1) C each way.
    - reduce-scatter: a member sends R - 1 of its parts to their reducers and its reduced
      part to the R - 1 others, and receives as much: 2 (R - 1) C / R each way. From 3
      members, one member audits one part: the R - 1 others send it their copy of that
      part (C / R each), (R - 1) C / R^2 per member each way on average over the group.
    """
    r = members
    if r < 2:
        return {"sent": 0.0, "received": 0.0}
    if scheme == "all_gather":
        each = (r - 1) * compressed
        return {"sent": each, "received": each}
    if scheme != "reduce_scatter":
        raise ValueError(f"scheme must be one of {AVERAGINGS}, got {scheme!r}")
    each = 2 * (r - 1) * compressed / r
    audit = (r - 1) * (compressed / r) / r if r >= 3 else 0.0  # per member, on average
    return {"sent": each + audit, "received": each + audit}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="agora bench outer",
        description="Outer averaging: wire bytes per replica per round and round time, by"
        " scheme and group size, with real outer processes on loopback (hivemind DHT +"
        " averager), and the byte model of each scheme up to --model-up-to replicas.",
    )
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument(
        "--sizes", default="2,3,4,6", help="group sizes to run (comma-separated; default 2,3,4,6)"
    )
    p.add_argument(
        "--schemes",
        default=",".join(AVERAGINGS),
        help=f"averaging schemes (comma-separated; default {','.join(AVERAGINGS)})",
    )
    p.add_argument(
        "--numel", type=int, default=1 << 20, help="parameters per replica (default 1048576)"
    )
    p.add_argument(
        "--compression",
        default="fp16",
        choices=[c for c in COMPRESSIONS if c in BYTES_PER_ELEMENT],
        help="pseudo-gradient wire codec (default fp16, the node's default)",
    )
    p.add_argument("--attempts", type=int, default=3, help="fresh stages per size (default 3)")
    p.add_argument(
        "--round-timeout", type=float, default=30.0, help="exchange timeout per round (s)"
    )
    p.add_argument("--model-up-to", type=int, default=64, help="largest group in the model table")
    p.add_argument(
        "--stagger",
        type=float,
        default=0.0,
        help="seconds between two members' begin of the round, so the first ones wait in"
        " matchmaking as in a swarm (default 0: all at once)",
    )
    return p


def _one_round(
    scheme: str, members: int, numel: int, cfg: OuterConfig, stagger: float = 0.0
) -> tuple[list[RoundResult], list[float]] | None:
    """One round of a fresh stage of `members` replicas, each beginning `stagger` seconds
    after the one before (replicas of a swarm reach their rounds at different moments):
    the results and each member's outer-process CPU seconds from the first begin to its
    result; None when the group split."""
    run = uuid.uuid4().hex[:8]
    links: list[OuterLink] = []
    try:
        for _ in range(members):  # each joins every earlier replica's DHT, as nodes do
            boot = [a for link in links for a in link.dht_addrs()]
            links.append(
                OuterLink.start(run_id=run, stage=0, numel=numel, initial_peers=boot, config=cfg)
            )
        first = links[0]
        g = torch.Generator().manual_seed(0)
        theta0 = torch.randn(numel, generator=g)
        first.set_initial_state([theta0])
        for link in links[1:]:
            if link.fetch_state(timeout=cfg.state_timeout_s) != 0:
                raise RuntimeError("a replica could not download the first one's state")
        # each replica's step: one shared by all (they descend one loss from one theta_g)
        # plus its own, as honest pseudo-gradients point alike; unrelated random steps
        # would be rejected by the robust aggregation's direction rules and send no part
        common = torch.randn(numel, generator=g)
        works = [theta0 - 0.01 * (common + torch.randn(numel, generator=g)) for _ in links]
        cpu0 = [cpu_seconds(link.pid) for link in links]
        for i, (link, work) in enumerate(zip(links, works, strict=True)):
            if i:
                time.sleep(stagger)
            link.begin_round([work], 1000 * (i + 1))
        wait = 2 * cfg.matchmaking_s + cfg.round_timeout_s + stagger * members + 60.0
        results = [link.wait_result(wait) for link in links]
        cpu = [cpu_seconds(link.pid) - c for link, c in zip(links, cpu0, strict=True)]
        if any(r.group_size != members for r in results):
            return None
        if len({r.digest for r in results}) != 1:
            raise RuntimeError(f"{scheme}: members of one group ended with different states")
        return results, cpu
    finally:
        for link in links:
            link.close(timeout=15.0)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
        schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
        bad = [s for s in schemes if s not in AVERAGINGS]
        if bad or not schemes:
            raise ValueError(f"--schemes must name some of {AVERAGINGS}, got {args.schemes!r}")
        if not sizes or min(sizes) < 2:
            raise ValueError(f"--sizes must be group sizes >= 2, got {args.sizes!r}")
        if not 0.0 <= args.stagger <= 10.0:
            raise ValueError(f"--stagger must be in [0, 10] seconds, got {args.stagger}")
        if args.numel < 2 * max(sizes):
            raise ValueError(f"--numel must be at least 2 x the largest size, got {args.numel}")
    except ValueError as exc:
        print(f"agora bench outer: {exc}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    compressed = args.numel * BYTES_PER_ELEMENT[args.compression]
    rows: list[dict[str, Any]] = []
    for scheme in schemes:
        for r in sizes:
            cfg = OuterConfig(
                compression=args.compression,
                averaging=scheme,
                matchmaking_s=max(3.0, 0.75 * r, 1.5 * args.stagger * (r - 1)),
                request_timeout_s=1.0,
                round_timeout_s=args.round_timeout,
                state_timeout_s=60.0,
                target_group_size=r,
                diloco=DilocoConfig(target_tokens=1000 * r * (r + 1) // 2),
            )
            got = None
            for attempt in range(args.attempts):
                t0 = time.monotonic()
                got = _one_round(scheme, r, args.numel, cfg, args.stagger)
                print(
                    f"{scheme} R={r} attempt {attempt + 1}: "
                    + ("group split, retrying" if got is None else "ok")
                    + f" ({time.monotonic() - t0:.1f}s)",
                    file=sys.stderr,
                )
                if got is not None:
                    break
            if got is None:
                rows.append({"scheme": scheme, "members": r, "error": "the group split"})
                continue
            results, cpu = got
            sent = statistics.mean(x.bytes_out for x in results)
            received = statistics.mean(x.bytes_in for x in results)
            model = bytes_model(scheme, r, compressed)
            rows.append(
                {
                    "scheme": scheme,
                    "members": r,
                    "sent_bytes": sent,
                    "received_bytes": received,
                    "sent_max_bytes": max(x.bytes_out for x in results),
                    "received_max_bytes": max(x.bytes_in for x in results),
                    "per_compressed": (sent + received) / compressed,
                    "model_sent_bytes": model["sent"],
                    "model_received_bytes": model["received"],
                    "round_s_median": statistics.median(x.seconds for x in results),
                    "round_s_max": max(x.seconds for x in results),
                    # CPU of each member's outer process tree (DHT, averager, p2p daemon)
                    "cpu_s_per_member": statistics.mean(cpu),
                }
            )
    model_sizes = sorted({2, 3, 4, 6, 8, 16, 32, 64} | set(sizes))
    modelled = [
        {
            "members": r,
            **{
                f"{s}_per_compressed": sum(bytes_model(s, r, compressed).values()) / compressed
                for s in AVERAGINGS
            },
        }
        for r in model_sizes
        if r <= args.model_up_to
    ]
    print(
        f"\nouter averaging, {args.numel} params, {args.compression}: one compressed"
        f" pseudo-gradient C = {compressed / 1e6:.2f} MB"
    )
    print(
        f"{'scheme':<15}{'R':>3}{'sent MB':>10}{'recv MB':>10}{'(s+r)/C':>9}"
        f"{'model':>8}{'round s':>9}{'CPU s':>7}"
    )
    for row in rows:
        if "error" in row:
            print(f"{row['scheme']:<15}{row['members']:>3}  {row['error']}")
            continue
        model_ratio = (row["model_sent_bytes"] + row["model_received_bytes"]) / compressed
        print(
            f"{row['scheme']:<15}{row['members']:>3}{row['sent_bytes'] / 1e6:>10.2f}"
            f"{row['received_bytes'] / 1e6:>10.2f}{row['per_compressed']:>9.2f}"
            f"{model_ratio:>8.2f}{row['round_s_median']:>9.2f}{row['cpu_s_per_member']:>7.2f}"
        )
    print("\nmodel, (sent + received) per replica per round / C:")
    print(f"{'R':>4}" + "".join(f"{s:>16}" for s in AVERAGINGS))
    for m in modelled:
        print(
            f"{m['members']:>4}" + "".join(f"{m[f'{s}_per_compressed']:>16.2f}" for s in AVERAGINGS)
        )
    if args.json:
        out = {
            "bench": "outer",
            "numel": args.numel,
            "compression": args.compression,
            "compressed_bytes": compressed,
            "stagger_s": args.stagger,
            "measured": rows,
            "model": modelled,
            # group size -> scheme -> bytes sent + received per replica per round:
            # measured where a row ran, the model up to --model-up-to
            "bytes_per_replica_per_round": {
                str(m["members"]): {s: m[f"{s}_per_compressed"] * compressed for s in AVERAGINGS}
                for m in modelled
            },
            "bytes_per_replica_per_round_measured": {
                str(r): {
                    row["scheme"]: row["sent_bytes"] + row["received_bytes"]
                    for row in rows
                    if row["members"] == r and "error" not in row
                }
                for r in sizes
            },
            "how": "real outer processes on loopback, one round per (scheme, size); bytes are"
            " each member's RoundResult.bytes_out/bytes_in (tensor payload on the wire),"
            " averaged over the group; model = bench.outer.bytes_model",
        }
        args.json.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
