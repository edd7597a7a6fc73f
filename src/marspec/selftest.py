"""``marspec selftest``: does marspec decode correctly on this machine and device?

In seconds, with small random-weight models built here (nothing is downloaded, no weights ship with
marspec), on the chosen device:

- **strict equals plain**: strict verification, as a draft chain and as a token tree, emits exactly the
  tokens plain greedy decoding emits (and the drafts were really accepted and rejected, so the check is
  not vacuous);
- **MARS(theta = 1) equals strict**: MARS at a threshold that can never relax, for both ratio margins;
- **speculative sampling is lossless**: a chi-square test of the joint distribution of the first tokens
  that strict speculative sampling emits (draft model sampling, verification, residual and bonus draws,
  the caches), against the target's exact distribution computed from its own forwards;
- **one device read per step**: every host read of a device tensor (``.cpu()``, ``.item()``,
  ``.tolist()``, ``int()``, ``bool()``, data-dependent shapes such as ``nonzero``) is counted while the
  loop runs; each verification step must make exactly one (its read-back), whichever rule, sampling
  or tree. On the CPU, where every tensor is a host tensor, the models' outputs stand for device
  tensors (they and everything computed from them are counted), as ``tests/test_decode.py`` does.

It needs only marspec, torch and transformers. :func:`run_selftest` returns a :class:`SelftestReport`;
the CLI (``marspec selftest``) prints it and exits non-zero when a check fails.
"""

from __future__ import annotations

import contextlib
import copy
import platform
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode

from marspec.devices import resolve_device

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

    from marspec.api import Decoder
    from marspec.backends.hf import HFCausalLM

# The pair the token-for-token checks decode with: a 2-layer Qwen2 target with grouped key/value heads and
# a draft that is the target plus noise, so most drafts are accepted and some are rejected. Its vocabulary
# is :func:`tiny_tokenizer`'s: 95 characters and an end-of-text token.
VOCAB = 96
EOS = "<|endoftext|>"
# Weights drawn 5x wider than transformers' default (std 0.02): narrow random weights make a model that
# repeats one token, wider ones vary their output. The draft's noise is 5% of that spread: about half of
# its drafted tokens are accepted.
INIT_STD = 0.1
DRAFT_NOISE = 0.005
# Random logits are sharpened so greedy choices are not decided by rounding between kernels.
SHARPEN = 20.0
PROMPTS = ("def add(a, b): return a + b", "The cache holds every token.", "1 + 1 = 2, 2 + 2 =")
NEW_TOKENS = 40
K = 4
TREE = "3,2"

# The sampling check: a 4-token vocabulary, the joint distribution of the first two emitted tokens (16
# cells), sampled TRIALS times at a temperature far from 1. CHI2_999_15 is the chi-square 0.999 quantile
# for 15 degrees of freedom: a correct sampler fails one run in a thousand (the seeds are fixed). Its
# power, measured: a drafter reporting its distribution at temperature 1 instead of 0.25 scored 89 (the
# correct one 5); at 0.5 the same bug scored 25 and went unseen (tests/test_selftest.py).
SAMPLING_VOCAB = 4
SAMPLING_TOKENS = 2
SAMPLING_TEMPERATURE = 0.25
TRIALS = 800
CHI2_999_15 = 37.697


@dataclass(frozen=True)
class Check:
    """One verdict: what was checked, whether it held, and the numbers behind it."""

    name: str
    passed: bool
    detail: str


@dataclass(frozen=True)
class SelftestReport:
    """What :func:`run_selftest` found: the device it ran on, each check, and the environment."""

    device: str
    checks: tuple[Check, ...]
    environment: dict[str, str]
    seconds: float

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed}


