"""The functions the tool-call serving tests offer, and the question that should make a model call one."""

from __future__ import annotations

from typing import Any

WEATHER: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Rome", "Lima"]},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME: Any = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 5}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
MESSAGES: Any = [{"role": "user", "content": "What is the weather in Oslo?"}]
