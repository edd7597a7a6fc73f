"""Memory while models are rewritten into another layout: pages given back, results unchanged, and the
peak of loading a real model near one copy of its weights."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import SMALL, tiny_lm

from marspec.backends.memory import release_pages
from marspec.backends.quantize import quantize_int8
from marspec.models import resolve_model_dir


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


PEAK_SCRIPT = """
import re, resource, sys, torch
from marspec.api import load_lm
from marspec.backends.prepack import prepack_linears
from marspec.backends.quantize import quantize_int8
from pathlib import Path

def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1)) * 1024

torch.set_num_threads(1)
folder = Path(sys.argv[1])
for warm in (prepack_linears, quantize_int8):  # load the kernels' code before measuring
    warm(torch.nn.Sequential(torch.nn.Linear(64, 64)))
base = rss()
lm, _ = load_lm(str(folder), torch.float32, prepack=sys.argv[2] == "prepack")
if sys.argv[2] == "int8":
    quantize_int8(lm.model)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print((folder / "model.safetensors").stat().st_size, peak - base)
"""


@pytest.mark.parametrize(("rewrite", "bound"), [("prepack", 1.75), ("int8", 1.2)])
def test_rewriting_a_real_model_peaks_near_one_copy_of_its_weights(rewrite, bound, tmp_path):
    """SmolLM2-135M (540 MB in fp32) loaded, then prepacked or quantised to int8. Measured: the process
    grows by 1.48x the fp32 weights when prepacking (its LM head, tied to the embedding, gets a packed
    copy of its own) and 0.79x when quantising; without giving each weight's pages back once copied,
    2.27x and 1.59x."""
    # A private copy of the checkpoint: the kernel only reclaims pages no other process maps, and this
    # test session's own models may map the cached file.
    folder = shutil.copytree(resolve_model_dir(SMALL), tmp_path / "model")
    done = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(folder), rewrite], capture_output=True, text=True, check=True
    )
    fp32_bytes, growth = map(int, done.stdout.split())
    assert growth < bound * fp32_bytes, (fp32_bytes, growth)
