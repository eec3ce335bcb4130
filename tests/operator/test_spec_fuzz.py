"""Whatever a spec holds, the operator's pure path never raises: validate() reports it, or reconcile builds it."""
from __future__ import annotations

import copy

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedmodel.operator.desired_state import Observed, desired_state
from pagedmodel.operator.spec import DEFAULTS, validate, with_defaults

from pm_factory import make_pm

json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-10, 10_000), st.floats(-2, 2, allow_nan=False),
                         st.sampled_from(["", "Off", "cpu", "cuda", "auto", "builtin://smollm2", "pvc://w/m", "x"]))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                                  st.dictionaries(st.text(max_size=5), inner,
                                                                                  max_size=3)), max_leaves=6)
# A value for each known field (good or bad), so the fuzzing reaches the rules instead of missing keys.
section_keys = {k: sorted(v) + ["extraArgs", "maxModelLen", "kvCacheMemoryBytes", "maxNumSeqs", "cpu", "memory",
                                "rateLimit", "perClientRateLimit", "tenantLimits", "blockSizes", "stableWindowSeconds",
                                "requestsPerSecondPerReplica"] for k, v in DEFAULTS.items() if isinstance(v, dict)}
sections = st.fixed_dictionaries({}, optional={k: st.one_of(json_values, st.dictionaries(
    st.sampled_from(keys), json_values, max_size=4)) for k, keys in section_keys.items()})
specs = st.builds(lambda s, model, replicas: {**s, "model": model, "replicas": replicas}, sections,
                  st.one_of(json_values, st.fixed_dictionaries({"source": json_values})), json_values)


@settings(max_examples=300, deadline=None)
@given(specs)
def test_validate_or_reconcile_never_raises(spec):
    full = with_defaults(copy.deepcopy(spec))
    errors = validate(full)
    if not errors:
        first = desired_state(make_pm(spec), Observed())
        assert first == desired_state(make_pm(copy.deepcopy(spec)), Observed())
    else:
        assert all(e.field.startswith("spec.") and e.message for e in errors)


BASE = {"model": {"source": "builtin://smollm2"}, "engine": {"device": "cpu", "maxModelLen": 256},
        "resources": {"gpus": 0}}
PATHS = [("model", "servedName"), ("image",), ("imagePullPolicy",), ("imagePullSecrets",), ("replicas",),
         ("scheduling",), ("scheduling", "nodeSelector"), ("scheduling", "tolerations"),
         ("scheduling", "priorityClassName"), ("service",), ("service", "type"), ("probes",),
         ("probes", "startupTimeoutSeconds"), ("router",), ("router", "rateLimit"), ("router", "perClientRateLimit"),
         ("router", "tenantLimits"), ("router", "tenantLimits", "overrides"), ("router", "strategy"),
         ("autoscaling", "stableWindowSeconds"), ("autoscaling", "requestsPerSecondPerReplica"),
         ("router", "maxQueueLength"), ("router", "queueTimeoutSeconds"), ("autoscaling", "enabled"),
         ("resources", "cpu"), ("resources", "memory"), ("resources", "gpuResourceName"), ("engine", "extraArgs"),
         ("engine", "kvCacheMemoryBytes"), ("engine", "preemptionMode"), ("engine", "maxQueueLength"),
         ("engine", "enablePrefixCaching"), ("engine", "swapSpaceGiB"), ("engine", "dtype")]


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(PATHS), json_values)
def test_one_bad_field_in_a_valid_spec_never_crashes(path, value):
    spec = copy.deepcopy(BASE)
    node = spec
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    errors = validate(with_defaults(spec))
    if not errors:
        desired_state(make_pm(spec), Observed())
