"""tool_choice "required" over tools whose parameters use `$defs` (pydantic's nested models and
enums, as OpenAI's pydantic_function_tool sends them): one call-list schema whose references
resolve, the same name defined differently by two tools kept apart."""
import enum
import json

import jsonschema
import openai
import pydantic
import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from raypaged.serve.tool_calls import tool_constraint


class Unit(str, enum.Enum):
    celsius = "celsius"
    fahrenheit = "fahrenheit"


class Item(pydantic.BaseModel):      # "Item" in the first tool: a city and a unit
    city: str
    unit: Unit


class Forecast(pydantic.BaseModel):
    items: list[Item]


class Basket(pydantic.BaseModel):
    class Item(pydantic.BaseModel):  # "Item" in the second tool: something else
        sku: str
        quantity: int
    items: list[Item]


TOOLS = [openai.pydantic_function_tool(Forecast), openai.pydantic_function_tool(Basket)]
GOOD = [{"name": "Forecast", "parameters": {"items": [{"city": "Oslo", "unit": "celsius"}]}},
        {"name": "Basket", "parameters": {"items": [{"sku": "A1", "quantity": 2}]}}]


def schema(parallel: bool = True) -> dict:
    return json.loads(tool_constraint(TOOLS, "required", None, parallel).json)


def test_the_tools_defs_move_to_the_root_and_a_clashing_name_is_renamed():
    s = schema()
    assert sorted(s["$defs"]) == ["Item", "Unit", "t1_Item"]
    assert s["$defs"]["Item"]["properties"]["unit"] == {"$ref": "#/$defs/Unit"}
    assert s["$defs"]["t1_Item"]["properties"].keys() == {"sku", "quantity"}
    basket = s["items"]["anyOf"][1]["properties"]["parameters"]
    assert basket["properties"]["items"]["items"] == {"$ref": "#/$defs/t1_Item"}
    assert "$defs" not in basket


def test_the_call_list_schema_accepts_right_calls_and_refuses_wrong_ones():
    jsonschema.validate(GOOD, schema())
    wrong = [{"name": "Basket", "parameters": {"items": [{"city": "Oslo", "unit": "celsius"}]}}]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(wrong, schema())
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema()))  # was: no $defs found
    assert _is_grammar_accept_string(grammar, json.dumps(GOOD))
    assert not _is_grammar_accept_string(grammar, json.dumps(wrong))


def test_parallel_tool_calls_false_allows_exactly_one_call():
    one, two = json.dumps(GOOD[:1]), json.dumps(GOOD)
    single = xgrammar.Grammar.from_json_schema(json.dumps(schema(parallel=False)))
    assert _is_grammar_accept_string(single, one)
    assert not _is_grammar_accept_string(single, two)
    assert _is_grammar_accept_string(xgrammar.Grammar.from_json_schema(json.dumps(schema())), two)


def test_the_call_list_ends_after_max_tool_calls():
    """A model that keeps repeating a call must close the list at max_tool_calls."""
    grammar = xgrammar.Grammar.from_json_schema(
        tool_constraint(TOOLS, "required", None, max_calls=2).json)
    assert _is_grammar_accept_string(grammar, json.dumps(GOOD, indent=2))
    assert not _is_grammar_accept_string(grammar, json.dumps(GOOD + GOOD[:1]))  # a third call
    assert json.loads(tool_constraint(TOOLS, "required", None).json)["maxItems"] == 4  # default
