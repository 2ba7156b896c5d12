#!/usr/bin/env python3
"""Validate the manifests beside this file offline, against the Kubernetes schemas.

    python3 -m venv /tmp/kv && /tmp/kv/bin/pip install kubernetes-validate
    /tmp/kv/bin/python deploy/kubernetes/validate.py [--crd kubeflow.org_pytorchjobs.yaml] [-k 1.37.0] [FILE ...]

Built-in kinds (Deployment, Service, StatefulSet, ...) are checked by the ``kubernetes-validate``
package (PyPI; it ships the JSON schemas of each Kubernetes release) in strict mode, so an unknown
field is an error. A Kubeflow ``PyTorchJob`` is not in those schemas: each replica's pod template is
checked strictly as a core ``PodTemplate``, the replica specs' own fields are checked by hand, and
with ``--crd`` the whole object is checked against the ``openAPIV3Schema`` of the training
operator's CustomResourceDefinition (kubeflow.org_pytorchjobs.yaml from its manifests), with unknown
fields made errors. Exit status 1 if anything failed.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

HERE = Path(__file__).resolve().parent
REPLICA_FIELDS = {"replicas", "restartPolicy", "template"}
RESTART_POLICIES = {"Always", "OnFailure", "Never", "ExitCode"}


def closed(schema: Any) -> Any:
    """The schema with ``additionalProperties: false`` on every object that lists its properties and
    does not say it keeps unknown fields: what the API server prunes silently becomes an error."""
    if isinstance(schema, dict):
        out = {k: closed(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [closed(v) for v in schema]
    return schema


def crd_schema(path: Path, kind: str, version: str) -> dict[str, Any]:
    for doc in yaml.safe_load_all(path.read_text()):
        if doc and doc.get("kind") == "CustomResourceDefinition" and doc["spec"]["names"]["kind"] == kind:
            for v in doc["spec"]["versions"]:
                if v["name"] == version:
                    return closed(v["schema"]["openAPIV3Schema"])
    raise SystemExit(f"{path}: no {kind} {version} in this CRD file")


def check_pytorchjob(doc: dict[str, Any], k8s: str, crd: Path | None) -> list[str]:
    errors = []
    if crd is not None:
        schema = crd_schema(crd, "PyTorchJob", doc["apiVersion"].split("/")[1])
        errors += [f"CRD schema: {'.'.join(map(str, e.absolute_path))}: {e.message}"
                   for e in jsonschema.Draft7Validator(schema).iter_errors(doc)]
    specs = doc.get("spec", {}).get("pytorchReplicaSpecs") or {}
    if "Master" not in specs:
        errors.append("spec.pytorchReplicaSpecs has no Master")
    for role, spec in specs.items():
        where = f"spec.pytorchReplicaSpecs.{role}"
        if role not in ("Master", "Worker"):
            errors.append(f"{where}: the roles are Master and Worker")
        if set(spec) - REPLICA_FIELDS:
            errors.append(f"{where}: unexpected fields {sorted(set(spec) - REPLICA_FIELDS)}")
        if spec.get("restartPolicy", "OnFailure") not in RESTART_POLICIES:
            errors.append(f"{where}.restartPolicy: {spec['restartPolicy']!r} is not one of {sorted(RESTART_POLICIES)}")
        template = copy.deepcopy(spec.get("template") or {})
        names = [c.get("name") for c in template.get("spec", {}).get("containers", [])]
        if "pytorch" not in names:
            errors.append(f"{where}: no container named 'pytorch' (the operator sets the job's variables there)")
        pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"{role.lower()}"},
               "template": template}
        try:
            kubernetes_validate.validate(pod, k8s, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(f"{where}.template: {'.'.join(map(str, e.path))}: {e.message}")
    return errors


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", type=Path, help="manifests (default: every *.yaml beside this script)")
    ap.add_argument("-k", "--kubernetes-version", default=kubernetes_validate.latest_version())
    ap.add_argument("--crd", type=Path, default=None, help="the training operator's PyTorchJob CRD file")
    args = ap.parse_args()
    files = args.files or sorted(HERE.glob("*.yaml"))
    failed = 0
    for path in files:
        for doc in yaml.safe_load_all(path.read_text()):
            if not doc:
                continue
            what = f"{path.name}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
            if doc.get("kind") == "PyTorchJob":
                errors = check_pytorchjob(doc, args.kubernetes_version, args.crd)
                how = "pod templates strictly" + (", whole object against the CRD" if args.crd else "")
            else:
                how = "strict"
                try:
                    kubernetes_validate.validate(doc, args.kubernetes_version, strict=True)
                    errors = []
                except kubernetes_validate.ValidationError as e:
                    errors = [f"{'.'.join(map(str, e.path))}: {e.message}"]
                except kubernetes_validate.SchemaNotFoundError as e:
                    errors = [str(e)]
            if errors:
                failed += 1
                print(f"FAIL {what} (Kubernetes {args.kubernetes_version})")
                for e in errors:
                    print(f"    {e}")
            else:
                print(f"ok   {what} (Kubernetes {args.kubernetes_version}, {how})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
