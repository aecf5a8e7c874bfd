#!/bin/bash
# byoc-runner install: run by the install stack's user-data (the template embeds this
# file verbatim after setting the BYOC_* variables), or by hand. Safe to re-run.
#
#  1. find the release (the AMI's /opt/byoc-runner/release, or download it over https),
#  2. verify SHA256SUMS's minisign signature with the pinned release key, then the
#     package's SHA-256 (nothing unverified is ever installed),
#  3. install the package (a re-run reinstalls: config and state are kept) and keep
#     the verified release for the updater to roll back to,
#  4. write /etc/byoc-runner/runner.toml (control plane, pinned keys, install, stack),
#  5. fetch the one-time bootstrap token from Secrets Manager under the instance role
#     (only before the first enrollment; the runner deletes it once enrolled),
#  6. validate the config, enable and start the unit (Type=notify: `systemctl start`
#     returns once the runner reports READY, i.e. enrolled and polling),
#  7. signal the stack: success only after 6, failure with the reason otherwise.
#
# The script avoids the dollar-brace form so CloudFormation's Fn::Sub passes it through.
#
# Inputs (environment):
#   BYOC_INSTALL_ID BYOC_CONTROL_PLANE_URL BYOC_CONTROL_PLANE_KEYS (comma-separated)
#   BYOC_REGION BYOC_ACCOUNT_ID BYOC_STACK_NAME BYOC_SIGNAL_RESOURCE BYOC_EXTERNAL_ID
#   BYOC_INSTALL_NAME BYOC_ORG_ID BYOC_APP_ID (only when the app's role names use
#     {{.install.name}}, {{.org.id}}, {{.app.id}}: written into [roles])
#   BYOC_STATE_BUCKET (the stack's terraform state bucket; empty: local state)
#   BYOC_ADMIN_GROUP (a local group whose members may pause, approve and allow without
#     root: created if missing, written as roles.admin_group, given control/; empty: root only)
#   BYOC_BOOTSTRAP_SECRET (Secrets Manager ARN) BYOC_RELEASE_PUBKEY (minisign key line)
#   BYOC_UPDATE_MODE (the runner's own updates: auto, approve or off; default approve)
#   BYOC_AUDIT_BUCKET BYOC_AUDIT_LOG_GROUP (the customer's copies of the audit log: a
#     name, `create` for the one the stack made, or empty for none)
#   BYOC_AUDIT_OTLP_ENDPOINT BYOC_AUDIT_OTLP_CA (an https OTLP collector and, base64,
#     the PEM of the CA its certificate chains to; empty: none)
#   BYOC_AUTOSCALING_GROUP BYOC_LIFECYCLE_HOOK (the instance's Auto Scaling group and its
#     termination hook, completed once the runner drained; empty: none)
#   BYOC_RELEASE_URL (https base URL; empty: use BYOC_RELEASE_DIR)
#   BYOC_RELEASE_DIR (default /opt/byoc-runner/release)
#   BYOC_ROOT (install into this directory instead of /; for tests)
set -eo pipefail
umask 022

ROOT="$BYOC_ROOT"
RELEASE_DIR="$BYOC_RELEASE_DIR"
[ -n "$RELEASE_DIR" ] || RELEASE_DIR=/opt/byoc-runner/release

log() {
    echo "byoc-install: $*" >&2
    logger -t byoc-install -- "$*" 2>/dev/null || true
}

signal() {
    # $1: 0 success, 1 failure; $2: reason (shown in the stack's events).
    if [ -z "$BYOC_STACK_NAME" ] || [ -z "$BYOC_SIGNAL_RESOURCE" ]; then return 0; fi
    if command -v cfn-signal >/dev/null; then
        cfn-signal -e "$1" --reason "$2" --stack "$BYOC_STACK_NAME" --resource "$BYOC_SIGNAL_RESOURCE" --region "$BYOC_REGION" || true
    elif command -v aws >/dev/null; then
        status=SUCCESS
        [ "$1" = 0 ] || status=FAILURE
        aws cloudformation signal-resource --region "$BYOC_REGION" --stack-name "$BYOC_STACK_NAME" \
            --logical-resource-id "$BYOC_SIGNAL_RESOURCE" --unique-id "$(hostname)" --status "$status" || true
    fi
}

fail() {
    log "FAILED: $*"
    signal 1 "$*"
    exit 1
}

for v in BYOC_INSTALL_ID BYOC_CONTROL_PLANE_URL BYOC_CONTROL_PLANE_KEYS BYOC_REGION BYOC_RELEASE_PUBKEY; do
    [ -n "$(eval echo "\$$v")" ] || fail "$v is not set"
