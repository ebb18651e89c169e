"""The base of every request model: strict types, and unknown keys kept rather than refused,
so a request may carry fields other servers know (each named once in a log warning by the
preflight, `ignored_fields`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class RequestPart(BaseModel):
    """A request part: strict types, unknown keys kept (and reported by `ignored_fields`)."""

    model_config = ConfigDict(strict=True, extra="allow")


def ignored_fields(model: BaseModel, where: str = "") -> list[str]:
    """Every unknown key in `model` and the request parts inside it, as `a.b[0].c`."""
    found = [f"{where}{'.' if where else ''}{key}" for key in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        path = f"{where}{'.' if where else ''}{name}"
        if isinstance(value, BaseModel):
            found += ignored_fields(value, path)
        elif isinstance(value, list):
            found += [f for i, v in enumerate(value) if isinstance(v, BaseModel)
                      for f in ignored_fields(v, f"{path}[{i}]")]
    return found
