"""`serve`'s disaggregation flags, checked once into a frozen DisaggConfig."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from jaxserve.errors import ConfigError

ROLES = ("both", "prefill", "decode")
SECRET_ENV = "JAXSERVE_KV_TRANSFER_SECRET"
MIN_SECRET_CHARS = 16  # a guessable secret would let anyone read prompts' KV off a prefill server
DEFAULT_PREFILL_TIMEOUT_S = 60.0
MAX_LOCAL_PREFILL_LENGTH = 1 << 20  # above any context: "never transfer"


@dataclass(frozen=True)
class DisaggConfig:
    role: str = "both"
    prefill_urls: tuple[str, ...] = ()  # a decode server's prefill servers (base URLs)
    secret: str | None = None  # shared by a decode server and its prefill servers
    prefill_timeout_s: float = DEFAULT_PREFILL_TIMEOUT_S
    max_local_prefill_length: int = 0  # uncached prompt tokens a decode server computes itself

    def __post_init__(self):
        if self.role not in ROLES:
            raise ConfigError(f"--role is one of {', '.join(ROLES)}, got {self.role!r}")
        if not 0 <= self.max_local_prefill_length <= MAX_LOCAL_PREFILL_LENGTH:
            raise ConfigError(f"--max-local-prefill-length must be in [0, "
                              f"{MAX_LOCAL_PREFILL_LENGTH}], got {self.max_local_prefill_length}")
        if self.max_local_prefill_length and self.role != "decode":
            raise ConfigError("--max-local-prefill-length is for --role decode")
        if self.role == "both":
            if self.prefill_urls:
                raise ConfigError("--prefill-url is for --role decode")
            return
        if self.role == "decode" and not self.prefill_urls:
            raise ConfigError("--role decode needs at least one --prefill-url")
        if self.role == "prefill" and self.prefill_urls:
            raise ConfigError("--prefill-url is for --role decode")
        for url in self.prefill_urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ConfigError(f"--prefill-url {url!r} is not an http(s) URL")
        if not self.secret or len(self.secret) < MIN_SECRET_CHARS:
            raise ConfigError(f"--role {self.role} needs a shared secret of at least "
                              f"{MIN_SECRET_CHARS} characters: --kv-transfer-secret-file FILE "
                              f"or ${SECRET_ENV}")
        if not 0 < self.prefill_timeout_s <= 3600:
            raise ConfigError(f"--prefill-timeout must be in (0, 3600] seconds, got "
                              f"{self.prefill_timeout_s}")


def add_disagg_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("prefill/decode disaggregation (docs/disaggregation.md)")
    group.add_argument("--role", choices=ROLES, default="both",
                       help="prefill: compute prompts' KV pages for decode servers; decode: "
                            "serve clients, the prompts prefilled by --prefill-url servers; "
                            "both: do both in this process (default: %(default)s)")
    group.add_argument("--prefill-url", action="append", default=None, metavar="URL",
                       help="a prefill server's base URL, e.g. http://10.0.0.5:8000 "
                            "(repeatable; --role decode; a prompt goes to one chosen by its "
                            "first page, so a shared prefix meets its cache)")
    group.add_argument("--kv-transfer-secret-file", type=Path, default=None, metavar="FILE",
                       help=f"the secret a decode server and its prefill servers share (the "
                            f"file's text; default: ${SECRET_ENV}); needed by --role prefill "
                            f"and decode")
    group.add_argument("--prefill-timeout", type=float, default=DEFAULT_PREFILL_TIMEOUT_S,
                       metavar="SECONDS",
                       help="a decode server fails a request (HTTP 502) whose prefill server "
                            "has not sent its pages within this many seconds "
                            "(default: %(default)s)")
    group.add_argument("--max-local-prefill-length", type=int, default=0, metavar="TOKENS",
                       help="--role decode: a prompt with at most this many tokens not in this "
                            "server's prefix cache is prefilled here, not sent to a prefill "
                            "server (default: %(default)s: every prompt with a full page is)")


def disagg_config(args: argparse.Namespace) -> DisaggConfig:
    if args.role != "both":
        if args.deployment is not None:
            raise ConfigError(f"--role {args.role} serves one --model, not a --deployment")
        if not args.kv_offloading_size:
            raise ConfigError(f"--role {args.role} moves KV pages through the host KV tier: "
                              f"give --kv-offloading-size GIB")
        if (args.data_parallel_size or 1) > 1:
            raise ConfigError(f"--role {args.role} serves one engine: no --data-parallel-size")
    secret = None
    if args.kv_transfer_secret_file is not None:
        try:
            secret = args.kv_transfer_secret_file.read_text().strip()
        except OSError as e:
            raise ConfigError(f"--kv-transfer-secret-file {args.kv_transfer_secret_file}: "
                              f"{e.strerror}") from None
    elif args.role != "both":
        secret = os.environ.get(SECRET_ENV) or None
    return DisaggConfig(args.role, tuple(args.prefill_url or ()), secret, args.prefill_timeout,
                        args.max_local_prefill_length)