def run_selftest(device: str | torch.device = "auto", threads: int | None = 1) -> SelftestReport:
    """Run every check on ``device`` ("auto", "cpu", "cuda", "cuda:N" or "mps"; a missing device is a
    one-line MarspecError). ``threads``: torch's thread count while the checks run on the CPU (1 by
    default: the models are tiny, and more threads only add contention), restored afterwards."""
    where = resolve_device(device)
    start = time.perf_counter()
    on_cpu = where.type == "cpu"
    with _threads(threads if on_cpu else None), tempfile.TemporaryDirectory() as tmp:
        used = torch.get_num_threads()
        decoder = _tiny_decoder(Path(tmp), where)
        checks = (
            strict_equals_plain(decoder),
            mars_theta_one_equals_strict(decoder),
            sampling_is_lossless(where),
            one_read_per_step(decoder),
        )
    env = environment(where)
    if on_cpu:
        env["torch threads"] = f"{used} for the checks ({env['torch threads']} in this process otherwise)"
    return SelftestReport(str(where), checks, env, time.perf_counter() - start)


@contextlib.contextmanager
def _threads(count: int | None) -> Iterator[None]:
    """torch's (process-wide) thread count set to ``count`` for the block, then put back."""
    before = torch.get_num_threads()
    if count is not None:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------ tiny models


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer without merges, built in memory: each printable ASCII character and the
    space is one token (ids 0-94), and ``<|endoftext|>`` (id 95) ends a text. It has Qwen2's form
    (vocabulary and merges under a byte-level pre-tokenizer), so transformers loads it back as
    ``Qwen2Tokenizer`` for a Qwen2 model folder, as it would a real one."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = [chr(c) for c in range(33, 127)] + ["\u0120"]  # byte-level BPE writes the space as "Ġ"
    vocab = {symbol: i for i, symbol in enumerate(symbols)}
    vocab[EOS] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=EOS, unk_token=EOS, pad_token=EOS)


