"""The outer-loop process of a node: hivemind's DHT and a `StageAverager` for one stage,
started by `node.outer_link.OuterLink` as a fresh interpreter (`python -m node.outer`).

hivemind and py-libp2p cannot share a process, so this is the only package that imports
hivemind, and it never imports libp2p. The stage process imports two of its modules,
`node.outer.contract` (the typed commands and replies the two processes exchange) and
`node.outer.settings`; they, like this package itself, load none of hivemind, libp2p or
torch.
"""
