"""The request parts that ask for structured output: OpenAI's `response_format` and vLLM's
`structured_outputs` (gateway/structured_output.py turns them into a grammar). Their schemas
publish the rules their validators apply (one kind of constraint per request, a schema with
type `json_schema` and only then)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from gateway.neutral_params import neutral_schema, require_neutral
from gateway.request_part import RequestPart
from gateway.schema_rules import NOT_NULL, one_of_keys

# A choice's strings (the grammar check refuses an empty list or an empty string).
CHOICES = {"anyOf": [{"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1}, {"type": "null"}]}


class ResponseFormat(RequestPart):
    """`{"type": "text" | "json_object"}` or `{"type": "json_schema", "json_schema": {...}}`."""

    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"properties": {"type": {"enum": ["text", "json_object"]}, "json_schema": {"type": "null"}}},
        {"properties": {"type": {"const": "json_schema"}, "json_schema": NOT_NULL}, "required": ["json_schema"]}]})

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("'json_schema' is required with type 'json_schema', and only then")
        return self


def _key_set(key: str) -> dict[str, Any]:
    return {"properties": {key: {"const": True} if key == "json_object" else NOT_NULL}, "required": [key]}


def _key_unset(key: str) -> dict[str, Any]:
    return {"properties": {key: {"enum": [False, None]} if key == "json_object" else {"type": "null"}}}


# At most one of json, regex, choice, grammar, json_object (true) per request.
_ONE_KEY = one_of_keys({key: (_key_set(key), _key_unset(key)) for key in ("json", "regex", "choice", "grammar",
                                                                            "json_object")})


class StructuredOutputs(RequestPart):
    """vLLM's `structured_outputs`: exactly one of json (a schema), json_object, regex,
    choice, grammar (llguidance's Lark)."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True,
                              json_schema_extra={"allOf": [_ONE_KEY]})
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")  # BaseModel has .json
    json_object: bool | None = None
    regex: str | None = None
    choice: Annotated[list[str] | None, WithJsonSchema(CHOICES)] = None
    grammar: str | None = None
    structural_tag: Annotated[Any, neutral_schema("structural_tag")] = None
    whitespace_pattern: Annotated[str | None, neutral_schema("whitespace_pattern")] = None

    @field_validator("structural_tag", "whitespace_pattern")
    @classmethod
    def _neutral_structured(cls, value: Any, info) -> Any:
        return require_neutral(info.field_name, value)


class JsonSchemaFormat(RequestPart):
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    # "schema" shadows a BaseModel attribute, hence the alias
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None



ResponseFormat.model_rebuild()