def tiny_model(
    seed: int,
    vocab_size: int = VOCAB,
    layers: int = 2,
    hidden: int = 64,
    sharpen: float = SHARPEN,
    init_std: float = INIT_STD,
) -> PreTrainedModel:
    """A random Qwen2 causal LM (4 query heads sharing 2 key/value heads), fp32, eval mode, its weights
    drawn with standard deviation ``init_std``. Its logits are scaled by ``sharpen`` (how peaked its
    distributions are). torch's global random state is left as it was."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        initializer_range=init_std,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).eval().requires_grad_(False)
    model.lm_head.weight.mul_(sharpen)
    if vocab_size == VOCAB:
        # The end-of-text token's logit is always 0, below the sharpened top choice: outputs run their length.
        model.lm_head.weight[VOCAB - 1] = 0.0
    return model


def noisy_copy(model: PreTrainedModel, seed: int, scale: float = DRAFT_NOISE) -> PreTrainedModel:
    """``model`` with Gaussian noise of standard deviation ``scale`` added to every weight: a draft that
    agrees with it often but not always."""
    gen = torch.Generator().manual_seed(seed)
    draft = copy.deepcopy(model)
    for param in draft.parameters():
        param.add_(scale * torch.randn(param.shape, generator=gen, dtype=param.dtype))
    return draft


def save_tiny_model(folder: Path, model: PreTrainedModel) -> Path:
    """Write ``model`` and :func:`tiny_tokenizer` into ``folder`` as a Hugging Face model folder."""
    from marspec.models.convert import quiet_transformers

    with quiet_transformers():  # no "Writing model shards" bar for a model of kilobytes
        model.save_pretrained(folder)
        tiny_tokenizer().save_pretrained(folder)
    return folder


def _tiny_decoder(folder: Path, device: torch.device) -> Decoder:
    """A Decoder for a tiny target and its noisy draft, saved under ``folder`` and loaded by path the way
    a user's models are (dtype fp32, the device's default kernels). The draft's confidence stop and
    prompt lookup are off: both add host reads by design (one per drafted token, one per lookup)."""
    from marspec.api import Decoder

    target = tiny_model(seed=0)
    save_tiny_model(folder / "target", target)
    save_tiny_model(folder / "draft", noisy_copy(target, seed=1))
    return Decoder(
        str(folder / "target"),
        str(folder / "draft"),
        dtype="fp32",
        device=device,
        draft_confidence=0.0,
        lookup=False,
    )


# ------------------------------------------------------------------------------------- token equality


def first_difference(expected: list[int], got: list[int]) -> int | None:
    """The first index where two token sequences differ (a length difference counts), or None."""
    for i, (a, b) in enumerate(zip(expected, got, strict=False)):
        if a != b:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))


def compare_runs(name: str, runs: list[tuple[str, list[int], list[int]]]) -> Check:
    """A check that every run's tokens equal its reference: ``runs`` holds ``(label, expected, got)``.
    The detail names the first difference found."""
    for label, expected, got in runs:
        at = first_difference(expected, got)
        if at is not None:
            want = expected[at] if at < len(expected) else "end"
            have = got[at] if at < len(got) else "end"
            return Check(name, False, f"{label}: token {at} is {have}, expected {want}")
    tokens = sum(len(expected) for _, expected, _ in runs)
    return Check(name, True, f"{len(runs)} runs, {tokens} tokens, all identical")


def strict_equals_plain(decoder: Decoder) -> Check:
    """Strict verification (chain and tree) emits plain greedy decoding's tokens, and really drafted."""
    name = "strict == plain (greedy, chain and tree)"
    runs = []
    drafted = accepted = rejected = 0
    for i, prompt in enumerate(PROMPTS):
        plain = _generate(decoder, prompt, rule="plain")
        for tree in (None, TREE):
            out = decoder.generate(prompt, rule="strict", tree=tree, **_greedy())
            label = f"prompt {i + 1}, strict {'tree ' + tree if tree else 'chain'}"
            runs.append((label, plain, out.token_ids))
            drafted += out.stats.drafted
            accepted += out.stats.accepted_exact
            rejected += out.stats.rejected
    check = compare_runs(name, runs)
    if check.passed and not (accepted and rejected):
        # Without both, the comparison proves nothing about verification.
        return Check(name, False, f"vacuous: {accepted} drafts accepted, {rejected} steps with a rejection")
    share = f"{accepted} of {drafted} drafts accepted, {rejected} rejections"
    return Check(name, check.passed, f"{check.detail}; {share}" if check.passed else check.detail)


def mars_theta_one_equals_strict(decoder: Decoder) -> Check:
    """MARS at theta = 1, which can never relax, emits strict's tokens (both ratio margins)."""
    runs = []
    for i, prompt in enumerate(PROMPTS):
        strict = _generate(decoder, prompt, rule="strict")
        for margin in ("prob_ratio", "logit_ratio"):
            got = _generate(decoder, prompt, rule="mars", theta=1.0, margin=margin)
            runs.append((f"prompt {i + 1}, mars {margin} 1", strict, got))
    return compare_runs("MARS(theta 1) == strict", runs)


def _greedy() -> dict[str, Any]:
    return {"k": K, "max_new_tokens": NEW_TOKENS, "chat": False, "temperature": 0.0}


def _generate(decoder: Decoder, prompt: str, **options: Any) -> list[int]:
    return decoder.generate(prompt, **_greedy(), **options).token_ids


# -------------------------------------------------------------------------------------------- sampling


