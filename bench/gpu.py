"""`agora bench gpu`: what one GPU gets out of Agora, against one plain PyTorch process on it.

Two measurements, one after the other, on the same device and with the same model,
micro-batch and precision (bf16 autocast where the GPU has it, fp32 weights and AdamW):

1. **central**: one process trains the whole preset on the embedded corpus for
   `--seconds` after a warm-up: tokens/s, model FLOPs utilisation and peak device memory
   (`torch.cuda.max_memory_allocated`).
2. **swarm**: a coordinator and a 2-stage pipeline of two `agora-node` processes sharing
   the device (one stage each, boundary codec `--codec`, fp16 by default, no outer loop,
   so the number is the pipeline's): tokens/s from stage 0's `agora_node_tokens_total`
   over `--seconds` after both trained, the boundary bytes per token both ways
   (`agora_node_boundary_bytes_total`), each node's peak device memory
   (`agora_node_device_peak_bytes`), and how many of stage 0's micro-batches ran their
   forward twice (`agora_node_recomputes_total`).

MFU is 6 x parameters x tokens/s over the device's peak dense bf16 FLOP/s (`--peak-tflops`,
or a table of known GPUs); attention's own FLOPs are left out, so it is a lower bound.
Without CUDA it exits 2 and says so; `--device cpu --preset tiny` runs the same code on
the CPU as a smoke test (no MFU, no device memory). The JSON has both measurements and
`swarm_over_central` (the tokens/s ratio).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from node.data import RandomBatches, load_dataset
from node.inner_step import inner_step
from node.model import PRESETS, build_model, param_groups, preset
from node.stage_compute import resolve_precision
from protocol.tensors import CODECS
from swarmlab.procs import wait_for
from swarmlab.swarm import LocalSwarm

# Peak dense bf16 tensor FLOP/s (TFLOPS) by a substring of the device name.
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0,
               "RTX 4090": 165.0, "RTX 4080": 97.0, "RTX 3090": 71.0, "RTX 3080": 60.0}  # fmt: skip
TOKENS = "agora_node_tokens_total"
RECOMPUTES = "agora_node_recomputes_total"
DEVICE_PEAK = "agora_node_device_peak_bytes"
BOUNDARY_BYTES = "agora_node_boundary_bytes_total"


def peak_tflops(device: torch.device, given: float | None) -> float | None:
    if given is not None or device.type != "cuda":
        return given
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def mfu(n_params: int, tokens_per_s: float, tflops: float | None) -> float | None:
    return None if not tflops else round(6 * n_params * tokens_per_s / (tflops * 1e12), 4)


def measure_central(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """One process, the whole model: tokens/s, peak memory."""
    cfg = preset(args.preset).replace(
        max_seq_len=max(args.seq_len, preset(args.preset).max_seq_len)
    )
    model = build_model(cfg).to(device)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-4, betas=(0.9, 0.95))
    precision = resolve_precision(args.precision, str(device))
    batches = RandomBatches(load_dataset().train, args.micro_batch, args.seq_len, seed=0)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def step() -> None:
        x, y = (t.to(device) for t in next(batches))
        with torch.autocast(device.type, torch.bfloat16, enabled=precision == "bf16"):
            loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        inner_step([model], opt, lr=3e-4, grad_clip=1.0)

    for _ in range(args.warmup_steps):
        step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda *a: None)
    sync(device)
    t0, steps = time.perf_counter(), 0
    while time.perf_counter() - t0 < args.seconds:
        step()
        steps += 1
    sync(device)
    seconds = time.perf_counter() - t0
    tps = steps * args.micro_batch * args.seq_len / seconds
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"tokens_per_s": round(tps, 1), "steps": steps, "seconds": round(seconds, 2),
            "precision": precision, "n_params": cfg.n_params(), "peak_memory_bytes": peak}  # fmt: skip


def measure_swarm(args: argparse.Namespace, device: torch.device, workdir: Path) -> dict[str, Any]:
    """A 2-stage pipeline of two nodes on `device`: stage 0's tokens/s, peak memory."""
    sw = LocalSwarm(workdir, preset=args.preset, stages=2, codec=args.codec)
    node_cfg = sw.write_node_config(
        micro_batch=args.micro_batch, seq_len=args.seq_len, device=str(device),
        precision=args.precision, outer_every_steps=0,
    )  # fmt: skip
    try:
        sw.start_coordinator()
        for name, stage in (("s0", 0), ("s1", 1)):
            sw.add_node(name, stage, "--config", str(node_cfg))

        def tokens(name: str) -> float:
            return sw.scrape(name).get(TOKENS, 0.0)

        def boundary_bytes() -> float:  # stage 0's boundary on the wire, both directions
            m = sw.scrape("s0")
            return sum(
                v for k, v in m.items() if k.startswith(BOUNDARY_BYTES) and 'kind="wire"' in k
            )

        def training() -> bool:
            if dead := [n for n in ("s0", "s1") if not sw.nodes[n].alive()]:
                raise RuntimeError(f"agora bench gpu: {dead} exited before training\n{sw.tails()}")
            return tokens("s0") > 0 and tokens("s1") > 0

        wait_for(training, "both stages training", args.start_timeout, poll_s=1.0,
                 detail=sw.tails)  # fmt: skip

        def recomputes() -> float:
            return sw.scrape("s0").get(RECOMPUTES, 0.0)

        t0, n0, b0, r0 = time.monotonic(), tokens("s0"), boundary_bytes(), recomputes()
        time.sleep(args.seconds)  # the measured window: the pipeline trains meanwhile
        t1, n1, b1, r1 = time.monotonic(), tokens("s0"), boundary_bytes(), recomputes()
        peaks = {name: sw.scrape(name).get(DEVICE_PEAK) for name in ("s0", "s1")}
    finally:
        codes = sw.stop()
    return {"tokens_per_s": round((n1 - n0) / (t1 - t0), 1), "seconds": round(t1 - t0, 2),
            "codec": args.codec, "peak_memory_bytes": peaks, "exit_codes": codes,
            "boundary_bytes_per_token": round((b1 - b0) / max(n1 - n0, 1.0), 1),
            # stage 0's backwards that ran the forward again, per micro-batch trained
            "recomputes_per_micro_batch": round(
                (r1 - r0) * args.micro_batch * args.seq_len / max(n1 - n0, 1.0), 3)}  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="agora bench gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu (a smoke test)")
    p.add_argument("--preset", default="llama-125m", choices=sorted(PRESETS),
                   help="model preset (default llama-125m)")  # fmt: skip
    p.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"))
    p.add_argument("--codec", default="fp16", choices=CODECS,
                   help="the swarm's boundary codec (default fp16: the pipeline's own cost)")  # fmt: skip
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch")
    p.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    p.add_argument("--seconds", type=float, default=60.0, help="each measured window (s)")
    p.add_argument("--warmup-steps", type=int, default=5, help="central steps before timing")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's peak dense bf16 TFLOPS (default: known GPUs' table)")  # fmt: skip
    p.add_argument("--start-timeout", type=float, default=300.0, help="swarm start-up limit (s)")
    p.add_argument("--workdir", type=Path, default=None, help="swarm logs (default a temp dir)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("agora bench gpu: no CUDA device here (torch.cuda.is_available() is False);"
              " --device cpu runs it as a smoke test", file=sys.stderr)  # fmt: skip
        return 2
    tflops = peak_tflops(device, args.peak_tflops)
    central = measure_central(args, device)
    central["mfu"] = mfu(central["n_params"], central["tokens_per_s"], tflops)
    print(f"central: {central['tokens_per_s']:.0f} tokens/s, MFU {central['mfu']},"
          f" peak memory {central['peak_memory_bytes']} B", flush=True)  # fmt: skip
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the swarm's nodes share the device next
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="agora-gpu-"))
    swarm = measure_swarm(args, device, workdir)
    swarm["mfu"] = mfu(central["n_params"], swarm["tokens_per_s"], tflops)
    print(f"swarm (2 stages, 2 nodes on one device): {swarm['tokens_per_s']:.0f} tokens/s,"
          f" MFU {swarm['mfu']}, {swarm['boundary_bytes_per_token']} boundary B/token ({args.codec}),"
          f" peak memory per node {swarm['peak_memory_bytes']}")  # fmt: skip
    result = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "preset": args.preset, "micro_batch": args.micro_batch, "seq_len": args.seq_len,
        "peak_tflops": tflops, "central": central, "swarm": swarm,
        "swarm_over_central": round(swarm["tokens_per_s"] / central["tokens_per_s"], 4),
        "workdir": str(workdir),
    }  # fmt: skip
    print(f"swarm over central: {result['swarm_over_central']}")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))
    bad = {k: v for k, v in swarm["exit_codes"].items() if v != 0}
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
