"""`agora chaos`: run a local swarm, inject a seeded schedule of faults, and check the
promise: training goes on, the audit finds no lost or duplicated range, and no honest
process crashes or grows without bound.

A run is a coordinator and 2 stages x 2 replicas (`LocalSwarm`, real processes on
loopback). After all four nodes train, the fault window of `--minutes` starts; the
schedule (`plan`) is a pure function of the seed: fault kinds come in shuffled cycles
(every kind once per cycle) at jittered, evenly spaced times in the first 85% of the
window, so the last part shows recovery. Kinds:

- `kill_node`: SIGKILL of a random trained node, replaced at once by a fresh node on
  the same stage;
- `zombie`: SIGSTOP of a node for the lease TTL plus a few seconds, then SIGCONT: its
  leases are fenced and it must re-join;
- `kill_coordinator`: SIGKILL of the coordinator, restart on the same port and DB;
- `cut_stream`: a rogue member cuts forward streams mid-message (EOF, reset);
- `rogue`: a rogue peer (`swarmlab.chaos.rogue`): non-member request, garbage, NaN, Inf,
  wrong shape, a frame claiming 2 GiB, thousands of streams, replayed / unsigned /
  forged / stale coordinator requests;
- `join_mid_round`: a fresh node joins, timed from the observed outer-round cadence to
  land while a round is under way.

Victims are drawn with the seeded generator among nodes that have trained and whose
stage keeps another healthy replica (so the run measures recovery, not a dead stage);
a fault with no eligible victim is counted as skipped. Then every node is drained
(SIGINT), the coordinator stopped, and `agora audit` replays the lease log. The nodes
write stage checkpoints after every applied outer round and at their drain; the model
the live nodes drained to is exported and its held-out loss evaluated (`heldout`). The
same seed without faults (`--baseline sequential|concurrent|none`) keeps every stage
state its nodes checkpoint, so its model at the chaos run's committed-token count is
evaluated on the same held-out set: the comparison at equal committed tokens.

With `--hostile` the schedule plays hostile attacks instead of faults (`hostile`): bad
addresses, msgpack amplification, connection floods and slow drips, stranger lease
calls, forged facility reports, key floods and replays, maximal address lists (raw
sockets), a member answering with poisoned gradients and one sending oversized forwards
(libp2p), while a probe times heartbeats and reads the committed tokens.

Modules: `schedule` (config, kinds, `plan`), `faults` (the injectors), `run` (one swarm
under one schedule, sampling, the per-run report), `heldout` (kept states, models over
time, their committed tokens, the held-out evaluation), `main` (both runs, the held-out
comparison, the command line),
`rogue` (the rogue peer process), `hostile` (the hostile run and its judgement),
`raw_attacks` and `member_attacks` (the hostile attackers), `control_wire` (a blocking
control-plane connection).
"""
