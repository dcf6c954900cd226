"""A peer's own signing identity: an Ed25519 key whose public half *is* its libp2p peer id.

A DHT record under a peer's subkey (its registry entry, its readiness announcements) must be verifiable
as that peer's, not merely as a key holder's: the run key is shared, so an HMAC under it lets any key
holder write under any subkey. :class:`PeerIdentity` generates an Ed25519 key in this process, hands it
to this peer's p2pd daemon as its libp2p identity (:meth:`PeerIdentity.identity_file`), and signs with
it. The libp2p peer id of an Ed25519 key is the *identity* multihash of its public key (libp2p peer-id
spec: ``0x00``, length, protobuf ``PublicKey{type: Ed25519, data: 32 bytes}``), so anyone holding only
a peer id can check a signature with :func:`verify` — no key exchange, no key in the record. The same id
is what libp2p authenticates on every stream, so a DHT record and a message stream now name one
identity.

Failure modes: a peer id that is not an Ed25519 identity multihash (an RSA or secp256k1 libp2p key, a
made-up string) cannot sign anything :func:`verify` accepts, so its records are refused; the private
key never leaves the process (no ``repr``, not picklable) except through the identity file, which is
written 0600 into a private temporary folder and removed once the daemon has read it.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import tempfile
from collections.abc import Iterator

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

#: libp2p's protobuf ``KeyType`` of Ed25519, and the multihash code of the identity "hash" (the bytes themselves).
ED25519 = 1
IDENTITY_MULTIHASH = 0x00
#: The protobuf ``PublicKey`` of an Ed25519 key: field 1 (varint) = 1, field 2 (bytes, 32 long) = the key.
_PUBLIC_PREFIX = bytes([0x08, ED25519, 0x12, 32])
#: The peer id bytes of an Ed25519 key: identity multihash (code, length 36) of that protobuf.
_PEER_ID_PREFIX = bytes([IDENTITY_MULTIHASH, len(_PUBLIC_PREFIX) + 32]) + _PUBLIC_PREFIX
SIGNATURE_BYTES = 64


def _base58(raw: bytes) -> str:
    from hivemind.p2p import PeerID

    return PeerID(raw).to_base58()


@functools.lru_cache(maxsize=4096)
def public_key_of(peer_id: str) -> Ed25519PublicKey | None:
    """The Ed25519 public key a libp2p peer id names, or ``None`` if it names none (another key type, junk)."""
    from hivemind.p2p import PeerID

    try:
        raw = PeerID.from_base58(str(peer_id)).to_bytes()
    except Exception:  # noqa: BLE001 - not base58, not a multihash: names no key
        return None
    if len(raw) != len(_PEER_ID_PREFIX) + 32 or not raw.startswith(_PEER_ID_PREFIX):
        return None
    return Ed25519PublicKey.from_public_bytes(raw[len(_PEER_ID_PREFIX) :])


def verify(peer_id: str, data: bytes, signature: bytes) -> bool:
    """Whether ``signature`` is ``peer_id``'s Ed25519 signature of ``data`` (the key comes from the id itself)."""
    public = public_key_of(peer_id)
    if public is None or not isinstance(signature, (bytes, bytearray)) or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        public.verify(bytes(signature), bytes(data))
    except InvalidSignature:
        return False
    return True


class PeerIdentity:
    """This peer's Ed25519 key and the libp2p peer id it gives (see the module docstring)."""

    __slots__ = ("_private", "peer_id")

    def __init__(self, private: Ed25519PrivateKey):
        self._private = private
        public = private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.peer_id = _base58(_PEER_ID_PREFIX + public)

    @classmethod
    def generate(cls) -> PeerIdentity:
        return cls(Ed25519PrivateKey.generate())

    def sign(self, data: bytes) -> bytes:
        """The 64-byte Ed25519 signature of ``data``."""
        return self._private.sign(bytes(data))

    def _libp2p_private_key(self) -> bytes:
        """The protobuf ``PrivateKey{type: Ed25519, data: seed ‖ public key}`` that p2pd reads with ``-id``."""
        seed = self._private.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                           serialization.NoEncryption())  # fmt: skip
        public = self._private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        data = seed + public
        return bytes([0x08, ED25519, 0x12, len(data)]) + data

    @contextlib.contextmanager
    def identity_file(self) -> Iterator[str]:
        """A path holding this key for p2pd (``identity_path`` of ``hivemind.P2P``), removed on exit."""
        folder = tempfile.mkdtemp(prefix="noloco-id-")
        try:
            path = os.path.join(folder, "identity.key")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(self._libp2p_private_key())
            yield path
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def __repr__(self) -> str:
        return f"PeerIdentity({self.peer_id})"

    def __reduce__(self):  # the private key is never pickled into a checkpoint or a child process by accident
        raise TypeError("PeerIdentity cannot be pickled")
