"""Server-side apply on the real API server: a second field manager (a platform team's
``kubectl apply --server-side``) owns a label and an annotation of the operator's engine
Deployment; the operator neither removes them when it rewrites the Deployment nor keeps
rewriting it (no fight: the resourceVersion settles)."""
from __future__ import annotations

import time

import yaml

from .helpers import wait_until
from .test_operator_pagedmodel import operator, pagedmodel_crd  # noqa: F401  (pagedmodel_crd: fixture)

MANAGER = "platform-team"



def deployment(cluster, namespace):
    return cluster.kubectl_json("get", "deployment", "ssa-engine", namespace=namespace)


def test_operator_leaves_another_managers_fields_alone(cluster, namespace, pagedmodel_crd, tmp_path):
    pm = {"apiVersion": "pagedmodel.io/v1alpha1", "kind": "PagedModel", "metadata": {"name": "ssa"},
          "spec": {"model": {"source": "builtin://smollm2"}, "replicas": 0, "resources": {"gpus": 0}}}
    with operator(cluster, namespace, tmp_path / "operator.log"):
        cluster.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(pm), namespace=namespace)
        wait_until(lambda: deployment(cluster, namespace), timeout=60, what="engine Deployment")
        theirs = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {
            "name": "ssa-engine", "labels": {"example.com/team": "platform"},
            "annotations": {"example.com/owner": "platform"}}}
        cluster.kubectl("apply", "--server-side", f"--field-manager={MANAGER}", "-f", "-",
                        stdin=yaml.safe_dump(theirs), namespace=namespace)

        # A spec change makes the operator rewrite the Deployment ...
        cluster.kubectl("patch", "pm", "ssa", "--type=merge", "-p", '{"spec":{"engine":{"maxNumSeqs":8}}}',
                        namespace=namespace)
        dep = wait_until(lambda: (lambda d: d if "8" in d["spec"]["template"]["spec"]["containers"][0]["args"]
                                  else None)(deployment(cluster, namespace)), timeout=60, what="Deployment rewritten")
        # ... and the other manager's fields survive, still owned by it.
        assert dep["metadata"]["labels"].get("example.com/team") == "platform", dep["metadata"]["labels"]
        assert dep["metadata"]["annotations"].get("example.com/owner") == "platform"
        managed = cluster.kubectl_json("get", "deployment", "ssa-engine", "--show-managed-fields",
                                       namespace=namespace)["metadata"]["managedFields"]
        owned = [m for m in managed if m["manager"] == MANAGER]
        assert owned and "f:example.com/team" in str(owned[0]["fieldsV1"]), managed
        ours = [m for m in managed if m["manager"] == "pagedmodel-operator"]
        assert ours and ours[0]["operation"] == "Apply", managed

        # No fight: over several status passes (1 s apart) nobody rewrites the Deployment.
        dep = wait_until(lambda: (lambda d: d if (d.get("status") or {}).get("observedGeneration") ==
                                  d["metadata"]["generation"] else None)(deployment(cluster, namespace)),
                         timeout=30, what="the Deployment controller caught up")
        version = dep["metadata"]["resourceVersion"]
        time.sleep(4)
        assert deployment(cluster, namespace)["metadata"]["resourceVersion"] == version
