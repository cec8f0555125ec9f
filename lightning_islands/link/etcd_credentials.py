"""How an island proves itself to an etcd coordinator: TLS client certificates and a run's user.

etcd secures itself with TLS (members with ``--client-cert-auth`` refuse a client without a
certificate signed by their CA) and with users and roles (a role grants read and write on a key
prefix; ``lightning-islands coordinator --etcd N --tls --run-user RUN_ID`` makes one per run,
limited to ``lightning_islands/RUN_ID/``). An island reads its credentials from the environment:

    LI_ETCD_CA             the CA that signed the members' certificates (TLS on when set)
    LI_ETCD_CERT, _KEY     this island's client certificate and key
    LI_ETCD_USER           the run's etcd user
    LI_ETCD_PASSWORD_FILE  a file (mode 600) holding that user's password

etcd's JSON gateway ignores the name in a client certificate and, with ``--client-cert-auth``,
refuses certificates that carry one: client certificates for islands have no subject name, only a
subject alternative name, and the user comes from ``LI_ETCD_USER``.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path

ENV_CA, ENV_CERT, ENV_KEY = "LI_ETCD_CA", "LI_ETCD_CERT", "LI_ETCD_KEY"
ENV_USER, ENV_PASSWORD_FILE = "LI_ETCD_USER", "LI_ETCD_PASSWORD_FILE"


@dataclass(frozen=True)
class EtcdCredentials:
    """TLS files and an etcd user for a client of an etcd cluster (all optional)."""

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    user: str | None = None
    password_file: str | None = None

    @classmethod
    def from_env(cls) -> EtcdCredentials:
        """The credentials the environment names (LI_ETCD_CA and the others above) (none set: plain HTTP, no user)."""
        def get(name: str) -> str | None:
            return os.environ.get(name) or None
        return cls(get(ENV_CA), get(ENV_CERT), get(ENV_KEY), get(ENV_USER), get(ENV_PASSWORD_FILE))

    @property
    def tls(self) -> bool:
        """Whether the members are reached over TLS (a CA is given)."""
        return self.ca_file is not None

    def context(self) -> ssl.SSLContext | None:
        """The TLS context for the members (``None``: plain HTTP); a missing file is named."""
        if not self.tls:
            if self.cert_file or self.key_file:
                raise ValueError(f"{ENV_CERT}/{ENV_KEY} are set but {ENV_CA} is not: set {ENV_CA} to the CA that "
                                 "signed the etcd members' certificates")
            return None
        for name, path in ((ENV_CA, self.ca_file), (ENV_CERT, self.cert_file), (ENV_KEY, self.key_file)):
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}={path}: no such file")
        context = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file:
            context.load_cert_chain(self.cert_file, self.key_file)
        return context

    def password(self) -> str:
        """The user's password, read from :attr:`password_file` (an error names the file and the fix)."""
        if self.password_file is None:
            raise ValueError(f"{ENV_USER}={self.user} needs {ENV_PASSWORD_FILE}: a file (mode 600) holding its "
                             "password")
        path = Path(self.password_file)
        try:
            return path.read_text().strip()
        except OSError as err:
            raise ValueError(f"{ENV_PASSWORD_FILE}={path}: cannot read it ({err.strerror})") from err
