"""Lint of the Dockerfile and .dockerignore. There is no container engine on the development and
CI machines, so the image is not built here; these checks hold the file to what the manifests and
the release process rely on (pinned base, non-root user, the hook where the init container looks,
no remote ADD)."""

from __future__ import annotations

import re
import shlex
import tomllib
from dataclasses import dataclass, field

from core import contract
from tests.deploy_render import ROOT, find, render

DOCKERFILE = ROOT / "Dockerfile"
HOOK_IN_IMAGE = "/opt/fracgpu/lib/libfracgpu.so"
HOOK_BUILD_OUTPUT = "native/build/libfracgpu.so"


@dataclass
class Stage:
    image: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)


def parse() -> tuple[dict[str, str], list[Stage]]:
    """ARG defaults before the first FROM, and the stages with their instructions."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        op, _, rest = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            words = rest.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(words[0], name))
        elif not stages:
            assert op == "ARG", f"only ARG may come before FROM, got {op}"
            key, _, default = rest.partition("=")
            args[key] = default
        else:
            stages[-1].instructions.append((op, rest))
    return args, stages


def resolve(image: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args[m.group(1) or m.group(2)], image)


def test_every_stage_starts_from_a_pinned_base() -> None:
    args, stages = parse()
    assert len(stages) >= 2, "the hook is built in a stage of its own"
    names = {s.name for s in stages if s.name}
    for stage in stages:
        image = resolve(stage.image, args)
        if image in names:
            continue
        assert "@sha256:" in image or re.search(r":\d+\.\d+\.\d+", image), (
            f"FROM {image}: pin the base image by an exact version or a digest"
        )
        assert not image.endswith(":latest")


def test_runtime_is_non_root_and_has_no_build_tools() -> None:
    _, stages = parse()
    final = stages[-1]
    users = [rest for op, rest in final.instructions if op == "USER"]
    assert users, "the runtime stage must set USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit(), f"USER {users[-1]}: use a numeric uid"
    assert int(uid) != 0, f"USER {users[-1]}: uid 0 is root; use a non-root uid"
    runs = " ".join(rest for op, rest in final.instructions if op == "RUN")
    assert "apt-get" not in runs, "build tools stay in the build stages"
    assert "gcc" not in runs, "build tools stay in the build stages"
    # The manifests run the webhook and the scheduler under the same uid.
    deployment = find(render("default"), "Deployment", "fracgpu-webhook")
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsUser"] == int(uid)


def test_no_remote_sources() -> None:
    _, stages = parse()
    for stage in stages:
        for op, rest in stage.instructions:
            assert op != "ADD", "use COPY; ADD fetches URLs and unpacks archives implicitly"
            if op == "RUN":
                assert not re.search(r"\b(curl|wget)\b", rest), f"RUN downloads: {rest}"


def test_hook_is_built_and_lands_where_the_device_plugin_installs_it_from() -> None:
    _, stages = parse()
    (hook,) = [s for s in stages if s.name == "hook"]
    runs = " ".join(rest for op, rest in hook.instructions if op == "RUN")
    assert "make -C native" in runs
    assert HOOK_BUILD_OUTPUT in runs
    copies = [shlex.split(rest) for op, rest in stages[-1].instructions if op == "COPY"]
    hook_copy = [c for c in copies if c[0] == "--from=hook"]
    assert len(hook_copy) == 1
    assert hook_copy[0][1].endswith(HOOK_BUILD_OUTPUT)
    assert hook_copy[0][2] == HOOK_IN_IMAGE

    daemonset = find(render("default"), "DaemonSet", "fracgpu-device-plugin")
    (init,) = [
        c
        for c in daemonset["spec"]["template"]["spec"]["initContainers"]
        if c["name"] == "install-hook"
    ]
    script = init["command"][-1]
    assert f"cp {HOOK_IN_IMAGE} " in script
    # The node directory is the contract's host root; the preload file names the library at the
    # path the device plugin mounts it to inside GPU containers.
    assert f"root={contract.HOST_ROOT}\n" in script
    assert '"$root/lib/libfracgpu.so"' in script, "where the device plugin mounts the hook from"
    assert f"printf '%s\\n' {contract.CONTAINER_HOOK_LIBRARY} > " in script
    assert '"$root/ld.so.preload"' in script, "where the device plugin mounts ld.so.preload from"
    assert init["image"] == daemonset["spec"]["template"]["spec"]["containers"][0]["image"]
    (mount,) = init["volumeMounts"]
    (volume,) = [
        v for v in daemonset["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]
    ]
    assert volume["hostPath"]["path"] == mount["mountPath"] == contract.HOST_ROOT


def test_entrypoint_is_the_console_script() -> None:
    _, stages = parse()
    entry = [rest for op, rest in stages[-1].instructions if op == "ENTRYPOINT"]
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert entry == ['["fracgpu"]']
    assert "fracgpu" in scripts


def test_dockerignore_keeps_local_state_out_of_the_context() -> None:
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert {".git", ".venv", "native/build", ".local"} <= ignored
    _, stages = parse()
    for stage in stages:
        for op, rest in stage.instructions:
            if op == "COPY" and not rest.startswith("--from"):
                for src in shlex.split(rest)[:-1]:
                    top = src.rstrip("/").split("/")[0]
                    assert top not in ignored, f"COPY {src}: excluded by .dockerignore"
                    assert (ROOT / src).exists() or src.startswith("native"), src


def _copied(stage: Stage) -> set[str]:
    """Top-level sources a stage copies from the build context."""
    sources: set[str] = set()
    for op, rest in stage.instructions:
        if op == "COPY" and not rest.startswith("--from"):
            sources.update(src.rstrip("/").split("/")[0] for src in shlex.split(rest)[:-1])
    return sources


def test_the_wheel_stage_copies_every_package_the_distribution_installs() -> None:
    """`pip install .` installs what is in the context: a package left out is missing from the
    image, and the console script fails on import."""
    _, stages = parse()
    (wheel,) = [s for s in stages if s.name == "wheel"]
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {p.removesuffix("*") for p in patterns if (ROOT / p.removesuffix("*")).is_dir()}
    assert packages - _copied(wheel) == set()


def test_the_hook_stage_copies_what_the_native_build_reads_outside_native() -> None:
    """native/Makefile generates a header from Python files of the repository ($(ROOT)/...)."""
    _, stages = parse()
    (hook,) = [s for s in stages if s.name == "hook"]
    makefile = (ROOT / "native" / "Makefile").read_text()
    outside = {path.split("/")[0] for path in re.findall(r"\$\(ROOT\)/([\w./-]+)", makefile)}
    assert outside, "the Makefile names the files it reads outside native/ as $(ROOT)/..."
    assert outside - _copied(hook) == set()
