"""The one error type of the wire protocol.

Anything malformed, oversized, unsigned, replayed or otherwise unacceptable that arrives
from the network surfaces as `ProtocolError`, never as a raw KeyError, TypeError or
msgpack exception.
"""


class ProtocolError(Exception):
    """Raised for every malformed or unacceptable input."""
