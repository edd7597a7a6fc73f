"""The fixed-shape path (marspec.backends.fixed, ``graphs="on"``) on tiny random models, on the CPU: padded
rows are computed bit for bit as without padding, decoding gives eager's tokens, speculative sampling
stays lossless, and the forwards a GPU captures never read the host."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from captured_reads import captured_regions_counted
from conftest import tiny_lm
from eagle3_heads import bigram_proposals, last_layer_ids, write_head
from transformers import LlamaConfig, LlamaForCausalLM

from marspec.api import Decoder
from marspec.backends.fixed import QUERY_SIZES, FixedShapeLM, fixed_shape_lm, graphs_plan
from marspec.backends.hf import HFCausalLM
from marspec.backends.int4 import int4_available
from marspec.backends.prepack import prepack_available, prepack_linears
from marspec.backends.quantize import quantize_target, rowwise_int8_available
from marspec.backends.row_attention import use_row_attention
from marspec.drafters.eagle3_fixed import FixedHeadCache
from marspec.drafters.eagle3_head import Eagle3Head, HeadCache, TreeRows
from marspec.drafters.model import ModelDrafter
from marspec.drafters.tree import build_tree
from marspec.errors import MarspecError
from marspec.interfaces import Draft
from marspec.rules import Rule
from marspec.selftest import reads_per_step
from marspec.selftest.sampling import CHI2_999_15, chi_square, sampled_counts, small_model, target_joint
from marspec.selftest.tiny import noisy_copy, save_tiny_model, tiny_model
from marspec.stats import GenerationStats

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("fixed")
    target = tiny_model(seed=0)
    return save_tiny_model(tmp / "target", target), save_tiny_model(tmp / "draft", noisy_copy(target, 1))


def _decoder(folders, graphs: str, **settings) -> Decoder:
    target, draft = folders
    settings = {"draft_confidence": 0.0, "lookup": False, **settings}
    return Decoder(str(target), str(draft), device="cpu", graphs=graphs, **settings)


@pytest.fixture(scope="module")
def eager(folders) -> Decoder:
    return _decoder(folders, "off")


@pytest.fixture(scope="module")
def fixed(folders) -> Decoder:
    return _decoder(folders, "on")


def test_graphs_option_is_checked_before_loading_and_plans_per_device(tmp_path):
    with pytest.raises(MarspecError, match="unknown graphs 'yes': choose one of auto, on, off"):
        Decoder(str(tmp_path / "missing"), None, graphs="yes")
    assert graphs_plan("auto", CPU) == (False, False)
    assert graphs_plan("on", CPU) == (True, False)
    assert graphs_plan("off", torch.device("cuda")) == (False, False)
    assert graphs_plan("auto", torch.device("cuda")) == (True, True)


def test_on_takes_the_fixed_path_for_both_models(fixed, eager):
    assert isinstance(fixed.target, FixedShapeLM) and fixed.target.graphs is None
    assert isinstance(fixed.drafter.draft_model, FixedShapeLM)
    assert type(eager.target) is HFCausalLM
    with pytest.raises(MarspecError, match="CUDA graphs need a CUDA device"):
        fixed_shape_lm(eager.target, graphs=True)


def _padded_and_unpadded(lm: HFCausalLM, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of ``n`` tokens after a 20-token prefix and of one token after them (which reads what
    the forward cached), with the forward padded and unpadded."""
    fixed = FixedShapeLM(lm.model, None, "fixed")
    gen = torch.Generator().manual_seed(n)
    fixed.forward(torch.randint(97, (20,), generator=gen))
    tokens = torch.randint(97, (n,), generator=gen)
    padded = fixed.forward(tokens)
    last = fixed.forward(tokens[:1])  # what the padded forward cached is what later rows see
    fixed.rollback(20)
    fixed.pads = False
    unpadded = fixed.forward(tokens)
    unpadded_last = fixed.forward(tokens[:1])
    fixed.rollback(20)
    fixed.pads = True
    assert torch.equal(fixed.forward(tokens, last_only=True), padded[-1:])
    return torch.cat([padded, last]), torch.cat([unpadded, unpadded_last])


