"""swarmlab: tools that run whole swarms on one machine.

`procs` (child processes, ports, waiting), `configs` (TOML from dicts), `coordinator`
(a coordinator child process, the lease audit), `swarm` (`LocalSwarm`), `demo`,
`chaos/` (seeded fault injection) and `cli` (the `agora` umbrella command). Nothing here
is imported by node/, coordinator/ or protocol/. This module imports nothing, so
`agora status` and `agora audit` start without torch.
"""