done
if [ -n "$BYOC_ADMIN_GROUP" ]; then
    printf '%s' "$BYOC_ADMIN_GROUP" | grep -Eqx '[a-z_][a-z0-9_-]{0,31}' \
        || fail "BYOC_ADMIN_GROUP is not a group name (lower-case letters, digits, _ and -)"
fi
for v in BYOC_ACCOUNT_ID BYOC_INSTALL_NAME BYOC_ORG_ID BYOC_APP_ID; do
    value="$(eval echo "\$$v")"
    [ -z "$value" ] || printf '%s' "$value" | grep -Eqx '[A-Za-z0-9_.-]{1,128}' \
        || fail "$v is not 1-128 of letters, digits, '_', '.' and '-'"
done
# The audit copies: the stack's own bucket and log group have fixed names.
[ "$BYOC_AUDIT_BUCKET" != create ] || BYOC_AUDIT_BUCKET="$BYOC_INSTALL_ID-audit-$BYOC_ACCOUNT_ID"
[ "$BYOC_AUDIT_LOG_GROUP" != create ] || BYOC_AUDIT_LOG_GROUP="/byoc-runner/$BYOC_INSTALL_ID/audit"
[ -z "$BYOC_AUDIT_BUCKET" ] || printf '%s' "$BYOC_AUDIT_BUCKET" | grep -Eqx '[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]' \
    || fail "BYOC_AUDIT_BUCKET is not an S3 bucket name"
[ -z "$BYOC_AUDIT_LOG_GROUP" ] || printf '%s' "$BYOC_AUDIT_LOG_GROUP" | grep -Eqx '[A-Za-z0-9._/#-]{1,512}' \
    || fail "BYOC_AUDIT_LOG_GROUP is not a log group name"
[ -z "$BYOC_AUDIT_OTLP_ENDPOINT" ] || printf '%s' "$BYOC_AUDIT_OTLP_ENDPOINT" | grep -Eqx 'https://[A-Za-z0-9.:/_-]+' \
    || fail "BYOC_AUDIT_OTLP_ENDPOINT must be an https:// URL"
[ -z "$BYOC_AUTOSCALING_GROUP" ] || printf '%s' "$BYOC_AUTOSCALING_GROUP" | grep -Eqx '[A-Za-z0-9._-]{1,255}' \
    || fail "BYOC_AUTOSCALING_GROUP is not an Auto Scaling group name"
[ -z "$BYOC_LIFECYCLE_HOOK" ] || printf '%s' "$BYOC_LIFECYCLE_HOOK" | grep -Eqx '[A-Za-z0-9_-]{1,255}' \
    || fail "BYOC_LIFECYCLE_HOOK is not a lifecycle hook name"
[ -n "$BYOC_UPDATE_MODE" ] || BYOC_UPDATE_MODE=approve
case "$BYOC_UPDATE_MODE" in auto|approve|off) ;; *) fail "BYOC_UPDATE_MODE must be auto, approve or off" ;; esac

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

if [ -n "$BYOC_AUDIT_OTLP_ENDPOINT" ] && [ -n "$BYOC_AUDIT_OTLP_CA" ]; then
    printf '%s' "$BYOC_AUDIT_OTLP_CA" | base64 -d > "$work/otlp-ca.pem" 2>/dev/null || fail "BYOC_AUDIT_OTLP_CA is not base64"
    grep -q 'BEGIN CERTIFICATE' "$work/otlp-ca.pem" || fail "BYOC_AUDIT_OTLP_CA holds no PEM certificate"
fi

# 1. The release: SHA256SUMS, its signature, and the package it names.
if [ -n "$BYOC_RELEASE_URL" ]; then
    case "$BYOC_RELEASE_URL" in https://*) ;; *) fail "BYOC_RELEASE_URL must be https://" ;; esac
    for f in SHA256SUMS SHA256SUMS.minisig; do
        curl -fsS --proto =https --retry 5 -o "$work/$f" "$BYOC_RELEASE_URL/$f" || fail "downloading $f"
    done
else
    for f in SHA256SUMS SHA256SUMS.minisig; do
        cp "$RELEASE_DIR/$f" "$work/$f" 2>/dev/null || fail "$RELEASE_DIR/$f not found (no BYOC_RELEASE_URL either)"
    done
fi

# 2. Signature first: nothing in SHA256SUMS is trusted before it verifies.
command -v minisign >/dev/null || fail "minisign is needed to verify the release (the AMI ships it)"
printf 'untrusted comment: byoc-runner release key\n%s\n' "$BYOC_RELEASE_PUBKEY" > "$work/release.pub"
minisign -V -q -p "$work/release.pub" -m "$work/SHA256SUMS" >/dev/null 2>&1 ||
    fail "SHA256SUMS signature does not verify with the pinned release key"
