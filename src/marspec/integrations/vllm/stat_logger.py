"""The plugin's counters as Prometheus metrics of ``vllm serve`` (see :mod:`.metrics`).

Loaded by vLLM only, through the entry point group ``vllm.stat_logger_plugins`` (it subclasses vLLM's
``StatLoggerBase``, so it imports vLLM and prometheus_client at the top). vLLM builds one per engine in
its API server process; the one for engine 0 of a deployment with the plugin registers a collector
that reads the workers' counter files when Prometheus scrapes ``/metrics``. Deployments without
``additional_config["marspec"]`` get an inert logger.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from vllm.v1.metrics.loggers import StatLoggerBase

from marspec.integrations.vllm.config import parse_plugin_config
from marspec.integrations.vllm.metrics import PROMETHEUS_COUNTERS, prepare_metrics_dir, read_counter_files


class CounterCollector(Collector):
    """Prometheus counters labelled by rule, read from the workers' files at each scrape."""

    def __init__(self, directory: Any) -> None:
        self.directory = directory

    def collect(self) -> Iterator[CounterMetricFamily]:
        totals = read_counter_files(self.directory)
        for metric, counter, documentation in PROMETHEUS_COUNTERS:
            family = CounterMetricFamily(metric, documentation, labels=["rule"])
            for rule, counts in sorted(totals.items()):
                family.add_metric([rule], counts[counter])
            yield family


_registered: CounterCollector | None = None  # this process's collector (one registry, one collector)


class MarspecStatLogger(StatLoggerBase):
    """vLLM's stat logger interface; the work is done by the collector it registers."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        global _registered
        if engine_index != 0 or parse_plugin_config(vllm_config.additional_config) is None:
            return
        if _registered is not None:  # an engine restarted in this process: its files replace the old
            REGISTRY.unregister(_registered)
        _registered = CounterCollector(prepare_metrics_dir())
        REGISTRY.register(_registered)

    def record(
        self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None, engine_idx: int = 0
    ) -> None:
        """Nothing per step: the collector reads the totals when scraped."""

    def log_engine_initialized(self) -> None:
        """Nothing to log."""
