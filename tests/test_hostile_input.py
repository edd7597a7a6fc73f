"""Input that once broke a generation, or its neighbours' (issue 82), in the library: a temperature too
small to divide by, probabilities that are not numbers, a text ending inside a character, and one
sequence's failing forward inside a packed batch."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from marspec.api import Decoder
from marspec.backends.int8 import rowwise_int8_available
from marspec.batch.gather import run_group
from marspec.batch.scheduler import PREFILL_CHUNK
from marspec.batch.views import SlotLM
from marspec.defaults import GREEDY_BELOW_TEMPERATURE
from marspec.detok import IncrementalDetokenizer
from marspec.errors import MarspecError, ModelOutputError
from marspec.forward_requests import Forward
from marspec.rules import Rule, RuleName
from marspec.selftest.tiny import noisy_copy, save_tiny_model, tiny_decoder, tiny_model, tiny_tokenizer
from marspec.settings import GenerationOptions, settle
from marspec.verify.block import verify_block
from marspec.verify.sampling import verify_sampling

needs_int8 = pytest.mark.skipif(not rowwise_int8_available(), reason="no oneDNN int8 kernels on this CPU")


@pytest.fixture(scope="module")
def decoder(tmp_path_factory: pytest.TempPathFactory):
    return tiny_decoder(tmp_path_factory.mktemp("tiny"), torch.device("cpu"))


@pytest.mark.parametrize("rule", ["plain", "strict", "mars"])
def test_a_temperature_below_the_floor_decodes_greedily(decoder, rule: str) -> None:
    options = {"max_new_tokens": 8, "chat": False, "rule": rule}
    greedy = decoder.generate("Hello there", **options)
    for temperature in (1e-300, 5e-324, GREEDY_BELOW_TEMPERATURE / 2):
        tiny = decoder.generate("Hello there", temperature=temperature, seed=1, **options)
        assert tiny.token_ids == greedy.token_ids and tiny.text == greedy.text
        assert settle(GenerationOptions(temperature=temperature)).temperature == 0.0


def test_the_floor_itself_samples() -> None:
    assert settle(GenerationOptions(temperature=GREEDY_BELOW_TEMPERATURE)).temperature > 0


@pytest.mark.parametrize("verify", ["sampling", "block"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_probabilities_that_are_not_numbers_are_refused_before_a_token_is_taken(
    verify: str, bad: float
) -> None:
    logits = torch.randn(3, 50)
    logits[1, 7] = bad  # the row a rejection at draft position 1 would draw its correction from
    draft = torch.tensor([4, 9])
    with pytest.raises(ModelOutputError, match="NaN or infinite") as err:
        if verify == "sampling":
            verify_sampling(logits, draft, None, Rule(RuleName.STRICT), 1.0, torch.Generator().manual_seed(0))
        else:
            verify_block(logits, draft, None, 1.0, torch.Generator().manual_seed(0))
    assert "\n" not in str(err.value)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer without merges: every byte is one token, so a 4-byte emoji is four
    tokens and a text can end after any of its bytes."""
    symbols = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={s: i for i, s in enumerate(symbols)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.mark.parametrize("chunk", [1, 2, 3, 5, 100])  # tokens per push: a speculative step commits several
def test_deltas_and_flush_add_up_to_the_decoding_of_every_prefix(chunk: int) -> None:
    tokenizer = byte_tokenizer()
    ids = tokenizer("a😀 b👩\u200d💻é", add_special_tokens=False).input_ids
    assert len(ids) > 15  # bytes, not characters
    for end in range(1, len(ids) + 1):  # the text ends after every byte, inside a character or not
        detok = IncrementalDetokenizer(tokenizer)
        deltas = [detok.push(ids[i : min(i + chunk, end)]) for i in range(0, end, chunk)]
        deltas.append(detok.flush())
        expected = tokenizer.decode(ids[:end])
        assert "".join(deltas) == detok.text == expected, (chunk, end)


@needs_int8
def test_a_failing_forward_in_a_packed_batch_fails_only_its_own_sequence(tmp_path) -> None:
    """Three sequences' forwards packed into one on the int8 target (rows computed alone); one holds a token
    id the embedding does not have. Its sequence gets the error; the others get their solo logits, bit
    for bit, and their caches as a solo forward leaves them."""
    target = tiny_decoder(tmp_path, torch.device("cpu"), target_quant="int8").target
    tokens = [torch.tensor([5, 17, 30]), torch.tensor([1, 2, 10**6]), torch.tensor([40, 41])]
    lms = [SlotLM(target, PREFILL_CHUNK) for _ in tokens]
    outcomes = run_group([Forward(lm, t) for lm, t in zip(lms, tokens, strict=True)])
    assert isinstance(outcomes[1], IndexError)
    for i in (0, 2):
        alone = type(target)(target.model, target.tokenizer, target.name)
        assert torch.equal(outcomes[i], alone.forward(tokens[i]))  # type: ignore[arg-type]
        assert lms[i].cached_len == alone.cached_len == len(tokens[i])
    assert lms[1].cached_len == 0


def test_a_prompt_token_the_model_has_no_row_for_is_refused_in_one_line(tmp_path) -> None:
    """A tokenizer that knows a token its model lacks (an added token): a prompt holding it is refused
    before any forward, which would fail inside torch's embedding (and fail every sequence packed with
    it)."""
    target = tiny_model(seed=0)
    for name, model in (("target", target), ("draft", noisy_copy(target, seed=1))):
        save_tiny_model(tmp_path / name, model)
        tokenizer = tiny_tokenizer()
        tokenizer.add_tokens(["<extra>"])
        tokenizer.save_pretrained(tmp_path / name)
    decoder = Decoder(
        str(tmp_path / "target"), str(tmp_path / "draft"), dtype="fp32", draft_confidence=0.0, lookup=False
    )
    assert decoder.generate("ab", chat=False, max_new_tokens=2).token_ids
    with pytest.raises(MarspecError, match=r"'<extra>' \(id 96\).*no row") as err:
        decoder.generate("ab <extra>", chat=False, max_new_tokens=2)
    assert "\n" not in str(err.value)