@pytest.mark.skipif(not prepack_available(), reason="oneDNN prepacking is unavailable here")
@pytest.mark.parametrize("n", [2, 3, 5, 7, 13])
def test_padded_rows_equal_an_unpadded_forward_bit_for_bit(n):
    """With every row computed alone (oneDNN's prepacked linears, attention one query row at a time) the
    counted rows of a padded forward are the unpadded forward's, bit for bit: they never see a padded
    row. SDPA's CPU kernel rounds by the forward's row count on some CPUs (an AMD EPYC's: 3 rows and 4
    differ by ~2e-6), so there the rows agree to rounding, far below what a padded row seen would move."""
    lm = tiny_lm(0)
    prepack_linears(lm.model)
    padded, unpadded = _padded_and_unpadded(lm, n)
    torch.testing.assert_close(unpadded, padded, rtol=1e-5, atol=1e-5)
    use_row_attention(lm.model)
    padded, unpadded = _padded_and_unpadded(lm, n)
    assert torch.equal(unpadded, padded)


@pytest.mark.skipif(not prepack_available(), reason="oneDNN prepacking is unavailable here")
def test_padded_tree_rows_equal_an_unpadded_forward_bit_for_bit():
    lm = tiny_lm(1)
    prepack_linears(lm.model)
    fixed = FixedShapeLM(lm.model, None, "fixed")
    fixed.forward(torch.arange(10, 30))
    draft = Draft(
        tokens=torch.tensor([3, 4, 5, 6]), alternatives=torch.tensor([[7, 8], [9, 10], [11, 12], [1, 2]])
    )
    tree = build_tree(draft, (3, 2))  # 4 chain nodes and 3 siblings: 8 rows, 8 padded... to 8
    root = torch.tensor([2])
    padded = fixed.forward_tree(tree, root)
    fixed.rollback(20)
    fixed.pads = False
    assert torch.equal(fixed.forward_tree(tree, root), padded)
    # The same tree with one sibling fewer: 7 rows run padded to 8.
    small = build_tree(draft, (2, 2))
    fixed.rollback(20)
    unpadded = fixed.forward_tree(small, root)
    fixed.rollback(20)
    fixed.pads = True
    assert torch.equal(fixed.forward_tree(small, root), unpadded)


def test_tree_and_chain_rows_agree_with_the_eager_backend():
    """The mask built on the device gives each row what the eager backend's forward gives it."""
    eager = tiny_lm(2)
    fixed = FixedShapeLM(eager.model, None, "fixed")
    prompt = torch.arange(5, 45)
    for lm in (eager, fixed):
        lm.forward(prompt)
    draft = Draft(tokens=torch.tensor([3, 4, 5]), alternatives=torch.tensor([[7, 8], [9, 10], [11, 12]]))
    tree = build_tree(draft, (3, 2))
    a, b = eager.forward_tree(tree, torch.tensor([2])), fixed.forward_tree(tree, torch.tensor([2]))
    torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    eager.keep_path(40, (1, 5)), fixed.keep_path(40, (1, 5))  # a sibling moves into the chain
    assert eager.cached_len == fixed.cached_len == 43
    tokens = torch.tensor([17, 18])
    torch.testing.assert_close(eager.forward(tokens), fixed.forward(tokens), rtol=0, atol=1e-4)


def test_the_cache_grows_past_its_first_capacity_and_keeps_its_positions():
    eager = tiny_lm(3)
    fixed = FixedShapeLM(eager.model, None, "fixed")
    prompt = torch.randint(97, (250,), generator=torch.Generator().manual_seed(0))
    for lm in (eager, fixed):
        lm.forward(prompt)
    tokens = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 9])  # 250 + 16 padded rows > 256: the buffers double
    torch.testing.assert_close(eager.forward(tokens), fixed.forward(tokens), rtol=0, atol=1e-4)
    assert fixed._capacity == 512


