"""The outer-loop process of a node (DESIGN.md sections 2 and 6): hivemind's DHT and a
`StageAverager` for one stage, started by `node.outer_link.OuterLink` as a fresh
interpreter (`python -m node.outer`). The only package that imports hivemind; it never
imports libp2p. Importing this package itself loads neither.
"""
