"""OpenAI's and vLLM's ways of asking for structured output, as the engine's `StructuredOutputs`.

Accepted (at most one of them per request, each naming one constraint):
- `response_format`: `{"type": "text"}` (none), `{"type": "json_object"}`, `{"type": "json_schema",
  "json_schema": {"name": ..., "schema": {...}}}` (OpenAI);
- `structured_outputs`: `{"json": schema | true, "regex": ..., "choice": [...], "grammar": ..., "json_object":
  true, "structural_tag": ...}` (vLLM's current extra);
- `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (vLLM's older extras).
The schema or grammar itself is checked where every front's is: the engine's grammar compile
(`paged_jax.structured`), whose errors name `structured_outputs`, shown here as the parameter that asked.
"""

from __future__ import annotations

from typing import Any

from paged_jax.sampling_params import StructuredOutputs

from ..convert import invalid

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_VLLM_FIELDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def structured_output(body: dict[str, Any]) -> tuple[StructuredOutputs | None, str | None]:
    """(the constraint, the parameter that asked for it) of a request body; (None, None) when it has none."""
    asked = {}
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        asked["response_format"] = _response_format(fmt)
    so = body.get("structured_outputs")
    if so is not None:
        asked["structured_outputs"] = _vllm(so)
    for name, kind in GUIDED.items():
        if body.get(name) is not None:
            asked[name] = _one(name, kind, body[name])
    if len(asked) > 1:
        raise invalid(f"{sorted(asked)[1]}: only one of {', '.join(sorted(asked))} may be given", sorted(asked)[1])
    if not asked:
        return None, None
    ((param, message),) = asked.items()
    return message, param


def _response_format(fmt: Any) -> StructuredOutputs:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise invalid(
            "response_format: must be an object with a type (text, json_object or json_schema)", "response_format"
        )
    if fmt["type"] == "json_object":
        return StructuredOutputs(json=True)
    if fmt["type"] == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise invalid("response_format.json_schema: must be an object with a schema object", "response_format")
        return StructuredOutputs(json=spec.get("schema", {"type": "object"}))
    raise invalid(
        f"response_format.type: {fmt['type']!r} is not one of text, json_object, json_schema", "response_format.type"
    )


def _vllm(so: Any) -> StructuredOutputs:
    if not isinstance(so, dict):
        raise invalid("structured_outputs: must be an object", "structured_outputs")
    given = [k for k in so if so[k] is not None]
    unknown = [k for k in given if k not in _VLLM_FIELDS]
    if unknown:
        raise invalid(
            f"structured_outputs.{unknown[0]}: not supported (supported: {', '.join(_VLLM_FIELDS)})",
            "structured_outputs",
        )
    if len(given) != 1:
        raise invalid(f"structured_outputs: set exactly one of {', '.join(_VLLM_FIELDS)}", "structured_outputs")
    return _one(f"structured_outputs.{given[0]}", given[0], so[given[0]])


def _one(param: str, kind: str, value: Any) -> StructuredOutputs:
    """One constraint of the vLLM kinds (json, regex, choice, grammar, json_object, structural_tag)."""
    if kind == "json":
        if value is True:
            return StructuredOutputs(json=True)
        if isinstance(value, str):
            return StructuredOutputs(json=value)
        if isinstance(value, dict):
            return StructuredOutputs(json=value)
        raise invalid(f"{param}: must be a JSON Schema (an object or its text)", param)
    if kind == "json_object":
        if value is not True:
            raise invalid(f"{param}: must be true", param)
        return StructuredOutputs(json=True)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise invalid(f"{param}: must be a non-empty array of strings", param)
        return StructuredOutputs(choice=list(value))
    if kind == "structural_tag":
        if not isinstance(value, (dict, str)):
            raise invalid(f"{param}: must be an object", param)
        return StructuredOutputs(structural_tag=value)
    if not isinstance(value, str) or not value:
        raise invalid(f"{param}: must be a non-empty string", param)
    field: dict[str, Any] = {kind: value}  # json, regex or grammar
    return StructuredOutputs(**field)
