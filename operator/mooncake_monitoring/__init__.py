"""Monitoring kit: the chart's ServiceMonitor/PodMonitor as a plain Prometheus scrape config,
a local Prometheus for drills and tests, the alert rules' time compression, and the Grafana
dashboard's panels evaluated and rendered to PNG (``mooncake-operator monitoring``)."""
