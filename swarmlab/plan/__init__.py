"""`agora plan`: a discrete-event simulation of a swarm, its validation against real
loopback swarms, and the CLI (swarmlab/plan/main.py).
"""
