"""Token-tree drafting: the path rule on hand-made trees, the tree forward and cache compaction on a tiny
model, and the decode loop's invariants with trees (real weights: test_real.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_VOCAB, tiny_lm
from test_decode import reference_greedy, run

from marspec.api import GenerationOptions
from marspec.drafters import Draft, ModelDrafter
from marspec.drafters.tree import build_tree, chain_tree, parse_tree_shape
from marspec.errors import MarspecError
from marspec.interfaces import DraftTree
from marspec.rules import Rule
from marspec.verify.greedy import verify_greedy
from marspec.verify.tree import verify_tree_greedy

V = 8
STRICT = Rule("strict")
MARS = Rule("mars", theta=0.9, margin="logit_ratio")


def row(top1: int, z1: float, top2: int, z2: float) -> list[float]:
    """Logits over V tokens with the given top two; every other token far below."""
    out = [min(z1, z2) - 5.0] * V
    out[top1], out[top2] = z1, z2
    return out


# Root (node 0) has the chain child 1 (token 3) and the sibling 3 (token 4); node 1 has the chain child 2
# (token 5). Rows: 0 scores the children of the root, 1 those of node 1, 2 and 3 are leaves' (bonus) rows.
TREE = DraftTree(tokens=torch.tensor([3, 5, 4]), parents=[0, 1, 0], depths=[1, 2, 1], chain_len=2)
BONUS_2, BONUS_3 = row(6, 9.0, 7, 1.0), row(7, 9.0, 6, 1.0)


def verify(rows: list[list[float]], rule: Rule, tree: DraftTree = TREE):
    return verify_tree_greedy(torch.tensor(rows), tree, rule)


@pytest.mark.parametrize("rule", [STRICT, MARS, Rule("topk", 2)])
def test_a_tree_is_read_back_in_one_copy(rule):
    from test_verify import OnDevice

    logits = torch.tensor([row(3, 10.0, 4, 9.9), row(5, 10.0, 1, 2.0), BONUS_2, BONUS_3]).as_subclass(
        OnDevice
    )
    tree = DraftTree(
        tokens=TREE.tokens.as_subclass(OnDevice), parents=TREE.parents, depths=TREE.depths, chain_len=2
    )
    OnDevice.reads.clear()
    v = verify_tree_greedy(logits, tree, rule)
    v.relaxed.tolist(), v.margins.tolist(), v.top1.tolist()
    assert OnDevice.reads == ["cpu"]
    assert v.emitted() == [3, 5, 6]


@pytest.mark.parametrize("rule", [STRICT, MARS])
def test_whole_chain_accepted_gives_the_bonus_of_its_leaf(rule):
    v = verify([row(3, 10.0, 4, 2.0), row(5, 10.0, 1, 2.0), BONUS_2, BONUS_3], rule)
    assert v.path == (1, 2) and v.tokens == (3, 5) and v.next_token == 6
    assert v.chain_prefix == 2 and v.n_relaxed == 0
    assert v.emitted() == [3, 5, 6]
    assert v.margins.shape == (2,)  # rows 0 and 1 were judged; the leaf's row is the bonus


@pytest.mark.parametrize("rule", [STRICT, MARS])
def test_rejected_chain_token_falls_back_to_a_sibling_that_is_top1(rule):
    v = verify([row(4, 10.0, 1, 2.0), row(5, 10.0, 1, 2.0), BONUS_2, BONUS_3], rule)
    assert v.path == (3,) and v.tokens == (4,) and v.next_token == 7  # bonus after the sibling
    assert v.chain_prefix == 0


def test_close_call_first_accepted_child_wins_under_mars_strict_takes_top1():
    # Root row: top-1 is the sibling's token 4, top-2 the chain's token 3, ratio 9.5 / 10 > 0.9.
    rows = [row(4, 10.0, 3, 9.5), row(5, 10.0, 1, 2.0), BONUS_2, BONUS_3]
    mars = verify(rows, MARS)
    assert mars.path == (1, 2) and mars.relaxed.tolist() == [True, False] and mars.next_token == 6
    strict = verify(rows, STRICT)
    assert strict.path == (3,) and strict.n_relaxed == 0 and strict.next_token == 7


def test_runner_up_outside_a_close_call_is_rejected_by_mars_too():
    rows = [row(4, 10.0, 3, 5.0), row(5, 10.0, 1, 2.0), BONUS_2, BONUS_3]
    assert verify(rows, MARS).path == (3,)


def test_no_child_accepted_ends_at_the_root_with_the_correction():
    v = verify([row(2, 10.0, 1, 9.8), BONUS_2, BONUS_2, BONUS_3], MARS)  # top two are neither 3 nor 4
    assert v.path == () and v.next_token == 2 and v.emitted() == [2]
    assert v.margins.shape == (1,)


def test_rejection_deeper_down_corrects_at_that_node():
    v = verify([row(3, 10.0, 4, 2.0), row(6, 10.0, 1, 2.0), BONUS_2, BONUS_3], MARS)
    assert v.path == (1,) and v.next_token == 6 and v.chain_prefix == 1
    assert v.margins.shape == (2,)  # root and node 1 were judged


def test_relaxed_accept_deeper_down_along_the_chain():
    v = verify([row(3, 10.0, 4, 2.0), row(1, 10.0, 5, 9.2), BONUS_2, BONUS_3], MARS)
    assert v.path == (1, 2) and v.relaxed.tolist() == [False, True]
    assert verify([row(3, 10.0, 4, 2.0), row(1, 10.0, 5, 9.2), BONUS_2, BONUS_3], STRICT).path == (1,)


def test_logit_ratio_never_relaxes_at_a_non_positive_top_logit():
    v = verify([row(4, -1.0, 3, -1.05), BONUS_2, BONUS_2, BONUS_3], MARS)
    assert v.path == (3,)  # the exact sibling, not the "close" chain token


@pytest.mark.parametrize("rule", [STRICT, MARS, Rule("mars", theta=0.0, margin="prob_ratio")])
def test_a_chain_tree_verifies_exactly_like_a_chain(rule):
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        k = int(torch.randint(1, 6, (), generator=gen))
        logits = torch.randn(k + 1, V, generator=gen) * 3 + 2
        top = logits.topk(2).indices
        # Mostly the target's top-1 or top-2, sometimes another token: every outcome occurs.
        pick = torch.randint(0, 3, (k,), generator=gen)
        draft = torch.where(
            pick < 2, top[:k].gather(1, pick.clamp(max=1)[:, None])[:, 0], (top[:k, 0] + 1) % V
        )
        chain = verify_greedy(logits, draft, rule)
        tree = verify_tree_greedy(logits, chain_tree(draft), rule)
        assert (tree.n_accepted, tree.next_token) == (chain.n_accepted, chain.next_token)
        assert tree.relaxed.tolist() == chain.relaxed.tolist()
        judged = min(chain.n_accepted + 1, k)
        assert torch.allclose(tree.margins, chain.margins[:judged], rtol=0, atol=0, equal_nan=True)


def test_build_tree_adds_runner_ups_as_leaves_at_the_first_depths():
    draft = Draft(
        tokens=torch.tensor([10, 11, 12]), alternatives=torch.tensor([[20, 30], [21, 31], [22, 32]])
    )
    tree = build_tree(draft, (3, 2))
    assert tree.tokens.tolist() == [10, 11, 12, 20, 30, 21]
    assert tree.parents == (0, 1, 2, 0, 0, 1) and tree.depths == (1, 2, 3, 1, 1, 2)
    assert tree.chain_len == 3
    assert build_tree(Draft(tokens=torch.tensor([10])), (3, 2)).tokens.tolist() == [10]  # no alternatives


def test_attention_mask_lets_a_node_see_the_cache_and_its_ancestors_only():
    mask = TREE.attention_mask(cached=2, dtype=torch.float32)  # [1, 1, 4, 6]
    sees = (mask[0, 0] == 0).int().tolist()
    assert sees == [
        [1, 1, 1, 0, 0, 0],  # root
        [1, 1, 1, 1, 0, 0],  # node 1: root, itself
        [1, 1, 1, 1, 1, 0],  # node 2: root, node 1, itself
        [1, 1, 1, 0, 0, 1],  # node 3 (sibling of 1): root, itself
    ]


def test_a_tree_shape_is_laid_out_once_and_shared():
    def draft(offset: int) -> Draft:
        return Draft(
            tokens=torch.tensor([10, 11, 12]) + offset,
            alternatives=torch.tensor([[20, 30], [21, 31], [22, 32]]) + offset,
        )

    first, second = build_tree(draft(0), (3, 2)), build_tree(draft(100), (3, 2))
    assert first.layout is second.layout  # the same shape: made once, not in every step
    assert build_tree(draft(0), (2,)).layout is not first.layout
    layout = first.layout
    assert layout.children == ((1, 4, 5), (2, 6), (3,), (), (), (), ())
    assert layout.parent_index.tolist() == [0, 1, 2, 0, 0, 1]
    assert layout.position_offsets.tolist() == [0, 1, 2, 3, 1, 1, 2]
    # The mask made from the layout is the one a node-by-node walk of the ancestors gives.
    mask = second.attention_mask(cached=3, dtype=torch.bfloat16)[0, 0, :, 3:]
    for node in range(7):
        ancestors, at = {node}, node
        while at:
            at = second.parents[at - 1]
            ancestors.add(at)
        assert [col in ancestors for col in range(7)] == (mask[node] == 0).tolist()


def test_tree_shape_parsing_and_errors():
    assert parse_tree_shape("3,2,1") == (3, 2)
    assert parse_tree_shape("1,1") is None and parse_tree_shape(None) is None
    for bad in ("2,x", "0", "2,-1"):
        with pytest.raises(MarspecError, match="tree shape"):
            parse_tree_shape(bad)
    with pytest.raises(MarspecError, match="greedily only"):
        GenerationOptions(tree="2", temperature=0.7)


def test_tree_forward_rows_equal_chain_forwards_along_each_path(prompt):
    lm = tiny_lm(0)
    lm.forward(prompt[:-1])
    base = lm.cached_len
    logits = lm.forward_tree(TREE, prompt[-1:])  # [4, V]
    for node, path in {1: [3], 2: [3, 5], 3: [4]}.items():
        lm.rollback(base)
        chain = lm.forward(torch.cat((prompt[-1:], torch.tensor(path))))[-1]
        assert torch.allclose(logits[node], chain, atol=1e-4), node
    lm.rollback(base)
    root = lm.forward(prompt[-1:])[-1]
    assert torch.allclose(logits[0], root, atol=1e-4)


def test_keep_path_compacts_a_sibling_into_place(prompt):
    lm, fresh = tiny_lm(0), tiny_lm(0)
    lm.forward(prompt[:-1])
    base = lm.cached_len
    lm.forward_tree(TREE, prompt[-1:])
    lm.keep_path(base, (3,))  # the sibling (token 4) at depth 1
    assert lm.cached_len == base + 2
    nxt = lm.forward(torch.tensor([6]))[-1]
    expected = fresh.forward(torch.cat((prompt, torch.tensor([4, 6]))))[-1]
    assert torch.allclose(nxt, expected, atol=1e-4)
    # The cache's token ids moved with it, so the whole sequence is a prefix a next prompt can keep.
    assert lm.keep_prefix(torch.cat((prompt, torch.tensor([4, 6, 9])))) == base + 3


class WrongChainRightSibling:
    """Knows plain decoding's continuation; drafts a wrong chain whose runner-up at each position is the
    right token, so only the tree's siblings can be accepted."""

    name = "oracle"
    draft_model = None  # it reads its answers, no model

    def __init__(self, prompt_len: int, continuation: list[int]) -> None:
        self.prompt_len = prompt_len
        self.continuation = continuation

    def propose(self, context, k, temperature, generator, alternatives=0):
        done = int(context.shape[0]) - self.prompt_len
        right = torch.tensor(self.continuation[done : done + k])
        wrong = (right + 1) % TINY_VOCAB
        return Draft(tokens=wrong, alternatives=right[:, None] if alternatives else None)

    def rollback(self, valid_len: int) -> None:
        pass

    def reset(self) -> None:
        pass


