"""The base of every request model: strict types, and unknown keys kept rather than refused,
so a request may carry fields other servers know (each named once in a log warning by the
preflight, `ignored_fields`). `Int` (`int_in(low, high)` with bounds): an integer field,
which takes 17.0 as 17 (JSON has one kind of number, and JSON Schema's "integer" is any
number without a fraction), but not "17", true or 17.5."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


def whole(value: Any) -> Any:
    """17.0 → 17; anything else as it is."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


def whole_numbers(value: Any) -> Any:
    """`value` with every whole float inside it (lists, objects) made an int."""
    if isinstance(value, dict):
        return {k: whole_numbers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [whole_numbers(v) for v in value]
    return whole(value)


Int = Annotated[int, BeforeValidator(whole)]


def int_in(low: int, high: int) -> Any:
    """`Int` within [low, high] (the bounds before the validator, so the schema shows them)."""
    return Annotated[int, Field(ge=low, le=high), BeforeValidator(whole)]


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
