"""Client-side envelope encryption of checkpoint files (AES-256-GCM).

Each checkpoint gets a fresh random 256-bit data key. Every file is encrypted with it
(``nonce(12) || ciphertext+tag``, the file's name as associated data, so files cannot be
swapped), and the data key is wrapped with the key-encryption key (KEK) the same way. The
manifest carries the wrapped data key and a fingerprint of the KEK (an HMAC, which reveals
nothing about the key), so a restore with the wrong key fails with a clear error naming the
checkpoint before any byte reaches MXNet. The manifest's sizes and sha256 are over the
ciphertext, so integrity is checked without the key.

The KEK comes from an environment variable whose *name* is in the config
(``checkpoint.encryption_key_env``): 32 bytes, as 64 hex digits or base64. Its value is never
logged, stored, or put in the job document.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from dataclasses import dataclass
from typing import Any

from common.errors import DeterministicError
from common.settings import secret

ALGORITHM = "AES-256-GCM/envelope-v1"
_NONCE = 12


class CheckpointKeyError(DeterministicError, ValueError):
    """The encryption key is missing, malformed, or not the one a checkpoint was written with.

    A ``ValueError``: a wrong key is a configuration problem, deterministic, not worth a retry.
    """


def parse_key(raw: str, env_name: str) -> bytes:
    raw = raw.strip()
    for decode in (bytes.fromhex, base64.b64decode):
        try:
            key = decode(raw)
        except (ValueError, binascii.Error):
            continue
        if len(key) == 32:
            return key
    raise CheckpointKeyError(f"${env_name} must hold a 32-byte key as 64 hex digits or base64")


def key_from_env(env_name: str) -> bytes:
    raw = secret(env_name)
    if not raw:
        raise CheckpointKeyError(f"checkpoint encryption is configured but ${env_name} is not set")
    return parse_key(raw, env_name)


def _aesgcm(key: bytes) -> Any:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(key)


def _seal(key: bytes, data: bytes, aad: bytes) -> bytes:
    nonce = os.urandom(_NONCE)
    return nonce + _aesgcm(key).encrypt(nonce, data, aad)


def _open(key: bytes, blob: bytes, aad: bytes) -> bytes:
    return _aesgcm(key).decrypt(blob[:_NONCE], blob[_NONCE:], aad)


@dataclass(frozen=True)
class Envelope:
    """Encrypts the files of one checkpoint and describes how to decrypt them (``header``)."""

    kek: bytes
    env_name: str

    def fingerprint(self) -> str:
        return hmac.new(self.kek, b"mxpipe-checkpoint-kek", hashlib.sha256).hexdigest()[:16]

    def seal(self, files: dict[str, bytes], context: str) -> tuple[dict[str, bytes], dict[str, Any]]:
        dek = os.urandom(32)
        sealed = {name: _seal(dek, data, f"{context}/{name}".encode()) for name, data in files.items()}
        header = {"algorithm": ALGORITHM, "kek_fingerprint": self.fingerprint(),
                  "wrapped_key": base64.b64encode(_seal(self.kek, dek, context.encode())).decode()}
        return sealed, header

    def open(self, files: dict[str, bytes], header: dict[str, Any], context: str, where: str) -> dict[str, bytes]:
        from cryptography.exceptions import InvalidTag

        if header.get("algorithm") != ALGORITHM:
            raise CheckpointKeyError(f"{where}: unknown encryption {header.get('algorithm')!r}")
        if header.get("kek_fingerprint") != self.fingerprint():
            raise CheckpointKeyError(f"{where}: encrypted with another key than the one in ${self.env_name} "
                                     "(wrong key?); refusing to restore it")
        try:
            dek = _open(self.kek, base64.b64decode(header["wrapped_key"]), context.encode())
            return {name: _open(dek, blob, f"{context}/{name}".encode()) for name, blob in files.items()}
        except InvalidTag as exc:
            raise CheckpointKeyError(f"{where}: decryption failed with the key in ${self.env_name}") from exc
