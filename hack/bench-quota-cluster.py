"""``python -m bench.quota --kubeconfig`` against the project's own cluster, with fracgpu
installed the way the e2e suite installs it: ``fracgpu serve`` on this machine, both webhook
configurations of deploy/ registered for it by URL (scoped to namespaces labelled for this
run), the GPUQuota CRD applied; all removed again at the end.

    hack/cluster/up.sh && source /var/lib/fracgpu-cluster/e2e.env
    .venv/bin/python hack/bench-quota-cluster.py [bench.quota flags...]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from tests.e2e.harness import RUN_LABEL, Settings, e2e_run


def main() -> int:
    settings = Settings.from_env(os.environ)
    if settings is None:
        sys.stderr.write("no FRACGPU_E2E_KUBECONFIG: source /var/lib/fracgpu-cluster/e2e.env\n")
        return 2
    run_id = f"bq{uuid.uuid4().hex[:6]}"
    with tempfile.TemporaryDirectory() as workdir, e2e_run(settings, Path(workdir), run_id):
        command = [
            sys.executable,
            "-m",
            "bench.quota",
            "--kubeconfig",
            str(settings.kubeconfig),
            "--namespace-label",
            f"{RUN_LABEL}={run_id}",
            *sys.argv[1:],
        ]
        return subprocess.call(command)


if __name__ == "__main__":
    sys.exit(main())
