"""Ten JSON schemas of the shapes agents send (nested objects, enums, bounded arrays,
integer ranges, patterns, additionalProperties: false): issue 19's acceptance set,
used by tests/server/test_structured_outputs.py and bench/structured_overhead.py."""
from __future__ import annotations

_CLOSED = {"additionalProperties": False}

SCHEMAS: list[dict] = [
    {"type": "object", **_CLOSED, "required": ["city", "rank"],
     "properties": {"city": {"type": "string", "maxLength": 16},
                    "rank": {"type": "integer", "minimum": 1, "maximum": 10}}},
    {"type": "object", **_CLOSED, "required": ["tags"],
     "properties": {"tags": {"type": "array", "minItems": 1, "maxItems": 3,
                             "items": {"enum": ["a", "b", "c"]}}}},
    {"type": "object", **_CLOSED, "required": ["code", "owner"],
     "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                    "owner": {"type": "object", **_CLOSED, "required": ["ok"],
                              "properties": {"ok": {"type": "boolean"}}}}},
    {"type": "object", **_CLOSED, "required": ["name", "age", "email"],
     "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 20},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}}},
    {"type": "object", **_CLOSED, "required": ["status"],
     "properties": {"status": {"enum": ["open", "closed", "pending"]},
                    "priority": {"type": "integer", "minimum": 1, "maximum": 5}}},
    {"type": "object", **_CLOSED, "required": ["point"],
     "properties": {"point": {"type": "object", **_CLOSED, "required": ["x", "y"],
                              "properties": {"x": {"type": "number"},
                                             "y": {"type": "number"}}}}},
    {"type": "object", **_CLOSED, "required": ["items"],
     "properties": {"items": {"type": "array", "minItems": 2, "maxItems": 4, "items": {
         "type": "object", **_CLOSED, "required": ["sku", "qty"],
         "properties": {"sku": {"type": "string", "pattern": "^[0-9]{4}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 99}}}}}},
    {"type": "object", **_CLOSED, "required": ["answer", "confidence"],
     "properties": {"answer": {"type": "boolean"},
                    "confidence": {"type": "number", "minimum": 0, "maximum": 1}}},
    {"type": "object", **_CLOSED, "required": ["date"],
     "properties": {"date": {"type": "string",
                             "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])$"},
                    "note": {"type": ["string", "null"], "maxLength": 30}}},
    {"type": "object", **_CLOSED, "required": ["matrix"],
     "properties": {"matrix": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
         "type": "array", "minItems": 2, "maxItems": 2,
         "items": {"type": "integer", "minimum": -9, "maximum": 9}}}}},
]