def test_accepted_siblings_keep_decoding_exact(target, prompt):
    plain = reference_greedy(target, prompt, 40)
    drafter = WrongChainRightSibling(len(prompt), plain + [0] * 8)
    tokens, relaxed, stats = run(target, drafter, prompt, rule=STRICT, k=3, max_new_tokens=40, tree=(2,))
    assert tokens == plain and not any(relaxed)
    assert stats.accepted_exact > 0 and stats.tau > 1.9  # a sibling and its bonus nearly every step
    chain, _, chain_stats = run(target, drafter, prompt, rule=STRICT, k=3, max_new_tokens=40)
    assert chain == plain and chain_stats.accepted_exact == 0


@pytest.mark.parametrize("shape", [(2,), (3, 2), (2, 2, 2, 2)])
def test_strict_and_mars_theta_one_trees_equal_plain(target, prompt, shape):
    plain = reference_greedy(target, prompt, 30)
    drafter = ModelDrafter(tiny_lm(1, "tiny-draft"), target_vocab_size=target.vocab_size)
    strict, _, stats = run(target, drafter, prompt, rule=STRICT, k=4, max_new_tokens=30, tree=shape)
    assert strict == plain and stats.rejected > 0
    mars1, relaxed, _ = run(
        target, drafter, prompt, rule=Rule("mars", 1.0, "logit_ratio"), k=4, max_new_tokens=30, tree=shape
    )
    assert mars1 == plain and not any(relaxed)
    assert sum(s.siblings for s in stats.steps) > 0
    assert max(stats.verify_sizes()) > 5  # the tree's siblings were scored beside the chain


