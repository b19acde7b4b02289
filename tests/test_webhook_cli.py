"""`fracgpu review`: offline admission of manifests, as a user runs it."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from fracgpu.cli import main

EXAMPLES = Path(__file__).parent.parent / "examples"
H100 = ["--gpu-model", "NVIDIA-H100-80GB-HBM3=81559"]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = main(["--log-format", "text", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def test_review_json_one_entry_per_object(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(
        capsys,
        "review",
        "-o",
        "json",
        *H100,
        str(EXAMPLES / "pod-fraction.yaml"),
        str(EXAMPLES / "deployment.yaml"),
        str(EXAMPLES / "pod-invalid.yaml"),
    )
    assert status == 1  # one object is denied
    entries = json.loads(out)
    assert [(e["kind"], e["allowed"]) for e in entries] == [
        ("Pod", True),
        ("Deployment", True),
        ("Pod", False),
    ]
    limits = entries[0]["object"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits == {"fracgpu.io/core": "30", "fracgpu.io/memory": "32"}
    assert entries[2]["message"].endswith("or a whole number of cards; got 1.5")
    assert entries[2]["object"] is None


def test_review_text_is_applyable_yaml(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    manifest = (
        "apiVersion: v1\nkind: Pod\nmetadata: {name: a}\nspec:\n  containers:\n"
        "  - name: c\n    resources: {limits: {fracgpu.io/gpu: '0.5', fracgpu.io/gpumem: 3000}}\n"
        "---\napiVersion: v1\nkind: List\nitems:\n"
        "- {apiVersion: v1, kind: Pod, metadata: {name: b}, spec: {containers: [{name: c}]}}\n"
    )
    monkeypatch.setattr("sys.stdin", io.StringIO(manifest))
    status, out, _ = run(capsys, "review", "-")
    assert status == 0
    assert "# Pod/a (<stdin>#1): allowed, mutated" in out
    assert '#   warning: container "c": 3000 MiB of GPU memory rounded up to 3072 MiB' in out
    assert "# Pod/b (<stdin>#2): allowed, unchanged" in out


def test_review_denies_without_inventory_and_says_what_to_configure(
    capsys: pytest.CaptureFixture[str],
) -> None:
    status, out, _ = run(capsys, "review", str(EXAMPLES / "deployment.yaml"))
    assert status == 1
    assert "not known to fracgpu" in out
    assert "inventory.models" in out


def test_review_config_file_and_dialects(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    manifest = tmp_path / "hami.json"
    manifest.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "h"},
                "spec": {
                    "containers": [
                        {
                            "name": "c",
                            "resources": {
                                "limits": {"nvidia.com/gpu": 1, "nvidia.com/gpumem": 4096}
                            },
                        }
                    ]
                },
            }
        )
    )
    status, out, _ = run(
        capsys,
        "review",
        "-o",
        "json",
        "--config",
        str(EXAMPLES / "config.yaml"),
        "--dialect",
        "hami",
        str(manifest),
    )
    assert status == 0
    (entry,) = json.loads(out)
    assert entry["object"]["spec"]["containers"][0]["resources"]["limits"] == {
        "fracgpu.io/core": "18",
        "fracgpu.io/memory": "16",
    }


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["review", "/nonexistent.yaml"], "fracgpu: /nonexistent.yaml: No such file or directory"),
        (["review", "--gpu-model", "H100", "x"], "expected PRODUCT=MIB"),
    ],
    ids=["a file that does not exist", "a model without its memory"],
)
def test_usage_errors_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    status, _, err = run(capsys, *argv)
    assert status == 2
    assert expected in err


def test_bad_config_names_the_key(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("admission:\n  schedulerName: x\n")
    status, _, err = run(capsys, "review", "--config", str(config), "-")
    assert status == 2
    assert "admission: schedulerName: Extra inputs are not permitted" in err


def test_review_with_quota_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    quota = tmp_path / "quota.yaml"
    quota.write_text(
        "apiVersion: fracgpu.io/v1\nkind: GPUQuota\nmetadata: {name: team-a, namespace: team-a}\n"
        'spec: {gpu: "0.5", gpumem: 16Gi}\n'
    )
    pod = str(EXAMPLES / "pod-fraction.yaml")
    status, out, _ = run(capsys, "review", "-o", "json", "--quota", str(quota), pod, pod)
    assert status == 1
    first, second = json.loads(out)
    assert first["allowed"] is True
    assert second["allowed"] is False
    assert second["message"] == (
        'GPU quota exceeded in namespace "team-a": this pod asks 0.30 card and 8192 MiB; '
        'quota "team-a" allows 0.50 card (0.30 used) and 16384 MiB (8192 used)'
    )


@pytest.mark.parametrize(
    ("value", "expected", "status"),
    [
        pytest.param("1" * 5000, "more than 4300 digits", 2, id="plain-number"),
        pytest.param('"' + "1" * 5000 + '"', "(5002 characters)", 1, id="quoted-number"),
        pytest.param("1e30", "a container may have at most 16 cards", 1, id="absurd-cards"),
    ],
)
def test_review_of_absurd_quantities_answers_without_a_traceback(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, value: str, expected: str, status: int
) -> None:
    manifest = tmp_path / "pod.yaml"
    manifest.write_text(
        "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  containers:\n"
        f"  - name: c\n    image: x\n    resources:\n      limits:\n"
        f"        fracgpu.io/gpu: {value}\n"
    )
    got, out, err = run(capsys, "review", str(manifest))
    assert expected in out + err
    assert got == status


MIXED = [
    "--gpu-model",
    "NVIDIA A100-SXM4-40GB=40960",
    "--gpu-model",
    "NVIDIA A100-SXM4-80GB=81920",
    "--gpu-model",
    "NVIDIA H100 80GB HBM3=81559",
]


def test_review_shows_the_gpu_models_a_pod_chose(capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run(capsys, "review", *MIXED, str(EXAMPLES / "pod-gpu-model.yaml"))
    assert status == 0
    assert "#   GPU models: only NVIDIA A100-SXM4-40GB, NVIDIA A100-SXM4-80GB" in out


def test_review_sizes_the_example_for_the_chosen_models(
    capsys: pytest.CaptureFixture[str],
) -> None:
    _, out, _ = run(capsys, "review", "-o", "json", *MIXED, str(EXAMPLES / "pod-gpu-model.yaml"))
    [entry] = json.loads(out)
    limits = entry["object"]["spec"]["containers"][0]["resources"]["limits"]
    assert limits["fracgpu.io/memory"] == "80"  # half of the 40 GB A100, the smallest chosen


@pytest.mark.parametrize(
    ("annotation", "expected"),
    [
        pytest.param(
            "fracgpu.io/gpu-model: H1000",
            "fracgpu.io/gpu-model 'H1000' matches no GPU model in this cluster",
            id="unknown-model",
        ),
        pytest.param(
            "fracgpu.io/gpu-model-exclude: 'NVIDIA A100-SXM4-40GB,NVIDIA A100-SXM4-80GB,"
            "NVIDIA H100 80GB HBM3'",
            "no GPU model of this cluster is left",
            id="excludes-every-model",
        ),
        pytest.param("fracgpu.io/gpu-model: 12", "must be a string", id="a-number"),
    ],
)
def test_review_denies_a_model_choice_without_a_traceback(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    annotation: str,
    expected: str,
) -> None:
    manifest = (
        f"apiVersion: v1\nkind: Pod\nmetadata:\n  name: a\n  annotations: {{{annotation}}}\n"
        "spec:\n  containers:\n  - name: c\n    resources: {limits: {fracgpu.io/gpu: '1'}}\n"
    )
    monkeypatch.setattr("sys.stdin", io.StringIO(manifest))
    status, out, err = run(capsys, "review", *MIXED, "-")
    assert status == 1
    assert expected in out
    assert "Traceback" not in err
