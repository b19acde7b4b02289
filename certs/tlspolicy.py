"""The TLS policy of the admission server, and SSLContexts built from certificates in memory.

TLS 1.2 and 1.3 only. For TLS 1.2, only forward-secret AEAD suites (ECDHE with AES-GCM or
ChaCha20-Poly1305); TLS 1.3 suites are all AEAD already. This is what kube-apiserver offers
as a client (Go's crypto/tls defaults), so nothing a real API server needs is lost.
"""

from __future__ import annotations

import contextlib
import os
import ssl
import tempfile
from collections.abc import Iterator
from pathlib import Path

from certs.material import ServingState

TLS12_CIPHERS = "ECDHE+AESGCM:ECDHE+CHACHA20:!aNULL:!eNULL:!MD5:!SHA1:!DSS"


def _harden(context: ssl.SSLContext) -> None:
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_ciphers(TLS12_CIPHERS)
    context.options |= ssl.OP_NO_COMPRESSION | ssl.OP_CIPHER_SERVER_PREFERENCE
    context.options |= ssl.OP_SINGLE_ECDH_USE | ssl.OP_NO_RENEGOTIATION


def server_context(state: ServingState) -> ssl.SSLContext:
    """A server context that serves ``state``'s chain under the TLS policy."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    _harden(context)
    with _in_memory_files(state.chain_pem(), state.key_pem) as (cert_path, key_path):
        context.load_cert_chain(cert_path, key_path)
    return context


def mutual_server_context(state: ServingState) -> ssl.SSLContext:
    """A server context that serves ``state``'s chain and requires a client certificate that
    chains to one of ``state``'s trusted CAs (the scheduler extender's listener).

    A client without a certificate, or with one from another CA, fails the handshake (TLS 1.2)
    or has its connection closed before its request is read (TLS 1.3, where the client's
    handshake ends first). OpenSSL checks the purpose too: only clientAuth certificates pass.
    """
    context = server_context(state)
    context.verify_mode = ssl.CERT_REQUIRED
    context.load_verify_locations(cadata=state.bundle_pem().decode("ascii"))
    return context


def client_context(bundle_pem: bytes) -> ssl.SSLContext:
    """A client context that trusts exactly ``bundle_pem``, as the API server trusts caBundle
    (for tools and tests that talk to the webhook)."""
    # With cadata, create_default_context loads no system roots: only the bundle is trusted.
    context = ssl.create_default_context(cadata=bundle_pem.decode("ascii"))
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


@contextlib.contextmanager
def _in_memory_files(cert_pem: bytes, key_pem: bytes) -> Iterator[tuple[str, str]]:
    """``load_cert_chain`` only reads paths. On Linux, memfds give it paths without the key
    ever touching a filesystem (and work on a read-only root); elsewhere a private temporary
    directory does."""
    if hasattr(os, "memfd_create") and Path("/proc/self/fd").is_dir():
        fds = [os.memfd_create(name, os.MFD_CLOEXEC) for name in ("tls.crt", "tls.key")]
        try:
            for fd, data in zip(fds, (cert_pem, key_pem), strict=True):
                os.write(fd, data)
            yield f"/proc/self/fd/{fds[0]}", f"/proc/self/fd/{fds[1]}"
        finally:
            for fd in fds:
                os.close(fd)
        return
    with tempfile.TemporaryDirectory(prefix="fracgpu-tls-") as tmp:
        paths = []
        for name, data in (("tls.crt", cert_pem), ("tls.key", key_pem)):
            path = Path(tmp, name)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            paths.append(str(path))
        yield paths[0], paths[1]