SETTINGS = {
    "plain": {"rule": "plain"},
    "strict": {"rule": "strict"},
    "strict_tree": {"rule": "strict", "tree": "3,2"},
    "mars1": {"rule": "mars", "theta": 1.0},
    "mars1_tree": {"rule": "mars", "theta": 1.0, "tree": "3,2"},
    "mars": {"rule": "mars", "theta": 0.3},
    "sampling": {"rule": "strict", "temperature": 1.0, "seed": 7},
}
PROMPTS = ("def add(a, b): return a + b", "1 + 1 = 2, 2 + 2 =")


def _tokens(decoder: Decoder, prompt: str, **options) -> list[int]:
    return decoder.generate(prompt, k=4, max_new_tokens=40, chat=False, **options).token_ids


@pytest.mark.parametrize("prompt", PROMPTS)
def test_on_gives_eager_tokens_and_strict_equals_plain(eager, fixed, prompt):
    runs = {name: _tokens(fixed, prompt, **options) for name, options in SETTINGS.items()}
    for name, options in SETTINGS.items():
        assert runs[name] == _tokens(eager, prompt, **options), name
    for name in ("strict", "strict_tree", "mars1", "mars1_tree"):
        assert runs[name] == runs["plain"], name


def test_the_confidence_stop_read_per_chunk_drafts_what_a_read_per_token_drafts(folders):
    """Chunks change how often the stop is read and how many forwards run past it, never the draft."""
    per_token = _decoder(folders, "on", draft_confidence=0.6)
    chunked = _decoder(folders, "on", draft_confidence=0.6)
    chunked.drafter.stop_chunk = 3
    for prompt in PROMPTS:
        a = per_token.generate(prompt, rule="mars", theta=0.3, k=6, max_new_tokens=40, chat=False)
        b = chunked.generate(prompt, rule="mars", theta=0.3, k=6, max_new_tokens=40, chat=False)
        assert a.token_ids == b.token_ids
        assert [s.drafted for s in a.stats.steps] == [s.drafted for s in b.stats.steps]
        assert 0 < a.stats.drafted < 6 * len(a.stats.steps)  # the stop really ended drafts
        assert b.stats.draft_forwards >= a.stats.draft_forwards


def test_speculative_sampling_stays_lossless_on_the_fixed_path():
    """The selftest's chi-square, through FixedShapeLM models, the confidence stop on and read per chunk
    (its forwards past an unsure token draw from the generator too)."""
    target = FixedShapeLM(small_model(seed=0, sharpen=1.0), None, "small-target")
    draft = FixedShapeLM(small_model(seed=1, sharpen=3.0), None, "small-draft")
    prompt = torch.tensor([1, 3, 0, 2])
    drafter = ModelDrafter(draft, 4, min_confidence=0.5, stop_chunk=2)
    stat = chi_square(sampled_counts(target, drafter, prompt, 800), target_joint(target, prompt))
    assert stat < CHI2_999_15


