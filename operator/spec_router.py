"""`spec.router`: a `sits router` in front of the replicas, deployed and wired by the operator.

With `enabled`, the operator runs `replicas` router pods (Deployment `x-router`, Service
`x-router`); the model's Service `x` then selects the router pods, and the router finds the
runtime pods from the EndpointSlices of `x-stable` and `x-canary`. `policy` and `weights` are the
router's `--policy` and `--weights` (docs/router.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from sits.operator.fields import Fields, SpecError

# The router's Policy values (runtime/router/config.py; a test keeps the two equal). The operator
# does not import the runtime.
POLICIES = ("precise", "approximate", "least-loaded", "round-robin")
WEIGHT_NAMES = ("prefix", "running", "waiting", "kv")  # spec key == the router's --weights name
FIELDS = {"enabled", "replicas", "policy", "weights"}


@dataclass(frozen=True)
class RouterSpec:
    """The router's part of the spec.

    Attributes:
        enabled: run a router in front of the replicas.
        replicas: router pods.
        policy: one of POLICIES.
        weights: (name, value) of the score weights the spec sets, in WEIGHT_NAMES order (the
            others keep the router's defaults); all >= 0.
    """

    enabled: bool = False
    replicas: int = 1
    policy: str = "precise"
    weights: tuple[tuple[str, float], ...] = ()

    def weights_arg(self) -> str:
        """`prefix=1,running=0.08` for `--weights` ('' when the spec sets none)."""
        return ",".join(f"{name}={value:g}" for name, value in self.weights)


def parse_router(fields: Fields | None) -> RouterSpec:
    """`spec.router` (absent: disabled); raises SpecError naming the field."""
    if fields is None:
        return RouterSpec()
    replicas = fields.integer("replicas", 1, minimum=1)
    assert replicas is not None  # a default
    weights_fields = fields.child("weights", set(WEIGHT_NAMES))
    weights: list[tuple[str, float]] = []
    if weights_fields is not None:
        for name in WEIGHT_NAMES:
            value = weights_fields.number(name, None, minimum=0.0)
            if value is not None:
                weights.append((name, value))
    return RouterSpec(enabled=fields.boolean("enabled", False), replicas=replicas,
                      policy=str(fields.string("policy", "precise", choices=POLICIES)), weights=tuple(weights))


def check_router_model(router: RouterSpec, model_uri: str, path: str = "spec.router.policy") -> None:
    """`precise` hashes prompts with the replicas' tokenizer, which the router reads from the model:
    a pvc:// or file:// model. Each replica downloads an hf:// model itself, so the router has none."""
    if router.enabled and router.policy == "precise" and model_uri.startswith("hf://"):
        raise SpecError(path, "precise routing needs the replicas' tokenizer, read from a pvc:// or file:// "
                              "model (an hf:// model is downloaded by each replica); use approximate, "
                              "least-loaded or round-robin")
