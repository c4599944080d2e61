"""The HTTP server: the Starlette app and its routes, the cold start (state, timeline), the engine service, metrics,
and the limits and middleware around every request."""