def sampling_is_lossless(device: torch.device, trials: int = TRIALS) -> Check:
    """Strict speculative sampling through the decode loop reproduces the target's distribution."""
    from marspec.backends.hf import HFCausalLM
    from marspec.drafters.model import ModelDrafter

    name = "speculative sampling is lossless"
    # A spread-out target (every cell is seen) and a sharper, different draft (rejections and residual
    # draws are common), over a 4-token vocabulary.
    target = HFCausalLM(_small_model(seed=0, sharpen=1.0).to(device), None, "small-target")
    draft = HFCausalLM(_small_model(seed=1, sharpen=3.0).to(device), None, "small-draft")
    prompt = torch.tensor([1, 3, 0, 2], dtype=torch.long, device=device)
    probs = target_joint(target, prompt)
    counts = sampled_counts(target, ModelDrafter(draft, SAMPLING_VOCAB), prompt, trials)
    stat = chi_square(counts, probs)
    least = float(probs.min()) * trials
    detail = (
        f"chi-square {stat:.1f} over {probs.numel()} cells ({trials} samples, at least {least:.0f} "
        f"expected per cell); fails above {CHI2_999_15} (p = 0.001)"
    )
    return Check(name, stat < CHI2_999_15, detail)


def _small_model(seed: int, sharpen: float) -> PreTrainedModel:
    # transformers' default spread (0.02): smooth distributions, so every cell is expected often.
    return tiny_model(seed, vocab_size=SAMPLING_VOCAB, layers=1, hidden=16, sharpen=sharpen, init_std=0.02)


def target_joint(target: HFCausalLM, prompt: torch.Tensor) -> torch.Tensor:
    """The target's exact distribution of its first SAMPLING_TOKENS tokens after ``prompt`` at
    SAMPLING_TEMPERATURE, float64 [V**SAMPLING_TOKENS] on the host, from one forward per prefix."""

    def next_dist(prefix: torch.Tensor) -> torch.Tensor:
        target.reset()
        logits = target.forward(prefix, last_only=True)[-1]
        return torch.softmax(logits.double().cpu() / SAMPLING_TEMPERATURE, dim=-1)

    joint = torch.ones(1, dtype=torch.float64)
    prefixes = [prompt]
    for _ in range(SAMPLING_TOKENS):
        dists = torch.stack([next_dist(p) for p in prefixes])  # [prefixes, V]
        joint = (joint[:, None] * dists).flatten()
        vocab = torch.arange(SAMPLING_VOCAB, device=prompt.device)
        prefixes = [torch.cat((p, t.view(1))) for p in prefixes for t in vocab]
    target.reset()
    return joint


def sampled_counts(target: HFCausalLM, drafter: Any, prompt: torch.Tensor, trials: int) -> torch.Tensor:
    """How often each joint outcome of the first SAMPLING_TOKENS tokens came out of ``trials`` strict
    speculative-sampling decodes (seeds 0 .. trials - 1), float64 [V**SAMPLING_TOKENS]."""
    from marspec.decode import DecodeConfig, decode
    from marspec.stats import GenerationStats
    from marspec.verify import Rule

    config = DecodeConfig(
        rule=Rule(name="strict"),
        k=2,
        temperature=SAMPLING_TEMPERATURE,
        max_new_tokens=SAMPLING_TOKENS,
        reuse_prefix=False,
    )
    counts = torch.zeros(SAMPLING_VOCAB**SAMPLING_TOKENS, dtype=torch.float64)
    for seed in range(trials):
        generator = torch.Generator(device=prompt.device).manual_seed(seed)
        tokens: list[int] = []
        for step in decode(target, drafter, prompt, config, GenerationStats(), generator):
            tokens.extend(step.tokens)
        cell = 0
        for token in tokens[:SAMPLING_TOKENS]:
            cell = cell * SAMPLING_VOCAB + token
        counts[cell] += 1
    return counts


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic of observed ``counts`` against the distribution ``probs`` (same shape)."""
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# ---------------------------------------------------------------------------------------- device reads


class _StandIn(torch.Tensor):
    """A CPU tensor standing for one on an accelerator; what is computed from it stays a stand-in."""


# Calls that read a tensor's values on the host: on an accelerator each waits for the device.
_READS = frozenset(
    {"cpu", "numpy", "item", "tolist", "__int__", "__float__", "__bool__", "__index__", "__complex__"}
    | {"__format__", "equal", "allclose", "is_nonzero"}
    # Results whose shape depends on the values: the host must read them to size the output.
    | {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount"}
)


class HostReads(TorchFunctionMode):
    """Counts host reads of tensors for which ``on_device`` holds, while active. A copy to the host made
    here (``.cpu()``, ``.to("cpu")``) is a plain host tensor, free to read."""

    def __init__(self, on_device: Callable[[torch.Tensor], bool]) -> None:
        super().__init__()
        self.on_device = on_device
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        to_host = name in ("cpu", "to", "copy_") and _to_host(name, args, kwargs)
        if name == "copy_":  # dst.copy_(src): the source is what is read
            src = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else None
            read = to_host and src is not None and self.on_device(src)
        else:
            read = source is not None and self.on_device(source) and (name in _READS or to_host)
        if read:
            self.reads.append(name)
        out = func(*args, **kwargs)
        if to_host and isinstance(out, _StandIn):
            out = out.as_subclass(torch.Tensor)
        return out


def _to_host(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a ``cpu``/``to``/``copy_`` call puts data on the host."""
    if name == "cpu":
        return True
    if name == "copy_":  # dst.copy_(src): a read of src when dst is a host tensor
        return len(args) > 1 and args[0].device.type == "cpu"
    target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
    if isinstance(target, torch.Tensor):
        target = target.device
    return target is not None and torch.device(target).type == "cpu"


