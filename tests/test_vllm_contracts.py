"""The places the vLLM plugin hooks, checked in the published source of every release it declares.

``tests/vllm_contracts.json`` holds, per release, short excerpts (signatures, assignments, imports, call
sites) that ``python -m marspec.integrations.vllm.contracts`` read with ``ast`` out of the release's wheel
from PyPI; this test parses them again and checks them against the plugin's contracts, without vLLM.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from marspec.integrations.vllm.contracts import CONTRACT_POINTS, KNOWN_REJECTION_METHODS, extract, problems
from marspec.integrations.vllm.versions import (
    REFUSED_REJECTION_METHODS,
    SIGNATURE_CHECKED_VLLM_VERSIONS,
    SUPPORTED_VLLM_VERSIONS,
)

RECORDS = json.loads((Path(__file__).parent / "vllm_contracts.json").read_text())
V1 = "vllm/v1/sample/rejection_sampler.py"
V2 = "vllm/v1/worker/gpu/spec_decode/rejection_sampler_utils.py"


def versions(records: dict[str, dict]) -> set[str]:
    return {requirement.split("==")[1] for requirement in records}


def test_every_declared_release_has_its_source_checked() -> None:
    assert versions(RECORDS) >= {*SUPPORTED_VLLM_VERSIONS, *SIGNATURE_CHECKED_VLLM_VERSIONS}
    assert not set(SUPPORTED_VLLM_VERSIONS) & set(SIGNATURE_CHECKED_VLLM_VERSIONS)


@pytest.mark.parametrize("requirement", sorted(RECORDS))
def test_each_release_keeps_every_contract_the_plugin_relies_on(requirement: str) -> None:
    record = RECORDS[requirement]
    assert record["wheel"].endswith(".whl") and len(record["sha256"]) == 64
    assert problems(record["files"]) == []


def test_vllm_033_adds_fly_and_the_plugin_refuses_it_by_name() -> None:
    methods = RECORDS["vllm==0.33.0"]["files"]["vllm/config/speculative.py"]["RejectionSampleMethod"]
    assert "'fly'" in methods
    assert "fly" in REFUSED_REJECTION_METHODS and "fly" in KNOWN_REJECTION_METHODS
    # 0.33's verifiers take FLy and block verification as trailing keywords, after the plugin's.
    assert "fly_window_size" in RECORDS["vllm==0.33.0"]["files"][V2]["rejection_sample"]
    assert "use_block_verification" in RECORDS["vllm==0.33.0"]["files"][V2]["rejection_sample"]


def planted(change: str) -> dict[str, dict[str, str]]:
    files = copy.deepcopy(RECORDS["vllm==0.33.0"]["files"])
    if change == "probabilities":
        files[V1]["rejection_sample"] = files[V1]["rejection_sample"].replace("target_logits", "target_probs")
    elif change == "reordered":
        files[V2]["rejection_sample"] = files[V2]["rejection_sample"].replace(
            "draft_logits: torch.Tensor | None, draft_sampled", "draft_sampled: torch.Tensor, draft_logits"
        )
    elif change == "new method":
        path = "vllm/config/speculative.py"
        files[path]["RejectionSampleMethod"] = "RejectionSampleMethod = Literal['standard', 'tree']"
    elif change == "renamed hook":
        path = "vllm/v1/worker/gpu/sample/states.py"
        files[path]["SamplingStates.add_request"] = (
            "def add_request(self, slot: int, params) -> None:\n    ..."
        )
    elif change == "missing":
        del files[V2]["rejection_sample"]
    return files


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ("probabilities", "V1 verifier"),
        ("reordered", "V2 verifier"),
        ("new method", "'tree'"),
        ("renamed hook", "SamplingStates.add_request"),
        ("missing", "rejection_sample is missing"),
    ],
)
def test_a_release_that_moved_a_contract_is_reported_in_one_line(change: str, named: str) -> None:
    found = problems(planted(change))
    assert len(found) == 1 and named in found[0] and "\n" not in found[0]


def test_extract_reads_signatures_assignments_imports_and_call_sites() -> None:
    source = """
from vllm.v1.worker.gpu.spec_decode.verify import rejection_sample
GREEDY_TEMPERATURE: int = 0

def rejection_sample(a, b, *, c=1):
    return a + b

class RejectionSampler:
    def forward(self, x):
        y = rejection_sample(x, 2, c=3)
        return y
"""
    names = (
        "rejection_sample",
        "GREEDY_TEMPERATURE",
        "RejectionSampler.forward>rejection_sample",
        "import rejection_sample",
        "absent",
    )
    excerpts = extract(source, names)
    assert excerpts == {
        "rejection_sample": "def rejection_sample(a, b, *, c=1):\n    ...",
        "GREEDY_TEMPERATURE": "GREEDY_TEMPERATURE: int = 0",
        "RejectionSampler.forward>rejection_sample": "rejection_sample(x, 2, c=3)",
        "import rejection_sample": "from vllm.v1.worker.gpu.spec_decode.verify import rejection_sample",
    }


def test_every_contract_point_is_recorded_for_every_release() -> None:
    for requirement, record in RECORDS.items():
        for path, names in CONTRACT_POINTS.items():
            assert set(record["files"][path]) == set(names), (requirement, path)
