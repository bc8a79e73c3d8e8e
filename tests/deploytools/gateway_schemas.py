"""Structural JSON schemas for the Gateway API and Gateway API Inference Extension kinds the chart
renders, written for these tests from the published API references (gateway.networking.k8s.io/v1
Gateway and HTTPRoute; inference.networking.k8s.io/v1 InferencePool).

Why not the real CRDs: no package registry ships their OpenAPI schemas, and the tests must run
offline; kubernetes-validate knows only built-in kinds. These schemas cover every field the chart
can emit, reject unknown fields, and encode the documented constraints (required fields, enums,
port ranges, name/label patterns, the single target port of an InferencePool, a port on Service
backend references). Fields the chart never renders are not described and so are rejected.
"""

from __future__ import annotations

_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_GROUP = r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_KIND = r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"
_SECTION = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_LABEL_KEY = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$"
_LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
_DURATION = r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"

PORT = {"type": "integer", "minimum": 1, "maximum": 65535}


def _obj(props: dict, required: list[str] | None = None) -> dict:
    out = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        out["required"] = required
    return out


METADATA = _obj({
    "name": {"type": "string", "pattern": _DNS_LABEL, "maxLength": 253},
    "namespace": {"type": "string", "pattern": _DNS_LABEL, "maxLength": 63},
    "labels": {"type": "object", "propertyNames": {"pattern": _LABEL_KEY},
               "additionalProperties": {"type": "string", "pattern": _LABEL_VALUE, "maxLength": 63}},
    "annotations": {"type": "object", "additionalProperties": {"type": "string"}},
}, ["name"])


def _resource(api_version: str, kind: str, spec: dict) -> dict:
    return _obj({
        "apiVersion": {"const": api_version},
        "kind": {"const": kind},
        "metadata": METADATA,
        "spec": spec,
    }, ["apiVersion", "kind", "metadata", "spec"])


GATEWAY = _resource("gateway.networking.k8s.io/v1", "Gateway", _obj({
    "gatewayClassName": {"type": "string", "minLength": 1, "maxLength": 253},
    "listeners": {"type": "array", "minItems": 1, "maxItems": 64, "items": _obj({
        "name": {"type": "string", "pattern": _SECTION, "maxLength": 253},
        "hostname": {"type": "string"},
        "port": PORT,
        "protocol": {"type": "string", "pattern": r"^[a-zA-Z0-9]([-a-zA-Z0-9]*[a-zA-Z0-9])?$|[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\/[A-Za-z0-9]+$"},
        "tls": {"type": "object"},
        "allowedRoutes": _obj({
            "namespaces": _obj({
                "from": {"enum": ["All", "Selector", "Same"]},
                "selector": {"type": "object"},
            }),
            "kinds": {"type": "array", "items": _obj({"group": {"type": "string"}, "kind": {"type": "string"}}, ["kind"])},
        }),
    }, ["name", "port", "protocol"])},
}, ["gatewayClassName", "listeners"]))

_BACKEND_REF = _obj({
    "group": {"type": "string", "pattern": _GROUP},
    "kind": {"type": "string", "pattern": _KIND},
    "name": {"type": "string", "minLength": 1, "maxLength": 253},
    "namespace": {"type": "string", "pattern": _DNS_LABEL},
    "port": PORT,
    "weight": {"type": "integer", "minimum": 0, "maximum": 1000000},
}, ["name"])
# A Service backend needs a port (the CRD's CEL rule).
_BACKEND_REF["allOf"] = [{
    "if": {"properties": {"kind": {"const": "Service"}}, "required": ["kind"]},
    "then": {"required": ["port"]},
}]

HTTPROUTE = _resource("gateway.networking.k8s.io/v1", "HTTPRoute", _obj({
    "parentRefs": {"type": "array", "maxItems": 32, "items": _obj({
        "group": {"type": "string", "pattern": _GROUP},
        "kind": {"type": "string", "pattern": _KIND},
        "namespace": {"type": "string", "pattern": _DNS_LABEL},
        "name": {"type": "string", "minLength": 1, "maxLength": 253},
        "sectionName": {"type": "string", "pattern": _SECTION},
        "port": PORT,
    }, ["name"])},
    "hostnames": {"type": "array", "items": {"type": "string"}},
    "rules": {"type": "array", "minItems": 1, "maxItems": 16, "items": _obj({
        "matches": {"type": "array", "maxItems": 64, "items": _obj({
            "path": _obj({
                "type": {"enum": ["Exact", "PathPrefix", "RegularExpression"]},
                "value": {"type": "string", "pattern": "^/", "maxLength": 1024},
            }),
            "method": {"enum": ["GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH"]},
            # HTTPHeaderMatch: at most 16, names are HTTP header names
            "headers": {"type": "array", "maxItems": 16, "items": _obj({
                "type": {"enum": ["Exact", "RegularExpression"]},
                "name": {"type": "string", "minLength": 1, "maxLength": 256,
                         "pattern": "^[A-Za-z0-9!#$%&'*+\\-.^_\\x60|~]+$"},
                "value": {"type": "string", "minLength": 1, "maxLength": 4096},
            }, required=["name", "value"])},
        })},
        "backendRefs": {"type": "array", "maxItems": 16, "items": _BACKEND_REF},
        "timeouts": _obj({
            "request": {"type": "string", "pattern": _DURATION},
            "backendRequest": {"type": "string", "pattern": _DURATION},
        }),
    })},
}))

INFERENCEPOOL = _resource("inference.networking.k8s.io/v1", "InferencePool", _obj({
    "selector": _obj({
        "matchLabels": {"type": "object", "minProperties": 1, "maxProperties": 64,
                        "propertyNames": {"pattern": _LABEL_KEY, "maxLength": 253},
                        "additionalProperties": {"type": "string", "pattern": _LABEL_VALUE, "maxLength": 63}},
    }, ["matchLabels"]),
    "targetPorts": {"type": "array", "minItems": 1, "maxItems": 1, "items": _obj({"number": PORT}, ["number"])},
    "endpointPickerRef": _obj({
        "group": {"type": "string", "pattern": _GROUP, "maxLength": 253},
        "kind": {"type": "string", "pattern": _KIND, "maxLength": 63},
        "name": {"type": "string", "minLength": 1, "maxLength": 253},
        "port": _obj({"number": PORT}, ["number"]),
        "failureMode": {"enum": ["FailOpen", "FailClose"]},
    }, ["name"]),
}, ["selector", "targetPorts", "endpointPickerRef"]))
# The endpoint picker is a Service unless told otherwise, and then the port is required.
INFERENCEPOOL["properties"]["spec"]["properties"]["endpointPickerRef"]["anyOf"] = [
    {"required": ["port"]},
    {"required": ["kind"], "properties": {"kind": {"not": {"const": "Service"}}}},
]

SCHEMAS = {
    ("gateway.networking.k8s.io/v1", "Gateway"): GATEWAY,
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): HTTPROUTE,
    ("inference.networking.k8s.io/v1", "InferencePool"): INFERENCEPOOL,
}
