"""The OpenAI protocol: request bodies in (prompt token ids and SamplingParams, or a 4xx), replies out (whole or SSE),
and what a reply is parsed into (tool calls, reasoning). No server state: the routes are in handlers/server/."""
