"""`agora launch slurm|pbs`: keep agora-node jobs queued on a cluster, as the coordinator
asks. Torch-free: imports only `protocol`, trio and the standard library, so it runs on
a login node."""
