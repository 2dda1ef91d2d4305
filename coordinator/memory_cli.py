"""`agora memory`: what each stage of a run needs of a GPU's memory, and which common
cards hold it (the estimate of protocol.memory, the one the coordinator places with).

    agora memory --preset llama-1b --stages 2 --precision bf16 --recompute
    agora memory --preset llama-1b --stages 4 --stage-layers 3,5,5,3
    agora memory --preset llama-350m --stages 2 --balance   # suggests a stage_layers

Torch-free, like the coordinator: it prints an estimate, it measures nothing.
"""

from __future__ import annotations

import argparse
import sys

from protocol.memory import (
    COMMON_GPUS,
    NodeSettings,
    StageNeed,
    balanced_split,
    size,
    stage_needs,
)
from protocol.model_config import PRESETS, ModelConfig, preset


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="agora memory",
        description="Estimate each pipeline stage's device memory (weights, gradients, AdamW"
        " state, bf16 copies, activations, transients, margin) and the common GPU sizes that"
        " hold it.",
    )
    p.add_argument("--preset", required=True, choices=sorted(PRESETS), help="model preset")
    p.add_argument("--stages", type=int, default=1, help="pipeline stages (default 1)")
    p.add_argument(
        "--stage-layers", default=None, metavar="A,B,...",
        help="layers of each stage (the run's stage_layers; default an even split)",
    )  # fmt: skip
    p.add_argument(
        "--balance", action="store_true",
        help="also print the stage_layers whose largest stage needs the least",
    )  # fmt: skip
    p.add_argument("--vocab-size", type=int, default=0, help="tokens (default: the preset's)")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per micro-batch (8)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (128)")
    p.add_argument("--in-flight", type=int, default=4, help="stage 0's micro-batches in flight")
    p.add_argument(
        "--activation-cache", type=int, default=16, help="micro-batches a later stage keeps"
    )
    p.add_argument(
        "--precision", choices=("fp32", "bf16"), default="bf16",
        help="bf16 (default: what --precision auto picks on a GPU that has it) or fp32",
    )  # fmt: skip
    p.add_argument("--recompute", action="store_true", help="recompute activations in backward")
    return p.parse_args(argv)


def fits(need: StageNeed) -> str:
    """The common card sizes that hold `need`, or "none"."""
    return " ".join(name for name, cap in COMMON_GPUS.items() if need.total <= cap) or "none"


def report(cfg: ModelConfig, n_stages: int, s: NodeSettings) -> str:
    needs = stage_needs(cfg, n_stages, s)
    split = [n.layers for n in needs]
    lines = [
        f"{cfg.n_params() / 1e6:.0f}M parameters in {n_stages} stage(s), layers {split};"
        f" micro-batch {s.micro_batch} x {s.seq_len} tokens, {s.precision},"
        f" {'recompute' if s.recompute else 'no recompute'}, in flight {s.in_flight},"
        f" activation cache {s.activation_cache}",
        f"{'stage':>5}  {'layers':>6}  {'params':>8}  {'needs':>10}  fits",
    ]
    for n in needs:
        lines.append(
            f"{n.stage:>5}  {n.layers:>6}  {n.params / 1e6:>7.1f}M  {size(n.total):>10}  {fits(n)}"
        )
    lines.append("(card sizes are nominal: a card has a little less free, less with a display)")
    lines += ["", *(n.describe() for n in needs)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        split = tuple(int(x) for x in args.stage_layers.split(",")) if args.stage_layers else ()
        cfg = preset(args.preset).replace(stage_layers=split)
        if args.vocab_size:
            cfg = cfg.replace(vocab_size=args.vocab_size)
        s = NodeSettings(
            micro_batch=args.micro_batch, seq_len=args.seq_len, in_flight=args.in_flight,
            activation_cache=args.activation_cache, precision=args.precision,
            recompute=args.recompute,
        )  # fmt: skip
        cfg.layers_of(0, args.stages)  # the split must be one into --stages stages
        print(report(cfg, args.stages, s))
        if args.balance:
            best = balanced_split(cfg.replace(stage_layers=()), args.stages, s)
            largest = max(n.total for n in stage_needs(cfg.replace(stage_layers=tuple(best)),
                                                       args.stages, s))  # fmt: skip
            print(f"\nbalanced: stage_layers = {best} (largest stage {size(largest)})")
    except ValueError as exc:
        print(f"agora memory: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
