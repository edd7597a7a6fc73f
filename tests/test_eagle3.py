"""EAGLE-3 heads as marspec's drafter, on a tiny random target: heads in the published format, built here
(tests/eagle3_heads.py says how they draft), loaded from a folder and by Hub id from an offline cache.

Checked: the target's verification forwards keep the hidden states a plain forward computes, at the
positions they keep (a tree's kept path included); strict verification of the head's drafts equals plain
decoding token for token (chains and trees), with drafts accepted and rejected; MARS at theta 1 equals
strict; MARS at a relaxing setting relaxes, first where strict takes the target's top choice over the
runner-up the head drafted; sampling with the head's probabilities, mapped to the target's vocabulary,
stays lossless; the feature layers come from the config, else EAGLE-3's default; heads that do not fit
the target are refused in one line before any weights load (library, CLI exit 2, server start-up).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest
import torch
from eagle3_heads import bigram_proposals, last_layer_ids, write_head
from test_hub import add_to_hub_cache, snapshot_of

import marspec.api
from marspec.api import Decoder
from marspec.drafters.eagle3 import Eagle3Drafter
from marspec.errors import MarspecError
from marspec.models.eagle3 import TargetShape, check_fits, default_layers, find_head
from marspec.rules import Rule
from marspec.selftest import save_tiny_model, tiny_model

LAYERS = 4
PROMPTS = ["def add(a, b):", "Hello world", "x = 1\ny ="]
NEW = 40
HUB_HEAD = "marspec-test/tiny-eagle3"
SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("e3") / "target", tiny_model(seed=0, layers=LAYERS))


@pytest.fixture(scope="module")
def plain(target_dir) -> Decoder:
    return Decoder(str(target_dir), None, device="cpu")


@pytest.fixture(scope="module")
def plain_runs(plain, target_dir) -> list[tuple[list[int], torch.Tensor]]:
    """Each prompt's plain greedy tokens, and the target's top two tokens at each of them."""
    runs = []
    for prompt in PROMPTS:
        tokens = plain.generate(prompt, rule="plain", max_new_tokens=NEW, chat=False).token_ids
        ids = plain.tokenizer(prompt)["input_ids"]
        with torch.inference_mode():
            logits = plain.target.model(torch.tensor([ids + tokens])).logits[0]
        top2 = logits.topk(2).indices[len(ids) - 1 : -1]  # [NEW, 2]
        assert top2[:, 0].tolist() == tokens
        runs.append((tokens, top2))
    return runs


def target_config(target_dir: Path) -> dict:
    return json.loads((target_dir / "config.json").read_text())


def make_head(target_dir: Path, plain_runs, folder: Path, rank: int = 0, **kwargs) -> Path:
    """A head proposing, after each token, the target's choice of that rank (0: its top choice, 1: its
    runner-up) at the next position of the plain runs."""
    followers = [top2[:, rank].tolist() for _, top2 in plain_runs]
    proposals = bigram_proposals([tokens for tokens, _ in plain_runs], followers)
    kwargs.setdefault("layers", last_layer_ids(LAYERS))
    return write_head(folder, target_config(target_dir), target_dir, proposals, **kwargs)


@pytest.fixture(scope="module")
def head_dir(target_dir, plain_runs, tmp_path_factory) -> Path:
    return make_head(target_dir, plain_runs, tmp_path_factory.mktemp("e3") / "head")


@pytest.fixture(scope="module")
def runner_up_head_dir(target_dir, plain_runs, tmp_path_factory) -> Path:
    return make_head(target_dir, plain_runs, tmp_path_factory.mktemp("e3") / "runner-up", rank=1)


@pytest.fixture(scope="module")
def eagle(target_dir, head_dir) -> Decoder:
    return Decoder(str(target_dir), str(head_dir), device="cpu", draft_confidence=0.0)


def options(**kwargs):
    return {"max_new_tokens": NEW, "chat": False, **kwargs}


def test_the_target_keeps_the_hidden_states_a_plain_forward_computes(plain):
    """Layer i is the stream entering decoder layer i (transformers' hidden_states[i]; the last is the
    last layer's output before the final norm), written at the positions each forward scores, and a
    tree's kept path is moved into place with its keys and values."""
    from marspec.drafters.tree import build_tree
    from marspec.interfaces import Draft

    target = plain.target
    layers = (0, 2, LAYERS)
    target.capture_hidden_states(layers)
    ids = torch.tensor([5, 17, 42, 8, 63, 5, 17, 42, 9, 11])
    with torch.inference_mode():
        reference = target.model(ids[None], output_hidden_states=True).hidden_states
        # transformers' last entry is after the final norm; layer L is the last layer's output before it.
        pre_norm = {}
        hook = target.model.model.layers[-1].register_forward_hook(
            lambda m, a, out: pre_norm.setdefault("x", out[0] if isinstance(out, tuple) else out)
        )
        target.model(ids[None])
        hook.remove()
    expected = torch.cat([reference[0][0], reference[2][0], pre_norm["x"][0]], dim=-1)  # [10, 3 H]
    target.reset()
    target.forward(ids[:6], last_only=True)
    target.forward(ids[6:8])
    close = {"rtol": 1e-4, "atol": 1e-5}
    torch.testing.assert_close(target.hidden_states(0, 8, layers), expected[:8], **close)
    hidden = target.hidden_size
    torch.testing.assert_close(target.hidden_states(2, 5, (LAYERS,)), expected[2:5, 2 * hidden :], **close)
    # A tree at position 8 whose kept path is the sibling (the token at 8): its row moves into place.
    target.rollback(7)
    tree = build_tree(Draft(tokens=torch.tensor([3]), alternatives=ids[8:9].unsqueeze(0)), (2,))
    target.forward_tree(tree, ids[7:8])  # root at 7; nodes at 8: 3 (the chain), then the sibling
    target.keep_path(7, (2,))
    assert target.cached_len == 9
    torch.testing.assert_close(target.hidden_states(0, 9, layers), expected[:9], **close)
    target.reset()


@pytest.mark.parametrize("k", [1, 3, 5])
def test_strict_with_the_head_equals_plain_decoding(eagle, plain_runs, k):
    accepted = rejected = 0
    for prompt, (tokens, _) in zip(PROMPTS, plain_runs, strict=True):
        result = eagle.generate(prompt, **options(rule="strict", k=k))
        assert result.token_ids == tokens
        accepted += result.stats.accepted_exact
        rejected += result.stats.rejected_steps if hasattr(result.stats, "rejected_steps") else 0
    assert accepted > 0, "no draft of the head was accepted: nothing was compared"


def test_strict_with_head_trees_equals_plain_decoding(eagle, plain_runs):
    for prompt, (tokens, _) in zip(PROMPTS, plain_runs, strict=True):
        result = eagle.generate(prompt, **options(rule="strict", k=3, tree="3,2"))
        assert result.token_ids == tokens


def test_mars_at_theta_one_equals_strict_with_head_trees(eagle, plain_runs):
    accepted = 0
    for prompt, (tokens, _) in zip(PROMPTS, plain_runs, strict=True):
        opts = options(rule="mars", theta=1.0, margin="prob_ratio", k=4, tree="3,2")
        result = eagle.generate(prompt, **opts)
        assert result.token_ids == tokens and not result.relaxed_positions
        accepted += result.stats.accepted_exact
    assert accepted > 0, "no node of the head's trees was accepted: nothing was compared"


def test_a_head_tree_one_wide_is_the_heads_chain(eagle, plain_runs):
    """The dynamic tree's expansion (rows at one position, masked to their ancestors) drafts, one
    candidate per depth, exactly the chain the head drafts position by position."""
    drafter, target = eagle.drafter, eagle.target
    ids = torch.tensor(eagle.tokenizer(PROMPTS[0])["input_ids"] + plain_runs[0][0][:5])
    target.reset()
    drafter.reset()
    target.forward(ids[:-1])  # the target holds all of the context but its last token
    chain = drafter.propose(ids, 4, 0.0, None).tokens
    draft, tree = drafter.propose_tree(ids, 4, (1,))
    assert tree is not None and tree.chain_len == len(tree) == 4
    assert tree.parents == (0, 1, 2, 3) and draft.tokens.tolist() == chain.tolist()
    wide, wide_tree = drafter.propose_tree(ids, 4, (3, 2))
    assert wide_tree is not None and len(wide_tree) <= 7 and max(wide_tree.depths) <= 4
    assert wide.tokens[0] == chain[0]  # the head's best first token leads the chain
    target.reset()
    drafter.reset()


def test_a_head_tree_step_isolates_siblings(eagle):
    """Rows of one tree depth at one position each see the sequence, their ancestors and themselves
    only: each equals the row run alone along its own path."""
    from marspec.drafters.eagle3_head import HeadCache, TreeRows

    head = eagle.drafter.draft_model.head
    g = torch.Generator().manual_seed(0)
    features = torch.randn(6, head.fc.out_features, generator=g)
    tokens = torch.tensor([3, 7, 9, 11, 13, 5])
    cache = HeadCache(head)
    cache.step(tokens[:3], features[:3])  # three positions of a sequence
    sees = torch.zeros(3, 6, dtype=torch.bool)
    sees[:, :3] = True
    sees[torch.arange(3), torch.arange(3, 6)] = True  # three siblings at position 3
    together, _ = cache.step(tokens[3:6], features[3:6], TreeRows(3, sees))
    child_sees = torch.zeros(1, 7, dtype=torch.bool)
    child_sees[0, [0, 1, 2, 4, 6]] = True  # a child of the second sibling, at position 4
    child, _ = cache.step(tokens[:1], features[:1], TreeRows(4, child_sees))
    for row in range(3):
        cache.rollback(3)
        alone, _ = cache.step(tokens[3 + row : 4 + row], features[3 + row : 4 + row])
        torch.testing.assert_close(together[row], alone[0])
        if row == 1:
            path_child, _ = cache.step(tokens[:1], features[:1])
            torch.testing.assert_close(child[0], path_child[0])


def test_a_head_drafts_in_the_dtype_of_a_target_passed_in_loaded(target_dir, head_dir):
    """A bf16 target passed in loaded keeps its dtype whatever ``dtype`` says; the head follows it (its
    hidden states come in bf16), rather than failing inside torch on mixed dtypes."""
    target = Decoder(str(target_dir), None, device="cpu", dtype="bf16").target
    eagle = Decoder(target, str(head_dir), draft_confidence=0.0)
    assert eagle.drafter.draft_model.head.fc.weight.dtype == torch.bfloat16
    for tree in (None, "3,2"):
        result = eagle.generate(PROMPTS[0], **options(rule="strict", k=3, tree=tree))
        assert len(result.token_ids) == NEW


def test_mars_at_theta_one_equals_strict_with_the_head(eagle, plain_runs):
    for prompt, (tokens, _) in zip(PROMPTS, plain_runs, strict=True):
        result = eagle.generate(prompt, **options(rule="mars", theta=1.0, margin="prob_ratio", k=3))
        assert result.token_ids == tokens and not result.relaxed_positions


def test_mars_relaxes_the_heads_runner_up_drafts(target_dir, runner_up_head_dir, plain_runs):
    """With a head that drafts the target's runner-up, strict accepts (almost) nothing and MARS at theta 0
    on the probability ratio relaxes; each output equals strict's up to its first relaxed token, where it
    holds the target's runner-up."""
    decoder = Decoder(str(target_dir), str(runner_up_head_dir), device="cpu", draft_confidence=0.0)
    relaxed = 0
    for prompt, (tokens, top2) in zip(PROMPTS, plain_runs, strict=True):
        assert decoder.generate(prompt, **options(rule="strict", k=1)).token_ids == tokens
        result = decoder.generate(prompt, **options(rule="mars", theta=0.0, margin="prob_ratio", k=1))
        relaxed += len(result.relaxed_positions)
        first = next(
            (i for i, (a, b) in enumerate(zip(result.token_ids, tokens, strict=False)) if a != b), None
        )
        if first is not None:
            assert first == result.relaxed_positions[0]
            assert result.token_ids[first] == int(top2[first, 1])
    assert relaxed > 0, "MARS relaxed none of the head's runner-up drafts"


def test_heads_take_turns_on_one_loaded_target(target_dir, head_dir, plain_runs, tmp_path):
    """A target passed in loaded is shared: a second head with other feature layers adds them to the
    target's kept states, and each head drafts from its own layers (the same accepts as alone)."""
    alone = Decoder(str(target_dir), str(head_dir), device="cpu", draft_confidence=0.0)
    accepts = [alone.generate(p, **options(rule="strict", k=3)).stats.accepted_exact for p in PROMPTS]
    shared = Decoder(str(target_dir), None, device="cpu").target
    unnamed = make_head(target_dir, plain_runs, tmp_path / "default-layers", layers=None)
    other = Decoder(shared, str(unnamed), draft_confidence=0.0)
    first = Decoder(shared, str(head_dir), draft_confidence=0.0)
    for decoder in (other, first, other, first):
        for prompt, (tokens, _), accepted in zip(PROMPTS, plain_runs, accepts, strict=True):
            result = decoder.generate(prompt, **options(rule="strict", k=3))
            assert result.token_ids == tokens
            if decoder is first:
                assert result.stats.accepted_exact == accepted


def test_fly_and_rivals_verify_the_heads_drafts_at_their_no_relax_settings(eagle, plain_runs):
    tokens = plain_runs[0][0]
    for rule, theta in (("fly", 0.0), ("topk", 1)):
        result = eagle.generate(PROMPTS[0], **options(rule=rule, theta=theta, k=3))
        assert result.token_ids == tokens, rule


def test_the_ensemble_reads_the_heads_distribution(target_dir, runner_up_head_dir, plain_runs):
    """Greedy, the head hands the ensemble its temperature-1 distribution: at weight 1 it is strict; at a
    small weight the mixture leans on the head's runner-up drafts and accepts some."""
    decoder = Decoder(str(target_dir), str(runner_up_head_dir), device="cpu", draft_confidence=0.0)
    tokens = plain_runs[0][0]
    assert decoder.generate(PROMPTS[0], **options(rule="ensemble", theta=1.0, k=1)).token_ids == tokens
    mixed = decoder.generate(PROMPTS[0], **options(rule="ensemble", theta=0.05, k=1))
    assert mixed.relaxed_positions, "the ensemble relaxed none of the head's runner-up drafts"


def test_sampling_with_the_head_is_lossless(tmp_path):
    """Strict speculative sampling with the head's drafts reproduces the target's joint distribution of
    three tokens (test_sampling_lossless.py's chi-square check, its 4-token target): the head samples
    over a draft vocabulary of 3 of the 4 tokens, in another order than the target's, and hands the
    verifier its probabilities mapped to the target's vocabulary (0 for the token it cannot draft)."""
    from test_sampling_lossless import CHI2_999_63, TRIALS, chi2, sampled_counts, small_lm, target_joint

    from marspec.drafters.eagle3_head import load_head

    target = small_lm(0, spread=1.0)
    config = target.model.config.to_dict()
    target.model.save_pretrained(tmp_path / "target")
    folder = write_head(tmp_path / "head", config, tmp_path / "target", {0: 3, 1: 0, 2: 1}, layers=[0, 1, 1])
    spec = find_head(str(folder))
    layers = check_fits(spec, TargetShape.of_config("small", config))
    head = load_head(spec, len(layers), target.model.get_input_embeddings(), torch.float32, target.device)
    drafter = Eagle3Drafter(head, target, layers, "head")
    joint = target_joint(target)
    counts = sampled_counts(target, drafter, Rule(name="strict"), TRIALS)
    assert chi2(counts, joint) < CHI2_999_63


def test_feature_layers_come_from_the_config_else_eagle3s_default(target_dir, plain_runs, tmp_path):
    shape = TargetShape.of_config("t", target_config(target_dir))
    named = make_head(target_dir, plain_runs, tmp_path / "named")
    assert check_fits(find_head(str(named)), shape) == tuple(last_layer_ids(LAYERS))
    unnamed = make_head(target_dir, plain_runs, tmp_path / "unnamed", layers=None)
    assert check_fits(find_head(str(unnamed)), shape) == default_layers(LAYERS) == (2, 2, 1)
    assert default_layers(28) == (2, 14, 25)  # the default target's
    # Drafting with the default layers runs, and strict still equals plain.
    decoder = Decoder(str(target_dir), str(unnamed), device="cpu")
    assert decoder.generate(PROMPTS[0], **options(rule="strict")).token_ids == plain_runs[0][0]


def test_a_causal_lm_folder_is_no_head(target_dir):
    assert find_head(str(target_dir)) is None
    assert find_head("ngram") is None and find_head("qwen2.5-coder-0.5b-instruct") is None


@pytest.fixture
def offline_cache(head_dir, tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "hub"
    add_to_hub_cache(cache, HUB_HEAD, head_dir)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_head_by_hub_id_offline_drafts_as_its_folder_does(target_dir, offline_cache, eagle, plain_runs):
    decoder = Decoder(str(target_dir), HUB_HEAD, device="cpu", draft_confidence=0.0)
    assert decoder.draft_name == HUB_HEAD
    assert isinstance(decoder.drafter, Eagle3Drafter)
    assert decoder.drafter.draft_model.head.fc.weight.data_ptr() != 0
    by_id = decoder.generate(PROMPTS[1], **options(rule="strict", k=3))
    by_folder = eagle.generate(PROMPTS[1], **options(rule="strict", k=3))
    assert by_id.token_ids == by_folder.token_ids == plain_runs[1][0]
    assert by_id.stats.accepted_exact == by_folder.stats.accepted_exact > 0
    assert find_head(HUB_HEAD).folder == snapshot_of(offline_cache, HUB_HEAD)


def misfits(target_dir: Path, plain_runs, root: Path) -> dict[str, tuple[Path, str]]:
    """Heads that do not fit the target, each with a phrase its refusal must hold."""
    config = target_config(target_dir)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    wide_dir = save_tiny_model(root / "wide-target", tiny_model(seed=0, layers=LAYERS, hidden=2 * hidden))
    proposals = bigram_proposals([t for t, _ in plain_runs], [t2[:, 0].tolist() for _, t2 in plain_runs])
    big = {a: b + 200 for a, b in proposals.items()}

    def head(name: str, **kwargs) -> Path:
        kwargs.setdefault("layers", last_layer_ids(LAYERS))
        return write_head(
            root / name,
            target_config(kwargs.get("of", target_dir)),
            kwargs.pop("of", target_dir),
            kwargs.pop("p", proposals),
            **kwargs,
        )

    return {
        "width": (head("width", of=wide_dir), f"hidden states {2 * hidden} wide"),
        "vocabulary": (head("vocab", config_changes={"vocab_size": vocab + 4}), f"vocabulary of {vocab + 4}"),
        "d2t": (head("d2t", p=big), "outside target"),
        "layers": (head("layers", layers=[2, 3, LAYERS + 5]), f"has {LAYERS}"),
        "missing": (head("missing", drop=("midlayer.hidden_norm.weight",)), "lacks 1 tensors"),
        "config": (
            head("config", config_changes={"num_attention_heads": 8, "head_dim": 8}),
            "config.json implies",
        ),
        "architecture": (
            head("arch", config_changes={"architectures": ["Qwen3ForCausalLMEagle3"]}),
            "Llama layout",
        ),
    }


@pytest.fixture(scope="module")
def misfit_heads(target_dir, plain_runs, tmp_path_factory):
    return misfits(target_dir, plain_runs, tmp_path_factory.mktemp("misfits"))


def test_misfit_heads_are_refused_in_one_line_before_any_weights_load(target_dir, misfit_heads, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("weights were loaded before the head was checked")

    monkeypatch.setattr(marspec.api, "load_lm", no_loading)
    for kind, (folder, phrase) in misfit_heads.items():
        with pytest.raises(MarspecError) as caught:
            Decoder(str(target_dir), str(folder), device="cpu")
        message = str(caught.value)
        assert "\n" not in message, kind
        assert phrase in message, (kind, message)
        assert "EAGLE-3 head" in message, kind


def test_a_head_takes_the_fixed_shape_path_with_on_and_auto_stays_eager_on_a_cpu(target_dir, head_dir):
    """tests/test_fixed.py checks what the head drafts there."""
    from marspec.backends.fixed import FixedShapeLM

    decoder = Decoder(str(target_dir), str(head_dir), device="cpu", graphs="on")
    assert isinstance(decoder.target, FixedShapeLM) and decoder.drafter.target is decoder.target
    decoder = Decoder(str(target_dir), str(head_dir), device="cpu", graphs="auto")
    assert not decoder.fixed_shape


def cli(*args: str, timeout: float = 240, hub_cache: Path | None = None) -> subprocess.CompletedProcess:
    """The CLI in a process of its own, offline (a closed local port as the Hub: nothing is reached)."""
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"
    if hub_cache is not None:
        env["HF_HUB_CACHE"] = str(hub_cache)
    code = "import sys; from marspec.cli import app; sys.argv[0] = 'marspec'; app()"
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def test_the_cli_generates_with_a_head_and_refuses_a_misfit_with_exit_2(
    target_dir, head_dir, misfit_heads, plain, plain_runs
):
    ok = cli(
        "generate",
        "--target",
        str(target_dir),
        "--draft",
        str(head_dir),
        "--rule",
        "strict",
        "--max-new-tokens",
        str(NEW),
        "--json",
        PROMPTS[0],
    )
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["token_ids"] == plain_runs[0][0]
    folder, phrase = misfit_heads["width"]
    bad = cli("generate", "--target", str(target_dir), "--draft", str(folder), PROMPTS[0])
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and phrase in lines[0] and "Traceback" not in bad.stderr


def test_the_server_refuses_to_start_with_a_misfit_head(target_dir, misfit_heads):
    folder, phrase = misfit_heads["vocabulary"]
    bad = cli("serve", "--target", str(target_dir), "--draft", str(folder), "--port", "0")
    assert bad.returncode == 2
    assert phrase in bad.stderr and "Traceback" not in bad.stderr


def test_the_forward_cost_profile_refuses_a_head_in_one_line(eagle):
    from marspec.profile import profile_pair

    with pytest.raises(MarspecError, match="EAGLE-3 head") as caught:
        profile_pair(eagle.target, eagle.drafter.draft_model, max_tokens=2, context=8, repeats=1)
    assert "\n" not in str(caught.value)


def test_the_cli_generates_with_a_head_by_hub_id_offline(target_dir, head_dir, plain_runs, tmp_path):
    """``marspec generate --draft ORG/HEAD`` with the head in an offline Hugging Face cache: recognised as
    a head by its config (no tokenizer looked for), and it drafts."""
    add_to_hub_cache(tmp_path / "hub", HUB_HEAD, head_dir)
    args = [
        "--target",
        str(target_dir),
        "--draft",
        HUB_HEAD,
        "--rule",
        "strict",
        "--max-new-tokens",
        str(NEW),
    ]
    ok = cli("generate", *args, "--json", PROMPTS[2], hub_cache=tmp_path / "hub")
    assert ok.returncode == 0, ok.stderr
    result = json.loads(ok.stdout)
    assert result["token_ids"] == plain_runs[2][0] and result["stats"]["accepted_exact"] > 0


def test_sequences_decoded_together_each_keep_their_own_head_and_states(target_dir, runner_up_head_dir):
    """An EAGLE-3 head in a batch (issue 69): each sequence gets its own head cache, reading its own
    slot's hidden states; the target keeps states, so its forwards run one sequence at a time. Every
    output equals the sequence decoded alone, a relaxing MARS (a head proposing runner-ups) included."""
    decoder = Decoder(str(target_dir), str(runner_up_head_dir), device="cpu", draft_confidence=0.0)
    settings = [{"rule": "strict", "k": 3}, {"rule": "mars", "theta": 0.3, "k": 3}, {"rule": "plain"}]
    alone = [decoder.generate(p, **options(**s)) for p, s in zip(PROMPTS, settings, strict=True)]
    together = decoder.generate_many(PROMPTS, max_batch=2, per_prompt=settings, **options())
    assert [r.token_ids for r in together] == [r.token_ids for r in alone]
    assert alone[1].relaxed_positions and alone[0].stats.drafted > 0
