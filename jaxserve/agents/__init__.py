"""Agents on the server: stored responses and their runs (store), the run as a recorded state
machine (run), the server's background runs (background) and the server-side tools (tools,
file_search). Host side: no JAX; the request path above drives the model turns."""
