"""Memory while models are rewritten into another layout: pages given back, results unchanged. (The peak
of loading the real pair is measured by command, with GNU time: docs/results.md, "The demo, memory and
bf16 exactness".)"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_lm

from marspec.backends.memory import release_pages
from marspec.backends.quantize import quantize_int8


def rss_file_bytes() -> int:
    return int(re.search(r"RssFile:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024


@pytest.mark.skipif(sys.platform != "linux", reason="madvise page-out is Linux only")
def test_released_pages_of_a_mapped_file_leave_memory_and_keep_their_values(tmp_path):
    data = np.random.default_rng(0).standard_normal(16 << 20).astype(np.float32)  # 64 MiB
    data.tofile(tmp_path / "w.bin")
    mapped = torch.from_file(str(tmp_path / "w.bin"), shared=False, size=data.size, dtype=torch.float32)
    before = rss_file_bytes()
    total = float(mapped.sum())  # touches every page
    assert rss_file_bytes() - before > 48 << 20
    release_pages(mapped)
    assert rss_file_bytes() - before < 16 << 20
    assert float(mapped.sum()) == total  # read back from the file: nothing lost


def test_int8_quantisation_layer_by_layer_equals_torchs_whole_model_pass():
    ours, reference = tiny_lm(3).model, tiny_lm(3).model
    quantize_int8(ours)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.ao.quantization.quantize_dynamic(
            reference,
            {torch.nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig},
            dtype=torch.qint8,
            inplace=True,
        )
    ids = torch.tensor([[5, 17, 42, 8, 63]])
    assert [type(m).__name__ for m in ours.modules()] == [type(m).__name__ for m in reference.modules()]
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, reference(ids).logits)
