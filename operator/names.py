"""Names, labels and API coordinates shared by the operator's pure and Kubernetes-facing code."""
from __future__ import annotations

GROUP = "pagedmodel.io"
VERSION = "v1alpha1"
PLURAL = "pagedmodels"
KIND = "PagedModel"
API_VERSION = f"{GROUP}/{VERSION}"

ENGINE_PORT = 8000          # `pagedmodel serve` and `pagedmodel router` listen here in their pods
MANAGED_BY = "pagedmodel-operator"

# Labels: the app.kubernetes.io set for tools, plus one short key the scale subresource selects on.
LABEL_NAME = "pagedmodel.io/name"
LABEL_COMPONENT = "app.kubernetes.io/component"

# Annotations the operator writes or reads.
ANNOTATION_CONFIG_HASH = "pagedmodel.io/engine-config-hash"   # on the pod template: changes roll the engines
ANNOTATION_ENGINE = "pagedmodel.io/engine"                    # on the engine Deployment: effective flags (JSON)
ANNOTATION_TUNED = "pagedmodel.io/tuned-engine"               # on the PagedModel: JSON overrides from the tuner

ENGINE = "engine"
ROUTER = "router"


def engine_name(model: str) -> str:
    """Engine Deployment, its Service and its PodDisruptionBudget."""
    return f"{model}-engine"


def router_name(model: str) -> str:
    """Router Deployment, ServiceAccount, Role and RoleBinding."""
    return f"{model}-router"


def public_service_name(model: str) -> str:
    """The Service clients call: named after the model, so its URL reads http://<model>.<ns>.svc/v1."""
    return model


def selector_labels(model: str, component: str) -> dict[str, str]:
    return {LABEL_NAME: model, LABEL_COMPONENT: component}


def selector_string(model: str, component: str) -> str:
    """The label selector as kubectl and the scale subresource spell it (keys sorted)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(model, component).items()))


def labels(model: str, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "pagedmodel",
        "app.kubernetes.io/instance": model,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        **selector_labels(model, component),
    }
