"""Several model versions in one process: manifests, deployments, routes, the canary gate.

Host-side modules (`deployment`, `routing`, `canary`) import no JAX; `manifest`, `memory` and
`fleet` (which loads engines) do. Nothing is imported here, so a host-side import stays light.
"""
