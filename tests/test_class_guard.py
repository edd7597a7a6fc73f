"""Token classes (marspec.token_classes) and the "class" guard on MARS and the rivals: classes of real
tokens, the per-tokenizer table, every branch of the guard on hand-made logits, and its refusals."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from marspec.decode import DecodeConfig
from marspec.defaults import GUARD_CLASSES
from marspec.drafters import Draft
from marspec.drafters.tree import build_tree
from marspec.errors import MarspecError
from marspec.models import resolve_model_dir
from marspec.rules import GUARDS, Rule
from marspec.token_classes import CLASSES, check_classes, class_table, relaxable_table, token_class
from marspec.verify import verify_greedy, verify_sampling, verify_tree_greedy

SMALL = "smollm2-135m-instruct"

# Row 0 is a close call between tokens 0 and 1 (p1/p0 = 0.9); token 3 is the bonus row's top-1.
CLOSE = [5.0, 4.9, 1.0, 0.0]
BONUS = [0.0, 1.0, 2.0, 9.0]
MARS = Rule("mars", 0.5, "prob_ratio")
GUARDED = Rule("mars", 0.5, "prob_ratio", guard="class")


def rows(*r: list[float]) -> torch.Tensor:
    return torch.tensor(r, dtype=torch.float32)


def tok(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


def table(*allowed: int) -> torch.Tensor:
    out = torch.zeros(4, dtype=torch.bool)
    out[list(allowed)] = True
    return out


@pytest.mark.parametrize(
    ("piece", "cls"),
    [
        ("\n", "whitespace"),
        ("    ", "whitespace"),
        ("42", "number"),
        (" 3.5", "number"),
        (" if", "keyword"),
        ("while", "keyword"),
        (" return", "keyword"),
        ("my_var", "identifier"),
        ("isSorted", "identifier"),
        ("x1", "identifier"),
        (" the", "word"),
        (" result", "word"),  # a code name the text alone cannot tell from a prose word
        (")", "bracket"),
        ("):", "bracket"),
        (" [", "bracket"),
        (" <=", "operator"),
        (" *", "operator"),
        ("+=", "operator"),
        (",", "punctuation"),
        (":", "punctuation"),
        ('"', "punctuation"),
    ],
)
def test_token_class(piece: str, cls: str) -> None:
    assert token_class(piece) == cls


def test_the_guard_classes_are_known_and_checked() -> None:
    assert set(GUARD_CLASSES) <= set(CLASSES)
    assert "class" in GUARDS
    assert check_classes(["number"]) == frozenset({"number"})
    with pytest.raises(MarspecError, match="unknown token class"):
        check_classes(["numbers"])
    with pytest.raises(MarspecError, match="no token class"):
        check_classes([])


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_dir(SMALL), local_files_only=True)


def test_the_table_classes_every_token_once_per_tokenizer(tokenizer) -> None:
    vocab = len(tokenizer) + 3  # an LM head padded past the tokenizer's vocabulary
    classes = class_table(tokenizer, vocab)
    assert classes.shape == (vocab,) and classes is class_table(tokenizer, vocab)  # computed once
    for text in (" if", " <=", "):", " the", "7"):
        (token,) = tokenizer.encode(text, add_special_tokens=False)
        assert CLASSES[int(classes[token])] == token_class(text), text
    assert (classes[len(tokenizer) :] == CLASSES.index("whitespace")).all()  # padded ids: no text
    relaxable = relaxable_table(tokenizer, vocab, ["operator"])
    (le,) = tokenizer.encode(" <=", add_special_tokens=False)
    (kw,) = tokenizer.encode(" if", add_special_tokens=False)
    assert relaxable.dtype == torch.bool and bool(relaxable[le]) and not bool(relaxable[kw])


def test_the_guard_lets_a_relaxed_accept_through_when_both_tokens_are_of_its_classes() -> None:
    out = verify_greedy(rows(CLOSE, BONUS), tok(1), GUARDED, relaxable=table(0, 1))
    assert (out.n_accepted, out.n_relaxed, out.next_token) == (1, 1, 3)


@pytest.mark.parametrize("allowed", [(0,), (1,), ()])
def test_the_guard_refuses_when_the_draft_or_the_replaced_top1_is_not(allowed: tuple[int, ...]) -> None:
    out = verify_greedy(rows(CLOSE, BONUS), tok(1), GUARDED, relaxable=table(*allowed))
    assert (out.n_accepted, out.next_token) == (0, 0)  # strict's correction
    assert verify_greedy(rows(CLOSE, BONUS), tok(1), MARS).n_relaxed == 1  # unguarded, it relaxes


def test_the_guard_leaves_exact_matches_alone() -> None:
    out = verify_greedy(rows(CLOSE, BONUS), tok(0), GUARDED, relaxable=table())
    assert (out.n_accepted, out.n_relaxed) == (1, 0)


def test_the_guard_applies_to_the_rivals_and_fly() -> None:
    topk = Rule("topk", 3, guard="class")
    assert verify_greedy(rows(CLOSE, BONUS), tok(2), topk, relaxable=table(0, 2)).n_relaxed == 1
    assert verify_greedy(rows(CLOSE, BONUS), tok(2), topk, relaxable=table(0, 1)).n_accepted == 0
    fly = Rule("fly", 0.0, guard="class", window=1)
    block = rows(CLOSE, [0.0, 0.0, 9.0, 0.0], BONUS), tok(1, 2)
    assert verify_greedy(*block, fly, relaxable=table(0, 1)).n_relaxed == 1
    assert verify_greedy(*block, fly, relaxable=table(0)).n_accepted == 0


def test_the_guard_under_sampling() -> None:
    q = torch.tensor([[0.0, 1.0, 0.0, 0.0]])  # draft token 1 sampled for sure; p(1) = 0.47
    for seed in range(30):
        gen = torch.Generator().manual_seed(seed)
        out = verify_sampling(rows(CLOSE, BONUS), tok(1), q, GUARDED, 1.0, gen, relaxable=table(0, 1))
        assert (out.n_accepted, out.n_relaxed) == (1, 1)  # the close call, no draw
    drawn = [
        verify_sampling(
            rows(CLOSE, BONUS), tok(1), q, GUARDED, 1.0, torch.Generator().manual_seed(s), relaxable=table(0)
        )
        for s in range(60)
    ]
    assert all(o.n_relaxed == 0 for o in drawn)
    assert 0 < sum(o.n_accepted for o in drawn) < 60  # the lossless draw decided instead


def test_the_guard_applies_per_node_on_trees() -> None:
    # The chain drafts 2 (rejected: third choice); the sibling 1 is the close call's runner-up.
    tree = build_tree(Draft(tokens=tok(2), alternatives=tok(1)[None]), (2,))
    logits = torch.stack([rows(CLOSE)[0], *[rows(BONUS)[0]] * len(tree)])
    assert verify_tree_greedy(logits, tree, GUARDED, relaxable=table(0, 1)).n_relaxed == 1
    assert verify_tree_greedy(logits, tree, GUARDED, relaxable=table(0, 2)).n_accepted == 0
    DecodeConfig(
        rule=GUARDED, k=4, max_new_tokens=8, tree=(2, 2)
    )  # the class guard, unlike "next", takes trees


def test_the_guard_needs_its_table() -> None:
    with pytest.raises(MarspecError, match="'class' guard needs the tokenizer's class table"):
        verify_greedy(rows(CLOSE, BONUS), tok(1), GUARDED)
