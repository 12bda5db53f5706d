"""TLS for a TCP endpoint: which files to use, and their contents (read once).

TLS is used when the endpoint is ``https://host:port``, or when it is a
``host:port`` (also ``tcp://`` / ``grpc://``) endpoint and a CA is configured
(``STEPWATCH_TLS_CA`` or ``tls_ca=``). ``unix:`` endpoints and ``http://`` ones
stay plaintext. A file that cannot be read is not raised: the error is kept on
:class:`TlsMaterial` and the client behaves as if no agent answered.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Optional

from ._identity import DEFAULT_ENDPOINT

ENV_CA = "STEPWATCH_TLS_CA"
ENV_CERT = "STEPWATCH_TLS_CERT"
ENV_KEY = "STEPWATCH_TLS_KEY"

# Largest file accepted (a CA bundle is well under this).
_MAX_PEM_BYTES = 1 << 20


@dataclass(frozen=True)
class TlsSettings:
    """Paths (``None``: not given) and where each came from, for log lines."""

    ca: Optional[str] = None
    cert: Optional[str] = None
    key: Optional[str] = None
    ca_from: str = ENV_CA
    cert_from: str = ENV_CERT
    key_from: str = ENV_KEY


@dataclass(frozen=True)
class TlsMaterial:
    """File contents for ``grpc.ssl_channel_credentials``, or why they are missing."""

    settings: TlsSettings
    root_certificates: Optional[bytes] = None
    certificate_chain: Optional[bytes] = None
    private_key: Optional[bytes] = None
    error: Optional[str] = None


def _pick(
    arg: Optional[str], env: Mapping[str, str], name: str, kw: str
) -> tuple[Optional[str], str]:
    if arg:
        return os.fspath(arg), f"{kw}="
    value = (env.get(name) or "").strip()
    return (value or None), name


def resolve_tls(
    endpoint: Optional[str] = None,
    tls_ca: Optional[str] = None,
    tls_cert: Optional[str] = None,
    tls_key: Optional[str] = None,
    env: Optional[Mapping[str, str]] = None,
) -> Optional[TlsSettings]:
    """The TLS settings for this endpoint, or ``None`` for a plaintext channel."""
    env = os.environ if env is None else env
    ep = (endpoint or env.get("STEPWATCH_ENDPOINT") or DEFAULT_ENDPOINT).strip()
    ca, ca_from = _pick(tls_ca, env, ENV_CA, "tls_ca")
    cert, cert_from = _pick(tls_cert, env, ENV_CERT, "tls_cert")
    key, key_from = _pick(tls_key, env, ENV_KEY, "tls_key")
    if ep.startswith("https://"):
        pass
    elif ep.startswith(("unix:", "/", "http://")):
        return None
    elif ca is None:
        return None  # plain host:port without a CA: plaintext, as before
    return TlsSettings(ca, cert, key, ca_from, cert_from, key_from)


def _read_pem(path: str, what: str, source: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read(_MAX_PEM_BYTES + 1)
    except OSError as e:
        reason = e.strerror or str(e)
        msg = f"cannot read the TLS {what} file {path!r} (from {source}): {reason}"
        raise ValueError(msg) from None
    if len(data) > _MAX_PEM_BYTES:
        raise ValueError(f"the TLS {what} file {path!r} (from {source}) is larger than 1 MiB")
    if b"-----BEGIN " not in data:
        raise ValueError(f"the TLS {what} file {path!r} (from {source}) holds no PEM block")
    return data


def load_tls(settings: TlsSettings) -> TlsMaterial:
    """Read the files named by ``settings`` (once); errors are returned, not raised."""
    s = settings
    try:
        if (s.cert is None) != (s.key is None):
            given, missing = (
                (s.cert_from, f"{ENV_KEY} / tls_key=")
                if s.cert is not None
                else (s.key_from, f"{ENV_CERT} / tls_cert=")
            )
            raise ValueError(
                f"a TLS client {'certificate' if s.cert is not None else 'key'} was given "
                f"({given}) without its {'key' if s.cert is not None else 'certificate'} "
                f"({missing}); mutual TLS needs both"
            )
        root = _read_pem(s.ca, "CA", s.ca_from) if s.ca is not None else None
        chain = _read_pem(s.cert, "client certificate", s.cert_from) if s.cert else None
        key = _read_pem(s.key, "client key", s.key_from) if s.key else None
    except ValueError as e:
        return TlsMaterial(settings, error=str(e))
    return TlsMaterial(settings, root, chain, key)
