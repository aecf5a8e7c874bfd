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
# Values are data, never code: the stack hands them over as a file of NAME=value lines
# (BYOC_PARAMS_FILE, written from a quoted here-document, which the shell never
# expands), read here without evaluation; every value, from there or the environment,
# is refused before anything is written if it holds a quote, a backslash, a dollar
# sign, a backtick or a control character, and checked against its own form. The
# runner's config is written by the binary (`byoc-runner config write`, TOML's own
# escaping), and root's writes into the runner's state directory go through the
# updater's `put-dir`/`put-file` (by descriptor, never through a link).
#
# Inputs (environment, or the NAME=value lines of BYOC_PARAMS_FILE):
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

# The names this script reads; nothing else is taken from the parameters file.
NAMES="BYOC_INSTALL_ID BYOC_CONTROL_PLANE_URL BYOC_CONTROL_PLANE_KEYS BYOC_REGION BYOC_ACCOUNT_ID
BYOC_STACK_NAME BYOC_SIGNAL_RESOURCE BYOC_EXTERNAL_ID BYOC_INSTALL_NAME BYOC_ORG_ID BYOC_APP_ID
BYOC_STATE_BUCKET BYOC_ADMIN_GROUP BYOC_BOOTSTRAP_SECRET BYOC_RELEASE_PUBKEY BYOC_UPDATE_MODE
BYOC_AUDIT_BUCKET BYOC_AUDIT_LOG_GROUP BYOC_AUDIT_OTLP_ENDPOINT BYOC_AUDIT_OTLP_CA
BYOC_AUTOSCALING_GROUP BYOC_LIFECYCLE_HOOK BYOC_RELEASE_URL"
if [ -n "$BYOC_PARAMS_FILE" ]; then
    [ -f "$BYOC_PARAMS_FILE" ] && [ ! -L "$BYOC_PARAMS_FILE" ] || fail "BYOC_PARAMS_FILE $BYOC_PARAMS_FILE is not a file"
    while IFS= read -r line || [ -n "$line" ]; do
        [ -n "$line" ] || continue
        name="$(printf '%s' "$line" | cut -d= -f1)"
        value="$(printf '%s' "$line" | cut -d= -f2-)"
        case " $(printf '%s' "$NAMES" | tr '\n' ' ') " in
            *" $name "*) export "$name=$value" ;;
            *) fail "the parameters file names $name, which is not one of this script's inputs" ;;
        esac
    done < "$BYOC_PARAMS_FILE"
fi

# The value of the variable named $1 (one of NAMES: the name is this script's, the
# value is only ever expanded inside double quotes).
val() { eval "printf '%s' \"\$$1\""; }