def test_a_rival_rule_accepts_a_sibling_in_its_test():
    # The chain child (token 3) is far down the root's row; the sibling (token 4) is its second choice.
    root = row(6, 5.0, 4, 4.9)
    out = verify([root, row(5, 9.0, 0, 1.0), BONUS_2, BONUS_3], Rule("topk", 2))
    assert (out.path, out.tokens, out.relaxed.tolist(), out.next_token) == ((3,), (4,), [True], 7)
    strict = verify([root, row(5, 9.0, 0, 1.0), BONUS_2, BONUS_3], STRICT)
    assert (strict.path, strict.next_token) == ((), 6)


def test_best_first_tree_keeps_the_best_candidates_chain_first():
    """EAGLE-2's reranking on hand-made candidates: the budget's best by cumulative log-probability,
    ancestors kept with their children (a tie goes to the parent), the best path numbered first, the
    rest by depth and score, each node's children in order of preference."""
    from marspec.drafters.tree import best_first_tree, node_budget

    # Root children a (-0.1), b (-0.5), c (-3.0); a's children d (-0.4), e (-2.0); b's child f (-0.5,
    # a tie with its parent b: f must not come before b); d's child g (-0.9).
    tokens = [10, 11, 12, 13, 14, 15, 16]
    parents = [-1, -1, -1, 0, 0, 1, 3]
    depths = [1, 1, 1, 2, 2, 2, 3]
    scores = [-0.1, -0.5, -3.0, -0.4, -2.0, -0.5, -0.9]
    tree = best_first_tree(tokens, parents, depths, scores, budget=5, device=torch.device("cpu"))
    # Kept: a, d, b, f (tie, after b), g; chain a -> d -> g; then b (depth 1) and f (depth 2).
    assert tree.tokens.tolist() == [10, 13, 16, 11, 15]
    assert tree.parents == (0, 1, 2, 0, 4)
    assert tree.depths == (1, 2, 3, 1, 2)
    assert tree.chain_len == 3
    assert tree.children()[0] == (1, 4)  # a before b
    small = best_first_tree(tokens, parents, depths, scores, budget=1, device=torch.device("cpu"))
    assert small.tokens.tolist() == [10] and small.chain_len == 1
    assert node_budget(4, (3, 2)) == 7 and node_budget(1, (3, 2)) == 3
    assert len(build_tree(Draft(tokens=torch.arange(4), alternatives=torch.zeros(4, 2)), (3, 2))) == 7
