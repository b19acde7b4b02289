#!/usr/bin/env bash
# Run the e2e suite (tests/e2e) on the project's own cluster in both node modes, one after the
# other on the one kubelet: device-plugin mode (with the admission, quota and certificate
# scenarios), then DRA mode. Starts the cluster unless one of this KUBE_VERSION already runs, and
# stops it again if it started it. Fails when a test fails, errors, or is skipped, or none ran.
#
#   hack/cluster/e2e.sh [PYTEST ARGS...]      (KUBE_VERSION=1.36|1.37; make e2e runs it)
set -euo pipefail
source "$(cd "$(dirname "$0")" && pwd)/common.sh"
need_root e2e.sh
need_version
PY="$ROOT/.venv/bin/python"
[[ -x $PY ]] || die "no $ROOT/.venv: run 'make setup' first"
T0=$SECONDS

started=0
if [[ $(cat "$R/version" 2>/dev/null) == "$KUBE_PATCH" && -f $R/e2e.env ]] && alive kubelet >/dev/null; then
    log "using the running cluster (Kubernetes v$KUBE_PATCH)"
else
    [[ -d $R ]] && "$HACK/down.sh"
    "$HACK/up.sh"
    started=1
fi
finish() {
    local rc=$?
    if ((started)); then "$HACK/down.sh" || rc=1; fi
    log "e2e on Kubernetes v$KUBE_PATCH: $([[ $rc == 0 ]] && echo passed || echo FAILED) in $((SECONDS - T0)) s"
    exit "$rc"
}
trap finish EXIT

out="$FRACGPU_CLUSTER_CACHE/e2e/v$KUBE_PATCH"
rm -rf "$out" && mkdir -p "$out"
# The suite's settings for this node, and this cluster's kubectl first on PATH (up.sh wrote them).
# shellcheck source=/dev/null
source "$R/e2e.env"

# run MODE PYTEST-ARGS...: one pytest session; its JUnit report is checked for skips afterwards.
run() {
    local mode=$1
    shift
    log "e2e, $mode mode"
    (cd "$ROOT" && "$PY" -m pytest -p no:cacheprovider -o addopts="" -rfEsxX -q \
        --basetemp "$out/$mode" --junitxml "$out/$mode.xml" "$@") || return 1
}
rc=0
[[ -f $IMAGE_ARCHIVE ]] || die "no fracgpu image ($IMAGE_ARCHIVE): run 'make image' (make e2e does)"
# The image as `make image` last built it (a running cluster may hold an older one by that tag).
ctr_ images import "$IMAGE_ARCHIVE" >/dev/null || die "importing $IMAGE_ARCHIVE into the cluster's containerd failed"
FRACGPU_E2E_NODE=$NODE_NAME run device-plugin tests/e2e --ignore tests/e2e/test_e2e_dra.py \
    --ignore tests/e2e/test_e2e_release.py --ignore tests/e2e/test_e2e_release_upgrade.py \
    --ignore tests/e2e/test_e2e_extender.py "$@" || rc=1
FRACGPU_E2E_DRA_NODE=$NODE_NAME run dra tests/e2e/test_e2e_dra.py "$@" || rc=1
# The release as users install it (helm install of the chart with the image), in both modes; a
# session of its own, so that none of the harness's webhooks or node agents runs beside it.
FRACGPU_E2E_RELEASE_NODE=$NODE_NAME run release tests/e2e/test_e2e_release.py \
    tests/e2e/test_e2e_release_upgrade.py tests/e2e/test_e2e_extender.py "$@" || rc=1
# Nothing skipped, something ran: a skip here means a mode did not really run.
"$PY" - "$out"/device-plugin.xml "$out"/dra.xml "$out"/release.xml <<'PYEOF' || rc=1
import sys
import xml.etree.ElementTree as ET

ran, xfailed, skipped = 0, 0, []
for path in sys.argv[1:]:
    try:
        cases = list(ET.parse(path).getroot().iter("testcase"))
    except (OSError, ET.ParseError) as err:
        sys.exit(f"e2e: no report {path}: {err}")
    for case in cases:
        skip = case.find("skipped")
        if skip is None:
            ran += 1
        elif skip.get("type") == "pytest.xfail":  # an open issue's test: it ran, and failed
            xfailed += 1
        else:
            skipped.append(f"{case.get('classname')}::{case.get('name')}: {skip.get('message')}")
for line in skipped:
    print(f"e2e: skipped, which this run does not allow: {line}")
if ran == 0:
    sys.exit("e2e: no test ran")
print(f"e2e: {ran + xfailed} tests ran in both modes ({xfailed} xfailed), {len(skipped)} skipped")
sys.exit(1 if skipped else 0)
PYEOF
exit $rc
