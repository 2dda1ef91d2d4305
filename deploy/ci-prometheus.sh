#!/usr/bin/env bash
# CI snippet (paste into .ci/run after `apt-get update`, before `make test`): installs
# Debian's Prometheus so tests/test_prometheus.py runs the real `prometheus` and `promtool`
# (without them those tests skip). Needs root. The package's service is not started in a
# container without systemd, and the test uses its own OS-chosen port anyway.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
    apt-get install -y -qq --no-install-recommends prometheus
fi
prometheus --version | head -n 1
promtool check config deploy/prometheus/prometheus.yml
promtool check rules deploy/prometheus/alerts.yml
(cd deploy/prometheus && promtool test rules alerts_test.yml)
