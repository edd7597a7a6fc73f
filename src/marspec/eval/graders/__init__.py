"""Graders: GSM8K answer matching, HumanEval execution in a sandbox process, MT-Bench text agreement.

- :mod:`~marspec.eval.graders.gsm8k`: the final number of a worked answer;
- :mod:`~marspec.eval.graders.agreement`: chrF and exact match against plain decoding (MT-Bench);
- :mod:`~marspec.eval.graders.humaneval_code`: a chat reply -> the program to run;
- :mod:`~marspec.eval.graders.sandbox`: running it, isolated, against the tests.
"""

from marspec.eval.graders.agreement import chrf, exact_match
from marspec.eval.graders.gsm8k import extract_gsm8k_answer, grade_gsm8k, normalize_number
from marspec.eval.graders.humaneval_code import extract_code
from marspec.eval.graders.sandbox import HumanEvalOutcome, run_humaneval, sandbox_report

__all__ = [
    "HumanEvalOutcome",
    "chrf",
    "exact_match",
    "extract_code",
    "extract_gsm8k_answer",
    "grade_gsm8k",
    "normalize_number",
    "run_humaneval",
    "sandbox_report",
]
