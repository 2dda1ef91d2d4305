"""Data-plane messages between peers: forward, backward and state requests.

(Extended by the pipeline work.)
"""

from __future__ import annotations