deb="$(awk '$2 ~ /^byoc-runner_[A-Za-z0-9.+~-]+_[a-z0-9]+\.deb$/ { print $2 }' "$work/SHA256SUMS")"
[ "$(printf '%s\n' "$deb" | grep -c .)" = 1 ] || fail "SHA256SUMS must name exactly one byoc-runner package"
if [ -n "$BYOC_RELEASE_URL" ]; then
    curl -fsS --proto =https --retry 5 -o "$work/$deb" "$BYOC_RELEASE_URL/$deb" || fail "downloading $deb"
else
    cp "$RELEASE_DIR/$deb" "$work/$deb" || fail "$RELEASE_DIR/$deb not found"
fi
(cd "$work" && grep " $deb\$" SHA256SUMS | sha256sum -c --strict --quiet -) ||
    fail "$deb does not match its checksum in the signed SHA256SUMS"
log "release verified: $deb"

# 3. Install (a reinstall of the same version is harmless; conffiles and state stay).
if [ -n "$ROOT" ]; then
    dpkg --root="$ROOT" --force-script-chrootless --force-not-root $BYOC_DPKG_OPTS -i "$work/$deb" >/dev/null ||
        fail "installing $deb"
else
    dpkg -i "$work/$deb" >/dev/null || fail "installing $deb"
fi
# The updater rolls back only to a release it keeps (root's, 0700; its directory 0711,
# where the runner reads the updater's last outcome by name): this one is the first.
version="$(printf '%s' "$deb" | sed -e 's/^byoc-runner_//' -e 's/_[a-z0-9]*\.deb$//')"
kept="$ROOT/var/lib/byoc-runner-update/releases/$version"
install -d -m 0711 "$ROOT/var/lib/byoc-runner-update" || fail "creating the updater's directory"
install -d -m 0700 "$ROOT/var/lib/byoc-runner-update/releases" "$kept" || fail "creating $kept"
cp "$work/$deb" "$work/SHA256SUMS" "$work/SHA256SUMS.minisig" "$kept/" || fail "keeping the release in $kept"

# 4. The configuration (written whole, then moved into place).
gid="$(awk -F: '$1 == "byoc-runner" { print $3 }' "$ROOT/etc/group")"
uid="$(awk -F: '$1 == "byoc-runner" { print $3 }' "$ROOT/etc/passwd")"
[ -n "$gid" ] && [ -n "$uid" ] || fail "the package did not create the byoc-runner user"
keys=""
for k in $(printf '%s' "$BYOC_CONTROL_PLANE_KEYS" | tr ',' ' '); do
    keys="$keys\"$k\", "
done
conf="$ROOT/etc/byoc-runner/runner.toml"
{
    echo "# Written by the install stack's user-data; re-running it rewrites this file."
    echo "[control_plane]"
    echo "url = \"$BYOC_CONTROL_PLANE_URL\""
    echo "public_keys = [$keys]"
    echo
    echo "[runner]"
    echo "install_id = \"$BYOC_INSTALL_ID\""
    echo "bootstrap_token_file = \"/var/lib/byoc-runner/bootstrap-token\""
    echo
    echo "[aws]"
    echo "region = \"$BYOC_REGION\""
    [ -z "$BYOC_ACCOUNT_ID" ] || echo "account_id = \"$BYOC_ACCOUNT_ID\""
    echo
    echo "[roles]"
    [ -z "$BYOC_STACK_NAME" ] || echo "stack_name = \"$BYOC_STACK_NAME\""
    [ -z "$BYOC_EXTERNAL_ID" ] || echo "external_id = \"$BYOC_EXTERNAL_ID\""
    [ -z "$BYOC_ADMIN_GROUP" ] || echo "admin_group = \"$BYOC_ADMIN_GROUP\""
    # Values the app's role names may use ({{.install.name}}, {{.org.id}}, {{.app.id}}).
    [ -z "$BYOC_INSTALL_NAME" ] || echo "install_name = \"$BYOC_INSTALL_NAME\""
    [ -z "$BYOC_ORG_ID" ] || echo "org_id = \"$BYOC_ORG_ID\""
    [ -z "$BYOC_APP_ID" ] || echo "app_id = \"$BYOC_APP_ID\""
    echo
    echo "[lifecycle]"
    echo "# A Spot interruption or an Auto Scaling termination drains the runner."
    echo "watch = true"
    if [ -n "$BYOC_AUTOSCALING_GROUP" ] && [ -n "$BYOC_LIFECYCLE_HOOK" ]; then
        echo "autoscaling_group = \"$BYOC_AUTOSCALING_GROUP\""
        echo "lifecycle_hook = \"$BYOC_LIFECYCLE_HOOK\""
    fi
    echo
    echo "[update]"
    echo "mode = \"$BYOC_UPDATE_MODE\""
    echo "release_public_key = \"$BYOC_RELEASE_PUBKEY\""
    if [ -n "$BYOC_STATE_BUCKET" ]; then
        echo
        echo "[terraform.state]"
        echo "bucket = \"$BYOC_STATE_BUCKET\""
    fi
    if [ -n "$BYOC_AUDIT_BUCKET" ]; then
        echo
        echo "[audit.export.s3]"
        echo "bucket = \"$BYOC_AUDIT_BUCKET\""
    fi
    if [ -n "$BYOC_AUDIT_LOG_GROUP" ]; then
        echo
        echo "[audit.export.cloudwatch]"
        echo "log_group = \"$BYOC_AUDIT_LOG_GROUP\""
    fi
    if [ -n "$BYOC_AUDIT_OTLP_ENDPOINT" ]; then
        echo
        echo "[audit.export.otlp]"
        echo "endpoint = \"$BYOC_AUDIT_OTLP_ENDPOINT\""
        [ -z "$BYOC_AUDIT_OTLP_CA" ] || echo "ca_file = \"/etc/byoc-runner/otlp-ca.pem\""
    fi
} > "$conf.new"
if [ -n "$BYOC_AUDIT_OTLP_ENDPOINT" ] && [ -n "$BYOC_AUDIT_OTLP_CA" ]; then
    install -m 0644 "$work/otlp-ca.pem" "$ROOT/etc/byoc-runner/otlp-ca.pem" || fail "writing the collector's CA"
