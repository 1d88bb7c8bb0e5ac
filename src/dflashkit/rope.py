"""A transformers config's rotary embedding, in either of its two spellings: transformers-5's
``rope_parameters`` or transformers-4's top-level ``rope_theta`` / ``rope_scaling``. Read by the drafter's
config (``dflashkit.model``) and by the target's weights read straight from its folder (``dflashkit.target``)."""

from __future__ import annotations

from typing import Any

from dflashkit.errors import ConfigError


def rope_from_hf_config(c: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from an HF config object: transformers-5 ``rope_parameters`` or transformers-4
    top-level ``rope_theta`` / ``rope_scaling``."""
    params = getattr(c, "rope_parameters", None)
    d = {"rope_parameters": params} if params else {}
    if getattr(c, "rope_theta", None) is not None:
        d["rope_theta"] = c.rope_theta
    if getattr(c, "rope_scaling", None):
        d["rope_scaling"] = c.rope_scaling
    return rope_from_dict(d)


def rope_from_dict(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from config.json keys, accepting both transformers-5 and transformers-4 forms."""
    params = d.get("rope_parameters")
    if params:
        if "rope_theta" not in params:
            raise ConfigError(
                "rope_parameters without rope_theta (per-layer-type RoPE settings are not supported)"
            )
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        if d.get("rope_theta") is None:
            raise ConfigError("the config has neither rope_parameters nor rope_theta")
        theta = float(d["rope_theta"])
        scaling = dict(d.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default" and set(scaling) <= {"rope_type"}:
        return theta, None
    return theta, scaling
