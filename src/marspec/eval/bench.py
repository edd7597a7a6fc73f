"""What a side-by-side benchmark run is: its configuration and its plan of decodes.

Every method runs on the same questions, in one process, interleaved. Under sampling (``temperature >
0``) each question is decoded ``samples`` times per method, with seeds derived from (question, sample,
turn) and shared by all methods; a question's score is its mean over samples. Plain decoding may run on
the first ``plain_limit`` questions only: it is needed for the speed baseline, while strict speculative
decoding (plain's equal, token for token when greedy and in distribution when sampling) is the quality
reference.

The rest of the evaluation layer, by job: :mod:`marspec.eval.records` (the records' typed schema),
:mod:`marspec.eval.rundir` (a run's folder), :mod:`marspec.eval.runner` (decoding a task into records),
:mod:`marspec.eval.summary` (metrics and intervals), :mod:`marspec.eval.render` (the summary's
markdown) and :mod:`marspec.eval.harness` (from settings to a summary: what ``marspec bench`` runs).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from marspec.drafters.tree import parse_tree_shape
from marspec.errors import MarspecError
from marspec.eval.method_names import PLAIN

if TYPE_CHECKING:
    from marspec.eval.datasets import Question
    from marspec.eval.methods import Method

# Long enough for answers to finish: GSM8K chain-of-thought needs several hundred tokens.
DEFAULT_MAX_NEW_TOKENS = {"humaneval": 512, "gsm8k": 512, "mtbench": 512}


@dataclass(frozen=True)
class BenchConfig:
    """Everything that must match for two runs' records to be comparable (the question limit need not)."""

    task: str
    methods: tuple[str, ...]
    theta: float
    margin: str
    k: int
    max_new_tokens: int
    target: str
    draft: str
    draft_quant: str
    draft_confidence: float
    lookup: bool
    dtype: str
    threads: int
    tree: str | None = None  # the shape "+tree" methods draft, e.g. "2,2" (None in runs without one)
    prepack: bool = True  # oneDNN-prepacked linear layers (runs before this option had none)
    temperature: float = 0.0  # 0: greedy (runs before sampling was measured were all greedy)
    samples: int = 1  # decodes per question and method (more than 1 only makes sense when sampling)
    plain_limit: int | None = None  # plain runs on the first N questions only (None: on all)
    device: str = "cpu"  # where the models ran (runs before --device existed ran on the CPU)
    # A conversation's later turns keep the cache of its earlier ones (the first turn of every question
    # and method is always scored from scratch, so no method inherits another's prefill).
    prefix_reuse: bool = False
    target_quant: str = "none"  # "int8": the target's linear layers in int8 (runs before it had none)
    graphs: str = "off"  # "on": the fixed-shape path (captured on CUDA); runs before it existed were eager

    def __post_init__(self) -> None:
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise MarspecError(f"--samples must be an integer >= 1, got {self.samples!r}")
        if self.samples > 1 and self.temperature == 0:
            raise MarspecError(
                "--samples > 1 needs --temperature > 0: greedy decoding gives the same output every time"
            )
        if self.plain_limit is not None and self.plain_limit < 1:
            raise MarspecError(f"--plain-limit must be >= 1, got {self.plain_limit}")

    @property
    def tree_shape(self) -> tuple[int, ...] | None:
        return parse_tree_shape(self.tree)


# Fields that may change between invocations on one directory: records are keyed by method, so adding a
# method reuses every record already there, and plain's question limit only decides where it runs.
ADDABLE_FIELDS = ("methods", "plain_limit")


def runs_on(method: str, index: int, config: BenchConfig) -> bool:
    """Whether ``method`` runs on the question at ``index`` (plain may be limited to the first few)."""
    return not (method == PLAIN and config.plain_limit is not None and index >= config.plain_limit)


def planned_runs(questions: Sequence[Question], methods: Sequence[Method], config: BenchConfig) -> int:
    """How many (question, sample, method) decodes the run consists of."""
    return sum(config.samples for i in range(len(questions)) for m in methods if runs_on(m.name, i, config))