@contextlib.contextmanager
def _stand_in_outputs(*lms: HFCausalLM) -> Iterator[None]:
    """Make the models' forwards return stand-ins for device tensors (CPU only), then undo it."""
    for lm in lms:
        for method in ("forward", "forward_tree"):
            original = getattr(lm, method)
            setattr(lm, method, lambda *a, _f=original, **kw: _f(*a, **kw).as_subclass(_StandIn))
    try:
        yield
    finally:
        for lm in lms:
            del lm.forward, lm.forward_tree  # the instance attributes: the class's methods show again


def reads_per_step(decoder: Decoder, prompt: torch.Tensor, **config: Any) -> list[int]:
    """Host reads of device tensors in each step of one decode with ``DecodeConfig(**config)``."""
    from marspec.decode import DecodeConfig, decode
    from marspec.stats import GenerationStats

    target, drafter = decoder.target, decoder.drafter
    lms = [target] + ([drafter.draft_model] if drafter is not None and drafter.draft_model else [])
    device = target.device
    if device.type == "cpu":
        on_device: Callable[[torch.Tensor], bool] = lambda t: isinstance(t, _StandIn)  # noqa: E731
        stand_in = _stand_in_outputs(*lms)
    else:
        on_device = lambda t: t.device.type == device.type  # noqa: E731
        stand_in = contextlib.nullcontext()
    generator = torch.Generator(device=device).manual_seed(0)
    steps = decode(target, drafter, prompt, DecodeConfig(**config), GenerationStats(), generator)
    counts = []
    with stand_in:
        while True:
            with HostReads(on_device) as reads:
                step = next(steps, None)
            if step is None:
                return counts
            counts.append(len(reads.reads))


def one_read_per_step(decoder: Decoder) -> Check:
    """Every verification step reads the device exactly once, whichever rule, regime or draft shape."""
    from marspec.verify import Rule

    name = "one device read per step"
    prompt = decoder.tokenizer(PROMPTS[0], return_tensors="pt")["input_ids"][0].to(decoder.target.device)
    regimes = {
        "strict": {"rule": Rule(name="strict")},
        "mars": {"rule": Rule(name="mars", theta=0.3, margin="prob_ratio")},
        "sampling": {"rule": Rule(name="strict"), "temperature": 1.0},
        "tree": {"rule": Rule(name="strict"), "tree": TREE},
    }
    steps = 0
    for label, config in regimes.items():
        counts = reads_per_step(decoder, prompt, k=K, max_new_tokens=NEW_TOKENS, reuse_prefix=False, **config)
        bad = [(i, n) for i, n in enumerate(counts) if n != 1]
        if bad or not counts:
            where = f"step {bad[0][0] + 1} read it {bad[0][1]} times" if bad else "no step ran"
            return Check(name, False, f"{label}: {where} ({len(counts)} steps)")
        steps += len(counts)
    return Check(name, True, f"{steps} steps ({', '.join(regimes)}): 1 read each")


