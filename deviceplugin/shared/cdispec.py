"""CDI spec files: how the node agents hand a container its card(s) through the runtime.

containerd and CRI-O read the specs in their CDI directories when they create a container (and
re-read the directory at each creation), so a spec written just before that, by
NodePrepareResources in DRA mode or PreStartContainer in device-plugin mode, is the one applied.
The spec version is the oldest that has what the specs use (0.5.0 for ``hostPath`` on device
nodes): runtimes refuse specs newer than they know. Files are written atomically (temp file,
rename) so a runtime never reads half a spec.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

CDI_VERSION = "0.5.0"
CONTROL_DEVICES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")


def write(path: Path, document: dict[str, Any], *, fresh: bool = False) -> bool:
    """Write the spec unless the file already holds exactly it; True when written.

    ``fresh``: the claim was not prepared before, so there is nothing to compare with. The
    directory is made by the plugin at start; it is made again only if it vanished since.
    """
    # Compact, one line: the C encoder (an indented dump runs the pure-Python one, which cost
    # more than the rest of a prepare).
    text = json.dumps(document, separators=(",", ":"), sort_keys=True) + "\n"
    if not fresh:
        try:
            if path.read_text(encoding="utf-8") == text:
                return False
        except (OSError, UnicodeDecodeError):
            pass  # unreadable or torn: written again below
    try:
        fd, tmp = tempfile.mkstemp(prefix=".fracgpu-", suffix=".tmp", dir=path.parent)
    except FileNotFoundError:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".fracgpu-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


__all__ = ["CDI_VERSION", "CONTROL_DEVICES", "write"]
