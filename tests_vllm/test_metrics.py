"""The plugin's stat logger as vLLM loads it, without an engine: registered through vLLM's entry point
group, inert without the plugin, and exporting the workers' counter files in Prometheus' text format."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("vllm")

from prometheus_client import REGISTRY, generate_latest
from vllm.engine.arg_utils import EngineArgs
from vllm.v1.metrics.loggers import load_stat_logger_plugin_factories

from marspec.integrations.vllm import stat_logger
from marspec.integrations.vllm.metrics import METRICS_DIR_VARIABLE, CounterFile
from marspec.integrations.vllm.stat_logger import MarspecStatLogger

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}


def test_vllm_loads_the_stat_logger_from_the_entry_point() -> None:
    assert MarspecStatLogger in load_stat_logger_plugin_factories()


def test_the_counters_reach_prometheus_per_rule(
    target_dir: str, tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(METRICS_DIR_VARIABLE, str(tmp_path))
    without = EngineArgs(model=target_dir, speculative_config=NGRAM).create_engine_config()
    MarspecStatLogger(without, engine_index=0)
    assert stat_logger._registered is None, "a deployment without the plugin registered metrics"

    config = EngineArgs(
        model=target_dir, speculative_config=NGRAM, additional_config={"marspec": {}}
    ).create_engine_config()
    MarspecStatLogger(config, engine_index=1)  # vLLM builds one per engine: only engine 0's exports
    assert stat_logger._registered is None
    logger = MarspecStatLogger(config, engine_index=0)
    try:
        CounterFile(tmp_path).write(  # type: ignore[arg-type]
            {
                "mars": {
                    "steps": 5,
                    "drafted": 20,
                    "accepted_exact": 9,
                    "accepted_relaxed": 3,
                    "rejected": 4,
                },
                "strict": {
                    "steps": 2,
                    "drafted": 8,
                    "accepted_exact": 5,
                    "accepted_relaxed": 0,
                    "rejected": 1,
                },
            }
        )
        logger.record(None, None)
        text = generate_latest(REGISTRY).decode()
        assert 'marspec:draft_tokens_total{rule="mars"} 20.0' in text
        assert 'marspec:accepted_relaxed_tokens_total{rule="mars"} 3.0' in text
        assert 'marspec:accepted_exact_tokens_total{rule="strict"} 5.0' in text
        assert 'marspec:rejected_blocks_total{rule="strict"} 1.0' in text
        assert 'marspec:verification_blocks_total{rule="mars"} 5.0' in text
        assert re.search(r"^# TYPE marspec:draft_tokens(_total)? counter$", text, re.MULTILINE)
    finally:
        assert stat_logger._registered is not None
        REGISTRY.unregister(stat_logger._registered)
        stat_logger._registered = None
