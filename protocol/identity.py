"""Node identity: ed25519 keys and the libp2p peer id they imply.

One key serves everywhere: it signs control-plane requests, it is the libp2p identity
on the data plane, and the outer-loop process's hivemind daemon runs under it (its
`libp2p_private_key`), so a member has one peer id on every plane. The peer id is computed here, the way libp2p does it (an identity
multihash of the protobuf-encoded public key, in base58btc), so the coordinator can bind
a join to a data-plane peer id without importing libp2p.
"""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from protocol.errors import ProtocolError

PUBLIC_KEY_SIZE = 32  # bytes
SIGNATURE_SIZE = 64  # bytes of an ed25519 signature
PRIVATE_KEY_SIZE = 32  # bytes (the ed25519 seed)
# PrivateKey{Type: Ed25519 (1), Data: 64 bytes}: the fixed head of an encoded private key
LIBP2P_ED25519_PRIVATE = b"\x08\x01\x12\x40"
LIBP2P_PRIVATE_KEY_SIZE = len(LIBP2P_ED25519_PRIVATE) + 64  # bytes
_B58 = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"


def b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = ""
    while n:
        n, r = divmod(n, 58)
        out = _B58[r] + out
    pad = len(data) - len(data.lstrip(b"\0"))
    return "1" * pad + out


def b58decode(text: str) -> bytes:
    """The bytes `b58encode` made `text` from; ProtocolError for a non-base58 character."""
    n = 0
    for ch in text:
        i = _B58.find(ch)
        if i < 0:
            raise ProtocolError(f"not base58: {ch!r}")
        n = n * 58 + i
    pad = len(text) - len(text.lstrip("1"))
    return b"\0" * pad + (n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b"")


def peer_id_from_public_key(public_key: bytes) -> str:
    """libp2p peer id of an ed25519 public key (identity multihash, base58btc)."""
    if len(public_key) != PUBLIC_KEY_SIZE:
        raise ProtocolError(f"ed25519 public key must be 32 bytes, got {len(public_key)}")
    proto = b"\x08\x01\x12\x20" + public_key  # PublicKey{Type: Ed25519, Data: key}
    return b58encode(b"\x00" + bytes([len(proto)]) + proto)


def is_libp2p_private_key(data: bytes) -> bool:
    """Whether `data` is an ed25519 key as `NodeKey.libp2p_private_key` encodes one."""
    return len(data) == LIBP2P_PRIVATE_KEY_SIZE and data.startswith(LIBP2P_ED25519_PRIVATE)


def libp2p_peer_id(private_key: bytes) -> str:
    """The peer id of a key encoded by `NodeKey.libp2p_private_key`."""
    if not is_libp2p_private_key(private_key):
        raise ProtocolError("not an ed25519 libp2p private key")
    return peer_id_from_public_key(private_key[-PUBLIC_KEY_SIZE:])


class NodeKey:
    """An ed25519 private key with the helpers the node needs."""

    __slots__ = ("_sk", "public_key")

    def __init__(self, seed: bytes) -> None:
        if len(seed) != PRIVATE_KEY_SIZE:
            raise ValueError(f"ed25519 seed must be 32 bytes, got {len(seed)}")
        self._sk = Ed25519PrivateKey.from_private_bytes(seed)
        self.public_key = self._sk.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    @classmethod
    def generate(cls) -> NodeKey:
        from cryptography.hazmat.primitives.serialization import NoEncryption, PrivateFormat

        sk = Ed25519PrivateKey.generate()
        return cls(sk.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()))

    @property
    def seed(self) -> bytes:
        from cryptography.hazmat.primitives.serialization import NoEncryption, PrivateFormat

        return self._sk.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption())

    @property
    def peer_id(self) -> str:
        return peer_id_from_public_key(self.public_key)

    def sign(self, data: bytes) -> bytes:
        return self._sk.sign(data)

    def libp2p_private_key(self) -> bytes:
        """The key as a libp2p `PrivateKey` protobuf (type Ed25519, data: seed then public
        key), the file format go-libp2p's daemon reads with `-id`: the outer-loop process
        runs hivemind under it, so its DHT peer id is this key's `peer_id`."""
        return LIBP2P_ED25519_PRIVATE + self.seed + self.public_key

    def __repr__(self) -> str:  # never print the secret
        return f"NodeKey(peer_id={self.peer_id})"


def verify_signature(public_key: bytes, signature: bytes, data: bytes) -> None:
    """Raise `ProtocolError` unless `signature` is valid for `data`."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, data)
    except Exception as exc:  # InvalidSignature, ValueError for bad key bytes
        raise ProtocolError("bad signature") from exc
