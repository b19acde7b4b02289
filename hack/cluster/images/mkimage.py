"""Write a root filesystem folder as a one-layer OCI image archive that `ctr images import` reads.

The project's cluster has no registry to pull from, so its images are made here from files on
this machine. Each ``--name`` becomes an image name (the ``io.containerd.image.name``
annotation). Entries are owned by root, dated 0 and sorted: the same folder gives the same digest.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import stat
import tarfile
from pathlib import Path

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
# The usual search path: a binary in /usr/local/bin (kube-scheduler's) is found by name.
PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def _entry(name: str, mode: int, kind: bytes, size: int = 0, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    info.mtime = 0
    info.mode = mode
    info.type = kind
    info.size = size
    info.linkname = link
    return info


def layer(rootfs: Path) -> bytes:
    """The folder as an uncompressed tar, in a fixed order."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(rootfs.rglob("*")):
            name = path.relative_to(rootfs).as_posix()
            st = path.lstat()
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISLNK(st.st_mode):
                tar.addfile(_entry(name, mode, tarfile.SYMTYPE, link=os.readlink(path)))
            elif stat.S_ISDIR(st.st_mode):
                tar.addfile(_entry(name, mode, tarfile.DIRTYPE))
            elif stat.S_ISREG(st.st_mode):
                with path.open("rb") as fh:
                    tar.addfile(_entry(name, mode, tarfile.REGTYPE, st.st_size), fh)
            else:
                raise SystemExit(f"mkimage: {path}: only files, folders and links can go in")
    return out.getvalue()


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def descriptor(media_type: str, data: bytes) -> dict[str, object]:
    return {"mediaType": media_type, "digest": sha(data), "size": len(data)}


def archive(rootfs: Path, names: list[str], entrypoint: list[str], cmd: list[str]) -> bytes:
    blob = layer(rootfs)
    run: dict[str, object] = {"Env": [f"PATH={PATH}"]}
    if entrypoint:
        run["Entrypoint"] = entrypoint
    if cmd:
        run["Cmd"] = cmd
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "config": run,
            "rootfs": {"type": "layers", "diff_ids": [sha(blob)]},
        },
        sort_keys=True,
    ).encode()
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": OCI_MANIFEST,
            "config": descriptor("application/vnd.oci.image.config.v1+json", config),
            "layers": [descriptor("application/vnd.oci.image.layer.v1.tar", blob)],
        },
        sort_keys=True,
    ).encode()
    index = json.dumps(
        {
            "schemaVersion": 2,
            "manifests": [
                {
                    **descriptor(OCI_MANIFEST, manifest),
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {
                        "io.containerd.image.name": name,
                        "org.opencontainers.image.ref.name": name.rsplit(":", 1)[-1],
                    },
                }
                for name in names
            ],
        },
        sort_keys=True,
    ).encode()
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for folder in ("blobs", "blobs/sha256"):
            tar.addfile(_entry(folder, 0o755, tarfile.DIRTYPE))
        files = [("oci-layout", b'{"imageLayoutVersion":"1.0.0"}'), ("index.json", index)]
        files += [(f"blobs/sha256/{sha(b)[7:]}", b) for b in (blob, config, manifest)]
        for name, data in files:
            tar.addfile(_entry(name, 0o644, tarfile.REGTYPE, len(data)), io.BytesIO(data))
    return out.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rootfs", required=True, type=Path)
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--name", action="append", required=True, help="image name; repeatable")
    ap.add_argument("--entrypoint", action="append", default=[])
    ap.add_argument("--cmd", action="append", default=[])
    args = ap.parse_args()
    data = archive(args.rootfs, args.name, args.entrypoint, args.cmd)
    tmp = args.out.with_suffix(".tmp")
    tmp.write_bytes(data)
    tmp.replace(args.out)
    print(f"{args.out}: {', '.join(args.name)}")


if __name__ == "__main__":
    main()