# Data, never code: no value may hold what a shell or TOML would read as syntax.
nl='
'
for v in $NAMES; do
    value="$(val "$v")"
    case "$value" in
        *"'"* | *'"'* | *'\'* | *'$'* | *'`'* | *"$nl"* | *[[:cntrl:]]*)
            fail "$v holds a quote, a backslash, a dollar sign, a backtick or a control character: refused" ;;
    esac
done

for v in BYOC_INSTALL_ID BYOC_CONTROL_PLANE_URL BYOC_CONTROL_PLANE_KEYS BYOC_REGION BYOC_RELEASE_PUBKEY; do
    [ -n "$(val "$v")" ] || fail "$v is not set"
done
# Each value's own form (the install stack's parameter patterns, checked again here).
form() {
    # $1: variable name, $2: extended regular expression the whole value must match, $3: what it is.
    value="$(val "$1")"
    [ -z "$value" ] || printf '%s' "$value" | grep -Eqx -- "$2" || fail "$1 is not $3"
}
form BYOC_INSTALL_ID '[a-z0-9][a-z0-9-]{2,40}' "an install id (lower-case letters, digits and -)"
form BYOC_CONTROL_PLANE_URL 'https://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~/%-]*)?' "an https:// URL"
form BYOC_CONTROL_PLANE_KEYS '[A-Za-z0-9+/]{43}=(,[A-Za-z0-9+/]{43}=)*' "comma-separated base64 Ed25519 keys"
form BYOC_RELEASE_PUBKEY '[A-Za-z0-9+/]{54}[A-Za-z0-9+/=]{2}' "a minisign public key line"
form BYOC_REGION '[a-z]{2}(-[a-z]+)+-[0-9]{1,2}' "an AWS region"
form BYOC_RELEASE_URL 'https://[A-Za-z0-9.-]+(:[0-9]{1,5})?(/[A-Za-z0-9._~/%-]*)?' "an https:// URL"
form BYOC_EXTERNAL_ID '[A-Za-z0-9+=,.@:/_-]{2,1224}' "an ExternalId (letters, digits and +=,.@:/_-)"
form BYOC_STACK_NAME '[A-Za-z][A-Za-z0-9-]{0,127}' "a stack name"
form BYOC_SIGNAL_RESOURCE '[A-Za-z0-9]{1,255}' "a logical resource id"
form BYOC_BOOTSTRAP_SECRET 'arn:aws[a-z-]*:secretsmanager:[a-z0-9-]+:[0-9]{12}:secret:[A-Za-z0-9/_+=.@-]+' "a Secrets Manager ARN"
form BYOC_STATE_BUCKET '[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]' "an S3 bucket name"
form BYOC_AUDIT_OTLP_CA '[A-Za-z0-9+/=]+' "base64"
if [ -n "$BYOC_ADMIN_GROUP" ]; then
    printf '%s' "$BYOC_ADMIN_GROUP" | grep -Eqx '[a-z_][a-z0-9_-]{0,31}' \
        || fail "BYOC_ADMIN_GROUP is not a group name (lower-case letters, digits, _ and -)"
fi
for v in BYOC_ACCOUNT_ID BYOC_INSTALL_NAME BYOC_ORG_ID BYOC_APP_ID; do
    value="$(val "$v")"
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
conf="$ROOT/etc/byoc-runner/runner.toml"
updater="$ROOT/usr/lib/byoc-runner/byoc-runner-updater"
[ -x "$updater" ] || fail "the package did not install $updater"
if [ -n "$BYOC_AUDIT_OTLP_ENDPOINT" ] && [ -n "$BYOC_AUDIT_OTLP_CA" ]; then
    install -m 0644 "$work/otlp-ca.pem" "$ROOT/etc/byoc-runner/otlp-ca.pem" || fail "writing the collector's CA"
    export BYOC_AUDIT_OTLP_CA_FILE=/etc/byoc-runner/otlp-ca.pem
fi
# Each instance writes its audit copy under its own prefix, the one its role may write:
# byoc-audit/<the instance role session's user id, role-id:instance-id>.
if [ -n "$BYOC_AUDIT_BUCKET" ]; then
    userid="$(aws sts get-caller-identity --region "$BYOC_REGION" --query UserId --output text)" ||
        fail "asking STS who this instance is (its audit copy's prefix)"
    printf '%s' "$userid" | grep -Eqx '[A-Za-z0-9:_.@-]{1,128}' || fail "STS answered an unexpected user id"
    export BYOC_AUDIT_S3_PREFIX="byoc-audit/$userid"
fi
export BYOC_AUDIT_BUCKET BYOC_AUDIT_LOG_GROUP BYOC_UPDATE_MODE
rm -f "$conf.new"
"$ROOT/usr/bin/byoc-runner" config write --out "$conf.new" >/dev/null || fail "writing runner.toml (byoc-runner config write)"
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
    # Read into root's own temporary directory, then put in place by descriptor: the
    # state directory is the runner's user's, and a link planted there is never followed.
    (
        umask 077
        aws secretsmanager get-secret-value --region "$BYOC_REGION" --secret-id "$BYOC_BOOTSTRAP_SECRET" \
            --query SecretString --output text > "$work/bootstrap-token"
    ) || fail "reading the bootstrap token from Secrets Manager"
    [ -s "$work/bootstrap-token" ] || fail "the bootstrap token secret is empty"
    "$updater" put-file "$ROOT/var/lib/byoc-runner/bootstrap-token" --mode 0600 --owner "$uid:$gid" \
        < "$work/bootstrap-token" || fail "writing the bootstrap token"
fi

# 5b. The admin group: control/ and what is in it belong to it (2770: the set-group-ID
#     bit keeps new files the group's; the inbox and approvals 3770, sticky too, so no
#     member removes or renames another's record), which only root can arrange; the
#     runner makes the state directory passable (0711) when it starts.
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
    # By descriptor: a link the runner's user left at one of these names is replaced,
    # never followed (a re-run must not hand a directory elsewhere to the group).
    for d in control control/audit-inbox control/approvals; do
        mode=3770
        [ "$d" = control ] && mode=2770
        "$updater" put-dir "$ROOT/var/lib/byoc-runner/$d" --mode "$mode" --owner "$uid:$agid" \
            || fail "giving /var/lib/byoc-runner/$d to $BYOC_ADMIN_GROUP"
    done
fi

# 5c. The customer's update terms on the VM (the admin's pin, people's approvals of
#     updates): root's, in the updater's directory, where the runner's user cannot write;
#     the admin group may write there.
terms="$ROOT/var/lib/byoc-runner-update/terms"
if [ -n "$BYOC_ADMIN_GROUP" ]; then
    install -d -m 2775 -o 0 -g "$agid" "$terms" || fail "creating $terms"
else
    install -d -m 0755 -o 0 -g 0 "$terms" || fail "creating $terms"
fi

# 6. Start; `systemctl start` of a Type=notify unit returns once the runner is READY.
systemctl enable byoc-runner >/dev/null 2>&1 || fail "enabling byoc-runner.service"
systemctl restart byoc-runner || fail "byoc-runner did not become ready (journalctl -u byoc-runner)"

# 7. Tell the stack.
log "byoc-runner is enrolled and polling"
signal 0 "byoc-runner is enrolled and polling"
