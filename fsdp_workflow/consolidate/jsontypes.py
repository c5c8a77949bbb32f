"""The JSON value types of the files the consolidator reads and writes (config.json, verification.json).

Kept apart from both so that the readers (:mod:`.hf_assets`, :mod:`.source`) and the report's
schema (:mod:`.verify.report_schema`) name one definition without importing each other.
"""

from __future__ import annotations

from typing import Dict, List, Union

# A value json.loads can return: config.json and verification.json are made of these.
JsonValue = Union[None, bool, int, float, str, List["JsonValue"], Dict[str, "JsonValue"]]
JsonObject = Dict[str, JsonValue]
PlainValue = Union[bool, int, float, str]
