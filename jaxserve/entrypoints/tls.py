"""TLS for both front ends (`serve --ssl-certfile CERT --ssl-keyfile KEY`): the certificate chain
and key are read and checked once at start, then handed to aiohttp as an `ssl.SSLContext` and to
gRPC as server credentials. TLS 1.2 is the oldest version either accepts."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc

from jaxserve.errors import ConfigError


@dataclass(frozen=True)
class TlsConfig:
    certfile: Path  # PEM: the server certificate, then any intermediates
    keyfile: Path  # PEM: its private key (unencrypted)

    @classmethod
    def from_args(cls, certfile: Path | None, keyfile: Path | None) -> "TlsConfig | None":
        if certfile is None and keyfile is None:
            return None
        if certfile is None or keyfile is None:
            raise ConfigError("TLS needs both --ssl-certfile and --ssl-keyfile")
        config = cls(Path(certfile), Path(keyfile))
        config.ssl_context()  # fail at start, naming the file, not at the first handshake
        return config

    def ssl_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        for path in (self.certfile, self.keyfile):
            if not path.is_file():
                raise ConfigError(f"TLS: no such file {path}")
        try:
            context.load_cert_chain(self.certfile, self.keyfile)
        except (ssl.SSLError, OSError) as e:
            raise ConfigError(f"TLS: cannot load the certificate {self.certfile} with the key "
                              f"{self.keyfile}: {e}") from None
        return context

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.keyfile.read_bytes(), self.certfile.read_bytes())])
