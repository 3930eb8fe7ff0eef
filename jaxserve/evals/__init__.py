"""`jaxserve eval`: suites of lm-evaluation-harness tasks run against model versions, every run and
its per-question correctness in a results store, a paired regression test between versions, alerts,
and a static HTML dashboard. Host side: no JAX; lm-eval is imported only where a suite runs."""
