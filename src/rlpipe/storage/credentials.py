"""Which S3 credentials a store uses: explicit keys (with a session token for temporary credentials), or
botocore's default chain when no keys are set.

Explicit keys come in pairs from one source, never mixed: ``RLPIPE_S3_ACCESS_KEY_ID`` /
``RLPIPE_S3_SECRET_ACCESS_KEY`` / ``RLPIPE_S3_SESSION_TOKEN``, else ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY`` / ``AWS_SESSION_TOKEN`` (read by :func:`rlpipe.config.settings`). The token goes with
the key id it was issued for, so a shell's ``AWS_SESSION_TOKEN`` never rides along with ``RLPIPE_S3_*`` keys
for another endpoint.

With no keys, s3fs is handed nothing and botocore resolves credentials itself, refreshing them before they
expire: ``AWS_PROFILE`` / ``AWS_SHARED_CREDENTIALS_FILE``, web identity (``AWS_WEB_IDENTITY_TOKEN_FILE``, EKS
IRSA), container credentials (``AWS_CONTAINER_CREDENTIALS_FULL_URI`` / ``..._RELATIVE_URI``, ECS and EKS Pod
Identity) and the EC2 instance profile (IMDS). We resolve once up front only to fail with a message that
names what was tried, instead of an anonymous-looking ``NoCredentialsError`` on the first request.

Nothing here returns or logs a secret or a token: :attr:`S3Credentials.describe` names the key id and where
it came from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from rlpipe.config import Settings

__all__ = ["S3Credentials", "S3CredentialsError", "resolve_s3_credentials"]

# The variables botocore's chain reads; a chain that resolved under the same values is not resolved again.
_CHAIN_VARS = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE",
               "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
               "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "AWS_EC2_METADATA_DISABLED")
_resolved: dict[tuple[str | None, ...], str] = {}

_FIX = ("set RLPIPE_S3_ACCESS_KEY_ID and RLPIPE_S3_SECRET_ACCESS_KEY (and RLPIPE_S3_SESSION_TOKEN for temporary "
        "credentials), or AWS_PROFILE / AWS_SHARED_CREDENTIALS_FILE naming a credentials file, or run where an "
        "instance profile, container credentials or a web identity (IRSA) provide them")


class S3CredentialsError(RuntimeError):
    """No usable S3 credentials; the message names what was tried and what to set."""


@dataclass(frozen=True)
class S3Credentials:
    """What :func:`open_store` hands s3fs, and a description of it that holds no secret."""

    key: str | None = field(default=None)
    secret: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    describe: str = ""

    def fs_kwargs(self) -> dict[str, Any]:
        """``key``/``secret``/``token`` for ``s3fs.S3FileSystem``; empty for botocore's own chain."""
        if self.key is None:
            return {}
        return {"key": self.key, "secret": self.secret, "token": self.token}


def resolve_s3_credentials(s: Settings) -> S3Credentials:
    """Explicit keys from ``s`` (a half pair is an error), else botocore's default chain, checked once."""
    if s.s3_access_key_id or s.s3_secret_access_key:
        source = s.s3_key_source or "RLPIPE_S3_*"
        if not (s.s3_access_key_id and s.s3_secret_access_key):
            have, missing = (("ACCESS_KEY_ID", "SECRET_ACCESS_KEY") if s.s3_access_key_id
                             else ("SECRET_ACCESS_KEY", "ACCESS_KEY_ID"))
            raise S3CredentialsError(
                f"S3 credentials: {source}{have} is set but {source}{missing} is not; set both, or neither to "
                "use botocore's default chain (AWS_PROFILE, instance profile, container credentials)")
        token = " with a session token" if s.s3_session_token else ""
        return S3Credentials(s.s3_access_key_id, s.s3_secret_access_key, s.s3_session_token,
                             f"key id {s.s3_access_key_id} from {source}ACCESS_KEY_ID{token}")
    return S3Credentials(describe=_default_chain())


def _default_chain() -> str:
    sig = tuple(os.environ.get(v) for v in _CHAIN_VARS)
    if sig in _resolved:
        return _resolved[sig]
    import botocore.exceptions
    import botocore.session  # lazy: the same chain s3fs's aiobotocore walks

    try:
        creds = botocore.session.Session().get_credentials()
    except botocore.exceptions.BotoCoreError as e:  # a profile that does not exist, an endpoint that fails
        raise S3CredentialsError(f"S3 credentials: botocore's default chain failed: {e}; {_FIX}") from None
    if creds is None:
        tried = ", ".join(f"{v}={os.environ[v]}" for v in _CHAIN_VARS if os.environ.get(v)) or "none of its variables set"
        raise S3CredentialsError(
            "S3 credentials: none found. Tried RLPIPE_S3_ACCESS_KEY_ID/SECRET_ACCESS_KEY, AWS_ACCESS_KEY_ID/"
            "SECRET_ACCESS_KEY, then botocore's default chain (shared credentials and config files, web identity, "
            f"container credentials, the EC2 instance metadata service; {tried}). Fix: {_FIX}")
    token = " with a session token" if creds.token else ""
    _resolved[sig] = f"key id {creds.access_key} from botocore's default chain ({creds.method}){token}"
    return _resolved[sig]