def test_captured_regions_read_nothing_and_a_step_reads_once_per_draft_chunk(folders):
    """Zero host reads inside the forwards a GPU replays; outside them one read per step for the
    verdict, plus one per draft chunk while the confidence stop is on."""
    # The int8 draft: its confidences on these random weights run past a chunk before the stop.
    decoder = _decoder(folders, "on", draft_confidence=0.6, draft_quant="int8")
    decoder.drafter.stop_chunk = 4
    target, draft = decoder.target, decoder.drafter.draft_model
    prompt = decoder.tokenizer(PROMPTS[0], return_tensors="pt")["input_ids"][0]
    for config in ({"rule": Rule(name="strict")}, {"rule": Rule(name="strict"), "tree": (3, 2)}):
        with captured_regions_counted(target, draft) as inside:
            stats = GenerationStats()
            per_step = reads_per_step(
                decoder, prompt, stats, k=8, max_new_tokens=40, reuse_prefix=False, **config
            )
        assert len(inside) > len(per_step) and set(inside) == {0}
        assert max(per_step) > 1  # the stop's chunk reads are counted too
        for count, step in zip(per_step, stats.steps, strict=True):
            chunks = -(-(step.drafted - 1) // 4) if step.drafted > 1 else 0
            assert count <= 1 + max(chunks, 1 if step.drafted else 0), (count, step)


def test_capture_is_refused_off_cuda_and_sizes_are_padded():
    lm = tiny_lm(4)
    with pytest.raises(MarspecError, match="CUDA graphs need a CUDA device"):
        FixedShapeLM(lm.model, None, "x", graphs=True)
    fixed = FixedShapeLM(lm.model, None, "x")
    assert [fixed._padded(n) for n in (1, 2, 3, 9, 13, 33)] == [1, 2, 4, 16, 16, 33]
    assert QUERY_SIZES[-1] == 32


def test_transformers_sdpa_path_reads_nothing_inside_the_captured_forwards():
    """The attention a CUDA device runs (transformers' sdpa, key/value heads expanded or packed), chains,
    a token tree and last-row forwards: no host read of anything computed from the inputs."""
    lm = tiny_lm(5)
    assert lm.model.config._attn_implementation == "sdpa"
    fixed = FixedShapeLM(lm.model, None, "fixed")
    draft = Draft(tokens=torch.tensor([3, 4, 5]), alternatives=torch.tensor([[7, 8], [9, 10], [11, 12]]))
    with captured_regions_counted(fixed) as inside:
        fixed.forward(torch.arange(10, 20), last_only=True)
        fixed.forward(torch.tensor([1]))
        fixed.forward(torch.arange(1, 14))
        fixed.forward(torch.arange(1, 4), last_only=True)
        fixed.forward_tree(build_tree(draft, (3, 2)), torch.tensor([2]))
    assert inside == [0, 0, 0, 0, 0]


# -- an EAGLE-3 head's feature layers on the fixed path -----------------------------------------------

HEAD_LAYERS = 4  # the tiny target of these tests, deep enough for three distinct feature layers


@pytest.fixture(scope="module")
def head_folders(tmp_path_factory) -> tuple[Path, Path]:
    """A 4-layer tiny target and a published-format head proposing what its plain decoding takes
    (tests/eagle3_heads.py says how the head drafts)."""
    tmp = tmp_path_factory.mktemp("fixed-head")
    target_dir = save_tiny_model(tmp / "target", tiny_model(seed=0, layers=HEAD_LAYERS))
    plain = Decoder(str(target_dir), None, device="cpu", graphs="off")
    runs = [_tokens(plain, prompt, rule="plain") for prompt in PROMPTS]
    config = json.loads((target_dir / "config.json").read_text())
    proposals = bigram_proposals(runs, runs)
    layers = last_layer_ids(HEAD_LAYERS)
    return target_dir, write_head(tmp / "head", config, target_dir, proposals, layers=layers)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_a_head_drafts_on_the_fixed_path_what_it_drafts_on_the_eager_path(head_folders, prompt):
    """The fixed-shape target writes the head's feature layers at the slots it scores (padded rows
    included, never read), so the head drafts as on the eager path: the same tokens and the same drafts
    step by step, and strict equals plain there."""
    target_dir, head_dir = head_folders
    decoders = {
        graphs: Decoder(str(target_dir), str(head_dir), device="cpu", graphs=graphs, draft_confidence=0.0)
        for graphs in ("off", "on")
    }
    assert isinstance(decoders["on"].target, FixedShapeLM) and type(decoders["off"].target) is HFCausalLM
    runs = {}
    for graphs, decoder in decoders.items():
        for name, options in SETTINGS.items():
            result = decoder.generate(prompt, k=4, max_new_tokens=40, chat=False, **options)
            runs[graphs, name] = (result.token_ids, [s.drafted for s in result.stats.steps])
    for name in SETTINGS:
        assert runs["on", name] == runs["off", name], name
    for name in ("strict", "strict_tree", "mars1", "mars1_tree"):
        assert runs["on", name][0] == runs["on", "plain"][0], name
    assert sum(runs["on", "strict"][1]) > 0


def test_the_fixed_path_keeps_the_hidden_states_the_eager_path_keeps():
    """Chains, a padded last-row prefill, a token tree whose kept path moves a sibling into place, and
    the buffers doubling past 256 positions: the kept rows match the eager backend's."""
    eager = tiny_lm(6, layers=3)
    fixed = FixedShapeLM(eager.model, None, "fixed")
    layers = (0, 2, 3)
    prompt = torch.randint(97, (240,), generator=torch.Generator().manual_seed(6))
    draft = Draft(tokens=torch.tensor([3, 4, 5]), alternatives=torch.tensor([[7, 8], [9, 10], [11, 12]]))
    for lm in (eager, fixed):
        lm.capture_hidden_states(layers)
        lm.forward(prompt, last_only=True)
        lm.forward(torch.tensor([1, 2, 3]))  # padded to 4
        lm.forward_tree(build_tree(draft, (3, 2)), torch.tensor([2]))
        lm.keep_path(243, (1, 5))  # a sibling moves into the chain
        lm.forward(torch.arange(1, 14))  # 246 + 16 padded rows: the buffers double
    assert fixed._capacity == 512 and eager.cached_len == fixed.cached_len == 259
    close = {"rtol": 0, "atol": 1e-4}
    torch.testing.assert_close(
        fixed.hidden_states(0, 259, layers), eager.hidden_states(0, 259, layers), **close
    )
    torch.testing.assert_close(
        fixed.hidden_states(240, 246, (3,)), eager.hidden_states(240, 246, (3,)), **close
    )


def test_kept_hidden_states_and_the_heads_steps_add_no_host_read_inside_the_captured_forwards(head_folders):
    target_dir, head_dir = head_folders
    decoder = Decoder(str(target_dir), str(head_dir), device="cpu", graphs="on", draft_confidence=0.0)
    cache = decoder.drafter.draft_model.cache
    assert isinstance(cache, FixedHeadCache)
    with captured_regions_counted(decoder.target, cache) as inside:
        decoder.generate(PROMPTS[0], rule="strict", k=4, max_new_tokens=12, chat=False)
        decoder.generate(PROMPTS[1], rule="strict", tree="3,2", k=4, max_new_tokens=12, chat=False)
    assert len(inside) > 12 and set(inside) == {0}


def _random_head(hidden: int = 32, heads: int = 4, kv_heads: int = 2, vocab: int = 97) -> Eagle3Head:
    from marspec.eagle3_training.head import head_config, spec_of

    target = {
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "vocab_size": vocab,
    }
    torch.manual_seed(7)
    embedding = torch.nn.Embedding(vocab, hidden)
    return Eagle3Head(spec_of(head_config(target, 50, 64, (0, 1, 2))), 3, embedding).eval()


def test_the_fixed_head_cache_steps_as_the_eager_cache_does():
    """Chain steps padded to the next query size (1, 3 -> 4, 13 -> 16), a token-tree depth, a rollback,
    and the buffers doubling past 256 positions: the logits and streams of the real rows are the eager
    cache's, and the padded rows leave no trace in the positions kept."""
    head = _random_head()
    eager, fixed = HeadCache(head), FixedHeadCache(head)
    g = torch.Generator().manual_seed(8)
    hidden = head.fc.out_features

    def both(tokens, features, tree=None):
        a, b = eager.step(tokens, features, tree), fixed.step(tokens, features, tree)
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(y, x, rtol=0, atol=1e-5)
        assert eager.length == fixed.length
        return a

    def rows(n):
        return torch.randint(97, (n,), generator=g), torch.randn(n, hidden, generator=g)

    both(*rows(200))
    for n in (1, 3, 13, 1):
        both(*rows(n))
    eager.rollback(210)
    fixed.rollback(210)
    base = eager.length
    sees = torch.zeros(2, base + 2, dtype=torch.bool)
    sees[:, :base] = True
    sees[0, base] = sees[1, base + 1] = True  # two siblings at one depth
    both(*rows(2), TreeRows(position=base, sees=sees))
    for n in (13, 13, 13, 13):  # past 256 positions: the buffers double, the cache kept
        both(*rows(n))
    assert fixed._capacity == 512 and fixed.length == 264


# -- quantised targets on the fixed path ----------------------------------------------------------------

QUANTS = [
    pytest.param("int8", marks=pytest.mark.skipif(not rowwise_int8_available(), reason="no oneDNN int8")),
    pytest.param("int4", marks=pytest.mark.skipif(not int4_available(), reason="no int4 CPU kernels")),
]


@pytest.mark.skipif(not rowwise_int8_available(), reason="no oneDNN int8")
def test_an_fp16_cache_asked_for_gives_the_fixed_path_its_eager_tokens(folders):
    """Both paths' caches in fp16 (the fixed path's buffers remade at the next sequence): the same tokens,
    strict == plain, and a cache of fp16 keys on the fixed path."""
    decoders = {graphs: _decoder(folders, graphs, target_quant="int8") for graphs in ("off", "on")}
    for decoder in decoders.values():
        _tokens(decoder, PROMPTS[0], rule="plain")  # float32 buffers first
        for lm in (decoder.target, decoder.drafter.draft_model):
            lm.kv_dtype = torch.float16
    names = ("plain", "strict", "strict_tree", "mars1")
    runs = {
        (g, name): _tokens(d, PROMPTS[0], **SETTINGS[name]) for g, d in decoders.items() for name in names
    }
    for name in names:
        assert runs["on", name] == runs["off", name] == runs["off", "plain"], name
    assert decoders["on"].target._fixed_cache.layers[0].keys.dtype == torch.float16


@pytest.mark.parametrize("quant", QUANTS)
def test_a_quantised_targets_padded_rows_are_scored_as_one_token_forwards_bit_for_bit(quant, prompt):
    """Row-exact linears and row-by-row attention: a padded chain's rows and a padded tree's nodes give
    what plain decoding's one-token forwards give on the same path, so strict equals plain there."""
    fixed = FixedShapeLM(quantize_target(tiny_lm(0, layers=3).model, quant), None, "fixed")
    fixed.forward(prompt[:3])
    together = fixed.forward(prompt[3:])  # 5 rows, padded to 8
    fixed.rollback(3)
    one_by_one = torch.cat([fixed.forward(prompt[i : i + 1]) for i in range(3, len(prompt))])
    assert torch.equal(together, one_by_one)
    draft = Draft(tokens=torch.tensor([3, 4, 5]), alternatives=torch.tensor([[7, 8], [9, 10], [11, 12]]))
    tree = build_tree(draft, (2, 2))  # the chain 3, 4, 5 and siblings 7 (of 3) and 9 (of 4): padded to 8
    base = fixed.cached_len
    rows = fixed.forward_tree(tree, torch.tensor([2]))
    for node, path in {0: [], 1: [3], 3: [3, 4, 5], 4: [7], 5: [3, 9]}.items():
        fixed.rollback(base)
        for token in [2, *path]:
            one_token = fixed.forward(torch.tensor([token]))[-1]
        assert torch.equal(rows[node], one_token), node


@pytest.mark.parametrize("quant", QUANTS)
def test_a_quantised_target_on_the_fixed_path_gives_its_eager_tokens(folders, quant):
    decoders = {graphs: _decoder(folders, graphs, target_quant=quant) for graphs in ("off", "on")}
    assert isinstance(decoders["on"].target, FixedShapeLM)
    names = ("plain", "strict", "strict_tree", "mars1")
    runs = {
        (graphs, name): _tokens(decoder, PROMPTS[0], **SETTINGS[name])
        for graphs, decoder in decoders.items()
        for name in names
    }
    for graphs in ("off", "on"):
        for name in names:
            assert runs[graphs, name] == runs[graphs, "plain"], (graphs, name)
    assert runs["on", "plain"] == runs["off", "plain"]


def test_a_llama_model_takes_the_fixed_path():
    """Llama's forward takes one 4D mask (no per-layer-type mapping, as Qwen2's does)."""
    torch.manual_seed(7)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    eager = HFCausalLM(LlamaForCausalLM(config).eval(), None, "tiny-llama")
    fixed = FixedShapeLM(eager.model, None, "tiny-llama")
    prompt = torch.arange(3, 23)
    for lm in (eager, fixed):
        lm.forward(prompt)
    tokens = torch.tensor([5, 6, 7])
    torch.testing.assert_close(fixed.forward(tokens), eager.forward(tokens), rtol=0, atol=1e-4)
