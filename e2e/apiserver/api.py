"""Object semantics shared by the HTTP layer and the in-process controllers.

Every write goes through here, so kubectl, kopf and the local controllers all see the
same resourceVersions, generations, finalizer handling and validation.
"""
from __future__ import annotations

import base64
import copy
import json
import random
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any

from . import builtin_schema, crds, defaults, events, patch as patches, schema as schemas
from .errors import ApiError, FieldError, already_exists, bad_request, conflict, invalid, not_found
from .patch import APPLY_PATCH, JSON_PATCH, MERGE_PATCH, STRATEGIC_MERGE_PATCH
from .resources import Registry, ResourceType
from .selectors import labels_match, parse_field_selector, parse_label_selector, selector_string
from .store import Store

_NAME_SUFFIX = "bcdfghjklmnpqrstvwxz2456789"
_UNDELETABLE_NAMESPACES = ("default", "kube-system", "kube-public")


def now_iso(offset_seconds: float = 0) -> str:
    t = datetime.now(timezone.utc) + timedelta(seconds=offset_seconds)
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def random_suffix(n: int = 5) -> str:
    return "".join(random.choice(_NAME_SUFFIX) for _ in range(n))


@dataclass
class WriteOptions:
    dry_run: bool = False
    field_validation: str = "Warn"          # Strict | Warn | Ignore
    warnings: list[str] = field(default_factory=list)


def _dig(obj: dict[str, Any], path: str) -> Any:
    cur: Any = obj
    for part in path.lstrip(".").split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(part)
    return cur


def _bury(obj: dict[str, Any], path: str, value: Any) -> None:
    parts = path.lstrip(".").split(".")
    cur = obj
    for part in parts[:-1]:
        cur = cur.setdefault(part, {})
    cur[parts[-1]] = value


def _spec_part(obj: dict[str, Any]) -> dict[str, Any]:
    """Everything a generation bump cares about: all but metadata and status."""
    return {k: v for k, v in obj.items() if k not in ("metadata", "status", "apiVersion", "kind")}


