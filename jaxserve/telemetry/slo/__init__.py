"""SLOs over the server's SLIs (telemetry/sli.py): the SLO file (spec.py), the Prometheus
recording and multi-window, multi-burn-rate alerting rules it becomes (rules.py), and a Grafana
dashboard of them (dashboard.py); `jaxserve slo rules | dashboard` (cli.py)."""
