"""The warmup datagram: who, for which model, when, a nonce, and an HMAC over all of it.

Wire form: msgpack of `[session_id, model, timestamp, nonce, mac]`, where
`mac = HMAC-SHA256(key, msgpack([session_id, model, timestamp, nonce]))`.
The timestamp is Unix time in seconds (float) and bounds how long a
datagram stays valid; the 16-byte nonce makes each one unique, so a copy
replayed within that time is recognized. The whole datagram fits easily in
one UDP packet (`MAX_DATAGRAM_BYTES`).
"""

import hashlib
import hmac
import os
import socket
import time

import msgspec

MAX_DATAGRAM_BYTES = 512
MAX_SESSION_ID_CHARS = 128
NONCE_BYTES = 16


class WarmupDatagram(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    session_id: str
    model: str
    timestamp: float
    nonce: bytes
    mac: bytes

    def signed_part(self) -> bytes:
        return msgspec.msgpack.encode([self.session_id, self.model, self.timestamp, self.nonce])


_decoder = msgspec.msgpack.Decoder(WarmupDatagram)


def sign(key: bytes, session_id: str, model: str, timestamp: float | None = None,
         nonce: bytes | None = None) -> bytes:
    """A ready-to-send datagram."""
    unsigned = WarmupDatagram(session_id, model, time.time() if timestamp is None else timestamp,
                              os.urandom(NONCE_BYTES) if nonce is None else nonce, b"")
    unsigned.mac = hmac.new(key, unsigned.signed_part(), hashlib.sha256).digest()
    return msgspec.msgpack.encode(unsigned)


def decode(data: bytes) -> WarmupDatagram | None:
    """The datagram's fields, or None when it is not a well-formed warmup datagram."""
    if len(data) > MAX_DATAGRAM_BYTES:
        return None
    try:
        datagram = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if not datagram.session_id or len(datagram.session_id) > MAX_SESSION_ID_CHARS:
        return None
    if len(datagram.nonce) != NONCE_BYTES or len(datagram.mac) != hashlib.sha256().digest_size:
        return None
    return datagram


def is_authentic(key: bytes, datagram: WarmupDatagram) -> bool:
    expected = hmac.new(key, datagram.signed_part(), hashlib.sha256).digest()
    return hmac.compare_digest(expected, datagram.mac)


def send_warmup(host: str, port: int, key: bytes, session_id: str, model: str) -> None:
    """Send one warmup datagram (fire and forget: UDP, no reply)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.sendto(sign(key, session_id, model), (host, port))
