"""``python -m bench.quota --kubeconfig`` against the project's own cluster, with fracgpu
installed the way the e2e suite installs it: ``fracgpu serve`` on this machine, both webhook
configurations of deploy/ registered for it by URL (scoped to namespaces labelled for this
run), the GPUQuota CRD applied; all removed again at the end.

    hack/cluster/up.sh && source /var/lib/fracgpu-cluster/e2e.env
    .venv/bin/python hack/bench-quota-cluster.py [--webhooks both|mutating|none] [bench flags]

``--webhooks`` keeps only some of the configurations registered, to measure what each
admission call costs the cluster: ``mutating`` leaves out the quota webhook (its pods are then
not counted, so the over-admission it reports is expected), ``none`` both (the "fracgpu" case
is then a webhook-free create of the same pod).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from tests.e2e.harness import RUN_LABEL, Settings, e2e_run, unregister

KEEP = {
    "both": {"MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"},
    "mutating": {"MutatingWebhookConfiguration"},
    "none": set(),
}


def main() -> int:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--webhooks", choices=sorted(KEEP), default="both")
    ours, rest = parser.parse_known_args()
    settings = Settings.from_env(os.environ)
    if settings is None:
        sys.stderr.write("no FRACGPU_E2E_KUBECONFIG: source /var/lib/fracgpu-cluster/e2e.env\n")
        return 2
    run_id = f"bq{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory() as workdir, e2e_run(settings, Path(workdir), run_id) as run:
        dropped = [o for o in run.configurations if o["kind"] not in KEEP[ours.webhooks]]
        run.portal.run(unregister(run.api, dropped))
        if dropped:
            print(f"webhooks registered: {ours.webhooks} (dropped {len(dropped)})", flush=True)
        command = [
            sys.executable,
            "-m",
            "bench.quota",
            "--kubeconfig",
            str(settings.kubeconfig),
            "--namespace-label",
            f"{RUN_LABEL}={run_id}",
            *rest,
        ]
        return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main())
