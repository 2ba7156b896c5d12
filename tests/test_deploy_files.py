"""The container and cluster files agree with the CLI they call (cheap; `make containers` runs the images).

Every ``omnireduce-agg`` command line in the Dockerfile, the Kubernetes probes and the Slurm script
must parse with the real argument parser, so renaming an option cannot silently break a deployment.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from omnireduce.aggregator.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCKER = ROOT / "docker"
K8S = ROOT / "deploy" / "kubernetes"
SBATCH = ROOT / "deploy" / "slurm" / "omnireduce.sbatch"


def _instruction(dockerfile: Path, name: str) -> str:
    """The last ``NAME ...`` instruction of a Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", dockerfile.read_text())
    found = [line[len(name):].strip() for line in text.splitlines() if line.startswith(name + " ")]
    assert found, f"{dockerfile.name} has no {name}"
    return found[-1]


def _parses(args: list[str]) -> None:
    build_parser().parse_args(args)  # SystemExit on an unknown option


def test_aggregator_image_commands_parse_and_it_runs_as_a_numeric_user():
    f = DOCKER / "Dockerfile.aggregator"
    assert json.loads(_instruction(f, "ENTRYPOINT")) == ["omnireduce-agg"]
    _parses(json.loads(_instruction(f, "CMD")))
    health = _instruction(f, "HEALTHCHECK")
    command = health.split(" CMD ", 1)[1]
    argv = shlex.split(command.replace("${OMNIREDUCE_CHECK_ADDRESS:-tcp://127.0.0.1:5555}", "tcp://127.0.0.1:5555"))
    assert argv[0] == "omnireduce-agg" and "--check" in argv
    _parses(argv[1:])
    assert re.fullmatch(r"\d+:\d+", _instruction(f, "USER")), "a numeric user, so runAsNonRoot can verify it"
    assert "5555" in _instruction(f, "EXPOSE") and "9100" in _instruction(f, "EXPOSE")


def test_dockerfiles_take_their_base_as_a_build_argument():
    for name in ("Dockerfile.aggregator", "Dockerfile.worker"):
        text = (DOCKER / name).read_text()
        assert re.search(r"^ARG BASE=\S+", text, re.M), name
        assert all(line.split()[1] == "${BASE}" for line in text.splitlines() if line.startswith("FROM ")), name


def test_kubernetes_probes_and_args_parse():
    yaml = pytest.importorskip("yaml")
    seen = 0
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc or doc["kind"] not in ("Deployment", "StatefulSet"):
                continue
            for c in doc["spec"]["template"]["spec"]["containers"]:
                _parses(c.get("args", []))
                for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                    command = c[probe]["exec"]["command"]
                    assert command[:2] == ["omnireduce-agg", "--check"], (path.name, probe)
                    _parses(command[1:])
                    seen += 1
    assert seen == 6


def test_slurm_script_is_valid_bash_and_its_agg_commands_parse():
    bash = shutil.which("bash")
    assert bash is not None
    subprocess.run([bash, "-n", str(SBATCH)], check=True)
    text = SBATCH.read_text()
    assert "--check" in text and "torch.distributed.run" in text
    _parses(["--listen", "tcp://0.0.0.0:20000"])
    _parses(["--check", "tcp://node1:20000", "--check-timeout", "2"])
