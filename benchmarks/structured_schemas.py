"""JSON schemas of varied shape, with a question each: the structured-output tests and benchmarks/structured_overhead.py use them."""
from __future__ import annotations

SCHEMAS: list[tuple[str, dict]] = [
    ("Describe a person.", {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                                            "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                            "required": ["name", "age"]}),
    ("Is the sky blue?", {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}),
    ("Pick a color.", {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                       "required": ["color"]}),
    ("List three fruits.", {"type": "object", "properties": {"fruits": {
        "type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 3, "maxItems": 3}},
        "required": ["fruits"]}),
    ("Give a temperature in Celsius.", {"type": "object", "properties": {
        "celsius": {"type": "number", "minimum": -50, "maximum": 60}}, "required": ["celsius"]}),
    ("Describe a city.", {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "location": {"type": "object", "properties": {"country": {"type": "string", "maxLength": 20},
                                                      "population": {"type": "integer", "minimum": 0}},
                     "required": ["country", "population"]}}, "required": ["city", "location"]}),
    ("Give a US zip code.", {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                             "required": ["zip"]}),
    ("Give a date.", {"type": "object", "properties": {
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}, "required": ["date"]}),
    ("Name two numbers.", {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9},
                           "minItems": 2, "maxItems": 2}),
    ("Rate this movie.", {"type": "object", "properties": {
        "stars": {"type": "integer", "enum": [1, 2, 3, 4, 5]}, "review": {"type": "string", "pattern": "^[A-Za-z ,.]{1,40}$"}},
        "required": ["stars", "review"]}),
    ("Describe a book.", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 30}, "pages": {"type": "integer", "minimum": 1, "maximum": 2000},
        "genre": {"enum": ["fiction", "history", "science"]}}, "required": ["title", "pages", "genre"]}),
    ("Give me a point.", {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                          "required": ["x", "y"], "additionalProperties": False}),
    ("List up to two tags.", {"type": "object", "properties": {"tags": {
        "type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 2}}, "required": ["tags"]}),
    ("A yes or no answer.", {"type": "string", "enum": ["yes", "no"]}),
    ("A small integer.", {"type": "integer", "minimum": 0, "maximum": 10}),
    ("Describe a team.", {"type": "object", "properties": {"members": {
        "type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object", "properties": {"name": {"type": "string", "maxLength": 15},
                                             "role": {"enum": ["lead", "dev"]}},
            "required": ["name", "role"]}}}, "required": ["members"]}),
    ("Give a product.", {"type": "object", "properties": {
        "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "price": {"type": "number", "minimum": 0,
                                                                        "maximum": 1000},
        "in_stock": {"type": "boolean"}}, "required": ["sku", "price", "in_stock"]}),
    ("Optional fields.", {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string",
                                                                                         "maxLength": 10}},
                          "required": ["a"]}),
    ("A null or a number.", {"type": "object", "properties": {"value": {"type": ["number", "null"]}},
                             "required": ["value"]}),
    ("Give a matrix.", {"type": "object", "properties": {"rows": {
        "type": "array", "minItems": 2, "maxItems": 2,
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                  "minItems": 2, "maxItems": 2}}}, "required": ["rows"]}),
    ("Give an email.", {"type": "object", "properties": {
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}, "required": ["email"]}),
    ("Describe the weather.", {"type": "object", "properties": {
        "condition": {"enum": ["sunny", "rainy", "cloudy"]},
        "wind": {"type": "object", "properties": {"speed": {"type": "integer", "minimum": 0, "maximum": 200},
                                                  "direction": {"enum": ["N", "E", "S", "W"]}},
                 "required": ["speed", "direction"]}}, "required": ["condition", "wind"]}),
    ("A constant.", {"type": "object", "properties": {"kind": {"const": "fixed"}, "n": {"type": "integer",
                                                                                      "minimum": 10,
                                                                                      "maximum": 20}},
                     "required": ["kind", "n"]}),
    ("A one-of.", {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0,
                                                                      "maximum": 99},
                                                                     {"type": "string", "maxLength": 5}]}},
                   "required": ["id"]}),
]