class Api:
    def __init__(self, store: Store | None = None, registry: Registry | None = None) -> None:
        self.store = store or Store()
        self.registry = registry or Registry()
        self._cluster_ips = iter(f"10.96.{i // 250}.{i % 250 + 2}" for i in range(1, 60000))

    # --- resolution and conversion ----------------------------------------------------

    def resource(self, group: str, version: str, plural: str) -> ResourceType:
        rt = self.registry.get(group, version, plural)
        if rt is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource",
                           details={"group": group, "kind": plural})
        return rt

    def served(self, rt: ResourceType, stored: dict[str, Any]) -> dict[str, Any]:
        """The stored object as this group/version presents it."""
        obj = copy.deepcopy(stored)
        if rt.group == "events.k8s.io":
            obj = events.from_core(obj)
        obj["apiVersion"] = rt.api_version
        obj["kind"] = rt.kind
        return obj

    def _to_storage(self, rt: ResourceType, obj: dict[str, Any]) -> dict[str, Any]:
        if rt.group == "events.k8s.io":
            return events.to_core(obj)
        return obj

    def _ns(self, rt: ResourceType, namespace: str | None) -> str:
        return (namespace or "") if rt.namespaced else ""

    def _stored(self, rt: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        obj = self.store.get(rt.storage_key, self._ns(rt, namespace), name)
        if obj is None:
            raise not_found(rt.group, rt.plural, name)
        return obj

    # --- reads -------------------------------------------------------------------------

    def get(self, rt: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        return self.served(rt, self._stored(rt, namespace, name))

    def list(self, rt: ResourceType, namespace: str | None, *, label_selector: str | None = None,
             field_selector: str | None = None, limit: int | None = None,
             continue_token: str | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        labels = parse_label_selector(label_selector)
        fields = parse_field_selector(field_selector)
        start = None
        if continue_token:
            try:
                start = tuple(json.loads(base64.urlsafe_b64decode(continue_token.encode()))["start"])
            except (ValueError, KeyError, TypeError):
                raise ApiError(400, "BadRequest", "continue key is not valid: bad continue token") from None
        ns = namespace if rt.namespaced else None
        items = []
        rv = self.store.resource_version
        for stored in self.store.list(rt.storage_key, ns):
            key = (stored["metadata"].get("namespace", ""), stored["metadata"]["name"])
            if start is not None and key <= start:
                continue
            obj = self.served(rt, stored)
            if labels_match(labels, obj) and fields(obj):
                items.append((key, obj))
        meta: dict[str, Any] = {"resourceVersion": str(rv)}
        if limit and len(items) > limit:
            last_key = items[limit - 1][0]
            meta["continue"] = base64.urlsafe_b64encode(json.dumps({"rv": rv, "start": list(last_key)}).encode()).decode()
            meta["remainingItemCount"] = len(items) - limit
            items = items[:limit]
        return [obj for _, obj in items], meta

    # --- create ------------------------------------------------------------------------

    def create(self, rt: ResourceType, namespace: str | None, body: Any,
               opts: WriteOptions | None = None) -> dict[str, Any]:
        opts = opts or WriteOptions()
        if not isinstance(body, dict):
            raise bad_request("the body of the request must be an object")
        if rt.storage_key == "selfsubjectaccessreviews.authorization.k8s.io":
            review = copy.deepcopy(body)
            self._check_type(rt, review)
            review["status"] = {"allowed": True, "reason": "the e2e API emulator does not enforce RBAC"}
            return review
        obj = copy.deepcopy(body)
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise bad_request("metadata must be an object")
        self._check_type(rt, obj)
        if meta.get("resourceVersion"):
            raise bad_request("resourceVersion should not be set on objects to be created")
        ns = self._ns(rt, namespace)
        if rt.namespaced:
            if meta.get("namespace") and namespace and meta["namespace"] != namespace:
                raise bad_request("the namespace of the provided object does not match the namespace sent on the "
                                  "request")
            if not ns:
                raise bad_request("a namespace is required to create a namespaced resource")
            meta["namespace"] = ns
            self._check_namespace_open(ns)
        else:
            meta.pop("namespace", None)
        if not meta.get("name"):
            if meta.get("generateName"):
                meta["name"] = meta["generateName"] + random_suffix()
            else:
                raise invalid(rt.kind, rt.group, "", [FieldError(
                    "FieldValueRequired", "metadata.name", "Required value: name or generateName is required")])
        for managed in ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "generation",
                        "managedFields", "selfLink"):
            meta.pop(managed, None)
        obj = self._to_storage(rt, obj)
        meta = obj["metadata"]
        self._admit(rt, obj, None, opts)
        if self.store.peek(rt.storage_key, ns, meta["name"]) is not None:
            raise already_exists(rt.group, rt.plural, meta["name"])
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_iso()
        if rt.has_generation:
            meta["generation"] = 1
        if rt.storage_key == "customresourcedefinitions.apiextensions.k8s.io":
            meta.setdefault("finalizers", [])
            if crds.CLEANUP_FINALIZER not in meta["finalizers"]:
                meta["finalizers"].append(crds.CLEANUP_FINALIZER)
            obj["status"] = crds.accepted_status(obj, now_iso())
        if rt.storage_key == "jobs.batch":
            defaults.default_job_selector(obj)
        if rt.storage_key == "services" and not obj["spec"].get("clusterIP") and obj["spec"]["type"] != "ExternalName":
            obj["spec"]["clusterIP"] = next(self._cluster_ips)
            obj["spec"]["clusterIPs"] = [obj["spec"]["clusterIP"]]
        if opts.dry_run:
            return self.served(rt, obj)
        written = self.store.write(rt.storage_key, obj, "ADDED")
        self._after_write(rt, written)
        return self.served(rt, written)

    def _check_type(self, rt: ResourceType, obj: dict[str, Any]) -> None:
        api_version, kind = obj.get("apiVersion"), obj.get("kind")
        if api_version and api_version != rt.api_version and not (rt.crd_name and api_version.startswith(rt.group + "/")):
            raise bad_request(f"the API version in the data ({api_version}) does not match the expected API version "
                              f"({rt.api_version})")
        if kind and kind != rt.kind:
            raise bad_request(f"the kind in the data ({kind}) does not match the expected kind ({rt.kind})")
        obj["apiVersion"], obj["kind"] = rt.api_version, rt.kind

    def _check_namespace_open(self, ns: str) -> None:
        namespace = self.store.peek("namespaces", "", ns)
        if namespace is None:
            raise not_found("", "namespaces", ns)
        if namespace["metadata"].get("deletionTimestamp"):
            raise ApiError(403, "Forbidden", f"{ns!s} is forbidden: unable to create new content in namespace {ns} "
                           "because it is being terminated", details={"name": ns, "kind": "namespaces", "causes": [
                               {"reason": "NamespaceTerminating", "message": f"namespace {ns} is being terminated",
                                "field": "metadata.namespace"}]})

    def _admit(self, rt: ResourceType, obj: dict[str, Any], old: dict[str, Any] | None, opts: WriteOptions) -> None:
        """Defaulting, pruning and validation; raises 400/422 the way the API server does."""
        name = obj["metadata"].get("name", "")
        errors = defaults.validate_name(rt.storage_key, name) if old is None else []
        unknown: list[str] = []
        if rt.schema is not None:
            schemas.prune(rt.schema, obj, "", unknown, top=True)
        elif rt.storage_key == "events":
            unknown = builtin_schema.prune_unknown("", "v1", "Event", obj)
        else:
            unknown = builtin_schema.prune_unknown(rt.group, rt.version, rt.kind, obj)
        if unknown and opts.field_validation == "Strict":
            listing = ", ".join(f'unknown field "{u}"' for u in unknown)
            raise bad_request(f'{rt.kind} in version "{rt.version}" cannot be handled as a {rt.kind}: '
                              f"strict decoding error: {listing}")
        if unknown and opts.field_validation != "Ignore":
            opts.warnings.extend(f'unknown field "{u}"' for u in unknown)
        if rt.schema is not None:
            meta = obj.get("metadata") or {}
            schemas.apply_defaults(rt.schema, obj)
            obj["metadata"] = meta
            errors += schemas.validate({k: v for k, v in rt.schema.items() if k != "required"} |
                                       {"required": [r for r in rt.schema.get("required") or []
                                                     if r not in ("apiVersion", "kind", "metadata")]},
                                       {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")})
        elif rt.storage_key == "customresourcedefinitions.apiextensions.k8s.io":
            errors += crds.validate_crd(obj)
        else:
            errors += defaults.default_and_validate(rt.storage_key, obj, creating=old is None)
            if old is not None:
                errors += defaults.validate_update(rt.storage_key, old, obj)
        if errors:
            raise invalid(rt.kind, rt.group, name, errors)

    # --- update ------------------------------------------------------------------------

    def update(self, rt: ResourceType, namespace: str | None, name: str, body: Any, *,
               subresource: str | None = None, opts: WriteOptions | None = None) -> dict[str, Any]:
        opts = opts or WriteOptions()
        if not isinstance(body, dict):
            raise bad_request("the body of the request must be an object")
        if subresource == "scale":
            return self._update_scale(rt, namespace, name, body, opts)
        body_name = (body.get("metadata") or {}).get("name")
        if body_name and body_name != name:
            raise bad_request(f"the name of the object ({body_name}) does not match the name on the URL ({name})")
        old = self._stored(rt, namespace, name)
        new = self._to_storage(rt, copy.deepcopy(body))
        new.setdefault("metadata", {})
        self._check_type(rt, new)
        return self._apply_update(rt, old, new, subresource, opts)

    def _apply_update(self, rt: ResourceType, old: dict[str, Any], new: dict[str, Any], subresource: str | None,
                      opts: WriteOptions) -> dict[str, Any]:
        meta, old_meta = new["metadata"], old["metadata"]
        name = old_meta["name"]
        if meta.get("resourceVersion") and meta["resourceVersion"] != old_meta["resourceVersion"]:
            raise conflict(rt.group, rt.plural, name)
        if meta.get("uid") and meta["uid"] != old_meta["uid"]:
            raise conflict(rt.group, rt.plural, name, f"Precondition failed: UID in precondition: {meta['uid']}, "
                                                      f"UID in object meta: {old_meta['uid']}")
        if subresource == "status":
            status = new.get("status")
            new = copy.deepcopy(old)
            if status is None:
                new.pop("status", None)
            else:
                new["status"] = status
            meta = new["metadata"]
        elif rt.status_subresource:
            if "status" in old:
                new["status"] = copy.deepcopy(old["status"])
            else:
                new.pop("status", None)
        for fixed in ("uid", "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "generation",
                      "namespace", "name"):
            if fixed in old_meta:
                meta[fixed] = old_meta[fixed]
            else:
                meta.pop(fixed, None)
        meta["resourceVersion"] = old_meta["resourceVersion"]
        if old_meta.get("deletionTimestamp"):
            added = set(meta.get("finalizers") or []) - set(old_meta.get("finalizers") or [])
            if added:
                raise invalid(rt.kind, rt.group, name, [FieldError(
                    "FieldValueForbidden", "metadata.finalizers",
                    f"Forbidden: no new finalizers can be added if the object is being deleted, found new finalizers "
                    f"{sorted(added)!r}")])
        if subresource != "status":
            self._admit(rt, new, old, opts)
        elif rt.schema is not None and isinstance(rt.schema.get("properties", {}).get("status"), dict):
            status_schema = rt.schema["properties"]["status"]
            unknown: list[str] = []
            if "status" in new:
                new["status"] = schemas.prune(status_schema, new["status"], "status", unknown)
                schemas.apply_defaults(status_schema, new["status"])
                errors = schemas.validate(status_schema, new["status"], "status")
                if errors:
                    raise invalid(rt.kind, rt.group, name, errors)
        if rt.has_generation and _spec_part(new) != _spec_part(old):
            meta["generation"] = old_meta.get("generation", 1) + 1
        if rt.storage_key == "customresourcedefinitions.apiextensions.k8s.io" and subresource != "status":
            new["status"] = crds.accepted_status(new, now_iso())
        if opts.dry_run:
            return self.served(rt, new)
        if new == old:
            return self.served(rt, old)   # no-op writes keep the resourceVersion, as in Kubernetes
        if self._finalized(rt, new):
            removed = self.store.remove(rt.storage_key, meta.get("namespace", ""), name)
            self._after_remove(rt, removed)
            return self.served(rt, removed)
        written = self.store.write(rt.storage_key, new, "MODIFIED")
        self._after_write(rt, written)
        return self.served(rt, written)

    def _finalized(self, rt: ResourceType, obj: dict[str, Any]) -> bool:
        meta = obj["metadata"]
        if not meta.get("deletionTimestamp") or meta.get("finalizers"):
            return False
        if rt.storage_key == "namespaces" and (obj.get("spec") or {}).get("finalizers"):
            return False
        # A pod in graceful termination is removed by its kubelet, not by losing finalizers.
        return not meta.get("deletionGracePeriodSeconds")

    # --- patch -------------------------------------------------------------------------

    def patch(self, rt: ResourceType, namespace: str | None, name: str, content_type: str, body: Any, *,
              subresource: str | None = None, opts: WriteOptions | None = None) -> dict[str, Any]:
        opts = opts or WriteOptions()
        content_type = (content_type or "").split(";")[0].strip()
        accepted = [JSON_PATCH, MERGE_PATCH, APPLY_PATCH] + ([STRATEGIC_MERGE_PATCH] if rt.builtin else [])
        if content_type not in accepted:
            raise ApiError(415, "UnsupportedMediaType",
                           f"the body of the request was in an unknown format - accepted media types include: "
                           f"{', '.join(accepted)}")
        if content_type == APPLY_PATCH:
            return self._apply(rt, namespace, name, body, subresource, opts)
        if subresource == "scale":
            current = self.get_scale(rt, namespace, name)
            return self._update_scale(rt, namespace, name, self._patched(current, content_type, body), opts)
        old = self._stored(rt, namespace, name)
        patched = self._patched(self.served(rt, old), content_type, body)
        if not isinstance(patched, dict):
            raise bad_request("the patched object is not a JSON object")
        new = self._to_storage(rt, patched)
        new.setdefault("metadata", {})
        self._check_type(rt, new)
        return self._apply_update(rt, old, new, subresource, opts)

    @staticmethod
    def _patched(current: dict[str, Any], content_type: str, body: Any) -> Any:
        if content_type == JSON_PATCH:
            return patches.json_patch(current, body)
        if not isinstance(body, dict):
            raise bad_request("a merge patch must be a JSON object")
        if content_type == MERGE_PATCH:
            return patches.merge_patch(current, body)
        return patches.strategic_merge_patch(current, body)

    def _apply(self, rt: ResourceType, namespace: str | None, name: str, body: Any, subresource: str | None,
               opts: WriteOptions) -> dict[str, Any]:
        """Server-side apply, approximated: create, or merge the applied configuration into the object.

        Field ownership is not tracked, so fields dropped from a later apply are not removed.
        """
        if not isinstance(body, dict):
            raise bad_request("the applied configuration must be an object")
        if self.store.peek(rt.storage_key, self._ns(rt, namespace), name) is None:
            if subresource:
                raise not_found(rt.group, rt.plural, name)
            body = copy.deepcopy(body)
            body.setdefault("metadata", {})["name"] = name
            return self.create(rt, namespace, body, opts)
        old = self._stored(rt, namespace, name)
        applied = copy.deepcopy(body)
        applied.get("metadata", {}).pop("resourceVersion", None)
        merged = patches.strategic_merge_patch(self.served(rt, old), applied)
        new = self._to_storage(rt, merged)
        self._check_type(rt, new)
        return self._apply_update(rt, old, new, subresource, opts)

    # --- scale subresource -------------------------------------------------------------

    def get_scale(self, rt: ResourceType, namespace: str | None, name: str) -> dict[str, Any]:
        if rt.scale is None:
            raise not_found(rt.group, f"{rt.plural}/scale", name)
        obj = self._stored(rt, namespace, name)
        meta = obj["metadata"]
        selector = _dig(obj, rt.scale.get("labelSelectorPath", "")) if rt.scale.get("labelSelectorPath") else None
        if rt.builtin:
            selector = selector_string(obj.get("spec", {}).get("selector"))
        status: dict[str, Any] = {"replicas": _dig(obj, rt.scale["statusReplicasPath"]) or 0}
        if selector:
            status["selector"] = selector
        return {
            "apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "creationTimestamp")
                         if k in meta},
            "spec": {"replicas": _dig(obj, rt.scale["specReplicasPath"]) or 0},
            "status": status,
        }

    def _update_scale(self, rt: ResourceType, namespace: str | None, name: str, scale: Any,
                      opts: WriteOptions) -> dict[str, Any]:
        if rt.scale is None:
            raise not_found(rt.group, f"{rt.plural}/scale", name)
        replicas = (scale.get("spec") or {}).get("replicas") if isinstance(scale, dict) else None
        if not isinstance(replicas, int) or isinstance(replicas, bool) or replicas < 0:
            raise invalid("Scale", "autoscaling", name, [FieldError(
                "FieldValueInvalid", "spec.replicas", f"Invalid value: {replicas!r}: must be greater than or equal to 0")])
        old = self._stored(rt, namespace, name)
        new = copy.deepcopy(old)
        rv = (scale.get("metadata") or {}).get("resourceVersion")
        if rv:
            new["metadata"]["resourceVersion"] = rv
        _bury(new, rt.scale["specReplicasPath"], replicas)
        self._apply_update(rt, old, new, None, opts)
        return self.get_scale(rt, namespace, name)

    # --- delete ------------------------------------------------------------------------

    def delete(self, rt: ResourceType, namespace: str | None, name: str, options: dict[str, Any] | None = None,
               dry_run: bool = False) -> tuple[dict[str, Any], bool]:
        """Returns (object, removed_now). Objects with finalizers get a deletionTimestamp instead."""
        options = options or {}
        obj = self._stored(rt, namespace, name)
        meta = obj["metadata"]
        if rt.storage_key == "namespaces" and name in _UNDELETABLE_NAMESPACES:
            raise ApiError(403, "Forbidden", f'namespaces "{name}" is forbidden: this namespace may not be deleted',
                           details={"name": name, "kind": "namespaces"})
        pre = options.get("preconditions") or {}
        if pre.get("uid") and pre["uid"] != meta["uid"]:
            raise conflict(rt.group, rt.plural, name, f"Precondition failed: UID in precondition: {pre['uid']}, "
                                                      f"UID in object meta: {meta['uid']}")
        if pre.get("resourceVersion") and pre["resourceVersion"] != meta["resourceVersion"]:
            raise conflict(rt.group, rt.plural, name)
        policy = options.get("propagationPolicy")
        if policy is None and options.get("orphanDependents") is not None:
            policy = "Orphan" if options["orphanDependents"] else "Background"
        if policy not in (None, "Background", "Foreground", "Orphan"):
            raise bad_request(f'Unsupported value: "{policy}": supported values: "Orphan", "Background", "Foreground"')
        grace = options.get("gracePeriodSeconds")
        if dry_run:
            return self.served(rt, obj), False
        if meta.get("deletionTimestamp"):
            if rt.storage_key == "pods" and grace == 0:
                meta["deletionGracePeriodSeconds"] = 0
                if not meta.get("finalizers"):
                    removed = self.store.remove("pods", meta["namespace"], name)
                    return self.served(rt, removed), True
                written = self.store.write("pods", obj, "MODIFIED")
                return self.served(rt, written), False
            return self.served(rt, obj), False
        finalizers = list(meta.get("finalizers") or [])
        if policy == "Foreground" and "foregroundDeletion" not in finalizers:
            finalizers.append("foregroundDeletion")
        if policy == "Orphan" and "orphan" not in finalizers:
            finalizers.append("orphan")
        graceful = 0
        if rt.storage_key == "pods":
            phase = (obj.get("status") or {}).get("phase")
            if obj.get("spec", {}).get("nodeName") and phase not in ("Succeeded", "Failed"):
                graceful = grace if grace is not None else obj["spec"].get("terminationGracePeriodSeconds", 30)
        pending = bool(finalizers) or graceful > 0 or (
            rt.storage_key == "namespaces" and (obj.get("spec") or {}).get("finalizers"))
        if not pending:
            removed = self.store.remove(rt.storage_key, meta.get("namespace", ""), name)
            self._after_remove(rt, removed)
            return self.served(rt, removed), True
        meta["finalizers"] = finalizers
        if not finalizers:
            meta.pop("finalizers")
        meta["deletionTimestamp"] = now_iso(graceful)
        meta["deletionGracePeriodSeconds"] = graceful
        if rt.storage_key == "namespaces":
            obj.setdefault("status", {})["phase"] = "Terminating"
        written = self.store.write(rt.storage_key, obj, "MODIFIED")
        return self.served(rt, written), False

    def delete_collection(self, rt: ResourceType, namespace: str | None, options: dict[str, Any] | None, *,
                          label_selector: str | None = None, field_selector: str | None = None) -> list[dict[str, Any]]:
        items, _ = self.list(rt, namespace, label_selector=label_selector, field_selector=field_selector)
        out = []
        for item in items:
            try:
                obj, _ = self.delete(rt, item["metadata"].get("namespace"), item["metadata"]["name"], options)
                out.append(obj)
            except ApiError as err:
                if err.code != 404:
                    raise
        return out

    # --- side effects ------------------------------------------------------------------

    def _after_write(self, rt: ResourceType, obj: dict[str, Any]) -> None:
        if rt.storage_key == "customresourcedefinitions.apiextensions.k8s.io":
            self.registry.remove_crd(obj["metadata"]["name"])
            for crt in crds.resource_types(obj):
                self.registry.add(crt)

    def _after_remove(self, rt: ResourceType, obj: dict[str, Any] | None) -> None:
        if obj is not None and rt.storage_key == "customresourcedefinitions.apiextensions.k8s.io":
            gone = self.registry.remove_crd(obj["metadata"]["name"])
            for storage in {g.storage_key for g in gone}:
                for leftover in self.store.list(storage):
                    self.store.remove(storage, leftover["metadata"].get("namespace", ""), leftover["metadata"]["name"])
                self.store.drop_storage(storage)

    # --- helpers for in-process controllers --------------------------------------------

    def rt(self, api_version: str, kind: str) -> ResourceType:
        rt = self.registry.by_kind(api_version, kind)
        if rt is None:
            raise not_found("", kind, api_version)
        return rt

    def builtin(self, storage: str) -> ResourceType:
        group, _, plural = storage.partition(".")
        if not plural:
            group, plural = "", storage
        else:
            plural, group = group, plural
        for rt in self.registry.all():
            if rt.storage_key == storage and rt.group == group:
                return rt
        raise KeyError(storage)

    def record_event(self, involved: dict[str, Any], event_type: str, reason: str, message: str,
                     component: str) -> None:
        """Emit (or bump the count of) a core/v1 Event, like client-go's recorder does."""
        meta = involved["metadata"]
        ns = meta.get("namespace") or "default"
        ref = {"apiVersion": involved.get("apiVersion", "v1"), "kind": involved.get("kind", ""), "name": meta["name"],
               "namespace": meta.get("namespace", ""), "uid": meta.get("uid", ""),
               "resourceVersion": meta.get("resourceVersion", "")}
        if self.store.peek("namespaces", "", ns) is None or self.store.peek("namespaces", "", ns)["metadata"].get(
                "deletionTimestamp"):
            return
        for existing in self.store.list("events", ns):
            io = existing.get("involvedObject") or {}
            if io.get("uid") == ref["uid"] and existing.get("reason") == reason and existing.get("message") == message:
                ev = copy.deepcopy(existing)
                ev["count"] = ev.get("count", 1) + 1
                ev["lastTimestamp"] = now_iso()
                self.store.write("events", ev, "MODIFIED")
                return
        ts = now_iso()
        name = f"{meta['name']}.{uuid.uuid4().hex[:16]}"
        event = {"apiVersion": "v1", "kind": "Event",
                 "metadata": {"name": name, "namespace": ns, "uid": str(uuid.uuid4()), "creationTimestamp": ts},
                 "involvedObject": ref, "reason": reason, "message": message, "type": event_type,
                 "source": {"component": component}, "firstTimestamp": ts, "lastTimestamp": ts, "count": 1,
                 "reportingComponent": component, "reportingInstance": ""}
        self.store.write("events", event, "ADDED")
