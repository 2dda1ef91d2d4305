"""The node's data-plane transport: py-libp2p (Noise, Yamux) under trio, with per-peer limits.

`Transport` is the small interface the pipeline uses (so tests can inject faults);
`Libp2pTransport` in `node.p2p.host` is the real implementation. This package must never
import hivemind: hivemind and py-libp2p both register the protobuf package `crypto.pb`,
so they cannot share a process, and hivemind lives in the outer-loop process (node.outer).
"""
