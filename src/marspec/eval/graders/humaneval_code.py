"""HumanEval: turning a chat reply into the program to run."""

from __future__ import annotations

import ast
import re
import textwrap

from marspec.errors import MarspecError

# An opening fence with an optional language tag, then everything up to a closing fence at the start or
# the end of a line ("return x```"), or to the end of the text (a reply cut off by the token limit).
_FENCE_RE = re.compile(r"^[ \t]*```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:^[ \t]*```|```[ \t]*$|\Z)", re.S | re.M)
_PYTHON_TAGS = {"", "python", "py", "python3", "py3"}
_CODE_START_RE = re.compile(r"^(?:import |from |def |class |@|async def )", re.M)
_FUTURE_RE = re.compile(r"^from __future__ import [^\n]*\n?", re.M)


def _def_re(entry_point: str) -> re.Pattern[str]:
    return re.compile(r"^(?:async[ \t]+)?def[ \t]+" + re.escape(entry_point) + r"[ \t]*\(", re.M)


def _parses(code: str) -> bool:
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True


def extract_code(completion_text: str, prompt: str, entry_point: str) -> str:
    """The program to run for a model's reply to a HumanEval prompt: it defines ``entry_point``.

    The code is the first ```python block that defines ``entry_point`` (else the first Python block,
    else the whole reply; an unterminated block runs to the end). If it defines the function, the
    prompt's text before its ``def`` (imports and helpers the tests may use) is put in front of it; if
    it is only a body, it is indented under the prompt's signature and docstring.
    """
    check_entry_point(entry_point)
    blocks = [(tag.lower(), body) for tag, body in _FENCE_RE.findall(completion_text)]
    python_blocks = [body for tag, body in blocks if tag in _PYTHON_TAGS]
    defines = _def_re(entry_point)
    defining = [b for b in python_blocks if defines.search(textwrap.dedent(b))]
    if defining:
        code = defining[0]
    elif python_blocks:
        code = python_blocks[0]
    elif blocks:
        code = blocks[0][1]
    else:
        code = completion_text
        start = _CODE_START_RE.search(code)
        if start and start.start() > 0 and not _parses(textwrap.dedent(code)):
            code = code[start.start() :]  # drop prose before the code
    code = textwrap.dedent(code).strip("\n")

    if defines.search(code):
        futures = "".join(line if line.endswith("\n") else line + "\n" for line in _FUTURE_RE.findall(code))
        code = _FUTURE_RE.sub("", code)
        in_prompt = defines.search(prompt)
        preamble = prompt[: in_prompt.start()] if in_prompt else ""
        return futures + preamble + code + "\n"
    # Only the body: put it under the prompt's signature and docstring.
    body = textwrap.indent(code, "    ") if code else "    pass"
    head = prompt if prompt.endswith("\n") else prompt + "\n"
    return head + body + "\n"


def check_entry_point(entry_point: str) -> None:
    if not isinstance(entry_point, str) or not entry_point.isidentifier():
        raise MarspecError(f"entry_point must be a Python function name, got {entry_point!r}")
