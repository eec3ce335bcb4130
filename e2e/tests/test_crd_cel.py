"""CEL rules of the PagedModel CRD (``x-kubernetes-validations``) are evaluated by kube-apiserver:
``kubectl apply`` is refused with the rule's own message and the field it names."""
from __future__ import annotations

import pytest
import yaml

from .test_operator_pagedmodel import pagedmodel_crd  # noqa: F401  (fixture)



def _pm(name: str, spec: dict) -> str:
    return yaml.safe_dump({"apiVersion": "pagedmodel.io/v1alpha1", "kind": "PagedModel",
                           "metadata": {"name": name}, "spec": {"model": {"source": "builtin://smollm2"}, **spec}})


@pytest.mark.parametrize("spec, field, message", [
    ({"autoscaling": {"minReplicas": 5, "maxReplicas": 2}}, "spec.autoscaling.minReplicas",
     "minReplicas must not exceed maxReplicas"),
    ({"tuning": {"maxNumSeqs": {"min": 64, "max": 16}}}, "spec.tuning.maxNumSeqs.min", "min must not exceed max"),
], ids=["autoscaling", "tuning"])
def test_cel_rule_rejects_apply_with_its_message(cluster, namespace, pagedmodel_crd, spec, field, message):
    result = cluster.kubectl("apply", "-f", "-", stdin=_pm("cel", spec), namespace=namespace, check=False)
    assert result.returncode != 0, result.stdout
    assert f"{field}: Invalid value" in result.stderr and message in result.stderr, result.stderr
    assert cluster.kubectl("get", "pm", "cel", namespace=namespace, check=False).returncode != 0
    # The same object within the rule is accepted (the rule is what refused it, not something else).
    fixed = {"autoscaling": {"minReplicas": 1, "maxReplicas": 2}} if "autoscaling" in spec else \
        {"tuning": {"maxNumSeqs": {"min": 16, "max": 64}}}
    cluster.kubectl("apply", "--dry-run=server", "-f", "-", stdin=_pm("cel", fixed), namespace=namespace)
