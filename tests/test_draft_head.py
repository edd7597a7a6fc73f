"""The draft's narrow-first output layer (marspec.backends.draft_head): where a row is sure among the ids
scored first it scores only those, with the whole layer's bits; elsewhere it is the whole layer, bit for
bit; a row scores the same alone or among others."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from marspec.backends.draft_head import NarrowFirstHead, narrow_first_head
from marspec.backends.kernels import kernels_available
from marspec.backends.q4k import Q4KLinear
from marspec.errors import MarspecError

pytestmark = pytest.mark.skipif(not kernels_available(), reason="the Q4_K kernel is not built here")

IN, OUT, NARROW_END, TAIL_START = 256, 640, 256, 576


@pytest.fixture(scope="module")
def weight() -> torch.Tensor:
    return torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def head(weight: torch.Tensor) -> Q4KLinear:
    return Q4KLinear.from_float(weight)


def rows(weight: torch.Tensor) -> tuple[torch.Tensor, list[int], list[int]]:
    """Rows sure among the narrow ids (a narrow or tail column's weights, scaled: its logit dominates),
    rows unsure (small noise: every probability near 1 / 640), and one whose top id is in the rest, with
    the narrow ids' logits small beside it (so unsure among them)."""
    gen = torch.Generator().manual_seed(1)
    sure = [weight[j] * 3.0 for j in (5, 200, 600)]
    unsure = [torch.randn(IN, generator=gen) * 0.01 for _ in range(3)]
    rest = [weight[400] * 0.05]
    x = torch.stack(sure + unsure[:2] + rest + unsure[2:])
    return x, [0, 1, 2], [3, 4, 5, 6]


def test_sure_rows_score_the_narrow_ids_only_and_the_others_score_whole(
    head: Q4KLinear, weight: torch.Tensor
) -> None:
    x, sure, whole = rows(weight)
    narrow = NarrowFirstHead(head, NARROW_END, TAIL_START)
    got, expected = narrow(x), head(x)
    for r in sure:
        parts = (slice(0, NARROW_END), slice(TAIL_START, OUT))
        assert all(torch.equal(got[r, p], expected[r, p]) for p in parts)
        assert torch.isneginf(got[r, NARROW_END:TAIL_START]).all()
    for r in whole:  # unsure among the narrow ids (row 5: its top id is in the rest, which it then finds)
        assert torch.equal(got[r], expected[r])
    assert int(got[5].argmax()) == 400


def test_a_row_scores_the_same_alone_and_among_others(head: Q4KLinear, weight: torch.Tensor) -> None:
    x, _, _ = rows(weight)
    narrow = NarrowFirstHead(head, NARROW_END, TAIL_START)
    together = narrow(x.unsqueeze(0))[0]  # [1, T, in] as a forward's hidden states come
    for r in range(x.shape[0]):
        assert torch.equal(narrow(x[r : r + 1])[0], together[r])


def test_switched_off_it_is_the_whole_layer(head: Q4KLinear, weight: torch.Tensor) -> None:
    x, _, _ = rows(weight)
    narrow = NarrowFirstHead(head, NARROW_END, TAIL_START)
    narrow.narrow_first = False
    assert torch.equal(narrow(x), head(x))


def test_a_row_holding_a_nan_is_scored_whole(head: Q4KLinear, weight: torch.Tensor) -> None:
    x = weight[5:6] * 3.0
    x[0, 7] = float("nan")
    assert torch.isnan(NarrowFirstHead(head, NARROW_END, TAIL_START)(x)).all()


def test_parts_must_be_whole_tiles(head: Q4KLinear) -> None:
    for narrow_end, tail_start in ((250, 576), (256, 570), (256, 256), (0, 576), (256, OUT)):
        with pytest.raises(MarspecError, match="whole tiles"):
            NarrowFirstHead(head, narrow_end, tail_start)


def tiny_model(vocab: int) -> Qwen2ForCausalLM:
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, tie_word_embeddings=False,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    model.lm_head = Q4KLinear.of(model.lm_head)
    return model


def test_a_draft_with_qwens_vocabulary_gets_it_and_a_smaller_one_does_not() -> None:
    qwen = tiny_model(151936)
    assert narrow_first_head(qwen, 151643)
    head = qwen.get_output_embeddings()
    assert isinstance(head, NarrowFirstHead)
    assert (head.narrow_end, head.tail_start, head.out_features) == (65536, 151616, 151936)
    # Llama 3's 128,256 ids, 256 of them added: the rest (62,464) is fewer than those scored first.
    llama = tiny_model(128256)
    assert not narrow_first_head(llama, 128000)
    assert type(llama.get_output_embeddings()) is Q4KLinear
