#!/usr/bin/env bash
# Writes the credentials of the compose stack (infra/compose.yaml) into DIR, a folder outside the
# repository, with fresh random values:
#   s3-identities.json   SeaweedFS's identities: infra/s3-identities.json with its REPLACE-ME keys replaced
#                        (one identity, scoped to the bucket rlpipe; no Admin)
#   s3-credentials       the same key pair as a botocore shared-credentials file (AWS_SHARED_CREDENTIALS_FILE)
#   verifier-token, trainer-token, rollout-token   the services' bearer tokens
#   grafana-admin-password                         Grafana's password for the user admin
# DIR is made 0700 and the files 0644: compose bind-mounts each file into containers that run as uid
# 10001, which must read it, and the folder keeps other users of this machine out.
#
#   infra/make-compose-secrets.sh ~/.config/rlpipe/compose-secrets
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:?usage: $0 DIR (a folder outside the repository)}
dir=$(realpath -m "$dir")
case "$dir/" in
  "$root"/*) echo "$0: $dir is inside the repository $root: choose a folder outside it" >&2; exit 2 ;;
esac
mkdir -p "$dir"
for f in s3-identities.json s3-credentials verifier-token trainer-token rollout-token grafana-admin-password; do
  if [ -e "$dir/$f" ]; then echo "$0: $dir/$f exists; not overwriting it (delete it to make a new one)" >&2; exit 2; fi
done
chmod 0700 "$dir"
python3 - "$root/infra/s3-identities.json" "$dir" <<'PY'
import json
import os
import secrets
import sys

sample, out = sys.argv[1], sys.argv[2]
ids = json.load(open(sample))
(ident,) = ids["identities"]
access, secret = f"rlpipe-{secrets.token_hex(6)}", secrets.token_urlsafe(32)
ident["credentials"] = [{"accessKey": access, "secretKey": secret}]
files = {
    "s3-identities.json": json.dumps(ids, indent=1) + "\n",
    "s3-credentials": f"[default]\naws_access_key_id = {access}\naws_secret_access_key = {secret}\n",
    **{f"{name}-token": secrets.token_urlsafe(32) + "\n" for name in ("verifier", "trainer", "rollout")},
    "grafana-admin-password": secrets.token_urlsafe(24),  # no newline: read as the whole password
}
for name, text in files.items():
    fd = os.open(os.path.join(out, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(os.path.join(out, name), 0o644)  # whatever the umask: the containers' uid 10001 reads it
print(f"wrote {', '.join(files)} to {out}")
PY