fi
chown "0:$gid" "$conf.new"
chmod 0640 "$conf.new"
mv "$conf.new" "$conf"
"$ROOT/usr/bin/byoc-runner" config validate --config "$conf" >/dev/null || fail "the written runner.toml does not validate"

# 5. The bootstrap token, before the first enrollment only. It goes in the state
#    directory (the unit's StateDirectory, created here as systemd would create it):
#    under ProtectSystem=strict /etc is read-only to the runner, which could then not
#    delete the token once it is spent.
if [ ! -e "$ROOT/var/lib/byoc-runner/enrollment.json" ]; then
    [ -n "$BYOC_BOOTSTRAP_SECRET" ] || fail "not enrolled yet and BYOC_BOOTSTRAP_SECRET is not set"
    install -d -m 0700 -o "$uid" -g "$gid" "$ROOT/var/lib/byoc-runner" || fail "creating /var/lib/byoc-runner"
    token_file="$ROOT/var/lib/byoc-runner/bootstrap-token"
    (
        umask 077
        aws secretsmanager get-secret-value --region "$BYOC_REGION" --secret-id "$BYOC_BOOTSTRAP_SECRET" \
            --query SecretString --output text > "$token_file.new"
    ) || fail "reading the bootstrap token from Secrets Manager"
    [ -s "$token_file.new" ] || fail "the bootstrap token secret is empty"
    chown "$uid:$gid" "$token_file.new"
    mv "$token_file.new" "$token_file"
fi

# 5b. The admin group: control/ and what is in it belong to it (2770: the set-group-ID
#     bit keeps new files the group's), which only root can arrange; the runner makes
#     the state directory passable (0711) when it starts.
if [ -n "$BYOC_ADMIN_GROUP" ]; then
    admin_gid() { awk -F: -v g="$BYOC_ADMIN_GROUP" '$1 == g { print $3 }' "$ROOT/etc/group"; }
    if [ -z "$(admin_gid)" ]; then
        if [ -n "$ROOT" ]; then
            groupadd --root "$ROOT" --system "$BYOC_ADMIN_GROUP"
        else
            groupadd --system "$BYOC_ADMIN_GROUP"
        fi || fail "creating group $BYOC_ADMIN_GROUP"
    fi
    agid="$(admin_gid)"
    [ -n "$agid" ] || fail "group $BYOC_ADMIN_GROUP does not exist"
    install -d -m 0700 -o "$uid" -g "$gid" "$ROOT/var/lib/byoc-runner" || fail "creating /var/lib/byoc-runner"
    for d in control control/audit-inbox control/approvals; do
        install -d -m 2770 -o "$uid" -g "$agid" "$ROOT/var/lib/byoc-runner/$d" \
            || fail "giving /var/lib/byoc-runner/$d to $BYOC_ADMIN_GROUP"
    done
fi

# 6. Start; `systemctl start` of a Type=notify unit returns once the runner is READY.
systemctl enable byoc-runner >/dev/null 2>&1 || fail "enabling byoc-runner.service"
systemctl restart byoc-runner || fail "byoc-runner did not become ready (journalctl -u byoc-runner)"

# 7. Tell the stack.
log "byoc-runner is enrolled and polling"
signal 0 "byoc-runner is enrolled and polling"