# ----------------------------------------------------------------------------------------- environment


def environment(device: torch.device) -> dict[str, str]:
    """Versions, the device, and the kernels marspec can use there (each probe that fails says so)."""
    import transformers

    from marspec import __version__

    env = {
        "python": f"{platform.python_version()} ({platform.platform()})",
        "marspec": __version__,
        "torch": torch.__version__ + (f", CUDA {torch.version.cuda}" if torch.version.cuda else ""),
        "transformers": transformers.__version__,
        "device": _probe(lambda: _device_name(device)),
        "devices seen": _probe(_devices_seen),
        "torch threads": str(torch.get_num_threads()),
        "attention (SDPA)": _probe(lambda: _sdpa(device)),
    }
    if device.type == "cpu":
        env["CPU kernels"] = _probe(_cpu_kernels)
    elif device.type == "cuda":
        env["CUDA kernels"] = _probe(_cuda_kernels)
    return env


def _probe(read: Callable[[], str]) -> str:
    try:
        return read()
    except Exception as exc:  # an introspection call missing from this torch build must not end the run
        return f"unknown ({type(exc).__name__}: {exc})"


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        memory = props.total_memory / 2**30
        return f"{props.name} (compute capability {props.major}.{props.minor}, {memory:.0f} GiB)"
    if device.type == "mps":
        return f"Apple MPS ({platform.machine()})"
    from marspec.eval.bench import cpu_name

    return f"{cpu_name()}, {torch.backends.cpu.get_cpu_capability()}"


def _devices_seen() -> str:
    mps = getattr(torch.backends, "mps", None)
    cuda = f"{torch.cuda.device_count()} CUDA" if torch.cuda.is_available() else "no CUDA"
    return f"cpu, {cuda}, {'MPS' if mps is not None and mps.is_available() else 'no MPS'}"


def _sdpa(device: torch.device) -> str:
    if device.type == "cuda":
        cuda = torch.backends.cuda
        flags = {
            "flash": cuda.flash_sdp_enabled() and cuda.is_flash_attention_available(),
            "memory-efficient": cuda.mem_efficient_sdp_enabled(),
            "cuDNN": cuda.cudnn_sdp_enabled(),
            "math": cuda.math_sdp_enabled(),
        }
        return "enabled: " + ", ".join(name for name, on in flags.items() if on)
    if device.type == "cpu":
        fused = hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
        grouped = "key/value heads grouped under masks (marspec_grouped_sdpa)"
        return f"{'fused flash kernel' if fused else 'math kernel'}; {grouped}"
    return "torch's MPS kernels"


def _cpu_kernels() -> str:
    from marspec.backends.prepack import prepack_available
    from marspec.backends.quantize import rowwise_int8_available

    engines = torch.backends.quantized.supported_engines
    return ", ".join(
        (
            f"oneDNN {'yes' if torch.backends.mkldnn.is_available() else 'no'}",
            f"prepacked linears {'yes' if prepack_available() else 'no'}",
            f"int8 draft (fbgemm) {'yes' if 'fbgemm' in engines else 'no'}",
            f"int8 target (oneDNN, VNNI/AMX) {'yes' if rowwise_int8_available() else 'no'}",
        )
    )


def _cuda_kernels() -> str:
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return ", ".join(
        (
            f"cuDNN {cudnn or 'no'}",
            f"bf16 {'yes' if torch.cuda.is_bf16_supported() else 'no'}",
            f"fp32 matmul precision {torch.get_float32_matmul_precision()} ('highest': no TF32)",
        )
    )
