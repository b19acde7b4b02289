"""deviceplugin/shared/guardproc.py: a pid's container and start time from the node's /proc
(the cgroup parser itself: test_deviceplugin_guard.py::test_parse_cgroup)."""

from __future__ import annotations

from pathlib import Path

import pytest

from deviceplugin.shared.guardproc import ProcReader, parse_start_time
from deviceplugin.shared.guardtypes import ContainerRef

UID = "6f1c2a8e-1b2c-4d5e-8f90-0123456789ab"
CID = "0f" * 32
CGROUP = f"0::/kubepods/burstable/pod{UID}/{CID}\n"
TAIL = " ".join(str(n) for n in range(3, 23))  # fields 3..22: field 22 is "22"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        pytest.param(f"42 (python3) {TAIL} 23 24\n", 22, id="plain"),
        pytest.param(f"42 (a b) c) {TAIL}\n", 22, id="command-with-spaces-and-parens"),
        pytest.param("42 (python3) S 1 2\n", None, id="truncated"),
        pytest.param(f"42 (x) {TAIL.replace(' 22', ' z')}\n", None, id="not-a-number"),
        pytest.param("", None, id="empty"),
    ],
)
def test_parse_start_time(text: str, expected: int | None) -> None:
    assert parse_start_time(text) == expected


@pytest.mark.parametrize(
    ("files", "container", "start"),
    [
        pytest.param(
            {"cgroup": CGROUP.encode(), "stat": f"7 (x) {TAIL}\n".encode()},
            ContainerRef(UID, CID),
            22,
            id="a-container-process",
        ),
        pytest.param({}, None, None, id="gone"),
        pytest.param(
            {"cgroup": b"0::/system.slice/cron.service\n", "stat": f"7 (x) {TAIL}\n".encode()},
            None,
            22,
            id="in-no-container",
        ),
        pytest.param({"cgroup": b"\xff\xfe", "stat": b"\xff"}, None, None, id="not-text"),
    ],
)
def test_proc_reader(
    tmp_path: Path, files: dict[str, bytes], container: ContainerRef | None, start: int | None
) -> None:
    (tmp_path / "7").mkdir()
    for name, content in files.items():
        (tmp_path / "7" / name).write_bytes(content)
    proc = ProcReader(tmp_path)
    assert (proc.container(7), proc.start_time(7)) == (container, start)
